//! Prometheus exposition: the per-owner accumulators turned into the contract's series at
//! scrape time, plus the HTTP server for /metrics and /healthz.
//!
//! The per-owner families are written straight into the text format ([`series_text`]): at
//! 1,000 pods a scrape holds some 200,000 lines, and building a protobuf `Metric` per series
//! for the prometheus crate's encoder, which formats every histogram bucket with two
//! allocations, took longer than the 20 ms a scrape may take. Each series' label text is
//! cached per owner until the owner's labels change (the pod store names a pod, or renames a
//! container). The agent's own few series, and everything registered in the `Registry` (the
//! hub, the correlation series), go through the prometheus crate as before.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use gpufeed_shared::http::HttpLimits;
use prometheus::proto::{MetricFamily, MetricType};
use prometheus::{Encoder, Registry, TextEncoder};

use crate::collect::{Owner, Store};
pub(crate) use crate::families::{counter, family, gauge};
use crate::finops::PodLabels;
use crate::pods::{PodMeta, PodStore};
use crate::probes::unit::{FamilySpec, Kind, Labels};
use crate::probes::ProbeStatus;

mod series_text;

use series_text::LabelCache;

use crate::join::FeedStallShare;

/// Pod metadata looked up during one scrape, by pod UID.
type Metas = HashMap<Arc<str>, Option<PodMeta>>;

pub struct AgentCollector {
    shared: Arc<Mutex<Store>>,
    pods: PodStore,
    families: Vec<&'static FamilySpec>,
    probes: Vec<ProbeStatus>,
    last_scrape_seconds: Mutex<f64>,
    cache: Mutex<LabelCache>,
    /// Pod labels (--pod-label) the GPU series carry.
    pod_labels: PodLabels,
    /// The join's feed stall by cause per pod.
    feed_stall: FeedStallShare,
}

impl AgentCollector {
    /// `families`: what the loaded units export; `probes`: their statuses.
    pub fn new(
        shared: Arc<Mutex<Store>>,
        pods: PodStore,
        families: Vec<&'static FamilySpec>,
        probes: Vec<ProbeStatus>,
    ) -> Self {
        AgentCollector {
            shared,
            pods,
            families,
            probes,
            last_scrape_seconds: Mutex::new(0.0),
            cache: Mutex::new(LabelCache::default()),
            pod_labels: PodLabels::default(),
            feed_stall: FeedStallShare::default(),
        }
    }

    /// Writes the feed stall by cause from what the join publishes in `share`.
    pub fn with_feed_stall(mut self, share: FeedStallShare) -> Self {
        self.feed_stall = share;
        self
    }

    /// Puts the configured pod labels on the GPU series.
    pub fn with_pod_labels(mut self, pod_labels: PodLabels) -> Self {
        self.pod_labels = pod_labels;
        self
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
                        .as_deref()
                        .and_then(|c| meta.containers.get(c))
                        .cloned()
                        .unwrap_or_default();
                    l.insert("container", c);
                }
                None => {
                    l.insert("namespace", String::new());
                    l.insert("pod", uid.to_string());
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
                        s.to_string()
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

    /// Appends the whole exposition of the agent's series to `out`.
    pub fn write_text(&self, out: &mut String) {
        let started = Instant::now();
        let mut metas = Metas::new();
        let stats;
        {
            let shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
            stats = shared.stats.clone();
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            let feed = self.feed_stall.snapshot();
            cache.write(out, &shared, &self.families, &feed, |owner| {
                let labels = self.owner_labels(owner, &mut metas);
                // the configured pod labels, for the GPU families only
                let mut gpu = Labels::new();
                if let Owner::Pod { uid, .. } = owner {
                    let meta = metas.get(uid).and_then(Option::as_ref);
                    self.pod_labels.extend(meta, &mut gpu);
                }
                (labels, gpu)
            });
        }
        let fams = self.self_families(&stats);
        if let Err(e) = TextEncoder::new().encode_utf8(&fams, out) {
            tracing::warn!("encoding metrics failed: {e}");
        }
        *self
            .last_scrape_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = started.elapsed().as_secs_f64();
    }

    /// The agent's own series: probes, maps, owners, ticks, the previous scrape.
    fn self_families(&self, stats: &crate::collect::SelfStats) -> Vec<MetricFamily> {
        let mut out = Vec::new();
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
            "gpufeed_probe_info",
            "How each probe runs on this kernel (hook, storage, reads), or why it is down (reason)",
            MetricType::GAUGE,
            self.probes
                .iter()
                .map(|p| {
                    let mut labels = Labels::from([("probe", p.name.to_string())]);
                    for (k, v) in &p.how {
                        if matches!(*k, "hook" | "storage" | "reads") {
                            labels.insert(k, v.clone());
                        }
                    }
                    if let Some(r) = &p.reason {
                        labels.insert("reason", r.clone());
                    }
                    gauge(&labels, 1.0)
                })
                .collect(),
        ));
        let maps = || stats.units.iter().flat_map(|u| u.maps.iter());
        out.push(family(
            "gpufeed_map_entries",
            "Entries in each BPF map the agent reads (per-cgroup storage maps: cgroups holding an entry)",
            MetricType::GAUGE,
            maps()
                .map(|m| gauge(&Labels::from([("map", m.map.to_string())]), m.entries as f64))
                .collect(),
        ));
        out.push(family(
            "gpufeed_map_capacity",
            "max_entries of each BPF map that has one, as set at load",
            MetricType::GAUGE,
            maps()
                .filter_map(|m| {
                    m.capacity
                        .map(|c| gauge(&Labels::from([("map", m.map.to_string())]), c as f64))
                })
                .collect(),
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
        for s in stats.units.iter().flat_map(|u| u.series.iter()) {
            let (t, m) = match s.kind {
                Kind::Counter | Kind::SecondsCounter => {
                    (MetricType::COUNTER, counter(&Labels::new(), s.value))
                }
                _ => (MetricType::GAUGE, gauge(&Labels::new(), s.value)),
            };
            out.push(family(s.name, s.help, t, vec![m]));
        }
        for f in stats.units.iter().flat_map(|u| u.node.iter()) {
            if f.kind == crate::probes::unit::Kind::Counter {
                let samples = f.samples.iter().map(|(l, v)| counter(l, *v)).collect();
                out.push(family(f.name, f.help, MetricType::COUNTER, samples));
            } else {
                let samples = f.samples.iter().map(|(l, v)| gauge(l, *v)).collect();
                out.push(family(f.name, f.help, MetricType::GAUGE, samples));
            }
        }
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
            "gpufeed_bpf_storage_alloc_failures_total",
            "Events lost because cgroup storage was unavailable (allocation failed or per-CPU lock busy)",
            MetricType::COUNTER,
            stats
                .units
                .iter()
                .filter_map(|u| u.storage_failures)
                .map(|(probe, n)| counter(&Labels::from([("probe", probe.to_string())]), n as f64))
                .collect(),
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
        // empty families are left out, as the registry does
        out.retain(|f| !f.get_metric().is_empty());
        out
    }
}

/// What /metrics serves: the agent's series, written directly, and a registry's.
#[derive(Clone)]
pub struct Exposition {
    registry: Registry,
    agent: Option<Arc<AgentCollector>>,
    /// Size of the last exposition: the next one starts with that much room (megabytes at
    /// 1,000 pods, grown by copying otherwise).
    last_len: Arc<std::sync::atomic::AtomicUsize>,
}

impl Exposition {
    pub fn new(registry: Registry, agent: Arc<AgentCollector>) -> Self {
        Exposition {
            registry,
            agent: Some(agent),
            last_len: Arc::default(),
        }
    }

    /// The text exposition: the agent's families, then the registry's.
    pub fn render(&self) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let mut out = String::with_capacity(self.last_len.load(Relaxed) + 4096);
        if let Some(a) = &self.agent {
            a.write_text(&mut out);
        }
        if let Err(e) = TextEncoder::new().encode_utf8(&self.registry.gather(), &mut out) {
            tracing::warn!("encoding metrics failed: {e}");
        }
        self.last_len.store(out.len(), Relaxed);
        out
    }
}

impl From<Registry> for Exposition {
    fn from(registry: Registry) -> Self {
        Exposition {
            registry,
            agent: None,
            last_len: Arc::default(),
        }
    }
}

/// Encodes everything registered in the text format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::default();
    if let Err(e) = TextEncoder::new().encode(&registry.gather(), &mut buf) {
        tracing::warn!("encoding metrics failed: {e}");
    }
    String::from_utf8(buf).unwrap_or_default()
}

/// `/healthz`: 200 while the map-reading tick keeps up, 503 otherwise.
pub fn health_router(healthy: Arc<dyn Fn() -> bool + Send + Sync>) -> axum::Router {
    use axum::http::StatusCode;
    axum::Router::new().route(
        "/healthz",
        axum::routing::get(move || {
            let ok = healthy();
            async move {
                if ok {
                    (StatusCode::OK, "ok\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "stalled\n")
                }
            }
        }),
    )
}

/// Serves /metrics and /healthz (and `more`) until the process ends, within the HTTP limits
/// ([`gpufeed_shared::http`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: impl Into<Exposition>,
    healthy: Arc<dyn Fn() -> bool + Send + Sync>,
    more: axum::Router,
) -> std::io::Result<()> {
    use axum::http::header;
    use axum::routing::get;
    let metrics: Exposition = metrics.into();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move {
                    let body = tokio::task::spawn_blocking(move || m.render())
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
        .merge(health_router(healthy))
        .merge(more);
    gpufeed_shared::http::serve_bounded(listener, app, HttpLimits::default(), "metrics").await
}

/// Serves the kubelet's probes (`/healthz`, `/readyz` in `probes`) on a listener of their own
/// (`--health-listen`, loopback by default: the kubelet of a hostNetwork pod reaches it, pods
/// on the pod network do not), with its own limits: a flood of the metrics port cannot make
/// the kubelet restart the agent.
pub async fn serve_health(
    listener: tokio::net::TcpListener,
    probes: axum::Router,
) -> std::io::Result<()> {
    gpufeed_shared::http::serve_bounded(listener, probes, HEALTH_LIMITS, "health").await
}

/// The probe listener's caps: the kubelet opens one connection per probe.
const HEALTH_LIMITS: HttpLimits = HttpLimits {
    max_connections: 64,
    max_per_address: 32,
};

pub fn bind_error(addr: SocketAddr, e: std::io::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "cannot listen on {addr} for /metrics: {e} (choose another with --metrics-listen)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::OwnerStats;
    use crate::families::label_pairs;
    use crate::probes::hist::{upper_bound_us, Hist, BUCKETS};
    use crate::probes::unit::{GaugeValue, Scope, Value};
    use prometheus::proto::{Bucket, Histogram, Metric};
    use std::collections::BTreeMap;

    const UID: &str = "1b2c3d4e-5f60-4718-9a2b-3c4d5e6f7a8b";
    const CID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    static FAMILIES: [FamilySpec; 4] = [
        FamilySpec {
            name: "test_latency_microseconds",
            help: "h",
            kind: Kind::Histogram,
            scope: Scope::Container,
            pod_labels: false,
        },
        FamilySpec {
            name: "test_bytes_total",
            help: "b",
            kind: Kind::Counter,
            scope: Scope::Pod,
            pod_labels: false,
        },
        FamilySpec {
            name: "test_limit",
            help: "g",
            kind: Kind::Gauge,
            scope: Scope::Pod,
            pod_labels: false,
        },
        FamilySpec {
            name: "test_busy_seconds_total",
            help: "s",
            kind: Kind::SecondsCounter,
            scope: Scope::Container,
            pod_labels: false,
        },
    ];

    /// (labels in name order, value) of the samples of `name` in a text exposition.
    fn samples(text: &str, name: &str) -> Vec<(Vec<(String, String)>, f64)> {
        gpufeed_testkit::prom::parse(text)
            .into_iter()
            .filter(|s| s.name == name)
            .map(|s| (s.labels.into_iter().collect(), s.value))
            .collect()
    }

    fn pod(container: Option<&str>) -> Owner {
        Owner::Pod {
            uid: UID.into(),
            container_id: container.map(Into::into),
        }
    }

    fn owner_with(series: &[((&'static str, Labels), Value)]) -> OwnerStats {
        OwnerStats {
            series: series.iter().cloned().collect(),
            ..OwnerStats::default()
        }
    }

    fn hist(buckets: &[(usize, u64)], sum_ns: u64) -> Hist {
        let mut h = Hist::default();
        for (i, n) in buckets {
            h.buckets[*i] = *n;
            h.count += n;
        }
        h.sum_ns = sum_ns;
        h
    }

    fn dir(d: &str) -> Labels {
        Labels::from([("direction", d.to_string())])
    }

    /// A pod with two owners (its container and its pod cgroup), a slice, and a gauge.
    fn shared() -> Store {
        let mut shared = Store::default();
        shared.owners.insert(
            pod(Some(CID)),
            owner_with(&[
                (
                    ("test_latency_microseconds", Labels::new()),
                    Value::Hist(hist(&[(3, 2)], 10_000)),
                ),
                (("test_bytes_total", dir("egress")), Value::Count(100)),
                (
                    ("test_busy_seconds_total", Labels::new()),
                    Value::Count(1_500_000_000),
                ),
            ]),
        );
        shared.owners.insert(
            pod(None),
            owner_with(&[
                // no samples yet: no series
                (
                    ("test_latency_microseconds", Labels::new()),
                    Value::Hist(Hist::default()),
                ),
                (("test_bytes_total", dir("egress")), Value::Count(20)),
                (("test_bytes_total", dir("ingress")), Value::Count(0)),
                // a family no loaded unit declares is not rendered
                (("test_unknown_total", Labels::new()), Value::Count(1)),
            ]),
        );
        shared.owners.insert(
            Owner::Slice("system.slice".into()),
            owner_with(&[(
                ("test_latency_microseconds", Labels::new()),
                Value::Hist(hist(&[(0, 1), (24, 3), (25, 1)], 7_777_777)),
            )]),
        );
        shared.gauges.insert(
            "test_limit",
            vec![GaugeValue {
                owner: pod(None),
                labels: dir("egress").into(),
                value: 1e9,
            }],
        );
        shared
    }

    fn collector(shared: Store, pods: PodStore) -> AgentCollector {
        AgentCollector::new(
            Arc::new(Mutex::new(shared)),
            pods,
            FAMILIES.iter().collect(),
            vec![
                ProbeStatus::up("test"),
                ProbeStatus::down("other", "no hook"),
            ],
        )
    }

    fn text(c: &AgentCollector) -> String {
        let mut out = String::new();
        c.write_text(&mut out);
        out
    }

    /// Labels as [`samples`] gives them: in name order.
    fn strings(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut v: Vec<_> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn families_render_at_their_scope_and_merge_owners() {
        let c = collector(shared(), PodStore::default());
        let out = text(&c);
        assert!(!out.contains("test_unknown_total"));
        let container = |c: &str| {
            strings(&[
                ("container", c),
                ("namespace", ""),
                ("pod", UID),
                ("le", "+Inf"),
            ])
        };
        let inf: Vec<_> = samples(&out, "test_latency_microseconds_bucket")
            .into_iter()
            .filter(|(l, _)| l.iter().any(|(k, v)| k == "le" && v == "+Inf"))
            .collect();
        assert_eq!(inf.len(), 2, "the pod's container and the slice: {inf:?}");
        assert!(
            inf.contains(&(container(&CID[..12]), 2.0)),
            "the empty histogram of the pod cgroup has no series: {inf:?}"
        );
        let sums: Vec<f64> = samples(&out, "test_latency_microseconds_sum")
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        assert_eq!(sums, [7777.777, 10.0], "µs: the slice, then the pod");
        // pod scope: no container label, both owners merged into one series
        let l = |d: &str| strings(&[("direction", d), ("namespace", ""), ("pod", UID)]);
        assert_eq!(
            samples(&out, "test_bytes_total"),
            [(l("egress"), 120.0), (l("ingress"), 0.0)]
        );
        assert_eq!(samples(&out, "test_limit"), [(l("egress"), 1e9)]);
        assert_eq!(samples(&out, "test_busy_seconds_total")[0].1, 1.5);
        assert_eq!(
            samples(&out, "gpufeed_probe_up"),
            [
                (strings(&[("probe", "test")]), 1.0),
                (strings(&[("probe", "other")]), 0.0)
            ]
        );
        // every family once
        let types: Vec<&str> = out.lines().filter(|l| l.starts_with("# TYPE")).collect();
        let mut unique = types.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(types.len(), unique.len(), "{types:?}");
    }

    /// What the prometheus crate's encoder writes for the same series, built the way the
    /// registry would be handed them.
    fn encoder_text(shared: &Store) -> String {
        let mut fams = Vec::new();
        let c = collector(Store::default(), PodStore::default());
        let mut metas = Metas::new();
        for f in FAMILIES.iter() {
            let mut merged: BTreeMap<Labels, Value> = BTreeMap::new();
            for (owner, o) in &shared.owners {
                for ((family, extra), v) in &o.series {
                    if *family != f.name || matches!(v, Value::Hist(h) if h.is_empty()) {
                        continue;
                    }
                    let mut l = c.owner_labels(owner, &mut metas);
                    if f.scope == Scope::Pod {
                        l.remove("container");
                    }
                    l.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
                    match (merged.get_mut(&l), v) {
                        (Some(Value::Hist(a)), Value::Hist(b)) => a.add(b),
                        (Some(Value::Count(a)), Value::Count(b)) => *a += b,
                        _ => {
                            merged.insert(l, v.clone());
                        }
                    }
                }
            }
            let metrics: Vec<Metric> = merged
                .into_iter()
                .map(|(l, v)| match v {
                    Value::Hist(h) => {
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
                    }
                    Value::Count(n) if f.kind == Kind::SecondsCounter => {
                        counter(&l, n as f64 * 1e-9)
                    }
                    Value::Count(n) => counter(&l, n as f64),
                })
                .collect();
            let t = match f.kind {
                Kind::Histogram => MetricType::HISTOGRAM,
                Kind::Gauge => MetricType::GAUGE,
                _ => MetricType::COUNTER,
            };
            let mut metrics = metrics;
            if f.kind == Kind::Gauge {
                for g in shared.gauges.get(f.name).into_iter().flatten() {
                    let mut l = c.owner_labels(&g.owner, &mut metas);
                    l.remove("container");
                    l.extend(g.labels.iter().map(|(k, v)| (*k, v.clone())));
                    metrics.push(gauge(&l, g.value));
                }
            }
            fams.push(family(f.name, f.help, t, metrics));
        }
        // as the registry hands them over: by name, empty ones left out (the series are in
        // label-value order already)
        fams.retain(|f| !f.get_metric().is_empty());
        fams.sort_by(|a, b| a.name().cmp(b.name()));
        TextEncoder::new().encode_to_string(&fams).unwrap()
    }

    #[test]
    fn the_text_is_what_the_prometheus_encoder_writes() {
        let pods = PodStore::default();
        let c = collector(shared(), pods);
        let ours = text(&c);
        let per_owner: String = ours.split("# HELP gpufeed_").next().unwrap().to_string();
        assert_eq!(per_owner, encoder_text(&shared()));
    }

    #[test]
    fn label_text_follows_the_pod_store() {
        let pods = PodStore::default();
        let c = collector(shared(), pods.clone());
        let before = text(&c);
        assert!(before.contains(&format!("pod=\"{UID}\"")));
        // The API names the pod: the cached label text is rebuilt.
        pods.upsert(PodMeta {
            containers: HashMap::from([(CID.to_string(), "server".to_string())]),
            ..PodMeta::named(UID, "ml", "vllm-0")
        });
        let after = text(&c);
        assert!(!after.contains(UID), "{after}");
        let l = |d: &str| strings(&[("direction", d), ("namespace", "ml"), ("pod", "vllm-0")]);
        assert_eq!(
            samples(&after, "test_bytes_total"),
            [(l("egress"), 120.0), (l("ingress"), 0.0)]
        );
        assert!(after.contains(
            "test_latency_microseconds_count{container=\"server\",namespace=\"ml\",pod=\"vllm-0\"} 2"
        ));
        // A gone owner leaves the cache with its series.
        c.shared.lock().unwrap().owners.remove(&pod(Some(CID)));
        let gone = text(&c);
        assert!(!gone.contains("container=\"server\""), "{gone}");
        assert_eq!(c.cache.lock().unwrap().owners(), 2, "pod cgroup and slice");
    }
}
