//! Run-queue latency per cgroup (`bpf/sched.bpf.c`): the unit's loader, its
//! per-cgroup reading and the `ebpf_sched_latency_microseconds` family.

pub(crate) mod skel {
    include!(concat!(env!("OUT_DIR"), "/sched.skel.rs"));
}

use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;

use libbpf_rs::skel::SkelBuilder;
use libbpf_rs::{Link, MapHandle};

use super::cgroup_batch::{self, BatchRead};
use super::cgroup_maps::{ActiveSet, Drained};
use super::cgroup_storage::{self, CgroupValues, Storage};
use super::hist::{Hist, HIST_BYTES};
use super::signal::{SignalKind, SignalSpec};
use super::unit::{
    read_each, Delta, FamilySpec, Kind, LastRead, LoadContext, Loaded, Probe, Scope, SelfSeries,
    UnitSpec, UnitStats, Value,
};
use super::{decode, err, handle, percpu_sum, KernelBtf, ProbeError, ProbeStatus};
use crate::cgroups::CgroupTree;

/// The counters of bpf/sched.h, generated from it by build.rs.
mod counters {
    #![allow(dead_code)] // STATS sizes the kernel's array
    include!(concat!(env!("OUT_DIR"), "/sched.consts.rs"));
}

pub const NAME: &str = "sched_latency";
pub const FAMILY: &str = "ebpf_sched_latency_microseconds";

// SAFETY: a generated #[repr(C)] struct of integers: every bit pattern is valid.
unsafe impl plain::Plain for skel::types::hist {}
// SAFETY: as above.
unsafe impl plain::Plain for skel::types::sched_cgroup {}
const _: () = assert!(std::mem::size_of::<skel::types::hist>() == HIST_BYTES);

pub const UNIT: UnitSpec = UnitSpec {
    names: &[NAME],
    reports: &[NAME],
    load: load_unit,
};

/// The unit's part of the command line.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub method: Method,
}

static FAMILIES: [FamilySpec; 1] = [FamilySpec {
    name: FAMILY,
    help: "Run-queue wait of tasks being scheduled in (switched-in task's cgroup)",
    kind: Kind::Histogram,
    scope: Scope::Container,
}];

fn load_unit(ctx: &LoadContext<'_>, _names: &[&'static str]) -> Result<Loaded, ProbeError> {
    Ok(match SchedProbe::load(ctx.btf, ctx.config.sched.method)? {
        Ok(p) => Loaded {
            statuses: vec![p.status.clone()],
            unit: Some(Box::new(p)),
        },
        Err(st) => Loaded {
            unit: None,
            statuses: vec![st],
        },
    })
}

/// How the probe learns when a task became runnable (see bpf/sched.bpf.c).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Method {
    /// sched_info when the kernel has it, stamp otherwise.
    Auto,
    /// The scheduler's own `sched_info`: one hook (switch) that follows each
    /// task's `run_delay` (/proc/<pid>/schedstat), waits before a migration included.
    SchedInfo,
    /// Stamps in task storage from the wakeup, wakeup_new and switch hooks.
    Stamp,
}

pub struct SchedProbe {
    hist: CgroupValues,
    stats: MapHandle,
    active: ActiveSet,
    drained: Drained,
    /// None on a kernel without batch reads: one lookup per cgroup
    batch: Option<BatchRead>,
    _links: Vec<Link>,
    last: LastRead<Hist>,
    /// how it runs here (`gpufeed_probe_info`)
    status: ProbeStatus,
}

impl SchedProbe {
    /// Loads and attaches; `Ok(Err(status))` when the kernel lacks a hook.
    pub fn load(
        btf: &KernelBtf,
        method: Method,
    ) -> Result<Result<SchedProbe, ProbeStatus>, ProbeError> {
        let use_sched_info = match method {
            Method::Auto => btf.has_sched_info(),
            Method::SchedInfo => {
                if !btf.has_sched_info() {
                    return Ok(Err(ProbeStatus::down(
                        NAME,
                        "kernel has no task_struct.sched_info (CONFIG_SCHED_INFO) or cfs_rq.rq (CONFIG_FAIR_GROUP_SCHED)",
                    )));
                }
                true
            }
            Method::Stamp => false,
        };
        let hooks: &[&str] = if use_sched_info {
            &["sched_switch"]
        } else {
            &["sched_wakeup", "sched_wakeup_new", "sched_switch"]
        };
        if let Some(missing) = hooks.iter().find(|h| !btf.has_tracepoint(h)) {
            return Ok(Err(ProbeStatus::down(
                NAME,
                format!("kernel has no BTF tracepoint {missing}"),
            )));
        }
        let chosen = cgroup_storage::load_first(NAME, |storage| {
            SchedProbe::load_with(btf, use_sched_info, storage)
        })?;
        let method = if use_sched_info {
            "sched_info"
        } else {
            "stamp"
        };
        tracing::info!(
            method,
            storage = chosen.storage.name(),
            "run-queue latency source"
        );
        let mut probe = chosen.loaded;
        probe.status = probe_status(&probe, method, chosen.fell_back);
        Ok(Ok(probe))
    }

    fn load_with(
        btf: &KernelBtf,
        use_sched_info: bool,
        storage: Storage,
    ) -> Result<SchedProbe, ProbeError> {
        let mut mem = MaybeUninit::uninit();
        let mut open = skel::SchedSkelBuilder::default()
            .open(&mut mem)
            .map_err(err(NAME, "open"))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.use_sched_info = use_sched_info;
            ro.cgroup_storage_by_id = storage.by_id();
            // tasks created from now on have all their run_delay counted
            ro.started_ns = monotonic_ns();
        }
        storage.configure(
            NAME,
            &mut open.maps.sched_hist,
            &mut open.maps.sched_hist_by_id,
            &mut open.maps.sched_hist_zero,
        )?;
        open.progs.sched_wakeup.set_autoload(!use_sched_info);
        open.progs.sched_wakeup_new.set_autoload(!use_sched_info);
        let has_rmdir = btf.has_tracepoint("cgroup_rmdir");
        open.progs.sched_hist_rmdir.set_autoload(has_rmdir);
        let batched = !storage.by_id() && cgroup_batch::supported();
        open.progs.sched_hist_batch_read.set_autoload(batched);
        let skel = crate::probes::object::load(NAME, open)?;
        let batch = BatchRead::if_loaded(
            batched,
            NAME,
            &skel.progs.sched_hist_batch_read,
            &skel.maps.sched_hist_batch,
            std::mem::size_of::<skel::types::sched_cgroup>(),
        )?;
        let mut links = vec![skel
            .progs
            .sched_switch
            .attach()
            .map_err(err(NAME, "attach sched_switch"))?];
        if has_rmdir {
            links.push(
                skel.progs
                    .sched_hist_rmdir
                    .attach()
                    .map_err(err(NAME, "attach cgroup_rmdir"))?,
            );
        }
        if !use_sched_info {
            links.push(
                skel.progs
                    .sched_wakeup
                    .attach()
                    .map_err(err(NAME, "attach sched_wakeup"))?,
            );
            links.push(
                skel.progs
                    .sched_wakeup_new
                    .attach()
                    .map_err(err(NAME, "attach sched_wakeup_new"))?,
            );
        }
        let values = if storage.by_id() {
            handle(NAME, &skel.maps.sched_hist_by_id)?
        } else {
            handle(NAME, &skel.maps.sched_hist)?
        };
        Ok(SchedProbe {
            hist: CgroupValues::new(values, storage),
            stats: handle(NAME, &skel.maps.sched_stats)?,
            active: ActiveSet::new(
                NAME,
                handle(NAME, &skel.maps.active_epoch)?,
                handle(NAME, &skel.maps.active_cgroups)?,
            )?,
            drained: Drained::new(
                NAME,
                handle(NAME, &skel.maps.sched_hist_drained)?,
                handle(NAME, &skel.maps.sched_hist_drain_added)?,
            )?,
            batch,
            _links: links,
            last: LastRead::default(),
            status: ProbeStatus::up(NAME),
        })
    }

    /// The value of the cgroup whose directory `cgroup_dir` is, if it has one.
    pub fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<Hist> {
        self.hist.get_by_dir(cgroup_dir).and_then(|b| hist_of(&b))
    }

    /// The cumulative histogram of one cgroup, if it has one.
    fn read_id(&self, id: u64, cgroup_dir: BorrowedFd<'_>) -> Option<Hist> {
        self.hist.get(id, cgroup_dir).and_then(|b| hist_of(&b))
    }
}

/// How the probe runs: its hooks, where its values live and how a tick reads them.
fn probe_status(p: &SchedProbe, method: &str, fell_back: Option<String>) -> ProbeStatus {
    let hook = if method == "sched_info" {
        "tp_btf/sched_switch (sched_info)"
    } else {
        "tp_btf/sched_switch,sched_wakeup,sched_wakeup_new (stamps)"
    };
    super::unit::status_of(NAME, hook, p.hist.storage(), p.batch.is_some(), fell_back)
}

/// The delta of a cgroup's cumulative histogram `h` since its previous reading.
fn push_delta(last: &mut LastRead<Hist>, id: u64, h: Hist, out: &mut Vec<Delta>) {
    let d = last.advance(id, h, Hist::delta_since);
    if !d.is_empty() {
        out.push(Delta {
            family: FAMILY,
            labels: Default::default(),
            value: Value::Hist(d),
        });
    }
}

/// Decodes a `struct sched_cgroup` (storage or drained value).
fn hist_of(bytes: &[u8]) -> Option<Hist> {
    decode::<skel::types::sched_cgroup>(bytes)
        .map(|c| Hist::from_parts(&c.hist.buckets, c.hist.sum_ns))
}

/// CLOCK_MONOTONIC in ns, the clock of `task_struct.start_time`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Probe for SchedProbe {
    fn families(&self) -> &'static [FamilySpec] {
        &FAMILIES
    }

    fn signals(&self) -> Vec<SignalSpec> {
        vec![SignalSpec {
            name: "run_queue_wait",
            family: FAMILY,
            kind: SignalKind::Latency,
        }]
    }

    fn read_cgroup(&mut self, id: u64, dir: BorrowedFd<'_>, out: &mut Vec<Delta>) {
        let Some(h) = self.read_id(id, dir) else {
            return;
        };
        push_delta(&mut self.last, id, h, out);
    }

    fn read_cgroups(&mut self, ids: &[u64], tree: &CgroupTree, out: &mut Vec<(u64, Delta)>) {
        let Some(batch) = self.batch.as_mut() else {
            return read_each(self, ids, tree, out);
        };
        let last = &mut self.last;
        let each = |id, bytes: &[u8], d: &mut Vec<Delta>| {
            if let Some(h) = hist_of(bytes) {
                push_delta(last, id, h, d);
            }
        };
        batch.deltas(NAME, ids, each, out);
    }

    fn active_cgroups(&mut self) -> Option<Vec<u64>> {
        self.active.take()
    }

    /// Every switch-in marks its task's cgroup: a cgroup missing from the set
    /// had no task run.
    fn marks_every_run(&self) -> bool {
        true
    }

    fn read_removed(&mut self, out: &mut Vec<(u64, Delta)>) {
        let (drained, last) = (&self.drained, &mut self.last);
        let push = |id, h, d: &mut Vec<Delta>| {
            push_delta(last, id, h, d);
            last.forget(id);
        };
        drained.deltas(hist_of, push, out);
    }

    fn forget_cgroup(&mut self, id: u64) {
        self.last.forget(id);
        self.hist.forget(id);
    }

    fn stats(&self) -> UnitStats {
        // [0] negative deltas dropped, [1] storage allocation failures
        UnitStats {
            maps: vec![super::unit::MapFill {
                map: "sched_hist",
                entries: self.last.len(),
                capacity: None,
            }],
            storage_failures: Some((
                NAME,
                percpu_sum(&self.stats, counters::STAT_NO_STORAGE as u32),
            )),
            series: vec![SelfSeries {
                name: "gpufeed_sched_negative_deltas_total",
                help: "Run-queue waits dropped because the clock went backwards across CPUs",
                kind: Kind::Counter,
                value: percpu_sum(&self.stats, counters::STAT_NEGATIVE_DELTA as u32) as f64,
            }],
            node: Vec::new(),
        }
    }
}
