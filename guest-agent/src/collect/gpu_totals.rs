//! What FinOps reads of a tick, taken by the collector at the end of it while it holds its
//! store (the report carries it on by value): every pod's GPU running totals, summed over its
//! containers, and the GPUs' capacity as the nvml unit reports it then. FinOps decides from
//! these ([`crate::finops::live`]); nothing here prices.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;

use rustc_hash::FxHashMap;

use crate::probes::cuda::{FeedPart, FEED_PART, FEED_STALL, PCIE, SYNC_WAIT, VRAM};
use crate::probes::gpu_compute::{ComputeSource, COMPUTE, DUTY};
use crate::probes::gpu_driver::IOCTL;
use crate::probes::nvml::{LIBRARY_INFO, LINK_MAX, MEMORY as NVML_MEMORY, MEMORY_TOTAL};
use crate::probes::unit::{Labels, Value};

use crate::owner::Owner;

use super::store::{OwnerStats, Store};

/// The families of owners' series read here: the store keeps which owners have one
/// (`Store::gpu_owners`).
const FAMILIES: [&str; 5] = [COMPUTE, IOCTL, PCIE, SYNC_WAIT, FEED_STALL];

/// Every pod's GPU running totals at one tick (by pod UID), and the GPUs' capacity.
#[derive(Debug, Clone, Default)]
pub struct GpuTotals {
    // hashed with Fx: FinOps looks each pod up again at every tick
    pub pods: FxHashMap<String, PodGpuTotals>,
    pub nvml: NvmlCapacity,
}

/// A pod's GPU running totals at one tick, summed over its containers.
#[derive(Debug, Clone, Default)]
pub struct PodGpuTotals {
    /// Compute time per GPU (`None`: the source does not say which), ns.
    pub compute_ns: BTreeMap<Option<u32>, u64>,
    /// Driver call time summed over calls (overlapping calls each count), ns.
    pub call_ns: u64,
    /// Time blocked in CUDA synchronisation, summed over calls, ns.
    pub sync_ns: u64,
    pub pcie_bytes: u64,
    pub vram_bytes: f64,
    /// The duty cycle of its busiest GPU (its containers' on that GPU summed).
    pub duty: Option<f64>,
}

/// A pod's raw feed-stall account as the CUDA probes keep it (running totals, summed over
/// its containers): the join splits it by cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeedRaw {
    /// Stall while the feeding thread waited on a run queue, ns.
    pub cpu_ns: u64,
    /// Stall of any cause, ns.
    pub all_ns: u64,
    /// Time in synchronous host-to-device copies, ns, and their bytes.
    pub copy_ns: u64,
    pub copy_bytes: u64,
}

/// The GPUs' capacity as the nvml unit reports it at one tick.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum NvmlCapacity {
    /// The nvml unit is not loaded (`--probes` leaves it out).
    #[default]
    ProbeOff,
    /// The unit runs without NVML: why (where it looked).
    NotLoaded(String),
    /// NVML is loaded: each GPU's total memory and maximum link bandwidth it gave (either may
    /// be empty: no GPU enumerated, all lost, or a call it lacks).
    Gpus { memory: Vec<f64>, link: Vec<f64> },
}

impl GpuTotals {
    pub fn of(shared: &Store) -> GpuTotals {
        GpuTotals {
            pods: pod_totals(shared),
            nvml: nvml_capacity(shared),
        }
    }
}

/// From the nvml unit's node series of the tick (the same numbers
/// `gpufeed_gpu_memory_total_bytes` and `gpufeed_gpu_link_max_bytes_per_second` export).
fn nvml_capacity(shared: &Store) -> NvmlCapacity {
    let Some(node) = shared
        .stats
        .units
        .iter()
        .map(|u| &u.node)
        .find(|n| n.iter().any(|f| f.name == LIBRARY_INFO))
    else {
        return NvmlCapacity::ProbeOff;
    };
    let samples = |name: &str| {
        node.iter()
            .filter(|f| f.name == name)
            .flat_map(|f| f.samples.iter().map(|(_, v)| *v))
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect::<Vec<f64>>()
    };
    if samples(LIBRARY_INFO).is_empty() {
        let why = shared
            .stats
            .compute
            .unavailable
            .iter()
            .find(|(s, _)| *s == ComputeSource::Nvml)
            .map(|(_, why)| why.clone())
            .unwrap_or_else(|| "no NVML library found".into());
        return NvmlCapacity::NotLoaded(why);
    }
    NvmlCapacity::Gpus {
        memory: samples(MEMORY_TOTAL),
        link: samples(LINK_MAX),
    }
}

/// Every pod with a GPU series, with its totals.
fn pod_totals(shared: &Store) -> FxHashMap<String, PodGpuTotals> {
    let mut out: FxHashMap<String, PodGpuTotals> = FxHashMap::default();
    for (owner, o) in gpu_owners(shared) {
        let Owner::Pod { uid, .. } = owner else {
            continue;
        };
        // the owner's series summed apart, and added to its pod's entry once: a pod's entry
        // looked up at every series was most of this walk on a node of idle GPU pods
        let mut t = PodGpuTotals::default();
        let mut any = false;
        for ((family, labels), value) in &o.series {
            match (*family, value) {
                (COMPUTE, Value::Count(ns)) => {
                    *t.compute_ns.entry(gpu_of(labels)).or_default() += ns;
                }
                (IOCTL, Value::Hist(h)) => t.call_ns += h.sum_ns,
                (SYNC_WAIT, Value::Hist(h)) => t.sync_ns += h.sum_ns,
                (PCIE, Value::Count(b)) => t.pcie_bytes += b,
                (COMPUTE | IOCTL | SYNC_WAIT | PCIE, _) => {}
                _ => continue,
            }
            any = true;
        }
        if any {
            pod_entry(&mut out, uid).add(t);
        }
    }
    // NVML sees every process's memory; the uprobes only the allocations made after they
    // attached
    let vram = if shared.gauges.contains_key(NVML_MEMORY) {
        NVML_MEMORY
    } else {
        VRAM
    };
    let mut duty: FxHashMap<(&str, Option<u32>), f64> = Default::default();
    for (family, values) in &shared.gauges {
        if *family != vram && *family != DUTY {
            continue;
        }
        for g in values {
            let Owner::Pod { uid, .. } = &g.owner else {
                continue;
            };
            if *family == vram {
                pod_entry(&mut out, uid).vram_bytes += g.value;
            } else {
                *duty.entry((&**uid, gpu_of(&g.labels))).or_default() += g.value;
            }
        }
    }
    for ((uid, _), d) in duty {
        let t = pod_entry(&mut out, uid);
        t.duty = Some(t.duty.unwrap_or(0.0).max(d.min(1.0)));
    }
    out
}

impl PodGpuTotals {
    /// Adds another container's running totals (its duty and VRAM are not read from series).
    fn add(&mut self, o: PodGpuTotals) {
        for (gpu, ns) in o.compute_ns {
            *self.compute_ns.entry(gpu).or_default() += ns;
        }
        self.call_ns += o.call_ns;
        self.sync_ns += o.sync_ns;
        self.pcie_bytes += o.pcie_bytes;
    }
}

/// The pod's entry of `out`, made at its first series: the UID is copied once per tick, not
/// once per series and gauge read.
fn pod_entry<'a, T: Default, S: BuildHasher>(
    out: &'a mut HashMap<String, T, S>,
    uid: &str,
) -> &'a mut T {
    if !out.contains_key(uid) {
        out.insert(uid.to_string(), T::default());
    }
    out.get_mut(uid).expect("inserted above")
}

/// Every pod's raw feed-stall account (the pods with one), for the join.
pub fn feed_totals(shared: &Store) -> HashMap<String, FeedRaw> {
    let mut out: HashMap<String, FeedRaw> = HashMap::new();
    for (owner, o) in gpu_owners(shared) {
        let Owner::Pod { uid, .. } = owner else {
            continue;
        };
        let mut f = FeedRaw::default();
        let mut any = false;
        for ((family, labels), value) in &o.series {
            let (FEED_STALL, Value::Count(n)) = (*family, value) else {
                continue;
            };
            any = true;
            let part = labels.get(FEED_PART).map(String::as_str);
            match FeedPart::ALL.into_iter().find(|p| Some(p.as_str()) == part) {
                Some(FeedPart::Cpu) => f.cpu_ns += n,
                Some(FeedPart::All) => f.all_ns += n,
                Some(FeedPart::CopyNs) => f.copy_ns += n,
                Some(FeedPart::CopyBytes) => f.copy_bytes += n,
                None => {}
            }
        }
        if any {
            let e = pod_entry(&mut out, uid);
            e.cpu_ns += f.cpu_ns;
            e.all_ns += f.all_ns;
            e.copy_ns += f.copy_ns;
            e.copy_bytes += f.copy_bytes;
        }
    }
    out
}

/// Whether the families of an owner's series hold one read here: the one test of which owners
/// `Store::gpu_owners` keeps, wherever series are added or handed on.
pub fn has_gpu_series<'a>(mut families: impl Iterator<Item = &'a &'static str>) -> bool {
    families.any(|f| FAMILIES.contains(f))
}

/// Fills `store.gpu_owners` from every owner's series (a store filled by hand; the collector
/// keeps it as it adds series).
pub fn index_gpu_owners(store: &mut Store) {
    store.gpu_owners = store
        .owners
        .iter()
        .filter(|(_, o)| has_gpu_series(o.series.keys().map(|(f, _)| f)))
        .map(|(owner, _)| owner.clone())
        .collect();
}

/// The owners with a series of one of `FAMILIES`, with their numbers.
fn gpu_owners(shared: &Store) -> impl Iterator<Item = (&Owner, &OwnerStats)> {
    shared
        .gpu_owners
        .iter()
        .filter_map(|o| shared.owners.get_key_value(o))
}

/// The `gpu` label of a compute series (NVML's index), if it has one.
fn gpu_of(labels: &Labels) -> Option<u32> {
    labels.get("gpu").and_then(|g| g.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::model::{Kind, NodeFamily, UnitStats};

    #[test]
    fn the_nvml_units_series_are_read() {
        let gpu = |g: &str| Labels::from([("gpu", g.to_string())]);
        let fam = |name, samples| NodeFamily {
            name,
            help: "",
            kind: Kind::Gauge,
            samples,
        };
        let mut s = Store::default();
        assert_eq!(nvml_capacity(&s), NvmlCapacity::ProbeOff);
        s.stats.units = vec![UnitStats {
            node: vec![fam(LIBRARY_INFO, vec![])],
            ..UnitStats::default()
        }];
        assert!(matches!(nvml_capacity(&s), NvmlCapacity::NotLoaded(_)));
        s.stats.units[0].node = vec![
            fam(LIBRARY_INFO, vec![(Labels::new(), 1.0)]),
            fam(MEMORY_TOTAL, vec![(gpu("0"), 80.0), (gpu("1"), 24.0)]),
            fam(LINK_MAX, vec![(gpu("0"), 16.0)]),
        ];
        assert_eq!(
            nvml_capacity(&s),
            NvmlCapacity::Gpus {
                memory: vec![80.0, 24.0],
                link: vec![16.0]
            }
        );
        s.stats.units[0].node.truncate(1);
        assert_eq!(
            nvml_capacity(&s),
            NvmlCapacity::Gpus {
                memory: vec![],
                link: vec![]
            }
        );
    }
}
