//! Who a cgroup's numbers belong to: the owner every unit's deltas are accumulated under.

use crate::pods::CgroupClass;

/// Who a cgroup's numbers belong to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    Pod {
        uid: String,
        container_id: Option<String>,
    },
    Slice(String),
    /// tc drops nobody could be found for (no socket, unknown device, unknown IPs)
    Unattributed,
}

impl Owner {
    pub fn of(class: CgroupClass) -> Owner {
        match class {
            CgroupClass::Pod {
                uid, container_id, ..
            } => Owner::Pod { uid, container_id },
            CgroupClass::Slice(s) => Owner::Slice(s),
        }
    }

    /// The owner at pod level: a pod's container dropped, anything else as is.
    pub fn pod_level(&self) -> Owner {
        match self {
            Owner::Pod { uid, .. } => Owner::Pod {
                uid: uid.clone(),
                container_id: None,
            },
            other => other.clone(),
        }
    }
}
