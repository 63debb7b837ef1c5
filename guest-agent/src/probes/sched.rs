//! Run-queue latency per cgroup (`bpf/sched.bpf.c`): the unit's loader, its
//! per-cgroup reading and the `ebpf_sched_latency_microseconds` family.

pub(crate) mod skel {
    include!(concat!(env!("OUT_DIR"), "/sched.skel.rs"));
}

use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapHandle};

use super::cgroup_storage::{self, Storage};
use super::hist::{Hist, HIST_BYTES};
use super::options::OptionsSpec;
use super::per_cgroup::{CgroupReads, CgroupSeries, PerCgroup, Prepared};
use super::signal::{SignalKind, SignalSpec};
use super::status::ProbeStatus;
use super::unit::{
    Delta, FamilySpec, Kind, LoadContext, Loaded, Probe, Scope, SelfSeries, UnitSpec, UnitStats,
    Value,
};
use crate::ebpf::{decode, err, handle, percpu_sum, KernelBtf, ProbeError};

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
    options: OptionsSpec::flags::<Config>(),
    load: load_unit,
};

/// The unit's part of the command line.
#[derive(Debug, Clone, Copy, clap::Args)]
#[group(id = "sched_latency options")]
pub struct Config {
    /// Where run-queue waits come from: the scheduler's own sched_info
    /// (one hook, exact) or stamps from the wakeup hooks.
    #[arg(
        long = "sched-method",
        value_name = "SCHED_METHOD",
        value_enum,
        default_value = "auto"
    )]
    pub method: Method,
}

static FAMILIES: [FamilySpec; 1] = [FamilySpec {
    name: FAMILY,
    help: "Run-queue wait of tasks being scheduled in (switched-in task's cgroup)",
    kind: Kind::Histogram,
    scope: Scope::Container,
    pod_labels: false,
}];

fn load_unit(ctx: &LoadContext<'_>, _names: &[&'static str]) -> Result<Loaded, ProbeError> {
    Ok(
        match SchedProbe::load(ctx.btf, ctx.options.get::<Config>().method)? {
            Ok(p) => Loaded {
                statuses: vec![p.status.clone()],
                unit: Some(Box::new(p)),
            },
            Err(st) => Loaded {
                unit: None,
                statuses: vec![st],
            },
        },
    )
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
    hist: PerCgroup<WaitSeries>,
    stats: MapHandle,
    _links: Vec<Link>,
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
        let rmdir = btf.has_tracepoint("cgroup_rmdir");
        let hist = Prepared::new(NAME, "sched_hist", storage, rmdir, open.open_object_mut())?;
        open.progs.sched_wakeup.set_autoload(!use_sched_info);
        open.progs.sched_wakeup_new.set_autoload(!use_sched_info);
        let skel = crate::ebpf::object::load(NAME, open)?;
        let mut links = vec![skel
            .progs
            .sched_switch
            .attach()
            .map_err(err(NAME, "attach sched_switch"))?];
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
        Ok(SchedProbe {
            hist: hist.reader(skel.object(), WaitSeries)?,
            stats: handle(NAME, &skel.maps.sched_stats)?,
            _links: links,
            status: ProbeStatus::up(NAME),
        })
    }

    /// The value of the cgroup whose directory `cgroup_dir` is, if it has one.
    pub fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<Hist> {
        self.hist.value_by_dir(cgroup_dir)
    }
}

/// How the probe runs: its hooks, where its values live and how a tick reads them.
fn probe_status(p: &SchedProbe, method: &str, fell_back: Option<String>) -> ProbeStatus {
    let hook = if method == "sched_info" {
        "tp_btf/sched_switch (sched_info)"
    } else {
        "tp_btf/sched_switch,sched_wakeup,sched_wakeup_new (stamps)"
    };
    super::unit::status_of(NAME, hook, p.hist.storage(), p.hist.batched(), fell_back)
}

/// A cgroup's run-queue waits: one histogram (`struct sched_cgroup`).
struct WaitSeries;

impl CgroupSeries for WaitSeries {
    type Value = Hist;

    fn decode(bytes: &[u8]) -> Option<Hist> {
        decode::<skel::types::sched_cgroup>(bytes)
            .map(|c| Hist::from_parts(&c.hist.buckets, c.hist.sum_ns))
    }

    fn delta(now: &Hist, prev: &Hist) -> Hist {
        now.delta_since(prev)
    }

    fn deltas(&mut self, _id: u64, _now: &Hist, delta: Hist, out: &mut Vec<Delta>) {
        if !delta.is_empty() {
            out.push(Delta {
                family: FAMILY,
                labels: Default::default(),
                value: Value::Hist(delta),
            });
        }
    }
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

    fn cgroup_reads(&mut self) -> Option<&mut dyn CgroupReads> {
        Some(&mut self.hist)
    }

    /// Every switch-in marks its task's cgroup: a cgroup missing from the set
    /// had no task run.
    fn marks_every_run(&self) -> bool {
        true
    }

    fn stats(&self) -> UnitStats {
        // [0] negative deltas dropped, [1] storage allocation failures
        UnitStats {
            maps: vec![self.hist.map_fill()],
            storage_failures: Some((
                NAME,
                percpu_sum(&self.stats, counters::STAT_NO_STORAGE as u32),
            )),
            series: vec![SelfSeries::counter(
                "gpufeed_sched_negative_deltas_total",
                "Run-queue waits dropped because the clock went backwards across CPUs",
                percpu_sum(&self.stats, counters::STAT_NEGATIVE_DELTA as u32),
            )],
            node: Vec::new(),
        }
    }
}
