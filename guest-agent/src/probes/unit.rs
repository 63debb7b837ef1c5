//! What a probe unit is: the trait the collector and the exporter drive, how
//! the registry lists a unit and what loading it gets and gives. The values a
//! unit hands over are in `model` and what its tick may ask in `tick`; both
//! are re-exported here, so a unit names one module.
//!
//! A unit reads its BPF maps and returns *deltas* (what happened since its
//! previous read), each tagged with a series family and the labels the unit
//! adds to the owner's. The collector adds them to per-owner accumulators and
//! the exporter renders every family the loaded units declare; neither knows
//! which probe a family belongs to.

use super::cgroup_storage::Storage;
use super::gpu_compute::{ComputeSeries, ComputeSource};
pub use super::model::{
    no_labels, Delta, FamilySpec, GaugeValue, Kind, Labels, LastRead, MapFill, NodeFamily, Scope,
    SelfSeries, SharedLabels, TickOutput, UnitStats, Value,
};
use super::options::{OptionsSpec, UnitOptions};
use super::per_cgroup::CgroupReads;
use super::signal::SignalSpec;
pub use super::status::ProbeStatus;
pub use super::tick::{PidCache, TickContext};
use crate::ebpf::{KernelBtf, ProbeError};

/// A loaded probe unit: one BPF object with its reading, delta state and series.
pub trait Probe: Send {
    /// The families this unit's deltas and gauges belong to.
    fn families(&self) -> &'static [FamilySpec];

    /// How the probe runs on this kernel (`hook`, `storage`, `reads`; see
    /// `gpufeed_probe_info`), for units loaded through [`Loaded::single`].
    fn how(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// Latency and rate signals a correlator can read per tick and owner
    /// (see `collect::TickReport::windows`).
    fn signals(&self) -> Vec<SignalSpec> {
        Vec::new()
    }

    /// The GPU compute-time source this unit can be, if any (`gpu_compute`).
    fn compute_source(&self) -> Option<ComputeSource> {
        None
    }

    /// A better source this unit could be but is not now, and why (NVML not found, 0 GPUs),
    /// for the log line and doctor that say why the node uses a lesser one.
    fn not_a_source(&self) -> Option<(ComputeSource, String)> {
        None
    }

    /// This unit's source was elected the node's (`registry::ComputeElection`): from now on
    /// it exports the compute time and duty cycle through `series`.
    fn publish_compute(&mut self, _series: ComputeSeries) {}

    /// Another source was elected (this one went away, or a better one came): the unit
    /// stops exporting compute time.
    fn retire_compute(&mut self) {}

    /// The unit's values kept per cgroup (`per_cgroup::PerCgroup`), which
    /// the collector reads each tick; None for a unit that keeps none.
    fn cgroup_reads(&mut self) -> Option<&mut dyn CgroupReads> {
        None
    }

    /// Whether [`CgroupReads::active`] names every cgroup in which any task
    /// ran (the scheduler's unit does): then a cgroup missing from it had no
    /// process start or change, and its process list need not be read again.
    fn marks_every_run(&self) -> bool {
        false
    }

    /// Once per tick, after every cgroup was read: work not keyed by cgroup.
    fn tick(&mut self, _ctx: &TickContext<'_>) -> TickOutput {
        TickOutput::default()
    }

    fn stats(&self) -> UnitStats;
}

/// What loading gets: the kernel's BTF, every unit's options (each unit takes
/// its own), the tick's interval, and the kernel's lockdown mode (`None` when
/// off or unreadable).
pub struct LoadContext<'a> {
    pub btf: &'a KernelBtf,
    pub options: &'a UnitOptions,
    pub interval: std::time::Duration,
    pub lockdown: Option<&'a str>,
}

/// The result of loading one unit: the unit when any part of it came up, and
/// one status per selected `--probes` name (or per part, for `gpufeed_probe_up`).
pub struct Loaded {
    pub unit: Option<Box<dyn Probe>>,
    pub statuses: Vec<ProbeStatus>,
}

impl Loaded {
    /// A unit with one `--probes` name: up when it loaded, else down with why.
    pub fn single<P: Probe + 'static>(name: &'static str, r: Result<P, ProbeStatus>) -> Loaded {
        match r {
            Ok(p) => Loaded {
                statuses: vec![ProbeStatus {
                    how: p.how(),
                    ..ProbeStatus::up(name)
                }],
                unit: Some(Box::new(p)),
            },
            Err(st) => Loaded {
                unit: None,
                statuses: vec![st],
            },
        }
    }
}

/// A unit as the registry lists it, before anything is loaded.
#[derive(Debug)]
pub struct UnitSpec {
    /// `--probes` names that select it.
    pub names: &'static [&'static str],
    /// The probes its statuses name (`gpufeed_probe_up{probe}`): a unit the kernel refuses
    /// is reported down under these (those selected, where they are `--probes` names too).
    pub reports: &'static [&'static str],
    /// Its part of the command line (`OptionsSpec::NONE` for a unit without flags).
    pub options: OptionsSpec,
    /// Loads the unit for the selected subset of `names`.
    pub load: fn(&LoadContext<'_>, &[&'static str]) -> Result<Loaded, ProbeError>,
}

impl UnitSpec {
    /// The probes a refused load of this unit reports down, for the `selected` names.
    pub fn reported(&self, selected: &[&'static str]) -> Vec<&'static str> {
        self.reports
            .iter()
            .copied()
            .filter(|r| selected.contains(r) || !self.names.contains(r))
            .collect()
    }
}

/// The loaded units, in registry order.
pub type Units = Vec<Box<dyn Probe>>;

/// The status of a unit that keeps values per cgroup: its hook, where the values live
/// (and why not in the preferred storage, when it fell back), how a tick reads them.
pub fn status_of(
    name: &'static str,
    hook: &str,
    storage: Storage,
    batched: bool,
    fell_back: Option<String>,
) -> ProbeStatus {
    let st = ProbeStatus::up(name)
        .with("hook", hook)
        .with("storage", storage.name())
        .with("reads", if batched { "batch" } else { "each" });
    match fell_back {
        Some(why) => st.with("fallback", why),
        None => st,
    }
}
