//! The tick: read every live cgroup's kernel aggregates, turn them into deltas
//! and add them to per-owner accumulators (a pod's container, a pod, or a
//! top-level slice for everything that is not a pod).
//!
//! Accumulating by owner rather than by cgroup keeps counters monotonic when a
//! container restarts into a new cgroup, sums all non-pod cgroups into one
//! series per slice, and lets the exporter relabel an owner (pod UID → name)
//! without restarting its counters.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cgroups::CgroupTree;
use crate::pods::{classify_cgroup, CgroupClass, PodStore};
use crate::probes::signal::{latency_window, rate_window, SignalKind, SignalWindow};
use crate::probes::unit::{
    Delta, FamilySpec, GaugeValue, Labels, TickContext, UnitStats, Units, Value,
};

/// Who a cgroup's numbers belong to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    Pod {
        uid: String,
        container_id: Option<String>,
    },
    Slice(String),
    /// tc drops nobody could be found for (no socket, unknown device, unknown IPs)
    Unattributed,
}

impl Owner {
    fn of(class: CgroupClass) -> Owner {
        match class {
            CgroupClass::Pod {
                uid, container_id, ..
            } => Owner::Pod { uid, container_id },
            CgroupClass::Slice(s) => Owner::Slice(s),
        }
    }

    /// The owner at pod level: a pod's container dropped, anything else as is.
    pub fn pod_level(&self) -> Owner {
        match self {
            Owner::Pod { uid, .. } => Owner::Pod {
                uid: uid.clone(),
                container_id: None,
            },
            other => other.clone(),
        }
    }
}

/// Cumulative numbers of one owner since the agent first saw it.
#[derive(Debug, Clone, Default)]
pub struct OwnerStats {
    /// Running totals per (family, labels the unit added).
    pub series: BTreeMap<(&'static str, Labels), Value>,
    /// Live cgroups that map to this owner in the last tick.
    pub live_cgroups: usize,
    /// When the owner lost its last cgroup or was deleted from the API.
    pub gone_since: Option<Instant>,
}

/// Self-observation numbers exported beside the data.
#[derive(Debug, Clone, Default)]
pub struct SelfStats {
    pub cgroups: usize,
    pub owners_pod: usize,
    pub owners_slice: usize,
    pub last_tick_seconds: f64,
    pub ticks: u64,
    /// each loaded unit's own numbers, in registry order
    pub units: Vec<UnitStats>,
}

/// What the exporter (and a correlator) reads.
#[derive(Default)]
pub struct Shared {
    pub owners: HashMap<Owner, OwnerStats>,
    pub stats: SelfStats,
    /// Gauge families as their units last set them.
    pub gauges: HashMap<&'static str, Vec<GaugeValue>>,
    /// The last tick's signal windows (see `probes::signal`); empty after the
    /// first tick, which has no window to divide by.
    pub windows: Vec<SignalWindow>,
}

/// One tick's deltas, merged per owner and series.
type TickDeltas = HashMap<Owner, BTreeMap<(&'static str, Labels), Value>>;

pub struct Collector {
    tree: CgroupTree,
    units: Units,
    /// owner of every cgroup read before, by cgroup id
    owners: HashMap<u64, Owner>,
    pods: PodStore,
    grace: Duration,
    last_tick: Option<Instant>,
    pub shared: Arc<Mutex<Shared>>,
}

impl Collector {
    pub fn new(tree: CgroupTree, units: Units, pods: PodStore, grace: Duration) -> Collector {
        Collector {
            tree,
            units,
            owners: HashMap::new(),
            pods,
            grace,
            last_tick: None,
            shared: Arc::default(),
        }
    }

    /// The families the loaded units export, for the exporter.
    pub fn families(&self) -> Vec<&'static FamilySpec> {
        self.units.iter().flat_map(|u| u.families()).collect()
    }

    /// One tick. Returns an error only if the cgroup hierarchy itself can't be read.
    pub fn tick(&mut self) -> std::io::Result<()> {
        let started = Instant::now();
        let now = started;
        // Cgroups present last tick: read them once more before the refresh
        // forgets removed ones, so their last numbers are not lost. A removed
        // cgroup's storage is freed by the kernel with the cgroup.
        let changes = self.tree.refresh()?;
        let mut deltas = TickDeltas::new();
        let mut live: HashMap<Owner, usize> = HashMap::new();
        let mut read = Vec::new();
        let cgroups = changes
            .removed
            .iter()
            .map(|(id, c)| (*id, c, false))
            .chain(self.tree.cgroups.iter().map(|(id, c)| (*id, c, true)));
        for (id, cg, is_live) in cgroups {
            let owner = self
                .owners
                .entry(id)
                .or_insert_with(|| Owner::of(classify_cgroup(&cg.path)));
            if is_live {
                *live.entry(owner.clone()).or_default() += 1;
            }
            for unit in &mut self.units {
                unit.read_cgroup(id, cg.dir.as_fd(), &mut read);
            }
            // an owner with no delta this tick is still listed: it may be new
            let d = deltas.entry(owner.clone()).or_default();
            for Delta {
                family,
                labels,
                value,
            } in read.drain(..)
            {
                add(d, (family, labels), value);
            }
        }
        let ctx = TickContext {
            tree: &self.tree,
            owners: &self.owners,
            pods: &self.pods,
            cgroups_changed: !changes.added.is_empty() || !changes.removed.is_empty(),
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
        for id in changes.removed.keys() {
            self.owners.remove(id);
            for unit in &mut self.units {
                unit.forget_cgroup(*id);
            }
        }
        let windows = match self.last_tick.replace(now) {
            Some(prev) => self.windows(&deltas, now, now.duration_since(prev)),
            None => Vec::new(),
        };
        let units: Vec<UnitStats> = self.units.iter().map(|u| u.stats()).collect();

        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        for (owner, series) in deltas {
            // No series before the first sample: idle cgroups cost nothing, and a
            // retired owner is not revived by zero deltas.
            if series.values().all(Value::is_zero) && !shared.owners.contains_key(&owner) {
                continue;
            }
            let o = shared.owners.entry(owner).or_default();
            for (key, value) in series {
                add(&mut o.series, key, value);
            }
        }
        for (family, values) in gauges {
            shared.gauges.insert(family, values);
        }
        shared.windows = windows;
        // Liveness and the grace period: an owner whose cgroups are all gone, or
        // whose pod the API deleted, keeps its series for `grace`, then goes.
        let grace = self.grace;
        let pods = &self.pods;
        shared.owners.retain(|owner, o| {
            o.live_cgroups = live.get(owner).copied().unwrap_or(0);
            let deleted = match owner {
                Owner::Pod { uid, .. } => pods.get(uid).is_some_and(|m| m.deleted_at.is_some()),
                Owner::Slice(_) => false,
                Owner::Unattributed => return true,
            };
            if o.live_cgroups == 0 || deleted {
                let since = *o.gone_since.get_or_insert(now);
                now.duration_since(since) < grace
            } else {
                o.gone_since = None;
                true
            }
        });
        self.pods.prune(grace);
        let (mut owners_pod, mut owners_slice) = (0, 0);
        for o in shared.owners.keys() {
            match o {
                Owner::Pod { .. } => owners_pod += 1,
                Owner::Slice(_) | Owner::Unattributed => owners_slice += 1,
            }
        }
        let ticks = shared.stats.ticks + 1;
        shared.stats = SelfStats {
            cgroups: self.tree.cgroups.len(),
            owners_pod,
            owners_slice,
            last_tick_seconds: started.elapsed().as_secs_f64(),
            ticks,
            units,
        };
        Ok(())
    }

    /// The signal windows of this tick's deltas.
    fn windows(&self, deltas: &TickDeltas, at: Instant, window: Duration) -> Vec<SignalWindow> {
        let signals: Vec<_> = self.units.iter().flat_map(|u| u.signals()).collect();
        let mut out = Vec::new();
        for (owner, series) in deltas {
            for ((family, labels), value) in series {
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
                        labels: labels.clone(),
                        at,
                        window,
                        value,
                    });
                }
            }
        }
        out
    }
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
