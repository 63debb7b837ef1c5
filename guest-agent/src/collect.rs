//! The tick: read every live cgroup's kernel aggregates, turn them into deltas
//! and add them to per-owner accumulators (a pod's container, a pod, or a
//! top-level slice for everything that is not a pod).
//!
//! Accumulating by owner rather than by cgroup keeps counters monotonic when a
//! container restarts into a new cgroup, sums all non-pod cgroups into one
//! series per slice, and lets the exporter relabel an owner (pod UID → name)
//! without restarting its counters.

use std::cell::RefCell;
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHashSet};

use crate::cgroups::{CgroupTree, Changes, Died};
use crate::pods::{classify_cgroup, PodStore};
use crate::probes::signal::{
    latency_window, level_window, rate_window, SignalKind, SignalSpec, SignalWindow,
};
use crate::probes::unit::{
    Delta, FamilySpec, GaugeValue, Labels, PidCache, Scope, TickContext, UnitStats, Units, Value,
};

pub use crate::owner::Owner;
pub use gpu_totals::{index_gpu_owners, FeedRaw, GpuTotals, NvmlCapacity, PodGpuTotals};
pub use store::{LiveUids, OwnerStats, SelfStats, Store};

mod gpu_totals;
mod store;

/// What one tick read, handed on by value (to the join and FinOps) instead of being left
/// in the store: they run without any lock of the collector's.
#[derive(Debug, Default)]
pub struct TickReport {
    /// The tick's signal windows (see `probes::signal`); none for the first
    /// tick, which has no window to divide by.
    pub windows: Vec<SignalWindow>,
    /// UIDs of the pods the collector has after the tick (by UID: a pod whose
    /// names arrive is the same pod, not one gone and one new).
    pub live: LiveUids,
    /// Whether the GPU worked this tick (`probes::gpu_activity`); `None`: nothing loaded can
    /// tell.
    pub gpu_busy: Option<bool>,
    /// The pods' GPU running totals and the GPUs' capacity after the tick, for FinOps.
    pub gpu: GpuTotals,
    /// The pods' raw feed-stall account after the tick (running totals), for the join.
    pub feed: HashMap<String, FeedRaw>,
}

/// One tick's deltas, merged per owner and series.
type TickDeltas = FxHashMap<Owner, BTreeMap<(&'static str, Labels), Value>>;

pub struct Collector {
    tree: CgroupTree,
    units: Units,
    /// owner of every live cgroup, by cgroup id
    owners: FxHashMap<u64, Owner>,
    /// live cgroups per owner
    live: FxHashMap<Owner, usize>,
    /// whether owners' liveness may have changed since `retire` last ran
    /// (cgroups came or went, owners were created, the pod store changed,
    /// an owner is in its grace period)
    retire_due: bool,
    /// whether the previous tick removed cgroups, whose owners left `owners` at its end
    owners_left: bool,
    /// the pod store's version `retire` last saw
    pods_seen: Option<u64>,
    /// the store's pod UIDs and its owners at pod and slice level, as `retire` last left
    /// them (owners come and go only there)
    live_uids: Option<LiveUids>,
    owner_counts: (usize, usize),
    /// owners of cgroups removed in the last few ticks, whose last numbers
    /// the units drain (see `CgroupReads::read_removed`)
    dying: FxHashMap<u64, Dying>,
    /// drained deltas whose cgroup's owner is not known yet (the removal's
    /// event is read a tick later), with the ticks they waited
    unresolved: Vec<(u64, Delta, u32)>,
    /// each pod cgroup's processes, for units that look at them
    pids: RefCell<PidCache>,
    ticks: u64,
    pods: PodStore,
    grace: Duration,
    last_tick: Option<Instant>,
    /// The node's GPU compute source, checked again each tick (None until asked for).
    election: Option<crate::probes::ComputeElection>,
    pub store: Arc<Mutex<Store>>,
}

/// A removed cgroup's owner, kept while its last numbers may still come.
struct Dying {
    owner: Owner,
    ticks: u32,
}

/// Ticks a removed cgroup's owner is kept for its drained numbers, and a
/// drained delta waits for its owner: the events and the drains are read one
/// after the other, so one tick is enough; the rest is margin.
const DYING_TICKS: u32 = 3;

/// Each owner's GPU activity read this tick (ns in the GPU driver and CUDA launch-to-completion
/// busy time), which attributes an MPS server's SM time to its clients (`probes::nvml`).
fn gpu_activity(deltas: &TickDeltas) -> HashMap<Owner, u64> {
    use crate::probes::{cuda, gpu_driver};
    deltas
        .iter()
        .filter_map(|(owner, series)| {
            let ns: u64 = series
                .iter()
                .filter(|((f, _), _)| *f == gpu_driver::DRIVER_TIME || *f == cuda::BUSY)
                .map(|(_, v)| match v {
                    Value::Count(n) => *n,
                    Value::Hist(_) => 0,
                })
                .sum();
            (ns > 0).then(|| (owner.clone(), ns))
        })
        .collect()
}

impl Collector {
    pub fn new(tree: CgroupTree, units: Units, pods: PodStore, grace: Duration) -> Collector {
        Collector {
            tree,
            units,
            owners: FxHashMap::default(),
            live: FxHashMap::default(),
            retire_due: true,
            owners_left: false,
            pods_seen: None,
            live_uids: None,
            owner_counts: (0, 0),
            dying: FxHashMap::default(),
            unresolved: Vec::new(),
            pids: RefCell::default(),
            ticks: 0,
            pods,
            grace,
            last_tick: None,
            election: None,
            store: Arc::default(),
        }
    }

    /// Elects the node's GPU compute source among the units now, and again at each tick
    /// where the best source changed (duty cycles over `window`).
    pub fn elect_compute(&mut self, window: Duration) {
        self.election = Some(crate::probes::ComputeElection::new(&mut self.units, window));
    }

    /// The families the loaded units export, for the exporter; each once (two units may
    /// declare the compute families, one of which publishes them).
    pub fn families(&self) -> Vec<&'static FamilySpec> {
        let mut seen = HashSet::new();
        self.units
            .iter()
            .flat_map(|u| u.families())
            .filter(|f| seen.insert(f.name))
            .collect()
    }

    /// One tick. Returns an error only if the cgroup hierarchy itself can't be read.
    ///
    /// Its cost follows what changed, not what exists: the tree follows
    /// cgroup creation and removal, the units name the cgroups their programs
    /// touched since the last tick (`CgroupReads::active`), and removed
    /// cgroups' last numbers come drained from the kernel.
    pub fn tick(&mut self) -> std::io::Result<TickReport> {
        let started = Instant::now();
        let now = started;
        let changes = self.tree.refresh()?;
        self.follow(&changes);
        let cgroups_changed = !changes.added.is_empty() || !changes.removed.is_empty();
        // the owners of added cgroups are in `owners` from now, those of removed ones until
        // the end of this tick
        let owners_changed = !changes.added.is_empty() || self.owners_left;
        self.owners_left = !changes.removed.is_empty();
        let mut deltas = TickDeltas::default();

        // Removed cgroups first: their last numbers, drained in the kernel at rmdir.
        let mut drained = Vec::new();
        for reads in self.units.iter_mut().filter_map(|u| u.cgroup_reads()) {
            reads.read_removed(&mut drained);
        }
        let waiting = std::mem::take(&mut self.unresolved);
        let fresh = drained.into_iter().map(|(id, d)| (id, d, 0));
        for (id, delta, waited) in waiting.into_iter().chain(fresh) {
            let owner = self
                .owners
                .get(&id)
                .or_else(|| self.dying.get(&id).map(|d| &d.owner));
            match owner {
                Some(o) => add(
                    series_of(&mut deltas, o),
                    (delta.family, delta.labels),
                    delta.value,
                ),
                None if waited < DYING_TICKS => self.unresolved.push((id, delta, waited + 1)),
                None => {
                    tracing::debug!(cgroup = id, "drained numbers of an unknown cgroup dropped")
                }
            }
        }

        // Live cgroups: those with activity, or all of them for a unit that cannot tell.
        let mut read = Vec::new();
        let mut ids = Vec::new();
        // cgroups where a task ran, from a unit that sees every run: only with
        // one can a process list be left unread (see `TickContext::pod_pids`)
        let mut active: Option<HashSet<u64>> = None;
        for unit in &mut self.units {
            let marks_every_run = unit.marks_every_run();
            let Some(reads) = unit.cgroup_reads() else {
                continue;
            };
            ids.clear();
            match reads.active() {
                Some(marked) => {
                    if marks_every_run {
                        active.get_or_insert_default().extend(&marked);
                    }
                    // one not in the tree yet (created after the refresh)
                    // stays in the unit's set for the next tick
                    ids.extend(marked.into_iter().filter(|id| {
                        self.tree.cgroups.contains_key(id) && self.owners.contains_key(id)
                    }));
                }
                None => ids.extend(
                    self.tree
                        .cgroups
                        .keys()
                        .filter(|id| self.owners.contains_key(id)),
                ),
            }
            reads.read(&ids, &self.tree, &mut read);
            for (
                id,
                Delta {
                    family,
                    labels,
                    value,
                },
            ) in read.drain(..)
            {
                let Some(owner) = self.owners.get(&id) else {
                    continue;
                };
                add(series_of(&mut deltas, owner), (family, labels), value);
            }
        }

        let gpu_activity = gpu_activity(&deltas);
        let ctx = TickContext {
            gpu_activity: &gpu_activity,
            tree: &self.tree,
            owners: &self.owners,
            pods: &self.pods,
            cgroups_changed,
            owners_changed,
            processes: changes.processes.as_ref(),
            active: active.as_ref(),
            tick: self.ticks,
            pids: &self.pids,
        };
        let mut gauges = Vec::new();
        for unit in &mut self.units {
            let out = unit.tick(&ctx);
            for (
                owner,
                Delta {
                    family,
                    labels,
                    value,
                },
            ) in out.deltas
            {
                add(deltas.entry(owner).or_default(), (family, labels), value);
            }
            gauges.extend(out.gauges);
        }
        // a source that came or went this tick publishes from the next
        if let Some(e) = self.election.as_mut() {
            e.update(&mut self.units);
        }
        for id in changes.removed.keys() {
            self.owners.remove(id);
        }
        self.age_dying();
        self.ticks += 1;
        let previous_tick = self.last_tick.replace(now);
        let signals: Vec<SignalSpec> = self.units.iter().flat_map(|u| u.signals()).collect();
        let units: Vec<UnitStats> = self.units.iter().map(|u| u.stats()).collect();
        let mut shared = self.store.lock().unwrap_or_else(|e| e.into_inner());
        // No series before the first sample: idle cgroups cost nothing, and a
        // retired owner is not revived by zero deltas.
        deltas.retain(|owner, series| {
            !series.values().all(Value::is_zero) || shared.owners.contains_key(owner)
        });
        let mut report = TickReport {
            windows: match previous_tick {
                Some(prev) => windows(&signals, &deltas, &gauges, now, now.duration_since(prev)),
                None => Vec::new(),
            },
            live: LiveUids::default(),
            gpu_busy: None,
            gpu: GpuTotals::default(),
            feed: HashMap::new(),
        };
        report.gpu_busy = crate::probes::gpu_activity::gpu_busy(
            &report.windows,
            &gauges,
            crate::probes::gpu_activity::sees_gpu_work(&signals),
        );
        let store = &mut *shared;
        for (owner, series) in deltas {
            if !store.gpu_owners.contains(&owner)
                && gpu_totals::has_gpu_series(series.keys().map(|(f, _)| f))
            {
                store.gpu_owners.insert(owner.clone());
            }
            let o = match store.owners.get_mut(&owner) {
                Some(o) => o,
                None => {
                    // a new owner: its liveness is set by `retire`
                    self.retire_due = true;
                    store.owners.entry(owner).or_default()
                }
            };
            for (key, value) in series {
                add(&mut o.series, key, value);
            }
        }
        for (family, values) in gauges {
            shared.gauges.insert(family, values);
        }
        let scopes: HashMap<&'static str, Scope> = self
            .units
            .iter()
            .flat_map(|u| u.families())
            .map(|f| (f.name, f.scope))
            .collect();
        // Liveness changes only with cgroups, owners and the pod store, and
        // an owner in its grace period waits for time: a steady node's tick
        // does not look at every owner.
        let pods_version = self.pods.version();
        if self.retire_due || cgroups_changed || self.pods_seen != Some(pods_version) {
            self.pods_seen = Some(pods_version);
            let store = &mut *shared;
            self.retire_due = retire(
                &mut store.owners,
                &mut store.gpu_owners,
                &self.live,
                &self.pods,
                &scopes,
                self.grace,
                now,
            );
            self.live_uids = None;
            store.gpu_owners.retain(|o| store.owners.contains_key(o));
            let pods = store
                .owners
                .keys()
                .filter(|o| matches!(o, Owner::Pod { .. }))
                .count();
            self.owner_counts = (pods, store.owners.len() - pods);
        }
        self.pods.prune(self.grace);
        let (owners_pod, owners_slice) = self.owner_counts;
        let ticks = shared.stats.ticks + 1;
        shared.stats = SelfStats {
            cgroups: self.tree.cgroups.len(),
            owners_pod,
            owners_slice,
            last_tick_seconds: started.elapsed().as_secs_f64(),
            ticks,
            units,
            compute: self
                .election
                .as_ref()
                .map(|e| e.status())
                .unwrap_or_default(),
        };
        report.live = self
            .live_uids
            .get_or_insert_with(|| shared.pod_uids())
            .clone();
        report.gpu = GpuTotals::of(&shared);
        report.feed = gpu_totals::feed_totals(&shared);
        Ok(report)
    }
}

impl Collector {
    /// Follows the tree's changes: owners of new cgroups, live counts, and the
    /// owners of removed cgroups kept for their drained numbers. A removed
    /// cgroup stays in `owners` until the end of the tick, for the units' tick.
    fn follow(&mut self, changes: &Changes) {
        for id in &changes.added {
            let Some(cg) = self.tree.cgroups.get(id) else {
                continue;
            };
            let owner = Owner::of(classify_cgroup(&cg.path));
            *self.live.entry(owner.clone()).or_default() += 1;
            if let Some(old) = self.owners.insert(*id, owner) {
                self.unlive(&old);
            }
        }
        for id in changes.removed.keys() {
            if let Some(owner) = self.owners.get(id).cloned() {
                self.unlive(&owner);
                self.dying.insert(*id, Dying { owner, ticks: 0 });
            }
        }
        for d in &changes.died {
            if self.dying.contains_key(&d.id) {
                continue;
            }
            if let Some(owner) = self.owner_of_unknown(d) {
                self.dying.insert(d.id, Dying { owner, ticks: 0 });
            }
        }
    }

    fn unlive(&mut self, owner: &Owner) {
        if let Some(n) = self.live.get_mut(owner) {
            *n -= 1;
            if *n == 0 {
                self.live.remove(owner);
            }
        }
    }

    /// The owner of a cgroup removed before the tree saw it: its path below
    /// its parent's when the parent is known (the tree's view, as for any
    /// cgroup), else the kernel's path, else (no path under lockdown) the
    /// parent's owner at pod level.
    fn owner_of_unknown(&self, d: &Died) -> Option<Owner> {
        let name = d.path.as_deref().and_then(|p| p.rsplit('/').next());
        let parent = self.tree.cgroups.get(&d.parent);
        match (parent, name, d.path.as_deref()) {
            (Some(p), Some(name), _) => Some(Owner::of(classify_cgroup(&format!(
                "{}/{name}",
                p.path.trim_end_matches('/')
            )))),
            (None, _, Some(path)) => Some(Owner::of(classify_cgroup(path))),
            _ => self
                .owners
                .get(&d.parent)
                .or_else(|| self.dying.get(&d.parent).map(|x| &x.owner))
                .map(Owner::pod_level),
        }
    }

    /// One more tick for the removed cgroups; those past `DYING_TICKS` are
    /// forgotten by every unit.
    fn age_dying(&mut self) {
        let mut gone = Vec::new();
        self.dying.retain(|id, d| {
            d.ticks += 1;
            let keep = d.ticks <= DYING_TICKS;
            if !keep {
                gone.push(*id);
            }
            keep
        });
        for id in gone {
            for reads in self.units.iter_mut().filter_map(|u| u.cgroup_reads()) {
                reads.forget(id);
            }
        }
    }
}

/// Liveness and the grace period. An owner whose cgroups are all gone, or
/// whose pod the API deleted, keeps its series for `grace`; then it goes, or,
/// while its pod lives on, hands its totals to the owner that carries the same
/// label set, so that no series the exporter sums ever goes down while its
/// labels live:
///
/// * a restarted container (same container name, new id and cgroup): to the
///   running container of that name; until one runs, the old owner stays;
/// * a container the API does not name (exported as `container=""`): to the
///   pod-level owner;
/// * without the API (containers labelled by their own id): the pod-scope
///   families go to the pod-level owner, the container's own series go with
///   their label set.
///
/// A pod that is gone or deleted takes all its owners' label sets with it.
///
/// Returns whether an owner is left in its grace period (so the next tick
/// must look again).
fn retire(
    owners: &mut FxHashMap<Owner, OwnerStats>,
    gpu_owners: &mut FxHashSet<Owner>,
    live: &FxHashMap<Owner, usize>,
    pods: &PodStore,
    scopes: &HashMap<&'static str, Scope>,
    grace: Duration,
    now: Instant,
) -> bool {
    let deleted = |uid: &str| pods.with(uid, |m| m.deleted_at.is_some()) == Some(true);
    let live_pods: FxHashSet<&str> = live
        .iter()
        .filter_map(|(o, n)| match o {
            Owner::Pod { uid, .. } if *n > 0 && !deleted(uid) => Some(&**uid),
            _ => None,
        })
        .collect();
    let mut expired = Vec::new();
    for (owner, o) in owners.iter_mut() {
        o.live_cgroups = live.get(owner).copied().unwrap_or(0);
        let gone = match owner {
            Owner::Pod { uid, .. } => o.live_cgroups == 0 || deleted(uid),
            Owner::Slice(_) => o.live_cgroups == 0,
            Owner::Unattributed => false,
        };
        if !gone {
            o.gone_since = None;
            continue;
        }
        let since = *o.gone_since.get_or_insert(now);
        if now.duration_since(since) >= grace {
            expired.push(owner.clone());
        }
    }
    for owner in expired {
        let Owner::Pod {
            uid,
            container_id: Some(cid),
        } = &owner
        else {
            // a slice, or a pod-level owner: its labels go with it (a pod-level
            // owner of a live pod waits for the pod)
            if !matches!(&owner, Owner::Pod { uid, .. } if live_pods.contains(&**uid)) {
                owners.remove(&owner);
            }
            continue;
        };
        if !live_pods.contains(&**uid) {
            owners.remove(&owner);
            continue;
        }
        let pod_level = owner.pod_level();
        let (heir, only_pod_scope) = match pods.get(uid) {
            Some(meta) => match meta.container_name(cid) {
                Some(name) => {
                    let running = live.iter().find_map(|(o, n)| match o {
                        Owner::Pod {
                            uid: u,
                            container_id: Some(c),
                        } if *n > 0 && u == uid && meta.container_name(c) == Some(name) => {
                            Some(o.clone())
                        }
                        _ => None,
                    });
                    match running {
                        Some(o) => (o, false),
                        None => continue, // not restarted (yet): keep it
                    }
                }
                None => (pod_level, false),
            },
            None => (pod_level, true),
        };
        let Some(gone) = owners.remove(&owner) else {
            continue;
        };
        let handed: Vec<_> = gone
            .series
            .into_iter()
            .filter(|(key, _)| !only_pod_scope || scopes.get(key.0) == Some(&Scope::Pod))
            .collect();
        if handed.is_empty() {
            continue;
        }
        if gpu_totals::has_gpu_series(handed.iter().map(|((f, _), _)| f)) {
            gpu_owners.insert(heir.clone());
        }
        let into = owners.entry(heir).or_default();
        for (key, value) in handed {
            add(&mut into.series, key, value);
        }
    }
    owners.values().any(|o| o.gone_since.is_some())
}

/// The signal windows of one tick's deltas (of owners that have series) and gauges.
fn windows(
    signals: &[SignalSpec],
    deltas: &TickDeltas,
    gauges: &[(&'static str, Vec<GaugeValue>)],
    at: Instant,
    window: Duration,
) -> Vec<SignalWindow> {
    let mut out = Vec::new();
    for (family, values) in gauges {
        for s in signals
            .iter()
            .filter(|s| s.kind == SignalKind::Level && s.family == *family)
        {
            out.extend(values.iter().map(|g| SignalWindow {
                owner: g.owner.clone(),
                signal: s.name,
                at,
                window,
                value: level_window(g.value),
            }));
        }
    }
    for (owner, series) in deltas {
        for ((family, _), value) in series {
            for s in signals.iter().filter(|s| s.family == *family) {
                let value = match (s.kind, value) {
                    (SignalKind::Latency, Value::Hist(h)) => match latency_window(h) {
                        Some(w) => w,
                        None => continue,
                    },
                    (SignalKind::Rate, Value::Count(n)) => rate_window(*n, window),
                    _ => continue,
                };
                out.push(SignalWindow {
                    owner: owner.clone(),
                    signal: s.name,
                    at,
                    window,
                    value,
                });
            }
        }
    }
    out
}

/// The tick's series of `owner` (a clone of an owner is a reference count: one lookup).
fn series_of<'a>(
    deltas: &'a mut TickDeltas,
    owner: &Owner,
) -> &'a mut BTreeMap<(&'static str, Labels), Value> {
    deltas.entry(owner.clone()).or_default()
}

/// Adds a delta to the series `key`, creating it (a zero delta too: a series
/// that exists reads 0 rather than nothing).
fn add(
    into: &mut BTreeMap<(&'static str, Labels), Value>,
    key: (&'static str, Labels),
    value: Value,
) {
    match into.entry(key) {
        Entry::Occupied(mut e) => e.get_mut().add(&value),
        Entry::Vacant(e) => {
            e.insert(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    use super::*;
    use crate::probes::gpu_compute::COMPUTE;
    use crate::probes::per_cgroup::CgroupReads;
    use crate::probes::signal::WindowValue;
    use crate::probes::unit::{FamilySpec, Kind, Probe, Scope, TickOutput, UnitStats};

    const UID: &str = "1b2c3d4e-5f60-4718-9a2b-3c4d5e6f7a8b";
    const CID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const EVENTS: &str = "test_events_total";
    const OTHER: &str = "test_other_total";

    static FAMILIES: [FamilySpec; 2] = [
        FamilySpec {
            name: EVENTS,
            help: "",
            kind: Kind::Counter,
            scope: Scope::Container,
            pod_labels: false,
        },
        FamilySpec {
            name: OTHER,
            help: "",
            kind: Kind::Counter,
            scope: Scope::Container,
            pod_labels: false,
        },
    ];

    /// A gauge family named by a level signal gives one window per value the unit set in
    /// the tick (a throughput it sampled), a gauge family no signal names none.
    #[test]
    fn level_signals_are_windows_of_the_gauges_the_units_set() {
        let pod = Owner::Pod {
            uid: "u".into(),
            container_id: None,
        };
        let signals = [SignalSpec {
            name: "link",
            family: "link_gauge",
            kind: SignalKind::Level,
        }];
        let value = |v| GaugeValue {
            owner: pod.clone(),
            labels: Labels::from([("gpu", "0".to_string())]).into(),
            value: v,
        };
        let gauges = vec![
            ("link_gauge", vec![value(5e9)]),
            ("other_gauge", vec![value(1.0)]),
        ];
        let at = Instant::now();
        let w = windows(
            &signals,
            &TickDeltas::default(),
            &gauges,
            at,
            Duration::from_millis(100),
        );
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!((w[0].owner.clone(), w[0].signal), (pod, "link"));
        assert_eq!(w[0].value, WindowValue::Level { value: 5e9 });
    }

    /// A unit whose "kernel" is a map of cumulative counts per cgroup id the
    /// test sets, turned into deltas like a real unit does.
    #[derive(Default)]
    struct Fake {
        kernel: Arc<Mutex<HashMap<u64, u64>>>,
        /// removed cgroups' last counts, as the kernel drains them at rmdir
        drained: Arc<Mutex<HashMap<u64, u64>>>,
        /// the cgroups with activity the unit reports; None: it cannot tell
        active: Arc<Mutex<Option<Vec<u64>>>>,
        last: crate::probes::unit::LastRead<u64>,
        forgotten: Arc<Mutex<Vec<u64>>>,
        ticks: Arc<Mutex<Vec<OwnersSeen>>>,
    }

    /// What a unit's tick saw: whether the collector said the owners changed, and the
    /// owners' cgroup ids.
    type OwnersSeen = (bool, Vec<u64>);

    impl Probe for Fake {
        fn families(&self) -> &'static [FamilySpec] {
            &FAMILIES
        }
        fn signals(&self) -> Vec<SignalSpec> {
            vec![SignalSpec {
                name: "event_rate",
                family: EVENTS,
                kind: SignalKind::Rate,
            }]
        }
        fn cgroup_reads(&mut self) -> Option<&mut dyn CgroupReads> {
            Some(self)
        }
        fn stats(&self) -> UnitStats {
            UnitStats::default()
        }
        fn tick(&mut self, ctx: &TickContext<'_>) -> TickOutput {
            let mut ids: Vec<u64> = ctx.owners.keys().copied().collect();
            ids.sort();
            self.ticks.lock().unwrap().push((ctx.owners_changed, ids));
            TickOutput::default()
        }
    }

    /// A delta of the fake unit's event counter.
    fn events(n: u64) -> Delta {
        Delta {
            family: EVENTS,
            labels: Labels::new(),
            value: Value::Count(n),
        }
    }

    impl CgroupReads for Fake {
        fn active(&mut self) -> Option<Vec<u64>> {
            self.active.lock().unwrap().clone()
        }
        fn read(&mut self, ids: &[u64], tree: &CgroupTree, out: &mut Vec<(u64, Delta)>) {
            for &id in ids.iter().filter(|id| tree.cgroups.contains_key(id)) {
                let Some(now) = self.kernel.lock().unwrap().get(&id).copied() else {
                    continue;
                };
                let d = self.last.advance(id, now, |n, p| n - p);
                out.push((id, events(d)));
                // a companion series that only ever gets zero deltas
                out.push((
                    id,
                    Delta {
                        family: OTHER,
                        labels: Labels::from([("dst", "private".to_string())]),
                        value: Value::Count(0),
                    },
                ));
            }
        }
        fn read_removed(&mut self, out: &mut Vec<(u64, Delta)>) {
            for (id, now) in self.drained.lock().unwrap().drain() {
                let d = self.last.advance(id, now, |n, p| n - p);
                self.last.forget(id);
                out.push((id, events(d)));
            }
        }
        fn forget(&mut self, id: u64) {
            self.last.forget(id);
            self.forgotten.lock().unwrap().push(id);
        }
    }

    /// A collector of the cgroup tree at `root` with one unit, `fake`, and a pod grace period.
    fn with_fake(root: &Path, fake: Fake, grace: Duration) -> Collector {
        Collector::new(
            CgroupTree::new(root.to_path_buf()),
            vec![Box::new(fake)],
            PodStore::default(),
            grace,
        )
    }

    fn ino(p: &Path) -> u64 {
        std::fs::metadata(p).unwrap().ino()
    }

    fn count(c: &Collector, owner: &Owner, family: &'static str, labels: Labels) -> Option<u64> {
        let shared = c.store.lock().unwrap();
        match shared.owners.get(owner)?.series.get(&(family, labels))? {
            Value::Count(n) => Some(*n),
            Value::Hist(_) => None,
        }
    }

    /// A unit is told the owners changed in exactly the ticks whose owners differ from the
    /// previous tick's: cgroups added, and the tick after cgroups were removed (their owners
    /// stay through the tick that saw them go, for its units).
    #[test]
    fn units_are_told_when_the_owners_changed() {
        let root = tempfile::tempdir().unwrap();
        let pod = |i: u32| {
            root.path()
                .join(format!("kubepods/burstable/pod{UID}/{i:064x}"))
        };
        std::fs::create_dir_all(pod(1)).unwrap();
        let fake = Fake::default();
        let ticks = fake.ticks.clone();
        let mut c = with_fake(root.path(), fake, Duration::ZERO);
        let steps: [&dyn Fn(); 7] = [
            &|| {},
            &|| {},
            &|| std::fs::create_dir(pod(2)).unwrap(),
            &|| {},
            &|| std::fs::remove_dir(pod(1)).unwrap(),
            &|| {},
            &|| {},
        ];
        for step in steps {
            step();
            c.tick().unwrap();
        }
        let ticks = ticks.lock().unwrap();
        let said: Vec<bool> = ticks.iter().map(|(changed, _)| *changed).collect();
        // the truth: the owners' ids differ from the previous tick's (all new at the first)
        let truth: Vec<bool> = ticks
            .iter()
            .enumerate()
            .map(|(i, (_, ids))| i == 0 || *ids != ticks[i - 1].1)
            .collect();
        assert_eq!(said, truth, "{ticks:?}");
        // pod(1)'s removal shows in the tick after it
        assert_eq!(truth, [true, false, true, false, false, true, false]);
    }

    #[test]
    fn deltas_accumulate_per_owner_with_windows_and_grace() {
        let root = tempfile::tempdir().unwrap();
        let container = root
            .path()
            .join(format!("kubepods/burstable/pod{UID}/{CID}"));
        let quiet = root.path().join("system.slice/quiet.service");
        std::fs::create_dir_all(&container).unwrap();
        std::fs::create_dir_all(&quiet).unwrap();
        let fake = Fake::default();
        let (kernel, forgotten) = (fake.kernel.clone(), fake.forgotten.clone());
        let fake_drained = fake.drained.clone();
        kernel.lock().unwrap().insert(ino(&container), 5);
        // a cgroup whose counts never move: no owner, no series
        kernel.lock().unwrap().insert(ino(&quiet), 0);
        let mut c = with_fake(root.path(), fake, Duration::ZERO);
        assert_eq!(
            c.families().iter().map(|f| f.name).collect::<Vec<_>>(),
            [EVENTS, OTHER]
        );
        let pod = Owner::Pod {
            uid: UID.into(),
            container_id: Some(CID.into()),
        };
        let dst = Labels::from([("dst", "private".to_string())]);

        let report = c.tick().unwrap();
        assert_eq!(count(&c, &pod, EVENTS, Labels::new()), Some(5));
        // the zero companion exists beside a non-zero delta: it reads 0
        assert_eq!(count(&c, &pod, OTHER, dst.clone()), Some(0));
        assert!(!c
            .store
            .lock()
            .unwrap()
            .owners
            .contains_key(&Owner::Slice("system.slice".into())));
        assert!(report.windows.is_empty(), "first tick");
        assert_eq!(*report.live, FxHashSet::from_iter([Arc::<str>::from(UID)]));

        kernel.lock().unwrap().insert(ino(&container), 8);
        std::thread::sleep(Duration::from_millis(20));
        let report = c.tick().unwrap();
        assert_eq!(count(&c, &pod, EVENTS, Labels::new()), Some(8));
        {
            assert_eq!(report.windows.len(), 1, "{:?}", report.windows);
            let w = &report.windows[0];
            assert_eq!((w.owner.clone(), w.signal), (pod.clone(), "event_rate"));
            let WindowValue::Rate { count, per_second } = w.value else {
                panic!("a rate")
            };
            assert_eq!(count, 3);
            assert!(w.window >= Duration::from_millis(20));
            assert!((per_second - 3.0 / w.window.as_secs_f64()).abs() < 1e-9);
        }

        // the container goes: its directory cannot be read any more, its
        // last count comes drained; with no grace its owner goes in the same
        // tick, after the last delta made its window
        let id = ino(&container);
        std::fs::remove_dir(&container).unwrap();
        kernel.lock().unwrap().remove(&id);
        fake_drained.lock().unwrap().insert(id, 10);
        let report = c.tick().unwrap();
        {
            assert!(!c.store.lock().unwrap().owners.contains_key(&pod));
            assert!(report.live.is_empty(), "{:?}", report.live);
            let rates: Vec<_> = report
                .windows
                .iter()
                .filter(|w| w.owner == pod)
                .map(|w| w.value.clone())
                .collect();
            assert!(
                matches!(rates[..], [WindowValue::Rate { count: 2, .. }]),
                "{rates:?}"
            );
        }
        // delta state is forgotten by every unit once late numbers cannot come
        for _ in 0..=DYING_TICKS {
            c.tick().unwrap();
        }
        assert_eq!(*forgotten.lock().unwrap(), [id]);
    }

    /// A container created and removed between two ticks: the tree never
    /// saw it; the kernel's removal event names it (under its known parent),
    /// or, without a path, its parent's pod.
    #[test]
    fn a_cgroup_removed_before_any_tick_counts_for_its_owner() {
        let root = tempfile::tempdir().unwrap();
        let pod_dir = root.path().join(format!("kubepods/burstable/pod{UID}"));
        std::fs::create_dir_all(&pod_dir).unwrap();
        let fake = Fake::default();
        let drained = fake.drained.clone();
        let mut c = with_fake(root.path(), fake, Duration::from_secs(3600));
        c.tick().unwrap();
        let parent = ino(&pod_dir);
        let (named, unnamed) = (u64::MAX - 1, u64::MAX - 2);
        c.follow(&Changes {
            died: vec![
                Died {
                    id: named,
                    parent,
                    // the kernel's path, from the hierarchy's root
                    path: Some(format!("/elsewhere/kubepods/burstable/pod{UID}/{CID}")),
                },
                Died {
                    id: unnamed,
                    parent,
                    path: None,
                },
            ],
            ..Changes::default()
        });
        drained.lock().unwrap().extend([(named, 4), (unnamed, 3)]);
        c.tick().unwrap();
        assert_eq!(count(&c, &pod(Some(CID)), EVENTS, Labels::new()), Some(4));
        assert_eq!(count(&c, &pod(None), EVENTS, Labels::new()), Some(3));

        // drained numbers whose removal event is not read yet wait for it
        let late = u64::MAX - 3;
        drained.lock().unwrap().insert(late, 6);
        c.tick().unwrap();
        assert_eq!(c.unresolved.len(), 1);
        c.follow(&Changes {
            died: vec![Died {
                id: late,
                parent,
                path: Some(format!("/kubepods/burstable/pod{UID}/{CID}")),
            }],
            ..Changes::default()
        });
        c.tick().unwrap();
        assert_eq!(count(&c, &pod(Some(CID)), EVENTS, Labels::new()), Some(10));
    }

    /// A unit that names the cgroups with activity is read for those only.
    #[test]
    fn only_active_cgroups_are_read() {
        let root = tempfile::tempdir().unwrap();
        let (a, b) = (root.path().join("a.slice"), root.path().join("b.slice"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let fake = Fake::default();
        let (kernel, active) = (fake.kernel.clone(), fake.active.clone());
        kernel.lock().unwrap().extend([(ino(&a), 1), (ino(&b), 1)]);
        *active.lock().unwrap() = Some(vec![ino(&a)]);
        let mut c = with_fake(root.path(), fake, Duration::from_secs(3600));
        c.tick().unwrap();
        let (sa, sb) = (
            Owner::Slice("a.slice".into()),
            Owner::Slice("b.slice".into()),
        );
        assert_eq!(count(&c, &sa, EVENTS, Labels::new()), Some(1));
        assert_eq!(count(&c, &sb, EVENTS, Labels::new()), None, "b not read");
        *active.lock().unwrap() = None;
        c.tick().unwrap();
        assert_eq!(count(&c, &sb, EVENTS, Labels::new()), Some(1), "all read");
    }

    fn counts(series: &[(&'static str, u64)]) -> OwnerStats {
        OwnerStats {
            series: series
                .iter()
                .map(|(f, n)| ((*f, Labels::new()), Value::Count(*n)))
                .collect(),
            ..OwnerStats::default()
        }
    }

    fn pod(cid: Option<&str>) -> Owner {
        Owner::Pod {
            uid: UID.into(),
            container_id: cid.map(Arc::from),
        }
    }

    #[test]
    fn a_gone_container_hands_its_totals_to_the_owner_with_its_labels() {
        const POD_SCOPE: &str = "test_pod_bytes_total";
        let scopes = HashMap::from([(EVENTS, Scope::Container), (POD_SCOPE, Scope::Pod)]);
        let now = Instant::now();
        let (old, new, init) = (pod(Some("old")), pod(Some("new")), pod(Some("init")));
        let pods = PodStore::default();
        pods.upsert(crate::pods::PodMeta {
            containers: HashMap::from([
                ("old".into(), "main".into()),
                ("new".into(), "main".into()),
                ("init".into(), "setup".into()),
            ]),
            ..crate::pods::PodMeta::named(UID, "ns", "p")
        });
        let mut owners = FxHashMap::from_iter([
            (
                old.clone(),
                counts(&[(EVENTS, 5), (POD_SCOPE, 7), (COMPUTE, 3)]),
            ),
            (new.clone(), counts(&[(EVENTS, 2)])),
            (init.clone(), counts(&[(EVENTS, 1)])),
        ]);
        let mut gpu = FxHashSet::from_iter([old.clone()]);
        // only the new container's cgroup lives; grace 0: the others expire now
        let live = FxHashMap::from_iter([(new.clone(), 1)]);
        let waiting = retire(
            &mut owners,
            &mut gpu,
            &live,
            &pods,
            &scopes,
            Duration::ZERO,
            now,
        );
        assert!(
            waiting,
            "the container not restarted waits in its grace period"
        );
        assert!(
            !owners.contains_key(&old),
            "the restarted container handed over"
        );
        let n = &owners[&new].series;
        assert_eq!(n[&(EVENTS, Labels::new())], Value::Count(7));
        assert_eq!(n[&(POD_SCOPE, Labels::new())], Value::Count(7));
        assert_eq!(n[&(COMPUTE, Labels::new())], Value::Count(3));
        assert!(
            gpu.contains(&new),
            "the heir of GPU series is among the owners the GPU totals read"
        );
        assert!(
            owners.contains_key(&init),
            "a container not restarted keeps its series while the pod lives"
        );

        // without the API: only pod-scope families go to the pod level
        let pods = PodStore::default();
        let mut owners = FxHashMap::from_iter([
            (old.clone(), counts(&[(EVENTS, 5), (POD_SCOPE, 7)])),
            (new.clone(), counts(&[(EVENTS, 2)])),
        ]);
        let mut gpu = FxHashSet::default();
        retire(
            &mut owners,
            &mut gpu,
            &live,
            &pods,
            &scopes,
            Duration::ZERO,
            now,
        );
        assert!(!owners.contains_key(&old));
        let p = &owners[&pod(None)].series;
        assert_eq!(p.len(), 1);
        assert_eq!(p[&(POD_SCOPE, Labels::new())], Value::Count(7));

        // the pod gone: every owner goes with its labels
        let waiting = retire(
            &mut owners,
            &mut gpu,
            &FxHashMap::default(),
            &pods,
            &scopes,
            Duration::ZERO,
            now,
        );
        assert!(owners.is_empty());
        assert!(!waiting, "nobody left to wait for");
    }
}
