//! GPU FinOps: the per-pod GPU series turned into cost per tenant and into advice.
//!
//! After every map-reading tick [`FinOps::book`] takes the GPU probes' running totals from the
//! collector's tick report ([`crate::collect::GpuTotals`]: compute time per GPU, duty cycle,
//! VRAM, PCIe bytes, and the time threads waited for the GPU in driver calls and CUDA
//! synchronisation, per pod), and feeds the differences to two sans-IO parts: the cost model ([`cost`]) and the MPS
//! advisor ([`mps`]). VRAM is NVML's per-process memory where the node has NVML (it sees
//! every allocation, the CUDA context's included), else what the CUDA uprobes saw allocated. Its Prometheus collector exports
//! `gpufeed_gpu_cost_total`, `gpufeed_gpu_idle_cost_total`, `gpufeed_gpu_node_cost_total`,
//! `gpufeed_gpu_cost_capacity`, `gpufeed_mps_recommended_active_thread_percentage` and
//! `gpufeed_pod_info`. The GPUs' capacity the cost divides by is read at each tick
//! ([`live`]): the cost waits for one instead of the agent refusing to start, and follows it
//! when it changes. docs/finops.md is the reader's side.

pub mod config;
pub mod cost;
pub mod error;
pub mod labels;
pub mod live;
pub mod mps;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::core::{Collector as PromCollector, Desc};
use prometheus::proto::{MetricFamily, MetricType};
use rustc_hash::FxHashMap;

use crate::collect::{GpuTotals, PodGpuTotals as PodTotals};
use crate::families::{counter, family, gauge};
use crate::pods::{PodMeta, PodStore};
use crate::probes::unit::Labels;

pub use config::{CapacityInput, ConfigError, FinopsArgs, FinopsConfig, GpuCapacity, Settings};
pub use labels::PodLabels;

pub const COST: &str = "gpufeed_gpu_cost_total";
pub const IDLE_COST: &str = "gpufeed_gpu_idle_cost_total";
pub const NODE_COST: &str = "gpufeed_gpu_node_cost_total";
pub const MPS: &str = "gpufeed_mps_recommended_active_thread_percentage";
pub const POD_INFO: &str = "gpufeed_pod_info";
pub const CAPACITY: &str = "gpufeed_gpu_cost_capacity";

/// Who a cost line is for, resolved when the cost is booked.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct CostKey {
    tenant: String,
    namespace: String,
    pod: String,
}

/// (namespace, pod) as exported.
type PodName = (String, String);

struct State {
    last: Option<Instant>,
    /// Totals at the previous tick, by pod UID.
    previous: FxHashMap<String, PodTotals>,
    /// `None` without an hourly rate, or until there is a capacity to divide by.
    meter: Option<cost::Meter<CostKey>>,
    /// What the cost divides by, read at each tick (`None` without an hourly rate).
    capacity: Option<live::Live>,
    advisor: mps::MpsAdvisor<PodName>,
}

struct Inner {
    cfg: FinopsConfig,
    pods: PodStore,
    state: Mutex<State>,
    descs: Vec<Desc>,
}

/// The FinOps state and its Prometheus collector; cheap to clone (one instance shared by the
/// tick thread and the registry).
#[derive(Clone)]
pub struct FinOps(Arc<Inner>);

impl FinOps {
    pub fn new(cfg: FinopsConfig, pods: PodStore) -> FinOps {
        let descs = [COST, IDLE_COST, NODE_COST, CAPACITY, MPS, POD_INFO]
            .iter()
            .filter_map(|n| Desc::new(n.to_string(), n.to_string(), vec![], HashMap::new()).ok())
            .collect();
        let advisor = mps::MpsAdvisor::new(cfg.mps);
        let capacity = cfg.cost.as_ref().map(|c| live::Live::new(c.configured));
        // a capacity known from the configuration prices from the start
        let meter = cfg.cost.as_ref().zip(capacity.as_ref()).and_then(|(c, l)| {
            let capacity = l.current?;
            Some(cost::Meter::new(cost::CostModel {
                hourly_rate: c.hourly_rate,
                weights: c.weights,
                capacity,
            }))
        });
        FinOps(Arc::new(Inner {
            cfg,
            pods,
            state: Mutex::new(State {
                last: None,
                previous: FxHashMap::default(),
                meter,
                capacity,
                advisor,
            }),
            descs,
        }))
    }

    /// The configured pod labels (the exporter puts them on the GPU series).
    pub fn pod_labels(&self) -> PodLabels {
        self.0.cfg.labels.clone()
    }

    /// Books the interval since the previous call from a tick's GPU totals (the collector's
    /// report: FinOps holds no lock of the collector's). The first call only takes the
    /// baseline.
    pub fn book(&self, totals: GpuTotals, now: Instant) {
        let GpuTotals { pods: totals, nvml } = totals;
        let reported = live::Reported::from(&nvml);
        let mut st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        self.price_with(&mut st, &reported);
        let Some(last) = st.last.replace(now) else {
            st.previous = totals;
            return;
        };
        let dt = now.saturating_duration_since(last);
        let mut usage = Vec::with_capacity(totals.len());
        let mut samples = Vec::with_capacity(totals.len());
        let none = PodTotals::default();
        for (uid, t) in &totals {
            // a pod first seen now had all of its totals in this interval; a total that went
            // down (an owner retired) added nothing
            let p = st.previous.get(uid).unwrap_or(&none);
            let compute = t
                .compute_ns
                .iter()
                .map(|(gpu, ns)| {
                    let before = p.compute_ns.get(gpu).copied().unwrap_or(0);
                    (*gpu, secs(ns.saturating_sub(before)))
                })
                .collect();
            // the pod's names read in place (a copy of the whole pod, its labels and
            // containers, for each pod at each tick was most of this booking's allocations)
            let names = |m: Option<&PodMeta>| (self.0.cfg.labels.tenant(m), pod_name(uid, m));
            let (tenant, name) = self
                .0
                .pods
                .with(uid, |m| names(Some(m)))
                .unwrap_or_else(|| names(None));
            usage.push((
                CostKey {
                    tenant,
                    namespace: name.0.clone(),
                    pod: name.1.clone(),
                },
                cost::Usage {
                    compute_seconds: compute,
                    vram_bytes: t.vram_bytes,
                    pcie_bytes: t.pcie_bytes.saturating_sub(p.pcie_bytes) as f64,
                },
            ));
            if let Some(duty) = t.duty {
                let calls = secs(t.call_ns.saturating_sub(p.call_ns));
                let syncs = secs(t.sync_ns.saturating_sub(p.sync_ns));
                let sample = mps::Sample {
                    duty,
                    waiting_seconds: calls.max(syncs),
                    seconds: dt.as_secs_f64(),
                };
                samples.push((name, sample));
            }
        }
        if let Some(meter) = &mut st.meter {
            // the lines of pods gone from the collector go with them
            meter.book(dt, usage);
        }
        st.advisor.observe(now, samples);
        st.previous = totals;
    }

    /// The capacity reported this tick into the cost model: the meter starts at the first
    /// capacity known and divides by the current one from then on.
    fn price_with(&self, st: &mut State, reported: &live::Reported) {
        let (Some(c), Some(live)) = (&self.0.cfg.cost, st.capacity.as_mut()) else {
            return;
        };
        live.update(reported);
        let Some(capacity) = live.current else {
            return;
        };
        match &mut st.meter {
            Some(meter) => meter.model.capacity = capacity,
            None => {
                st.meter = Some(cost::Meter::new(cost::CostModel {
                    hourly_rate: c.hourly_rate,
                    weights: c.weights,
                    capacity,
                }))
            }
        }
    }

    fn families(&self) -> Vec<MetricFamily> {
        let inner = &self.0;
        let mut out = Vec::new();
        let st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
        if let (Some(c), Some(meter)) = (&inner.cfg.cost, &st.meter) {
            let ledger = &meter.ledger;
            let currency = || Labels::from([("currency", c.currency.clone())]);
            out.push(family(
                COST,
                "Cost of the pod's use of the GPU: the node's hourly rate × the weighted compute, VRAM and PCIe shares (docs/finops.md)",
                MetricType::COUNTER,
                sorted(&ledger.pods)
                    .into_iter()
                    .map(|(k, v)| {
                        let mut l = currency();
                        l.insert("tenant", k.tenant.clone());
                        l.insert("namespace", k.namespace.clone());
                        l.insert("pod", k.pod.clone());
                        counter(&l, *v)
                    })
                    .collect(),
            ));
            out.push(family(
                IDLE_COST,
                "Cost of the GPU capacity no pod used",
                MetricType::COUNTER,
                vec![counter(&currency(), ledger.idle)],
            ));
            out.push(family(
                NODE_COST,
                "The node's cost at its hourly rate since the agent started: the pods' costs plus the idle cost",
                MetricType::COUNTER,
                vec![counter(&currency(), ledger.node)],
            ));
        }
        if let Some(live) = &st.capacity {
            out.push(capacity_family(live));
        }
        out.push(family(
            MPS,
            "Advised CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for the pod, from its sustained duty cycle (docs/finops.md)",
            MetricType::GAUGE,
            st.advisor
                .advice()
                .map(|((ns, pod), pct)| {
                    let l = Labels::from([("namespace", ns.clone()), ("pod", pod.clone())]);
                    gauge(&l, f64::from(pct))
                })
                .collect(),
        ));
        drop(st);
        if !inner.cfg.labels.is_empty() {
            out.push(family(
                POD_INFO,
                "1 for each pod of this node known from the API, with its configured labels (--pod-label) to join to any per-pod series",
                MetricType::GAUGE,
                inner.pod_info(),
            ));
        }
        out
    }
}

impl Inner {
    fn pod_info(&self) -> Vec<prometheus::proto::Metric> {
        let mut rows: BTreeMap<Labels, ()> = BTreeMap::new();
        for uid in self.pods.uids() {
            let Some(meta) = self.pods.get(&uid).filter(|m| m.deleted_at.is_none()) else {
                continue;
            };
            let mut l = Labels::from([
                ("namespace", meta.namespace.clone()),
                ("pod", meta.name.clone()),
            ]);
            self.cfg.labels.extend(Some(&meta), &mut l);
            rows.insert(l, ());
        }
        rows.keys().map(|l| gauge(l, 1.0)).collect()
    }
}

impl PromCollector for FinOps {
    fn desc(&self) -> Vec<&Desc> {
        self.0.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.families()
    }
}

/// What the cost shares divide by, by resource. A resource neither configured nor reported
/// now has a `reason` (why NVML does not give it) and the last value known, 0 before any:
/// an agent without a capacity says why its cost series are absent.
fn capacity_family(live: &live::Live) -> MetricFamily {
    let cap = live.current;
    let pick = |f: fn(&GpuCapacity) -> f64| cap.as_ref().map(f).unwrap_or(0.0);
    let memory = pick(|c| c.memory_bytes as f64);
    let link = pick(|c| c.link_bytes_per_second as f64);
    let gpus = pick(|c| f64::from(c.gpus));
    let samples = [
        ("memory_bytes", memory),
        ("link_bytes_per_second", link),
        ("gpus", gpus),
    ]
    .into_iter()
    .map(|(r, v)| {
        // the GPU count comes with the memory
        let missing = live.missing.contains(&r) || (r == "gpus" && cap.is_none());
        let reason = if missing { live.reason } else { "" };
        let l = Labels::from([("resource", r.to_string()), ("reason", reason.to_string())]);
        gauge(&l, v)
    })
    .collect();
    family(
        CAPACITY,
        "What the cost shares divide by, by resource: memory_bytes and link_bytes_per_second (configured, else summed over the GPUs NVML reports now), gpus (the GPUs priced); reason: why one is neither configured nor reported now (nvml_not_loaded, nvml_no_gpu, nvml_probe_off, nvml_incomplete, not_read_yet before the first tick), its value then the last known, 0 before any: no cost series until both are known (docs/finops.md)",
        MetricType::GAUGE,
        samples,
    )
}

/// The ledger's lines in the order of their keys, as a scrape shows them.
fn sorted(pods: &FxHashMap<CostKey, f64>) -> Vec<(&CostKey, &f64)> {
    let mut lines: Vec<(&CostKey, &f64)> = pods.iter().collect();
    lines.sort_unstable_by(|a, b| a.0.cmp(b.0));
    lines
}

fn secs(ns: u64) -> f64 {
    Duration::from_nanos(ns).as_secs_f64()
}

/// As the exporter names pods: namespace and name from the API, else "" and the UID.
fn pod_name(uid: &str, meta: Option<&PodMeta>) -> PodName {
    match meta {
        Some(m) => (m.namespace.clone(), m.name.clone()),
        None => (String::new(), uid.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::{NvmlCapacity, Owner, OwnerStats, Store};
    use crate::probes::cuda::{PCIE, VRAM};
    use crate::probes::gpu_compute::{COMPUTE, DUTY};
    use crate::probes::gpu_driver::IOCTL;
    use crate::probes::hist::Hist;
    use crate::probes::nvml::MEMORY as NVML_MEMORY;
    use crate::probes::unit::GaugeValue;
    use crate::probes::unit::{no_labels, Value};

    fn pod(uid: &str, cid: &str) -> Owner {
        Owner::Pod {
            uid: uid.into(),
            container_id: Some(cid.into()),
        }
    }

    /// The store as the GPU probes leave it: `busy` ns of driver time per container, PCIe
    /// bytes at pod level, VRAM and duty gauges.
    fn shared(a_busy: [u64; 2], pcie: u64, vram: f64) -> Store {
        let mut s = Store::default();
        for (i, ns) in a_busy.iter().enumerate() {
            let h = Hist {
                sum_ns: 2 * ns,
                count: 1,
                ..Hist::default()
            };
            s.owners.insert(
                pod("a", &format!("c{i}")),
                OwnerStats {
                    series: [
                        ((COMPUTE, Labels::new()), Value::Count(*ns)),
                        (
                            (IOCTL, Labels::from([("cmd", "other".into())])),
                            Value::Hist(h),
                        ),
                    ]
                    .into_iter()
                    .collect(),
                    ..OwnerStats::default()
                },
            );
        }
        s.owners.insert(
            Owner::Pod {
                uid: "a".into(),
                container_id: None,
            },
            OwnerStats {
                series: [(
                    (PCIE, Labels::from([("direction", "h2d".into())])),
                    Value::Count(pcie),
                )]
                .into_iter()
                .collect(),
                ..OwnerStats::default()
            },
        );
        // a non-GPU owner is no cost line
        s.owners
            .insert(Owner::Slice("system.slice".into()), OwnerStats::default());
        s.gauges.insert(
            VRAM,
            vec![GaugeValue {
                owner: pod("a", "c0"),
                labels: no_labels(),
                value: vram,
            }],
        );
        s.gauges.insert(
            DUTY,
            vec![
                GaugeValue {
                    owner: pod("a", "c0"),
                    labels: no_labels(),
                    value: 0.2,
                },
                GaugeValue {
                    owner: pod("a", "c1"),
                    labels: no_labels(),
                    value: 0.4,
                },
            ],
        );
        crate::collect::index_gpu_owners(&mut s);
        s
    }

    fn config() -> FinopsConfig {
        Settings {
            pod_labels: vec!["tenant=example.com/team".into()],
            hourly_rate: Some(3.6),
            capacity: CapacityInput {
                memory_bytes: Some(1000),
                link_bytes_per_second: Some(100),
                gpus: None,
            },
            ..Settings::default()
        }
        .validate()
        .unwrap()
    }

    fn value(fams: &[MetricFamily], name: &str) -> Vec<(Vec<(String, String)>, f64)> {
        let f = fams.iter().find(|f| f.name() == name).unwrap();
        f.get_metric()
            .iter()
            .map(|m| {
                let l = m
                    .get_label()
                    .iter()
                    .map(|p| (p.name().to_string(), p.value().to_string()))
                    .collect();
                let v = if f.get_field_type() == MetricType::COUNTER {
                    m.get_counter().get_value()
                } else {
                    m.get_gauge().get_value()
                };
                (l, v)
            })
            .collect()
    }

    #[test]
    fn ticks_book_the_differences_of_the_shared_totals() {
        let pods = PodStore::default();
        let f = FinOps::new(config(), pods.clone());
        let t0 = Instant::now();
        f.book(GpuTotals::of(&shared([1_000_000_000, 0], 100, 500.0)), t0);
        // 2 s later: container 0 +0.5 s, container 1 +0.5 s of driver time, 50 more bytes,
        // 250 bytes of VRAM held
        f.book(
            GpuTotals::of(&shared([1_500_000_000, 500_000_000], 150, 250.0)),
            t0 + Duration::from_secs(2),
        );
        let fams = f.families();
        let cost = value(&fams, COST);
        // node 0.002; compute 1 s / 2 s = 0.5; VRAM 250/1000; PCIe 50/(100 × 2)
        let want = 0.002 * (0.55 * 0.5 + 0.35 * 0.25 + 0.10 * 0.25);
        assert_eq!(cost.len(), 1);
        let (labels, v) = &cost[0];
        assert!((v - want).abs() < 1e-15, "{v} vs {want}");
        assert_eq!(
            labels,
            &[
                ("currency".to_string(), "USD".to_string()),
                ("namespace".to_string(), String::new()),
                ("pod".to_string(), "a".to_string()),
                ("tenant".to_string(), String::new()),
            ]
        );
        let idle = value(&fams, IDLE_COST)[0].1;
        let node = value(&fams, NODE_COST)[0].1;
        assert!((node - 0.002).abs() < 1e-15);
        assert!((idle + v - node).abs() < 1e-15);
        // MPS: a pod with a duty cycle has advice (the default until sustained)
        assert_eq!(
            value(&fams, MPS),
            [(
                vec![
                    ("namespace".to_string(), String::new()),
                    ("pod".to_string(), "a".to_string())
                ],
                100.0
            )]
        );
        // no pods known from the API: no info rows
        assert!(value(&fams, POD_INFO).is_empty());
    }

    #[test]
    fn totals_sum_containers_and_take_the_busiest_duty() {
        let t = GpuTotals::of(&shared([3, 4], 9, 7.0)).pods;
        assert_eq!(t.len(), 1);
        let a = &t["a"];
        assert_eq!(a.compute_ns, BTreeMap::from([(None, 7)]));
        assert_eq!((a.call_ns, a.pcie_bytes), (14, 9));
        assert_eq!(a.vram_bytes, 7.0);
        // both containers' duty is on the one GPU the source does not name: summed
        assert!((a.duty.unwrap() - 0.6).abs() < 1e-12, "{:?}", a.duty);
    }

    #[test]
    fn nvml_memory_and_per_gpu_compute_when_the_node_has_nvml() {
        let mut s = shared([0, 0], 0, 7.0);
        let gpu = |i: &str| Labels::from([("gpu", i.to_string())]);
        let o = s.owners.get_mut(&pod("a", "c1")).unwrap();
        o.series.clear();
        o.series.insert((COMPUTE, gpu("0")), Value::Count(5));
        o.series.insert((COMPUTE, gpu("1")), Value::Count(6));
        let duty = |c: &str, g: &str, value| GaugeValue {
            owner: pod("a", c),
            labels: gpu(g).into(),
            value,
        };
        s.gauges.insert(
            DUTY,
            vec![
                duty("c0", "0", 0.3),
                duty("c1", "0", 0.4),
                duty("c1", "1", 0.5),
            ],
        );
        let mem = |c: &str, value| GaugeValue {
            owner: pod("a", c),
            labels: no_labels(),
            value,
        };
        s.gauges
            .insert(NVML_MEMORY, vec![mem("c0", 1000.0), mem("c1", 24.0)]);
        let a = &GpuTotals::of(&s).pods["a"];
        assert_eq!(
            a.compute_ns,
            BTreeMap::from([(None, 0), (Some(0), 5), (Some(1), 6)])
        );
        assert_eq!(a.vram_bytes, 1024.0, "NVML's memory, not the uprobes' 7");
        // GPU 0: 0.3 + 0.4 of the pod's containers; GPU 1: 0.5
        assert!((a.duty.unwrap() - 0.7).abs() < 1e-12, "{:?}", a.duty);
    }

    #[test]
    fn without_a_rate_there_is_no_cost_series() {
        let f = FinOps::new(Settings::default().validate().unwrap(), PodStore::default());
        f.book(GpuTotals::default(), Instant::now());
        let names: Vec<String> = f.families().iter().map(|f| f.name().to_string()).collect();
        assert_eq!(names, [MPS]);
    }

    /// A rate and no capacity: no cost series, the capacity series says why; NVML's capacity
    /// reported at a later tick starts the cost, and a change is divided by from then on.
    #[test]
    fn the_cost_waits_for_a_capacity_and_follows_it() {
        let cfg = Settings {
            hourly_rate: Some(3.6),
            weights: "0,1,0".into(),
            ..Settings::default()
        }
        .validate()
        .unwrap();
        let f = FinOps::new(cfg, PodStore::default());
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let totals = |nvml: NvmlCapacity| GpuTotals {
            pods: GpuTotals::of(&shared([0, 0], 0, 500.0)).pods,
            nvml,
        };
        f.book(totals(NvmlCapacity::NotLoaded("x".into())), at(0));
        f.book(totals(NvmlCapacity::NotLoaded("x".into())), at(1));
        let fams = f.families();
        assert!(fams
            .iter()
            .all(|f| f.name() != COST && f.name() != NODE_COST));
        let cap = value(&fams, CAPACITY);
        assert_eq!(cap.len(), 3);
        for (l, v) in &cap {
            assert_eq!(*v, 0.0);
            assert!(
                l.contains(&("reason".into(), "nvml_not_loaded".into())),
                "{l:?}"
            );
        }
        let nvml = |memory: u64| NvmlCapacity::Gpus {
            memory: vec![memory as f64],
            link: vec![10.0],
        };
        // VRAM only: 500 of 1000 bytes for 1 s at 0.001 a second, then of 2000
        f.book(totals(nvml(1000)), at(2));
        f.book(totals(nvml(2000)), at(3));
        let fams = f.families();
        let cost = value(&fams, COST)[0].1;
        let want = 0.001 * 0.5 + 0.001 * 0.25;
        assert!((cost - want).abs() < 1e-15, "{cost} vs {want}");
        let memory = value(&fams, CAPACITY)
            .into_iter()
            .find(|(l, _)| l.contains(&("resource".into(), "memory_bytes".into())))
            .unwrap();
        assert_eq!(memory.1, 2000.0);
        assert!(memory.0.contains(&("reason".into(), String::new())));
    }
}
