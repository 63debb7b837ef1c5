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

use libbpf_rs::{Link, MapCore, Object, OpenObject};

use super::cgroup_batch::{self, BatchRead};
use super::cgroup_storage::{CgroupValues, Storage};
use super::model::{Delta, LastRead, MapFill};
use crate::cgroups::CgroupTree;
use crate::ebpf::cgroup_maps::{ActiveSet, Drained};
use crate::ebpf::{err, handle, not_in_object, ProbeError};

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

/// A unit's per-cgroup value in its object before load: the maps and
/// programs that `CGROUP_STORAGE(value, …)`, `CGROUP_DRAIN(value, …)` and
/// `CGROUP_BATCH(value, …)` declare, found by the names those macros give
/// them (`<value>`, `<value>_by_id`, `<value>_zero`, `<value>_drained`,
/// `<value>_drain_added`, `<value>_rmdir`, `<value>_batch`,
/// `<value>_batch_read`), and `cgroup_active.h`'s `active_epoch` and
/// `active_cgroups`. A name the object lacks is an error at load, which
/// every kernel test reaches.
pub struct Prepared {
    probe: &'static str,
    value: &'static str,
    storage: Storage,
    batched: bool,
    rmdir: bool,
}

impl Prepared {
    /// Chooses, before load, what of the value the kernel gets: the storage
    /// maps `storage` uses (`Storage::configure`), the drain where the kernel
    /// has `cgroup_rmdir` (`rmdir`), the batch program where it can run.
    pub fn new(
        probe: &'static str,
        value: &'static str,
        storage: Storage,
        rmdir: bool,
        open: &mut OpenObject,
    ) -> Result<Prepared, ProbeError> {
        storage.configure(probe, value, open)?;
        let batched = !storage.by_id() && cgroup_batch::supported();
        for (suffix, load) in [("_rmdir", rmdir), ("_batch_read", batched)] {
            let name = format!("{value}{suffix}");
            let mut prog = open
                .progs_mut()
                .find(|p| p.name() == name.as_str())
                .ok_or_else(|| not_in_object(probe, "program", &name))?;
            prog.set_autoload(load);
        }
        Ok(Prepared {
            probe,
            value,
            storage,
            batched,
            rmdir,
        })
    }

    /// After load: the reader of the value in `obj`, with the unit's
    /// `series`; attaches the drain at `cgroup_rmdir` where it was loaded.
    pub fn reader<S: CgroupSeries>(
        self,
        obj: &Object,
        series: S,
    ) -> Result<PerCgroup<S>, ProbeError> {
        let Prepared {
            probe,
            value,
            storage,
            batched,
            rmdir,
        } = self;
        let map = |name: &str| {
            let m = obj
                .maps()
                .find(|m| m.name() == name)
                .ok_or_else(|| not_in_object(probe, "map", name))?;
            handle(probe, &m)
        };
        let prog = |name: &str| {
            obj.progs_mut()
                .find(|p| p.name() == name)
                .ok_or_else(|| not_in_object(probe, "program", name))
        };
        let values = map(&match storage {
            Storage::Local => value.to_string(),
            Storage::ById => format!("{value}_by_id"),
        })?;
        let batch = if batched {
            let value_size = values.value_size() as usize;
            let slots = map(&format!("{value}_batch"))?;
            let run = prog(&format!("{value}_batch_read"))?;
            Some(BatchRead::new(probe, &run, &slots, value_size)?)
        } else {
            None
        };
        let rmdir = if rmdir {
            let drain = prog(&format!("{value}_rmdir"))?;
            Some(drain.attach().map_err(err(probe, "attach cgroup_rmdir"))?)
        } else {
            None
        };
        Ok(PerCgroup {
            probe,
            value,
            values: CgroupValues::new(values, storage),
            active: ActiveSet::new(probe, map("active_epoch")?, map("active_cgroups")?)?,
            drained: Drained::new(
                probe,
                map(&format!("{value}_drained"))?,
                map(&format!("{value}_drain_added"))?,
            )?,
            batch,
            last: LastRead::default(),
            series,
            _rmdir: rmdir,
        })
    }
}

/// A unit's per-cgroup values and what reading them needs.
pub struct PerCgroup<S: CgroupSeries> {
    probe: &'static str,
    /// The value's name in the object (`gpufeed_map_entries{map}`).
    value: &'static str,
    values: CgroupValues,
    active: ActiveSet,
    drained: Drained,
    /// None on a kernel without batch reads: one lookup per cgroup
    batch: Option<BatchRead>,
    last: LastRead<S::Value>,
    /// The unit's series and the state they need (open to the unit's other work).
    pub series: S,
    /// The drain at `cgroup_rmdir`, where the kernel has the tracepoint.
    _rmdir: Option<Link>,
}

impl<S: CgroupSeries> PerCgroup<S> {
    pub fn storage(&self) -> Storage {
        self.values.storage()
    }

    /// Whether a tick reads the values with the batch program.
    pub fn batched(&self) -> bool {
        self.batch.is_some()
    }

    /// The value map's fill: cgroups read at least once and not gone
    /// (`gpufeed_map_entries`; cgroup storage has no capacity of its own).
    pub fn map_fill(&self) -> MapFill {
        MapFill {
            map: self.value,
            entries: self.last.len(),
            capacity: None,
        }
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

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use libbpf_rs::skel::{OpenSkel, SkelBuilder};

    use super::*;
    use crate::probes::sched::skel;

    /// The names are the C macros': a value the object lacks fails at once, naming what is
    /// missing, and the unit's real value prepares (opening needs no privilege).
    #[test]
    fn a_value_the_object_lacks_is_named_and_the_real_one_prepares() {
        let mut mem = MaybeUninit::uninit();
        let mut open = skel::SchedSkelBuilder::default().open(&mut mem).unwrap();
        let e = Prepared::new(
            "sched_latency",
            "sched_hits",
            Storage::Local,
            true,
            open.open_object_mut(),
        )
        .err()
        .expect("no such value");
        assert_eq!(
            e.to_string(),
            "sched_latency: finding the object's maps and programs failed: the object has no map sched_hits"
        );
        let p = Prepared::new(
            "sched_latency",
            "sched_hist",
            Storage::ById,
            false,
            open.open_object_mut(),
        )
        .unwrap();
        assert!(!p.batched, "no batch read of the id map");
        assert!(!open.progs.sched_hist_rmdir.autoload());
        assert!(!open.progs.sched_hist_batch_read.autoload());
    }
}
