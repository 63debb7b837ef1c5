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

use crate::collect::{Owner, Shared};
use crate::finops::PodLabels;
use crate::pods::{PodMeta, PodStore};
use crate::probes::hist::{upper_bound_us, Hist, BUCKETS};
use crate::probes::unit::{FamilySpec, Kind, Labels, Scope, Value};
use crate::probes::ProbeStatus;

/// Pod metadata looked up during one scrape, by pod UID.
type Metas = HashMap<String, Option<PodMeta>>;

/// Series of one family, merged by label set.
#[derive(Default)]
struct Merged {
    hists: BTreeMap<Labels, Hist>,
    counts: BTreeMap<Labels, u64>,
    gauges: Vec<Metric>,
}

pub struct AgentCollector {
    shared: Arc<Mutex<Shared>>,
    pods: PodStore,
    families: Vec<&'static FamilySpec>,
    probes: Vec<ProbeStatus>,
    last_scrape_seconds: Mutex<f64>,
    descs: Vec<Desc>,
    /// Pod labels (--pod-label) the GPU series carry.
    pod_labels: PodLabels,
}

impl AgentCollector {
    /// `families`: what the loaded units export; `probes`: their statuses.
    pub fn new(
        shared: Arc<Mutex<Shared>>,
        pods: PodStore,
        families: Vec<&'static FamilySpec>,
        probes: Vec<ProbeStatus>,
    ) -> Self {
        let descs = families
            .iter()
            .filter_map(|f| Desc::new(f.name.into(), f.help.into(), vec![], HashMap::new()).ok())
            .collect();
        AgentCollector {
            shared,
            pods,
            families,
            probes,
            last_scrape_seconds: Mutex::new(0.0),
            descs,
            pod_labels: PodLabels::default(),
        }
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

    /// The full label set of one series: the owner's at the family's scope
    /// (interfaces belong to pods, not containers) plus the unit's.
    fn series_labels(
        &self,
        owner: &Owner,
        (family, scope): (&str, Scope),
        extra: &Labels,
        metas: &mut Metas,
    ) -> Labels {
        let mut l = self.owner_labels(owner, metas);
        if scope == Scope::Pod {
            l.remove("container");
        }
        l.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
        if let Owner::Pod { uid, .. } = owner {
            let meta = metas.get(uid).and_then(Option::as_ref);
            self.pod_labels.extend_gpu(family, meta, &mut l);
        }
        l
    }

    fn families(&self) -> Vec<MetricFamily> {
        let started = Instant::now();
        // Several owners can map to one label set (a pod's sandbox and its pod
        // cgroup both have container=""): merge them so no series repeats.
        let mut merged: HashMap<&'static str, Merged> = HashMap::new();
        let scope_of: HashMap<&'static str, Scope> =
            self.families.iter().map(|f| (f.name, f.scope)).collect();
        let mut metas = Metas::new();
        let stats;
        {
            let shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
            stats = shared.stats.clone();
            for (owner, o) in &shared.owners {
                for ((family, extra), value) in &o.series {
                    let Some(&scope) = scope_of.get(family) else {
                        continue;
                    };
                    let l = self.series_labels(owner, (family, scope), extra, &mut metas);
                    let m = merged.entry(family).or_default();
                    match value {
                        // no samples yet: no series
                        Value::Hist(h) if h.is_empty() => {}
                        Value::Hist(h) => m.hists.entry(l).or_default().add(h),
                        Value::Count(n) => *m.counts.entry(l).or_default() += n,
                    }
                }
            }
            for (family, values) in &shared.gauges {
                let Some(&scope) = scope_of.get(family) else {
                    continue;
                };
                let m = merged.entry(family).or_default();
                for g in values {
                    let l = self.series_labels(&g.owner, (family, scope), &g.labels, &mut metas);
                    m.gauges.push(gauge(&l, g.value));
                }
            }
        }
        let mut out: Vec<MetricFamily> = self
            .families
            .iter()
            .map(|f| {
                let m = merged.remove(f.name).unwrap_or_default();
                match f.kind {
                    Kind::Histogram => histogram_family(f.name, f.help, m.hists),
                    Kind::Counter | Kind::SecondsCounter => {
                        let unit = if f.kind == Kind::SecondsCounter {
                            1e-9
                        } else {
                            1.0
                        };
                        family(
                            f.name,
                            f.help,
                            MetricType::COUNTER,
                            m.counts
                                .into_iter()
                                .map(|(l, v)| counter(&l, v as f64 * unit))
                                .collect(),
                        )
                    }
                    Kind::Gauge => family(f.name, f.help, MetricType::GAUGE, m.gauges),
                }
            })
            .collect();
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
        *self
            .last_scrape_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = started.elapsed().as_secs_f64();
        out
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

pub(crate) fn family(name: &str, help: &str, t: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_string());
    f.set_help(help.to_string());
    f.set_field_type(t);
    f.set_metric(metrics);
    f
}

pub(crate) fn gauge(l: &Labels, v: f64) -> Metric {
    let mut g = Gauge::default();
    g.set_value(v);
    let mut m = Metric::from_gauge(g);
    m.set_label(label_pairs(l));
    m
}

pub(crate) fn counter(l: &Labels, v: f64) -> Metric {
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
    more: axum::Router,
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
        )
        .merge(more);
    serve_bounded(listener, app).await
}

/// How long a client may take to send a request's headers (a connection that stalls in them
/// is closed). Applies to every request of a kept-alive connection, not to a response that
/// takes long (event streams).
const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Open HTTP connections at once, and from one IP address; beyond them a new connection is
/// closed at once. Each costs some 10 KiB of buffers, so the caps bound the server's memory.
const MAX_HTTP_CONNECTIONS: usize = 512;
const MAX_HTTP_PER_ADDRESS: usize = 64;

/// Serves `app` on `listener` with a header read timeout and connection caps: the node
/// address is reachable from every pod, and `axum::serve` has neither.
async fn serve_bounded(
    listener: tokio::net::TcpListener,
    app: axum::Router,
) -> std::io::Result<()> {
    use gpufeed_shared::stream::hub::admission::{Admission, Decision, Limits, RateLimitedLog};
    // Every connection holds its place for its lifetime (never `established`).
    let admission = Admission::new(Limits {
        max_handshakes: MAX_HTTP_CONNECTIONS,
        max_per_address: MAX_HTTP_PER_ADDRESS,
        retry_above: usize::MAX,
    });
    let refusals = RateLimitedLog::new(std::time::Duration::from_secs(10));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors or a connection reset before accept: not fatal.
                tracing::warn!(error = %e, "metrics server: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let ticket = match admission.decide(peer.ip(), true) {
            Decision::Accept(t) => t,
            Decision::Refuse(reason) => {
                if let Some(unlogged) = refusals.note(reason, Instant::now()) {
                    tracing::warn!(%peer, reason, unlogged, "metrics server: too many connections (limits: {MAX_HTTP_CONNECTIONS} in all, {MAX_HTTP_PER_ADDRESS} per address); closed");
                }
                continue;
            }
            Decision::Retry => continue,
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "metrics server: connection ended");
            }
            drop(ticket);
        });
    }
}

pub fn bind_error(addr: SocketAddr, e: std::io::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "cannot listen on {addr} for /metrics: {e} (choose another with --metrics-listen)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::OwnerStats;
    use crate::probes::unit::GaugeValue;

    const UID: &str = "1b2c3d4e-5f60-4718-9a2b-3c4d5e6f7a8b";
    const CID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    static FAMILIES: [FamilySpec; 3] = [
        FamilySpec {
            name: "test_latency_microseconds",
            help: "h",
            kind: Kind::Histogram,
            scope: Scope::Container,
        },
        FamilySpec {
            name: "test_bytes_total",
            help: "b",
            kind: Kind::Counter,
            scope: Scope::Pod,
        },
        FamilySpec {
            name: "test_limit",
            help: "g",
            kind: Kind::Gauge,
            scope: Scope::Pod,
        },
    ];

    fn labels(m: &Metric) -> Vec<(String, String)> {
        m.get_label()
            .iter()
            .map(|p| (p.name().to_string(), p.value().to_string()))
            .collect()
    }

    fn pod(container: Option<&str>) -> Owner {
        Owner::Pod {
            uid: UID.into(),
            container_id: container.map(str::to_string),
        }
    }

    fn owner_with(series: &[((&'static str, Labels), Value)]) -> OwnerStats {
        OwnerStats {
            series: series.iter().cloned().collect(),
            ..OwnerStats::default()
        }
    }

    #[test]
    fn families_render_at_their_scope_and_merge_owners() {
        let mut h = Hist::default();
        h.buckets[3] = 2;
        h.count = 2;
        h.sum_ns = 10_000;
        let dir = |d: &str| Labels::from([("direction", d.to_string())]);
        let mut shared = Shared::default();
        // the container and the pod-level cgroup: one pod, two owners
        shared.owners.insert(
            pod(Some(CID)),
            owner_with(&[
                (
                    ("test_latency_microseconds", Labels::new()),
                    Value::Hist(h.clone()),
                ),
                (("test_bytes_total", dir("egress")), Value::Count(100)),
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
        shared.gauges.insert(
            "test_limit",
            vec![GaugeValue {
                owner: pod(None),
                labels: dir("egress"),
                value: 1e9,
            }],
        );
        let c = AgentCollector::new(
            Arc::new(Mutex::new(shared)),
            PodStore::default(),
            FAMILIES.iter().collect(),
            vec![
                ProbeStatus::up("test"),
                ProbeStatus::down("other", "no hook"),
            ],
        );
        let out = c.families();
        let get = |n: &str| out.iter().find(|f| f.name() == n).unwrap();
        assert!(out.iter().all(|f| f.name() != "test_unknown_total"));

        let lat = get("test_latency_microseconds");
        assert_eq!(lat.get_field_type(), MetricType::HISTOGRAM);
        assert_eq!(
            lat.get_metric().len(),
            1,
            "the empty histogram has no series"
        );
        let m = &lat.get_metric()[0];
        assert_eq!(
            labels(m),
            [
                ("container".to_string(), CID[..12].to_string()),
                ("namespace".to_string(), String::new()),
                ("pod".to_string(), UID.to_string()),
            ]
        );
        assert_eq!(m.get_histogram().get_sample_count(), 2);
        assert_eq!(m.get_histogram().get_sample_sum(), 10.0);

        // pod scope: no container label, both owners merged into one series
        let bytes = get("test_bytes_total");
        let series: Vec<(Vec<(String, String)>, f64)> = bytes
            .get_metric()
            .iter()
            .map(|m| (labels(m), m.get_counter().get_value()))
            .collect();
        let l = |d: &str| {
            vec![
                ("direction".to_string(), d.to_string()),
                ("namespace".to_string(), String::new()),
                ("pod".to_string(), UID.to_string()),
            ]
        };
        assert_eq!(series, [(l("egress"), 120.0), (l("ingress"), 0.0)]);

        let limit = get("test_limit");
        assert_eq!(limit.get_metric().len(), 1);
        assert_eq!(labels(&limit.get_metric()[0]), l("egress"));
        assert_eq!(limit.get_metric()[0].get_gauge().get_value(), 1e9);

        let up: Vec<(Vec<(String, String)>, f64)> = get("gpufeed_probe_up")
            .get_metric()
            .iter()
            .map(|m| (labels(m), m.get_gauge().get_value()))
            .collect();
        assert_eq!(
            up,
            [
                (vec![("probe".to_string(), "test".to_string())], 1.0),
                (vec![("probe".to_string(), "other".to_string())], 0.0)
            ]
        );
    }
}
