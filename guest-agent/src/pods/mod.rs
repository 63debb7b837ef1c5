//! Pod resolution: cgroup path → pod UID / container id ([`layout`]), pod UID → Kubernetes
//! metadata ([`store`]), filled by a node-scoped watch of the API ([`watch`]).

// Parts of this API serve the tc probe and tests rather than the binary today.
#![allow(dead_code, unused_imports)]

pub mod layout;
pub mod store;
pub mod watch;

pub use layout::{classify_cgroup, CgroupClass, Qos};
pub use store::{PodMeta, PodStore};
pub use watch::{run_watcher, run_watcher_with_client, WatchConfig};
