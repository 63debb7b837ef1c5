//! Who a cgroup's numbers belong to: the owner every unit's deltas are accumulated under.

use std::sync::Arc;

use crate::pods::CgroupClass;

/// Who a cgroup's numbers belong to.
///
/// The tick keys its maps by owner and hands owners on in every window, for every active
/// pod: shared strings make that a reference count, not an allocation, and two keys cloned
/// from one owner compare by pointer before their bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    Pod {
        uid: Arc<str>,
        container_id: Option<Arc<str>>,
    },
    Slice(Arc<str>),
    /// tc drops nobody could be found for (no socket, unknown device, unknown IPs)
    Unattributed,
}

impl Owner {
    pub fn of(class: CgroupClass) -> Owner {
        match class {
            CgroupClass::Pod {
                uid, container_id, ..
            } => Owner::Pod {
                uid: uid.into(),
                container_id: container_id.map(Arc::from),
            },
            CgroupClass::Slice(s) => Owner::Slice(s.into()),
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
