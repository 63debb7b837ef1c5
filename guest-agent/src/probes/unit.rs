//! What a probe unit is: the trait the collector and the exporter drive, and
//! the few kinds of values a unit hands them.
//!
//! A unit reads its BPF maps and returns *deltas* (what happened since its
//! previous read), each tagged with a series family and the labels the unit
//! adds to the owner's. The collector adds them to per-owner accumulators and
//! the exporter renders every family the loaded units declare; neither knows
//! which probe a family belongs to.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};

use rustc_hash::{FxHashMap, FxHashSet};

use super::gpu_compute::{ComputeSeries, ComputeSource};
use super::hist::Hist;
use super::options::{OptionsSpec, UnitOptions};
use super::per_cgroup::CgroupReads;
use super::signal::SignalSpec;
use super::{KernelBtf, ProbeError, ProbeStatus};
use crate::cgroups::{CgroupTree, ProcessChanges};
use crate::owner::Owner;
use crate::pods::PodStore;

/// Label names and values of a series, in a fixed (sorted) order. Units use it
/// for the labels they add (`dst`, `direction`, ...); the exporter merges those
/// with the owner's.
pub type Labels = BTreeMap<&'static str, String>;

/// The Prometheus type of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Pre-bucketed kernel histogram (`Value::Hist`), exported in microseconds.
    Histogram,
    /// Monotonic count (`Value::Count`).
    Counter,
    /// Monotonic count of nanoseconds (`Value::Count`), exported in seconds.
    SecondsCounter,
    /// A value the unit sets whole each time (`TickOutput::gauges`).
    Gauge,
}

/// Which owner labels a family carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// `namespace`, `pod`, `container` (or `slice`).
    Container,
    /// `namespace`, `pod`: interfaces and annotations belong to pods, not containers.
    Pod,
}

/// One exported series family.
#[derive(Debug)]
pub struct FamilySpec {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub scope: Scope,
    /// Whether the family's series carry the pod labels the operator configured
    /// (`--pod-label tenant=…`): the GPU families do, so that a tenant's GPU use and cost add
    /// up without a join; the rest reach them through `gpufeed_pod_info`.
    pub pod_labels: bool,
}

/// A delta (or, in the accumulators, a running total) of one series.
// Most values are histograms; boxing them to shrink the counters would cost
// an allocation per delta and tick.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Hist(Hist),
    Count(u64),
}

impl Value {
    /// Whether adding it changes nothing. A zero delta still *creates* its
    /// series for an owner that has series already (a clean pod reads 0).
    pub fn is_zero(&self) -> bool {
        match self {
            Value::Hist(h) => h.is_empty(),
            Value::Count(n) => *n == 0,
        }
    }

    pub fn add(&mut self, other: &Value) {
        match (self, other) {
            (Value::Hist(a), Value::Hist(b)) => a.add(b),
            (Value::Count(a), Value::Count(b)) => *a = a.wrapping_add(*b),
            // a family has one kind; a unit mixing them is a bug, not input
            (a, b) => debug_assert!(false, "adding {b:?} to {a:?}"),
        }
    }
}

/// One delta a unit read: which family, which labels besides the owner's.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    pub family: &'static str,
    pub labels: Labels,
    pub value: Value,
}

/// A gauge value the unit sets (not accumulated).
#[derive(Debug, Clone, PartialEq)]
pub struct GaugeValue {
    pub owner: Owner,
    pub labels: Labels,
    pub value: f64,
}

/// What a unit's once-per-tick work produced besides per-cgroup reads.
#[derive(Debug, Default)]
pub struct TickOutput {
    /// Deltas attributed by the unit itself (per interface, drained maps).
    pub deltas: Vec<(Owner, Delta)>,
    /// Gauge families replaced whole: (family, all its values now).
    pub gauges: Vec<(&'static str, Vec<GaugeValue>)>,
}

/// How full one BPF map is, for `gpufeed_map_entries` / `gpufeed_map_capacity`.
#[derive(Debug, Clone, PartialEq)]
pub struct MapFill {
    pub map: &'static str,
    pub entries: usize,
    /// `max_entries` for maps that have one (cgroup storage has none: it
    /// lives and dies with the cgroup).
    pub capacity: Option<u32>,
}

/// A self-observation series of one unit (exported without labels).
#[derive(Debug, Clone, PartialEq)]
pub struct SelfSeries {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub value: f64,
}

impl SelfSeries {
    /// A count the unit's programs keep (failures, drops, things learned).
    pub fn counter(name: &'static str, help: &'static str, value: u64) -> SelfSeries {
        SelfSeries {
            name,
            help,
            kind: Kind::Counter,
            value: value as f64,
        }
    }

    /// A level the unit reads at the tick (attached files, probed processes).
    pub fn gauge(name: &'static str, help: &'static str, value: f64) -> SelfSeries {
        SelfSeries {
            name,
            help,
            kind: Kind::Gauge,
            value,
        }
    }
}

/// A unit's self-observation, taken at the end of each tick.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UnitStats {
    pub maps: Vec<MapFill>,
    /// (`probe` label, events lost because cgroup storage was unavailable)
    pub storage_failures: Option<(&'static str, u64)>,
    pub series: Vec<SelfSeries>,
    /// Series about the node's devices, one per label set (a GPU's capacity).
    pub node: Vec<NodeFamily>,
}

/// A labelled family of node-level gauges a unit reports (not per owner).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeFamily {
    pub name: &'static str,
    pub help: &'static str,
    pub samples: Vec<(Labels, f64)>,
}

/// What the collector knows that a unit may need in its tick.
pub struct TickContext<'a> {
    pub tree: &'a CgroupTree,
    /// Owner of every live (or just removed) cgroup, by cgroup id.
    pub owners: &'a FxHashMap<u64, Owner>,
    pub pods: &'a PodStore,
    /// Whether cgroups came or went since the previous tick.
    pub cgroups_changed: bool,
    /// What the kernel says changed in processes (None: it does not say).
    pub processes: Option<&'a ProcessChanges>,
    /// The cgroups in which any task ran since the previous tick, from a
    /// unit that marks every run (None without one: every list is re-read),
    /// and the tick's number.
    pub active: Option<&'a HashSet<u64>>,
    pub tick: u64,
    pub pids: &'a RefCell<PidCache>,
}

/// Without the kernel's process changes: ticks over which every pod cgroup's
/// process list is re-read once, whatever its activity (a process that exits
/// while running leaves no trace in the activity sets).
const PIDS_ROTATION: u64 = 30;

/// Each pod cgroup's processes (cgroup.procs), kept between ticks, and the
/// per-pod lists built from them.
#[derive(Default)]
pub struct PidCache {
    by_cgroup: HashMap<u64, Vec<i32>>,
    by_pod: HashMap<String, Vec<i32>>,
    /// every pod process, and a number bumped whenever that set is rebuilt
    all: FxHashSet<i32>,
    generation: u64,
    /// the tick `by_pod` was brought up to date in
    built: Option<u64>,
}

impl TickContext<'_> {
    /// The pod of a cgroup (container dropped), or its slice; None for an
    /// unknown cgroup.
    pub fn pod_of_cgroup(&self, id: u64) -> Option<Owner> {
        self.owners.get(&id).map(Owner::pod_level)
    }

    /// Processes the kernel says exec'd or mapped something since the
    /// previous tick (see `probes::lookout`); None when it does not say.
    pub fn processes_changed(&self) -> Option<&HashSet<i32>> {
        self.processes.map(|p| &p.processes)
    }

    /// The pids of each pod, from the cgroup.procs of its cgroups. A cgroup's
    /// list is re-read when the cgroup is new, or when the kernel says it
    /// gained or lost a process (fork, exit, a task moved in). A process moved
    /// *out* of a cgroup is not reported for the cgroup it left, so its pid
    /// stays in that list until the list changes otherwise; kubelet moves
    /// processes into containers, never out.
    ///
    /// Without the kernel's process changes, a list is re-read when a task of
    /// the cgroup ran since the previous tick (a process that starts runs, so
    /// the scheduler probe marks its cgroup; without that probe every list is
    /// re-read each tick), or its turn in a rotation over `PIDS_ROTATION`
    /// ticks came. Otherwise the list read before stands: an idle node's tick
    /// reads none, and with the kernel's changes a busy but steady one neither.
    pub fn pod_pids(&self) -> HashMap<String, Vec<i32>> {
        self.refresh_pids();
        self.pids.borrow().by_pod.clone()
    }

    /// Every process of the pods' cgroups (the lists of
    /// [`TickContext::pod_pids`] together), with a number that stays the same
    /// as long as the set does: a unit that looked at every process of a
    /// generation need only look at those the kernel names while it lasts.
    pub fn pod_pid_set(&self) -> (u64, std::cell::Ref<'_, FxHashSet<i32>>) {
        self.refresh_pids();
        let cache = self.pids.borrow();
        let generation = cache.generation;
        (generation, std::cell::Ref::map(cache, |c| &c.all))
    }

    /// For a unit that looks at pod processes (and looked at every one of
    /// generation `seen`): Some(the pod processes the kernel named since)
    /// while the set of pod processes is the one of `seen`, None when it must
    /// look at all of them again ([`TickContext::pod_pid_set`]). Sets `seen`
    /// to the current generation.
    pub fn pod_pids_named(&self, seen: &mut Option<u64>) -> Option<Vec<i32>> {
        let (generation, pids) = self.pod_pid_set();
        let steady = seen.replace(generation) == Some(generation);
        let named = self.processes_changed().filter(|_| steady)?;
        Some(named.iter().copied().filter(|t| pids.contains(t)).collect())
    }

    /// The cgroup of each process of the pods' cgroups: the lists of
    /// [`TickContext::pod_pids`], read no more often.
    pub fn pod_pid_cgroups(&self) -> HashMap<u32, u64> {
        self.refresh_pids();
        let cache = self.pids.borrow();
        let lists = cache.by_cgroup.iter();
        lists
            .flat_map(|(id, pids)| pids.iter().map(move |&pid| (pid as u32, *id)))
            .collect()
    }

    /// Brings the process lists up to date for this tick (see `pod_pids`).
    fn refresh_pids(&self) {
        let mut cache = self.pids.borrow_mut();
        if cache.built == Some(self.tick) {
            return;
        }
        let before = cache.by_cgroup.len();
        cache
            .by_cgroup
            .retain(|id, _| self.owners.contains_key(id) && self.tree.cgroups.contains_key(id));
        let mut changed = self.cgroups_changed || cache.by_cgroup.len() != before;
        for (id, owner) in self.owners {
            let (Owner::Pod { .. }, Some(cg)) = (owner, self.tree.cgroups.get(id)) else {
                continue;
            };
            let stale = !cache.by_cgroup.contains_key(id)
                || match self.processes {
                    Some(p) => p.cgroups.contains(id),
                    None => {
                        self.active.is_none_or(|a| a.contains(id))
                            || id % PIDS_ROTATION == self.tick % PIDS_ROTATION
                    }
                };
            if !stale {
                continue;
            }
            let procs = self.tree.path_of(cg).join("cgroup.procs");
            let pids: Vec<i32> = std::fs::read_to_string(procs)
                .map(|text| {
                    text.lines()
                        .filter_map(|l| l.trim().parse::<i32>().ok())
                        .collect()
                })
                .unwrap_or_default();
            if cache.by_cgroup.get(id) != Some(&pids) {
                cache.by_cgroup.insert(*id, pids);
                changed = true;
            }
        }
        if changed || cache.built.is_none() {
            let mut by_pod: HashMap<String, Vec<i32>> = HashMap::new();
            for (id, pids) in &cache.by_cgroup {
                if let Some(Owner::Pod { uid, .. }) = self.owners.get(id) {
                    by_pod.entry(uid.clone()).or_default().extend(pids);
                }
            }
            cache.by_pod = by_pod;
            cache.all = cache.by_pod.values().flatten().copied().collect();
            cache.generation += 1;
        }
        cache.built = Some(self.tick);
    }
}

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

    /// This unit's source was elected the node's (`gpu_compute::elect`, after loading):
    /// from now on it exports the compute time and duty cycle through `series`.
    fn publish_compute(&mut self, _series: ComputeSeries) {}

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

/// Remembers each cgroup's last absolute reading, to turn the next into a delta.
pub struct LastRead<T> {
    last: rustc_hash::FxHashMap<u64, T>,
}

impl<T> Default for LastRead<T> {
    fn default() -> Self {
        LastRead {
            last: Default::default(),
        }
    }
}

impl<T> LastRead<T> {
    /// Stores `now` as the cgroup's reading and returns `delta(now, previous)`,
    /// or `now` itself the first time.
    pub fn advance(&mut self, id: u64, now: T, delta: impl FnOnce(&T, &T) -> T) -> T
    where
        T: Clone,
    {
        match self.last.get_mut(&id) {
            Some(prev) => {
                let d = delta(&now, prev);
                *prev = now;
                d
            }
            None => {
                self.last.insert(id, now.clone());
                now
            }
        }
    }

    pub fn forget(&mut self, id: u64) {
        self.last.remove(&id);
    }

    /// Cgroups with an entry (read at least once and not gone).
    pub fn len(&self) -> usize {
        self.last.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

/// The status of a unit that keeps values per cgroup: its hook, where the values live
/// (and why not in the preferred storage, when it fell back), how a tick reads them.
pub fn status_of(
    name: &'static str,
    hook: &str,
    storage: super::cgroup_storage::Storage,
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
