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
const HOOKS: [&str; 3] = ["sched_wakeup", "sched_wakeup_new", "sched_switch"];

pub struct SchedProbe {
    hist: MapHandle,
    stats: MapHandle,
    _links: Vec<Link>,
}

impl SchedProbe {
    /// Loads and attaches; `Ok(Err(status))` when the kernel lacks a hook.
    pub fn load(btf: &KernelBtf) -> Result<Result<SchedProbe, ProbeStatus>, ProbeError> {
        if let Some(missing) = HOOKS.iter().find(|h| !btf.has_tracepoint(h)) {
            return Ok(Err(ProbeStatus {
                name: NAME,
                up: false,
                reason: Some(format!("kernel has no BTF tracepoint {missing}")),
            }));
        }
        let mut storage = MaybeUninit::uninit();
        let open = skel::SchedSkelBuilder::default().open(&mut storage).map_err(err(NAME, "open"))?;
        let skel = open.load().map_err(err(NAME, "load"))?;
        let links = vec![
            skel.progs.sched_wakeup.attach().map_err(err(NAME, "attach sched_wakeup"))?,
            skel.progs.sched_wakeup_new.attach().map_err(err(NAME, "attach sched_wakeup_new"))?,
            skel.progs.sched_switch.attach().map_err(err(NAME, "attach sched_switch"))?,
        ];
        Ok(Ok(SchedProbe {
            hist: handle(NAME, &skel.maps.sched_hist)?,
            stats: handle(NAME, &skel.maps.sched_stats)?,
            _links: links,
        }))
    }

    /// The cumulative histogram of one cgroup, if it has one.
    pub fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<Hist> {
        lookup_cgroup(&self.hist, cgroup_dir).ok().flatten().and_then(|b| Hist::from_bytes(&b))
    }

    /// (negative deltas dropped, storage allocation failures)
    pub fn kernel_stats(&self) -> (u64, u64) {
        (percpu_sum(&self.stats, 0), percpu_sum(&self.stats, 1))
    }
}
