//! Prometheus exposition: a custom collector that turns the per-owner
//! accumulators into the contract's series at scrape time, plus the HTTP server
//! for /metrics and /healthz.
//!
//! Pre-bucketed kernel histograms can't go through the `prometheus` crate's own
//! Histogram type, so the collector builds the metric families directly.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus::core::{Collector as PromCollector, Desc};
use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, Registry, TextEncoder};

use crate::collect::{Owner, OwnerStats, Shared};
use crate::dst::{DstTable, MAX_DST};
use crate::pods::{PodMeta, PodStore};
use crate::probes::hist::{upper_bound_us, Hist, BUCKETS};
use crate::probes::ProbeStatus;

pub const SCHED: &str = "ebpf_sched_latency_microseconds";
pub const RTT: &str = "ebpf_tcp_rtt_microseconds";
pub const RETRANS: &str = "ebpf_tcp_retransmissions_total";
pub const TC_BYTES: &str = "ebpf_tc_bytes_total";
pub const TC_DROPS: &str = "ebpf_tc_dropped_packets_total";
pub const BW_LIMIT: &str = "gpufeed_bandwidth_limit_bits_per_second";

/// Labels of one exported series, in a fixed order.
type Labels = BTreeMap<&'static str, String>;

/// Pod metadata looked up during one scrape, by pod UID.
type Metas = HashMap<String, Option<PodMeta>>;

pub struct AgentCollector {
    shared: Arc<Mutex<Shared>>,
    pods: PodStore,
    dst: DstTable,
    probes: Vec<ProbeStatus>,
    last_scrape_seconds: Mutex<f64>,
    descs: Vec<Desc>,
}

impl AgentCollector {
    pub fn new(
        shared: Arc<Mutex<Shared>>,
        pods: PodStore,
        dst: DstTable,
        probes: Vec<ProbeStatus>,
    ) -> Self {
        let descs = vec![
            Desc::new(
                SCHED.into(),
                "Run-queue wait of tasks being scheduled in, per pod/container".into(),
                vec![],
                HashMap::new(),
            ),
            Desc::new(
                RTT.into(),
                "TCP smoothed RTT sampled per received segment, by socket owner".into(),
                vec![],
                HashMap::new(),
            ),
            Desc::new(
                RETRANS.into(),
                "TCP segments retransmitted, by socket owner".into(),
                vec![],
                HashMap::new(),
            ),
        ]
        .into_iter()
        .filter_map(Result::ok)
        .collect();
        AgentCollector {
            shared,
            pods,
            dst,
            probes,
            last_scrape_seconds: Mutex::new(0.0),
            descs,
        }
    }

    /// Label set of an owner: pods by namespace/name/container when the API
    /// knows them, by UID otherwise; everything else by its top-level slice.
    /// `metas` caches the pod store's answers for one scrape: a pod is looked
    /// up (and its metadata cloned) once, not once per container and series.
    fn owner_labels(&self, owner: &Owner, metas: &mut Metas) -> Labels {
        let mut l = Labels::default();
        match owner {
            Owner::Pod { uid, container_id } => match metas
                .entry(uid.clone())
                .or_insert_with(|| self.pods.get(uid))
            {
                Some(meta) => {
                    l.insert("namespace", meta.namespace.clone());
                    l.insert("pod", meta.name.clone());
                    let c = container_id
                        .as_ref()
                        .and_then(|c| meta.containers.get(c))
                        .cloned()
                        .unwrap_or_default();
                    l.insert("container", c);
                }
                None => {
                    l.insert("namespace", String::new());
                    l.insert("pod", uid.clone());
                    l.insert(
                        "container",
                        container_id
                            .as_deref()
                            .map(|c| c[..c.len().min(12)].to_string())
                            .unwrap_or_default(),
                    );
                }
            },
            Owner::Slice(s) => {
                l.insert("namespace", String::new());
                l.insert("pod", String::new());
                l.insert("container", String::new());
                l.insert(
                    "slice",
                    if s.is_empty() {
                        "/".to_string()
                    } else {
                        s.clone()
                    },
                );
            }
            Owner::Unattributed => {
                l.insert("namespace", String::new());
                l.insert("pod", String::new());
                l.insert("container", String::new());
            }
        }
        l
    }

    /// Labels of tc and bandwidth series: interfaces belong to pods, not containers.
    fn pod_level_labels(&self, owner: &Owner, metas: &mut Metas) -> Labels {
        let mut l = self.owner_labels(owner, metas);
        l.remove("container");
        l
    }

    fn families(&self) -> Vec<MetricFamily> {
        let started = Instant::now();
        // Several owners can map to one label set (a pod's sandbox and its pod
        // cgroup both have container=""): merge them so no series repeats.
        let mut sched: BTreeMap<Labels, Hist> = BTreeMap::default();
        let mut rtt: BTreeMap<Labels, Hist> = BTreeMap::default();
        let mut retrans: BTreeMap<Labels, u64> = BTreeMap::default();
        let mut tc_bytes: BTreeMap<Labels, u64> = BTreeMap::default();
        let mut tc_drops: BTreeMap<Labels, u64> = BTreeMap::default();
        let mut limits: Vec<Metric> = Vec::new();
        let mut metas = Metas::new();
        let stats;
        {
            let shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
            stats = shared.stats.clone();
            for (owner, o) in &shared.owners {
                let labels = self.owner_labels(owner, &mut metas);
                self.add_owner(&labels, o, &mut sched, &mut rtt, &mut retrans);
                if !o.tc_bytes.is_empty() || !o.tc_drops.is_empty() {
                    let base = self.pod_level_labels(owner, &mut metas);
                    for (dir, n) in &o.tc_bytes {
                        let mut l = base.clone();
                        l.insert("direction", dir.as_str().to_string());
                        *tc_bytes.entry(l).or_default() += n;
                    }
                    for ((dir, reason), n) in &o.tc_drops {
                        let mut l = base.clone();
                        l.insert(
                            "direction",
                            dir.map(|d| d.as_str()).unwrap_or("").to_string(),
                        );
                        l.insert("reason", reason.clone());
                        *tc_drops.entry(l).or_default() += n;
                    }
                }
            }
            for b in &shared.bandwidth {
                let pod = Owner::Pod {
                    uid: b.uid.clone(),
                    container_id: None,
                };
                let mut l = self.pod_level_labels(&pod, &mut metas);
                l.insert("direction", b.direction.as_str().to_string());
                limits.push(gauge(&l, b.bits_per_second));
            }
        }
        let mut out = vec![
            histogram_family(
                SCHED,
                "Run-queue wait of tasks being scheduled in (switched-in task's cgroup)",
                sched,
            ),
            histogram_family(
                RTT,
                "TCP smoothed RTT per received segment, attributed to the socket's owner",
                rtt,
            ),
            family(
                RETRANS,
                "TCP segments retransmitted (as counted by TcpRetransSegs), by socket owner",
                MetricType::COUNTER,
                retrans
                    .into_iter()
                    .map(|(l, v)| counter(&l, v as f64))
                    .collect(),
            ),
        ];
        out.push(family(
            TC_BYTES,
            "Bytes passing the tc layer of the pod's host-side interface; direction from the pod's point of view",
            MetricType::COUNTER,
            tc_bytes.into_iter().map(|(l, v)| counter(&l, v as f64)).collect(),
        ));
        out.push(family(
            TC_DROPS,
            "Packets dropped in the tc/qdisc layer, by the kernel's drop reason",
            MetricType::COUNTER,
            tc_drops
                .into_iter()
                .map(|(l, v)| counter(&l, v as f64))
                .collect(),
        ));
        out.push(family(
            BW_LIMIT,
            "Bandwidth cap from the pod's kubernetes.io/{egress,ingress}-bandwidth annotation",
            MetricType::GAUGE,
            limits,
        ));
        let g = |name: &str, help: &str, v: f64| {
            family(
                name,
                help,
                MetricType::GAUGE,
                vec![gauge(&Labels::new(), v)],
            )
        };
        out.push(family(
            "gpufeed_probe_up",
            "1 if the probe is loaded and attached, 0 if the kernel lacks what it needs",
            MetricType::GAUGE,
            self.probes
                .iter()
                .map(|p| {
                    gauge(
                        &Labels::from([("probe", p.name.to_string())]),
                        if p.up { 1.0 } else { 0.0 },
                    )
                })
                .collect(),
        ));
        out.push(family(
            "gpufeed_map_entries",
            "Cgroups holding an entry in each per-cgroup BPF storage map",
            MetricType::GAUGE,
            vec![
                gauge(
                    &Labels::from([("map", "sched_hist".to_string())]),
                    stats.sched_entries as f64,
                ),
                gauge(
                    &Labels::from([("map", "tcp_stats".to_string())]),
                    stats.tcp_entries as f64,
                ),
            ],
        ));
        out.push(family(
            "gpufeed_owners",
            "Owners (pods/containers, slices) with series",
            MetricType::GAUGE,
            vec![
                gauge(
                    &Labels::from([("kind", "pod".to_string())]),
                    stats.owners_pod as f64,
                ),
                gauge(
                    &Labels::from([("kind", "slice".to_string())]),
                    stats.owners_slice as f64,
                ),
            ],
        ));
        out.push(g(
            "gpufeed_tc_interfaces",
            "Pod interfaces the tc programs are attached to",
            stats.tc_interfaces as f64,
        ));
        out.push(family(
            "gpufeed_tc_drop_overflow_total",
            "tc/qdisc drops not recorded because the drop map was full",
            MetricType::COUNTER,
            vec![counter(&Labels::new(), stats.tc_drop_overflow as f64)],
        ));
        out.push(g(
            "gpufeed_cgroups",
            "Live cgroups in the cgroup v2 hierarchy",
            stats.cgroups as f64,
        ));
        out.push(g(
            "gpufeed_pods_known",
            "Pods known from the Kubernetes API",
            self.pods.len() as f64,
        ));
        out.push(g(
            "gpufeed_kube_synced",
            "1 once the pod list from the Kubernetes API was received",
            if self.pods.synced() { 1.0 } else { 0.0 },
        ));
        out.push(g(
            "gpufeed_tick_duration_seconds",
            "Time the last map-reading tick took",
            stats.last_tick_seconds,
        ));
        out.push(family(
            "gpufeed_ticks_total",
            "Map-reading ticks done",
            MetricType::COUNTER,
            vec![counter(&Labels::new(), stats.ticks as f64)],
        ));
        out.push(family(
            "gpufeed_sched_negative_deltas_total",
            "Run-queue waits dropped because the clock went backwards across CPUs",
            MetricType::COUNTER,
            vec![counter(&Labels::new(), stats.sched_negative_deltas as f64)],
        ));
        out.push(family(
            "gpufeed_bpf_storage_alloc_failures_total",
            "Events lost because cgroup storage was unavailable (allocation failed or per-CPU lock busy)",
            MetricType::COUNTER,
            vec![
                counter(&Labels::from([("probe", "sched_latency".to_string())]), stats.sched_alloc_failures as f64),
                counter(&Labels::from([("probe", "tcp".to_string())]), stats.tcp_lost as f64),
            ],
        ));
        out.push(family(
            "gpufeed_build_info",
            "Build information",
            MetricType::GAUGE,
            vec![gauge(
                &Labels::from([("version", env!("CARGO_PKG_VERSION").to_string())]),
                1.0,
            )],
        ));
        let prev = *self
            .last_scrape_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        out.push(g(
            "gpufeed_scrape_duration_seconds",
            "Time the previous scrape of this collector took",
            prev,
        ));
        *self
            .last_scrape_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = started.elapsed().as_secs_f64();
        out
    }

    fn add_owner(
        &self,
        labels: &Labels,
        o: &OwnerStats,
        sched: &mut BTreeMap<Labels, Hist>,
        rtt: &mut BTreeMap<Labels, Hist>,
        retrans: &mut BTreeMap<Labels, u64>,
    ) {
        if !o.sched.is_empty() {
            sched.entry(labels.clone()).or_default().add(&o.sched);
        }
        for i in 0..MAX_DST {
            // A socket owner with traffic to a destination gets both series,
            // so a clean pod reads 0 retransmits rather than nothing.
            if o.rtt[i].is_empty() && o.retrans_segs[i] == 0 {
                continue;
            }
            let mut l = labels.clone();
            l.insert("dst", self.dst.name(i).to_string());
            if !o.rtt[i].is_empty() {
                rtt.entry(l.clone()).or_default().add(&o.rtt[i]);
            }
            *retrans.entry(l).or_default() += o.retrans_segs[i];
        }
    }
}

impl PromCollector for AgentCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.families()
    }
}

fn label_pairs(l: &Labels) -> Vec<LabelPair> {
    l.iter()
        .map(|(k, v)| {
            let mut p = LabelPair::default();
            p.set_name(k.to_string());
            p.set_value(v.clone());
            p
        })
        .collect()
}

fn family(name: &str, help: &str, t: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_string());
    f.set_help(help.to_string());
    f.set_field_type(t);
    f.set_metric(metrics);
    f
}

fn gauge(l: &Labels, v: f64) -> Metric {
    let mut g = Gauge::default();
    g.set_value(v);
    let mut m = Metric::from_gauge(g);
    m.set_label(label_pairs(l));
    m
}

fn counter(l: &Labels, v: f64) -> Metric {
    let mut c = Counter::default();
    c.set_value(v);
    let mut m = Metric::from_label(label_pairs(l));
    m.set_counter(c);
    m
}

fn histogram_family(name: &str, help: &str, series: BTreeMap<Labels, Hist>) -> MetricFamily {
    let metrics = series
        .into_iter()
        .map(|(l, h)| {
            let cum = h.cumulative();
            let buckets = (0..BUCKETS)
                .map(|i| {
                    let mut b = Bucket::default();
                    b.set_upper_bound(upper_bound_us(i));
                    b.set_cumulative_count(cum[i]);
                    b
                })
                .collect();
            let mut ph = Histogram::default();
            ph.set_bucket(buckets);
            ph.set_sample_count(h.count);
            ph.set_sample_sum(h.sum_ns as f64 / 1000.0);
            let mut m = Metric::from_label(label_pairs(&l));
            m.set_histogram(ph);
            m
        })
        .collect();
    family(name, help, MetricType::HISTOGRAM, metrics)
}

/// Encodes everything registered in the text format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::default();
    if let Err(e) = TextEncoder::new().encode(&registry.gather(), &mut buf) {
        tracing::warn!("encoding metrics failed: {e}");
    }
    String::from_utf8(buf).unwrap_or_default()
}

/// Serves /metrics and /healthz until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Registry,
    healthy: Arc<dyn Fn() -> bool + Send + Sync>,
) -> std::io::Result<()> {
    use axum::http::{header, StatusCode};
    use axum::routing::get;
    let reg = registry.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let reg = reg.clone();
                async move {
                    let body = tokio::task::spawn_blocking(move || render(&reg))
                        .await
                        .unwrap_or_default();
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        body,
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let ok = healthy();
                async move {
                    if ok {
                        (StatusCode::OK, "ok\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "stalled\n")
                    }
                }
            }),
        );
    axum::serve(listener, app).await
}

pub fn bind_error(addr: SocketAddr, e: std::io::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "cannot listen on {addr} for /metrics: {e} (choose another with --metrics-listen)"
    )
}
