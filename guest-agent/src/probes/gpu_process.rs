//! What the two GPU units that follow pod processes have in common: `cuda`
//! (uprobes bound to the CUDA library a process maps) and `gpu_driver` (the
//! processes holding a GPU device file, and their driver calls). Both keep
//! values per cgroup whose busy time may be the node's compute time, look at
//! the pod processes each tick (new ones, and known ones whose mappings may
//! have changed), and report the same way. A unit implements
//! [`GpuProcessUnit`] (how it looks at one process, what it forgets, its
//! families and self-series); the [`Probe`] impl here is the rest, once.

use std::collections::HashSet;
use std::os::fd::BorrowedFd;

use super::cgroup_storage::{self, Storage};
use super::gpu_compute::{ComputeSeries, ComputeSource};
use super::lookout::Lookout;
use super::per_cgroup::{CgroupReads, CgroupSeries, PerCgroup};
use super::signal::SignalSpec;
use super::tick::PodProcesses;
use super::unit::{
    self, FamilySpec, GaugeValue, Probe, ProbeStatus, SelfSeries, TickContext, TickOutput,
    UnitStats,
};
use crate::ebpf::ProbeError;

/// A GPU unit's series hold the node's compute series once the unit's source
/// is elected (`registry::elect_compute`); until then, none.
pub trait ComputeSlot {
    fn compute(&self) -> Option<&ComputeSeries>;
    fn compute_mut(&mut self) -> &mut Option<ComputeSeries>;
}

/// The state both GPU units hold besides their own.
pub struct GpuProcesses<S: CgroupSeries> {
    pub cgroups: PerCgroup<S>,
    /// Which pod processes to look at (again) this tick.
    pub lookout: Lookout,
    /// The pod processes' generation (`TickContext::pod_processes`) last looked at.
    pids_seen: Option<u64>,
    /// how it runs here (`gpufeed_probe_info`)
    status: ProbeStatus,
}

impl<S: CgroupSeries> GpuProcesses<S> {
    /// A unit's parts as it loads; [`load_first`] sets its status once the storage is chosen.
    pub fn new(name: &'static str, cgroups: PerCgroup<S>) -> Self {
        GpuProcesses {
            cgroups,
            lookout: Lookout::default(),
            pids_seen: None,
            status: ProbeStatus::up(name),
        }
    }
}

/// A GPU unit that follows pod processes: what it does itself.
pub trait GpuProcessUnit: Send {
    type Series: CgroupSeries + ComputeSlot + Send;
    const NAME: &'static str;
    /// Its families.
    const FAMILIES: &'static [FamilySpec];
    /// Its families with the compute time and duty cycle, when its source is the node's.
    const FAMILIES_COMPUTE: &'static [FamilySpec];
    /// The latency signal a correlator reads from it.
    const SIGNAL: SignalSpec;

    fn parts(&self) -> &GpuProcesses<Self::Series>;
    fn parts_mut(&mut self) -> &mut GpuProcesses<Self::Series>;

    /// The compute-time source it can be here (`Probe::compute_source`).
    fn source(&self) -> Option<ComputeSource>;

    /// Forgets what it keeps of processes no longer in `tgids`.
    fn forget(&mut self, tgids: &PodProcesses);

    /// Looks at those of `tgids` that [`Lookout::look`] says may have changed
    /// (`changed`: the processes the kernel saw exec or map something, when
    /// it said), forgetting none. Returns what it newly found (library files
    /// attached, GPU files seeded).
    fn look_at(
        &mut self,
        tgids: impl Iterator<Item = i32>,
        changed: Option<&HashSet<i32>>,
    ) -> usize;

    /// Its gauges of the tick, besides the duty cycle.
    fn gauges(&mut self, _ctx: &TickContext<'_>) -> Vec<(&'static str, Vec<GaugeValue>)> {
        Vec::new()
    }

    /// The kernel's count of values it had no storage for, and its own self-series.
    fn self_series(&self) -> (u64, Vec<SelfSeries>);

    /// Looks at the pod processes `tgids` (see [`GpuProcessUnit::look_at`])
    /// and forgets those no longer listed.
    fn scan(&mut self, tgids: &PodProcesses, changed: Option<&HashSet<i32>>) -> usize {
        self.forget(tgids);
        self.parts_mut().lookout.retain(tgids);
        self.look_at(tgids.iter(), changed)
    }

    /// The value of the cgroup whose directory `cgroup_dir` is, if it has one
    /// (its delta state unchanged).
    fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<<Self::Series as CgroupSeries>::Value> {
        self.parts().cgroups.value_by_dir(cgroup_dir)
    }
}

/// Loads unit `U` with the first cgroup storage this kernel takes; its status
/// names `hook`, the storage, how a tick reads it, and why a better storage
/// was refused.
pub fn load_first<U: GpuProcessUnit>(
    hook: &str,
    load_with: impl FnMut(Storage) -> Result<U, ProbeError>,
) -> Result<U, ProbeError> {
    let chosen = cgroup_storage::load_first(U::NAME, load_with)?;
    let mut loaded = chosen.loaded;
    let cgroups = &loaded.parts().cgroups;
    let status = unit::status_of(
        U::NAME,
        hook,
        cgroups.storage(),
        cgroups.batched(),
        chosen.fell_back,
    );
    loaded.parts_mut().status = status;
    Ok(loaded)
}

impl<U: GpuProcessUnit> Probe for U {
    fn families(&self) -> &'static [FamilySpec] {
        match self.parts().cgroups.series.compute() {
            Some(_) => U::FAMILIES_COMPUTE,
            None => U::FAMILIES,
        }
    }

    fn how(&self) -> Vec<(&'static str, String)> {
        self.parts().status.how.clone()
    }

    fn signals(&self) -> Vec<SignalSpec> {
        vec![U::SIGNAL]
    }

    fn compute_source(&self) -> Option<ComputeSource> {
        self.source()
    }

    fn publish_compute(&mut self, series: ComputeSeries) {
        *self.parts_mut().cgroups.series.compute_mut() = Some(series);
    }

    fn retire_compute(&mut self) {
        *self.parts_mut().cgroups.series.compute_mut() = None;
    }

    fn cgroup_reads(&mut self) -> Option<&mut dyn CgroupReads> {
        Some(&mut self.parts_mut().cgroups)
    }

    fn tick(&mut self, ctx: &TickContext<'_>) -> TickOutput {
        let changed = ctx.processes_changed();
        // only the processes the kernel named, while the set of pod processes holds
        let found = match ctx.pod_pids_named(&mut self.parts_mut().pids_seen) {
            Some(named) => self.look_at(named.into_iter(), changed),
            None => self.scan(&ctx.pod_processes().1, changed),
        };
        if found > 0 {
            tracing::debug!(probe = U::NAME, found, "pod processes looked at");
        }
        let mut gauges = self.gauges(ctx);
        let compute = self.parts_mut().cgroups.series.compute_mut();
        gauges.extend(compute.as_mut().map(|c| c.duty_gauges(ctx)));
        TickOutput {
            deltas: Vec::new(),
            gauges,
        }
    }

    fn stats(&self) -> UnitStats {
        let (storage_failures, series) = self.self_series();
        let cgroups = &self.parts().cgroups;
        UnitStats {
            maps: vec![cgroups.map_fill()],
            storage_failures: Some((U::NAME, storage_failures)),
            series,
            node: cgroups.series.compute().iter().map(|c| c.info()).collect(),
        }
    }
}
