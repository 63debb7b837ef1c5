//! Pod resolution: cgroup path → pod UID / container id ([`layout`]), pod UID → Kubernetes
//! metadata ([`store`]), filled by a node-scoped watch of the API ([`watch`]).

pub mod layout;
pub mod store;
pub mod watch;

pub use layout::{classify_cgroup, CgroupClass, Qos};
pub use store::{PodMeta, PodStore};
pub use watch::{run_watcher, run_watcher_with_client, WatchConfig};
