//! Userspace halves of `bpf/cgroup_drain.h` and `bpf/cgroup_active.h`, the
//! two maps a unit keyed by cgroup storage adds so that a tick reads only what
//! changed and nothing is lost when a cgroup goes.

use libbpf_rs::{MapCore, MapFlags, MapHandle};

/// Entries one batch syscall moves. Drained values are large (a TCP cgroup's
/// is 3.6 KiB), so their batches are smaller.
const ACTIVE_BATCH: u32 = 1024;
const DRAIN_BATCH: u32 = 64;

fn id_of(key: &[u8]) -> Option<u64> {
    Some(u64::from_ne_bytes(key.get(..8)?.try_into().ok()?))
}

/// `<storage>_drained`: removed cgroups' storage values as they were at rmdir.
pub struct Drained {
    map: MapHandle,
}

impl Drained {
    pub fn new(map: MapHandle) -> Drained {
        Drained { map }
    }

    /// Takes every entry out of the map: (cgroup id, value bytes).
    pub fn take(&self) -> Vec<(u64, Vec<u8>)> {
        match self
            .map
            .lookup_and_delete_batch(DRAIN_BATCH, MapFlags::ANY, MapFlags::ANY)
        {
            Ok(it) => it.filter_map(|(k, v)| Some((id_of(&k)?, v))).collect(),
            Err(e) => {
                tracing::debug!(error = %e, "reading drained cgroups");
                Vec::new()
            }
        }
    }
}

/// `active_epoch` and `active_cgroups`: the cgroups whose storage changed.
pub struct ActiveSet {
    epoch_map: MapHandle,
    set: MapHandle,
    epoch: u64,
    /// The previous take's cgroups, read once more: an event that saw the old
    /// epoch (so did not mark its cgroup again) may update the storage just
    /// after the agent read it.
    previous: Vec<u64>,
}

impl ActiveSet {
    /// Starts the first epoch (fresh storage has epoch 0: its first event marks it).
    pub fn new(epoch_map: MapHandle, set: MapHandle) -> ActiveSet {
        let mut s = ActiveSet {
            epoch_map,
            set,
            epoch: 0,
            previous: Vec::new(),
        };
        s.bump();
        s
    }

    fn bump(&mut self) -> bool {
        self.epoch += 1;
        self.epoch_map
            .update(
                &0u32.to_ne_bytes(),
                &self.epoch.to_ne_bytes(),
                MapFlags::ANY,
            )
            .is_ok()
    }

    /// Whether an insert failed since the last call (and clears the flag).
    fn overflowed(&self) -> bool {
        let key = 1u32.to_ne_bytes();
        let full = self
            .epoch_map
            .lookup(&key, MapFlags::ANY)
            .ok()
            .flatten()
            .and_then(|v| id_of(&v))
            .unwrap_or(0);
        if full != 0 {
            let _ = self
                .epoch_map
                .update(&key, &0u64.to_ne_bytes(), MapFlags::ANY);
        }
        full != 0
    }

    /// Starts a new epoch and returns the cgroups that had activity in the
    /// ones before (this and the previous take's set), or None when the set
    /// cannot be trusted (it overflowed, or a map operation failed): then the
    /// caller reads every cgroup.
    pub fn take(&mut self) -> Option<Vec<u64>> {
        let bumped = self.bump();
        let overflowed = self.overflowed();
        let now: Vec<u64> =
            match self
                .set
                .lookup_and_delete_batch(ACTIVE_BATCH, MapFlags::ANY, MapFlags::ANY)
            {
                Ok(it) => it.filter_map(|(k, _)| id_of(&k)).collect(),
                Err(e) => {
                    tracing::debug!(error = %e, "reading active cgroups");
                    return None;
                }
            };
        let mut out = std::mem::replace(&mut self.previous, now.clone());
        out.extend(now);
        out.sort_unstable();
        out.dedup();
        (bumped && !overflowed).then_some(out)
    }
}
