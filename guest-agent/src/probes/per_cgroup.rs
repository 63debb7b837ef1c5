//! The per-cgroup reading every unit keyed by cgroup storage shares: the
//! values map (cgroup-local storage or the id map), the activity ring that
//! names the cgroups a tick must read, the batch program that reads many of
//! them with one syscall, the drain that keeps a removed cgroup's last value,
//! and each cgroup's previous reading to turn the next into a delta.
//!
//! A unit supplies only what is its own ([`CgroupSeries`]): how its value
//! decodes, how two readings make a delta, and which series a delta adds to.
//! The collector drives the rest through [`CgroupReads`].

use std::os::fd::{AsFd, BorrowedFd};

use libbpf_rs::MapHandle;

use super::cgroup_batch::BatchRead;
use super::cgroup_maps::{ActiveSet, Drained};
use super::cgroup_storage::{CgroupValues, Storage};
use super::unit::{Delta, LastRead};
use super::ProbeError;
use crate::cgroups::CgroupTree;

/// What a unit knows about its per-cgroup value.
pub trait CgroupSeries: Send {
    /// The cumulative value the kernel keeps per cgroup.
    type Value: Clone + Send;

    /// The value from its bytes (a storage, batch slot or drained value).
    fn decode(bytes: &[u8]) -> Option<Self::Value>;

    /// What happened between reading `prev` and reading `now` (the whole of
    /// `now` where the counters went backwards: new storage).
    fn delta(now: &Self::Value, prev: &Self::Value) -> Self::Value;

    /// Pushes the series deltas of cgroup `id`, read as `now`, `delta` since
    /// its previous reading (the first reading's delta is `now` itself).
    fn deltas(&mut self, id: u64, now: &Self::Value, delta: Self::Value, out: &mut Vec<Delta>);

    /// Cgroup `id` is gone (its last value was read, or never will be).
    fn forget(&mut self, _id: u64) {}
}

/// The per-cgroup work of a unit, as the collector drives it each tick.
pub trait CgroupReads {
    /// The cgroups whose values the unit's programs changed since the
    /// previous call; None when that cannot be trusted (the ring overflowed),
    /// and then every cgroup is read.
    fn active(&mut self) -> Option<Vec<u64>>;

    /// Reads the values of `ids` (cgroups of `tree`) and pushes (cgroup id,
    /// what changed since its previous reading).
    fn read(&mut self, ids: &[u64], tree: &CgroupTree, out: &mut Vec<(u64, Delta)>);

    /// The last values of cgroups removed since the previous call (drained
    /// at `cgroup_rmdir`, as their directories cannot be read any more):
    /// pushes what changed since each one's previous reading and forgets it.
    fn read_removed(&mut self, out: &mut Vec<(u64, Delta)>);

    /// The cgroup is gone and its last numbers were taken (or never will be).
    fn forget(&mut self, id: u64);
}

/// The maps a unit's object declares for its value.
pub struct ValueMaps {
    /// The values: `<value>` (cgroup-local storage) or `<value>_by_id`,
    /// whichever `storage` chose (`bpf/cgroup_storage.h`).
    pub values: MapHandle,
    /// `active_epoch` and the ring `active_cgroups` (`bpf/cgroup_active.h`).
    pub active_epoch: MapHandle,
    pub active_cgroups: MapHandle,
    /// `<value>_drained` and `<value>_drain_added` (`bpf/cgroup_drain.h`).
    pub drained: MapHandle,
    pub drain_added: MapHandle,
}

/// A unit's per-cgroup values and what reading them needs.
pub struct PerCgroup<S: CgroupSeries> {
    probe: &'static str,
    values: CgroupValues,
    active: ActiveSet,
    drained: Drained,
    /// None on a kernel without batch reads: one lookup per cgroup
    batch: Option<BatchRead>,
    last: LastRead<S::Value>,
    /// The unit's series and the state they need (open to the unit's other work).
    pub series: S,
}

impl<S: CgroupSeries> PerCgroup<S> {
    pub fn new(
        probe: &'static str,
        storage: Storage,
        maps: ValueMaps,
        batch: Option<BatchRead>,
        series: S,
    ) -> Result<PerCgroup<S>, ProbeError> {
        Ok(PerCgroup {
            probe,
            values: CgroupValues::new(maps.values, storage),
            active: ActiveSet::new(probe, maps.active_epoch, maps.active_cgroups)?,
            drained: Drained::new(probe, maps.drained, maps.drain_added)?,
            batch,
            last: LastRead::default(),
            series,
        })
    }

    pub fn storage(&self) -> Storage {
        self.values.storage()
    }

    /// Whether a tick reads the values with the batch program.
    pub fn batched(&self) -> bool {
        self.batch.is_some()
    }

    /// Cgroups read at least once and not gone (`gpufeed_map_entries`).
    pub fn entries(&self) -> usize {
        self.last.len()
    }

    /// The value of the cgroup whose directory `dir` is, if it has one (no
    /// delta state changes).
    pub fn value_by_dir(&self, dir: BorrowedFd<'_>) -> Option<S::Value> {
        self.values.get_by_dir(dir).and_then(|b| S::decode(&b))
    }

    /// Turns one reading into deltas.
    fn take(
        last: &mut LastRead<S::Value>,
        series: &mut S,
        id: u64,
        now: S::Value,
        out: &mut Vec<Delta>,
    ) {
        let delta = last.advance(id, now.clone(), S::delta);
        series.deltas(id, &now, delta, out);
    }
}

impl<S: CgroupSeries> CgroupReads for PerCgroup<S> {
    fn active(&mut self) -> Option<Vec<u64>> {
        self.active.take()
    }

    fn read(&mut self, ids: &[u64], tree: &CgroupTree, out: &mut Vec<(u64, Delta)>) {
        let (last, series) = (&mut self.last, &mut self.series);
        let Some(batch) = self.batch.as_mut() else {
            let mut read = Vec::new();
            for &id in ids {
                let Some(cg) = tree.cgroups.get(&id) else {
                    continue;
                };
                let Some(now) = self
                    .values
                    .get(id, cg.dir.as_fd())
                    .and_then(|b| S::decode(&b))
                else {
                    continue;
                };
                Self::take(last, series, id, now, &mut read);
                out.extend(read.drain(..).map(|d| (id, d)));
            }
            return;
        };
        let each = |id, bytes: &[u8], d: &mut Vec<Delta>| {
            if let Some(now) = S::decode(bytes) {
                Self::take(last, series, id, now, d);
            }
        };
        batch.deltas(self.probe, ids, each, out);
    }

    fn read_removed(&mut self, out: &mut Vec<(u64, Delta)>) {
        let (last, series) = (&mut self.last, &mut self.series);
        let push = |id, now, d: &mut Vec<Delta>| {
            Self::take(last, series, id, now, d);
            last.forget(id);
            series.forget(id);
        };
        self.drained.deltas(S::decode, push, out);
    }

    fn forget(&mut self, id: u64) {
        self.last.forget(id);
        self.series.forget(id);
        self.values.forget(id);
    }
}
