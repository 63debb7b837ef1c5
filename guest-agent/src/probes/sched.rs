//! Run-queue latency per cgroup (`bpf/sched.bpf.c`).

mod skel {
    include!(concat!(env!("OUT_DIR"), "/sched.skel.rs"));
}

use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapHandle};

use super::hist::Hist;
use super::{err, handle, lookup_cgroup, percpu_sum, KernelBtf, ProbeError, ProbeStatus};

pub const NAME: &str = "sched_latency";

/// How the probe learns when a task became runnable (see bpf/sched.bpf.c).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Method {
    /// sched_info when the kernel has it, stamp otherwise.
    Auto,
    /// The scheduler's own `sched_info.last_queued` against the run-queue clock:
    /// one hook (switch), exactly what /proc/<pid>/schedstat accounts.
    SchedInfo,
    /// Stamps in task storage from the wakeup, wakeup_new and switch hooks.
    Stamp,
}

pub struct SchedProbe {
    hist: MapHandle,
    stats: MapHandle,
    _links: Vec<Link>,
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
                    return Ok(Err(ProbeStatus {
                        name: NAME,
                        up: false,
                        reason: Some(
                            "kernel has no task_struct.sched_info (CONFIG_SCHED_INFO) or cfs_rq.rq (CONFIG_FAIR_GROUP_SCHED)"
                                .into(),
                        ),
                    }));
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
            return Ok(Err(ProbeStatus {
                name: NAME,
                up: false,
                reason: Some(format!("kernel has no BTF tracepoint {missing}")),
            }));
        }
        let mut storage = MaybeUninit::uninit();
        let mut open = skel::SchedSkelBuilder::default()
            .open(&mut storage)
            .map_err(err(NAME, "open"))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.use_sched_info = use_sched_info;
        }
        open.progs.sched_wakeup.set_autoload(!use_sched_info);
        open.progs.sched_wakeup_new.set_autoload(!use_sched_info);
        let skel = open.load().map_err(err(NAME, "load"))?;
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
        tracing::info!(
            method = if use_sched_info {
                "sched_info"
            } else {
                "stamp"
            },
            "run-queue latency source"
        );
        Ok(Ok(SchedProbe {
            hist: handle(NAME, &skel.maps.sched_hist)?,
            stats: handle(NAME, &skel.maps.sched_stats)?,
            _links: links,
        }))
    }

    /// The cumulative histogram of one cgroup, if it has one.
    pub fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<Hist> {
        lookup_cgroup(&self.hist, cgroup_dir)
            .ok()
            .flatten()
            .and_then(|b| Hist::from_bytes(&b))
    }

    /// (negative deltas dropped, storage allocation failures)
    pub fn kernel_stats(&self) -> (u64, u64) {
        (percpu_sum(&self.stats, 0), percpu_sum(&self.stats, 1))
    }
}
