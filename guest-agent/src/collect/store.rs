//! The collector's store, shared with the exporter: every owner's running totals, the gauges
//! as their units last set them, and the agent's own numbers.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::owner::Owner;
use crate::probes::unit::{GaugeValue, Labels, UnitStats, Value};

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
    /// the node's GPU compute source and why better ones are not used (doctor)
    pub compute: crate::probes::ComputeStatus,
}

/// The exporter's store: every owner's running totals, the gauges as their
/// units last set them, the agent's own numbers. A scrape renders it; the tick
/// writes it, and takes FinOps' totals from it ([`super::GpuTotals`]).
#[derive(Default)]
pub struct Store {
    pub owners: FxHashMap<Owner, OwnerStats>,
    pub stats: SelfStats,
    /// Gauge families as their units last set them.
    pub gauges: HashMap<&'static str, Vec<GaugeValue>>,
    /// The owners with a series of a family FinOps or the feed stall reads (the collector
    /// keeps it as it adds series; `gpu_totals::index_gpu_owners` fills it for a store filled
    /// by hand): the few a tick's totals look at, however many pods are idle.
    pub gpu_owners: FxHashSet<Owner>,
}

/// UIDs of the pods the collector has, shared: a tick whose owners did not change hands on the
/// same set, and a reader that kept the last one sees that by pointer.
pub type LiveUids = Arc<FxHashSet<Arc<str>>>;

impl Store {
    /// UIDs of the pods that have series.
    pub fn pod_uids(&self) -> LiveUids {
        Arc::new(
            self.owners
                .keys()
                .filter_map(|o| match o {
                    Owner::Pod { uid, .. } => Some(uid.clone()),
                    _ => None,
                })
                .collect(),
        )
    }
}
