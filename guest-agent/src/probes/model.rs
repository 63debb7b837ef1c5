//! The values a probe unit hands the collector and the exporter: series
//! families and their labels, deltas, gauges, the unit's self-observation,
//! and the last reading per cgroup a delta is taken against. The bottom of
//! the probes: it imports nothing of the agent but the owner and the
//! histogram.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

use super::hist::Hist;
use crate::owner::Owner;

/// Label names and values of a series, in a fixed (sorted) order. Units use it
/// for the labels they add (`dst`, `direction`, ...); the exporter merges those
/// with the owner's.
pub type Labels = BTreeMap<&'static str, String>;

/// A gauge's labels, shared. Gauges are set whole every tick, and most of a tick's values
/// repeat label sets: every pod on a GPU gets that GPU's link labels, a duty cycle window
/// hands its series' labels at each tick. Shared, a value costs a reference count, not a
/// map and its strings made and freed per tick.
pub type SharedLabels = Arc<Labels>;

/// The empty label set, shared (a gauge with only its owner's labels).
pub fn no_labels() -> SharedLabels {
    static NONE: LazyLock<SharedLabels> = LazyLock::new(|| Arc::new(Labels::new()));
    NONE.clone()
}

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
    pub labels: SharedLabels,
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
    /// `Kind::Gauge`, or `Kind::Counter` for a count (failures by label).
    pub kind: Kind,
    pub samples: Vec<(Labels, f64)>,
}

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
