//! OTLP metrics push, beside the Prometheus endpoint, for both agents.
//!
//! The source is the very text the agent's `/metrics` serves: each export renders it, parses it
//! ([`crate::exposition::parse_text`]) and turns every family into an OTLP metric of the same name with the same
//! labels ([`to_request`]), so that what a receiver stores has the names and labels a scrape
//! stores, by construction:
//!
//! * a counter is a cumulative monotonic `Sum` named as the counter, `_total` included (a
//!   receiver that appends `_total` to monotonic sums, as Prometheus 2.x does, finds it there
//!   and does not double it); a counter whose name lacks `_total` would get one appended, so
//!   it goes as a cumulative non-monotonic `Sum` and keeps its name (none of ours);
//! * a gauge (and an untyped series) is a `Gauge`;
//! * a histogram is an explicit-bounds `Histogram`, cumulative: its `le` bounds (less `+Inf`)
//!   are the explicit bounds, the bucket counts the differences of the cumulative ones, with
//!   its `_count` and `_sum`;
//! * a summary is a `Summary` with its quantiles, `_count` and `_sum`;
//! * the unit is left empty (a unit would add a suffix to the name) and the description is
//!   the family's `HELP`.
//!
//! One task exports on its own interval, with at most one request in flight and a timeout:
//! an export that fails, is refused or times out is dropped (the next one carries the
//! cumulative values again), counted in `<prefix>_otlp_exports_total{result}` and logged when
//! the state changes, never per attempt. The scrape never waits for it.
//!
//! `docs/metrics.md` ("OTLP push") documents the mapping as a receiver sees it.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{
    metric::Data, number_data_point, summary_data_point::ValueAtQuantile, AggregationTemporality,
    Gauge, Histogram, HistogramDataPoint, Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics,
    Sum, Summary, SummaryDataPoint,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prometheus::{IntCounterVec, Opts, Registry};

use crate::exposition::{parse_text, Family, Kind, Sample};

/// Where and how to push.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpConfig {
    /// The full URL the request is POSTed to, e.g. `http://collector:4318/v1/metrics`.
    pub endpoint: String,
    /// Extra request headers (authorisation, tenant).
    pub headers: Vec<(String, String)>,
    /// Time between exports.
    pub interval: Duration,
    /// The longest one export may take (connect, send, answer); at most `interval`.
    pub timeout: Duration,
    /// Resource attributes (`service.name`, `host.name`, `k8s.node.name`, ...).
    pub resource: Vec<(String, String)>,
}

/// The shortest export interval accepted.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
/// The default export interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(15);
/// The default timeout of one export.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

impl OtlpConfig {
    /// Checks the endpoint (an `http` or `https` URL), the headers (valid names and values),
    /// the interval and the timeout; the error says which and why.
    pub fn validate(&self) -> Result<(), String> {
        let url = reqwest::Url::parse(&self.endpoint)
            .map_err(|e| format!("OTLP endpoint {:?} is not a URL: {e}", self.endpoint))?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(format!(
                "OTLP endpoint {:?}: the scheme must be http or https (OTLP over HTTP, protobuf)",
                self.endpoint
            ));
        }
        if url.host_str().is_none() {
            return Err(format!("OTLP endpoint {:?} has no host", self.endpoint));
        }
        for (k, v) in &self.headers {
            reqwest::header::HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| format!("OTLP header name {k:?} is not a valid HTTP header name"))?;
            reqwest::header::HeaderValue::from_str(v)
                .map_err(|_| format!("OTLP header {k:?}: its value is not a valid header value"))?;
        }
        if self.interval < MIN_INTERVAL {
            return Err(format!(
                "OTLP interval {:?} is below the minimum {MIN_INTERVAL:?}",
                self.interval
            ));
        }
        if self.timeout.is_zero() || self.timeout > self.interval {
            return Err(format!(
                "OTLP timeout {:?} must be above zero and at most the interval ({:?})",
                self.timeout, self.interval
            ));
        }
        Ok(())
    }
}

/// `KEY=VALUE` (a header, or a resource attribute): the key must not be empty.
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// A duration as the command lines take them (`15s`, `500ms`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))
}

/// The flags both agents take (the host agent's `[otlp]` section says the same).
#[cfg(feature = "cli")]
#[derive(clap::Args, Debug, Clone, Default)]
pub struct OtlpArgs {
    /// Push metrics over OTLP (HTTP, protobuf) to this URL too, beside /metrics, e.g.
    /// http://collector:4318/v1/metrics or Prometheus's http://prom:9090/api/v1/otlp/v1/metrics.
    /// Off when not given.
    #[arg(long, value_name = "URL", env = "GPUFEED_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// A header for each OTLP request (authorisation, tenant). Repeatable.
    #[arg(long = "otlp-header", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub otlp_headers: Vec<(String, String)>,
    /// Time between OTLP exports [default: 15s].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub otlp_interval: Option<Duration>,
    /// The longest one OTLP export may take; a slower one is dropped and counted
    /// [default: 10s, at most the interval].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub otlp_timeout: Option<Duration>,
    /// A resource attribute added to the agent's own (`service.name`, `host.name`, ...).
    /// Repeatable.
    #[arg(long = "otlp-resource", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub otlp_resource: Vec<(String, String)>,
}

#[cfg(feature = "cli")]
impl OtlpArgs {
    /// The configuration the flags ask for (`None` without `--otlp-endpoint`), checked, with
    /// `resource` first and the `--otlp-resource` attributes after (a key given twice: the
    /// flag's value).
    pub fn config(&self, resource: Vec<(String, String)>) -> Result<Option<OtlpConfig>, String> {
        let Some(endpoint) = self.otlp_endpoint.clone() else {
            if self.otlp_interval.is_some()
                || self.otlp_timeout.is_some()
                || !self.otlp_headers.is_empty()
                || !self.otlp_resource.is_empty()
            {
                return Err("--otlp-header, --otlp-interval, --otlp-timeout and --otlp-resource need --otlp-endpoint".into());
            }
            return Ok(None);
        };
        let interval = self.otlp_interval.unwrap_or(DEFAULT_INTERVAL);
        let cfg = OtlpConfig {
            endpoint,
            headers: self.otlp_headers.clone(),
            interval,
            timeout: self.otlp_timeout.unwrap_or(default_timeout(interval)),
            resource: merge_resource(resource, &self.otlp_resource),
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }
}

/// `base` with `extra` added, a key in both taking `extra`'s value.
pub fn merge_resource(
    mut base: Vec<(String, String)>,
    extra: &[(String, String)],
) -> Vec<(String, String)> {
    for (k, v) in extra {
        match base.iter_mut().find(|(b, _)| b == k) {
            Some(e) => e.1 = v.clone(),
            None => base.push((k.clone(), v.clone())),
        }
    }
    base
}

/// This machine's host name (`host.name`), from the kernel.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// The timeout for an interval when none is given: [`DEFAULT_TIMEOUT`], at most the interval.
pub fn default_timeout(interval: Duration) -> Duration {
    DEFAULT_TIMEOUT.min(interval)
}

// ---------------------------------------------------------------------------------------------
// The text exposition
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// The OTLP request
// ---------------------------------------------------------------------------------------------

fn kv(k: &str, v: &str) -> KeyValue {
    KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.to_string())),
        }),
        ..Default::default()
    }
}

fn attributes(labels: &[(String, String)]) -> Vec<KeyValue> {
    labels.iter().map(|(k, v)| kv(k, v)).collect()
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The OTLP request for the families: one resource (`resource`), one scope (`scope`, the
/// agent's name and version), every point at `now`, cumulative ones starting at `start`.
pub fn to_request(
    families: &[Family],
    resource: &[(String, String)],
    scope: (&str, &str),
    start: SystemTime,
    now: SystemTime,
) -> ExportMetricsServiceRequest {
    let (start, now) = (unix_nanos(start), unix_nanos(now));
    let cumulative = AggregationTemporality::Cumulative as i32;
    let number = |s: &Sample| NumberDataPoint {
        attributes: attributes(&s.labels),
        start_time_unix_nano: start,
        time_unix_nano: now,
        value: Some(number_data_point::Value::AsDouble(s.value)),
        ..Default::default()
    };
    let mut metrics = Vec::with_capacity(families.len());
    for f in families {
        if f.samples.is_empty() {
            continue;
        }
        let data = match f.kind {
            Kind::Counter => Data::Sum(Sum {
                data_points: f.samples.iter().map(number).collect(),
                aggregation_temporality: cumulative,
                is_monotonic: f.name.ends_with("_total"),
            }),
            Kind::Gauge | Kind::Untyped => Data::Gauge(Gauge {
                data_points: f.samples.iter().map(number).collect(),
            }),
            Kind::Histogram => Data::Histogram(Histogram {
                data_points: histogram_points(f, start, now),
                aggregation_temporality: cumulative,
            }),
            Kind::Summary => Data::Summary(Summary {
                data_points: summary_points(f, start, now),
            }),
        };
        metrics.push(Metric {
            name: f.name.clone(),
            description: f.help.clone(),
            unit: String::new(),
            data: Some(data),
            ..Default::default()
        });
    }
    ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(Resource {
                attributes: resource.iter().map(|(k, v)| kv(k, v)).collect(),
                ..Default::default()
            }),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: scope.0.to_string(),
                    version: scope.1.to_string(),
                    ..Default::default()
                }),
                metrics,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

/// The samples of a histogram or summary family grouped by their labels (less `le` or
/// `quantile`), in order of first appearance.
/// Labels, and the samples that carry them.
type Group<'a> = (Vec<(String, String)>, Vec<&'a Sample>);

fn grouped<'a>(f: &'a Family, special: &str) -> Vec<Group<'a>> {
    let mut groups: Vec<Group<'a>> = Vec::new();
    for s in &f.samples {
        let key: Vec<(String, String)> = s
            .labels
            .iter()
            .filter(|(k, _)| k != special)
            .cloned()
            .collect();
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(s),
            None => groups.push((key, vec![s])),
        }
    }
    groups
}

fn histogram_points(f: &Family, start: u64, now: u64) -> Vec<HistogramDataPoint> {
    let bucket = format!("{}_bucket", f.name);
    let sum = format!("{}_sum", f.name);
    let count = format!("{}_count", f.name);
    let mut out = Vec::new();
    for (labels, samples) in grouped(f, "le") {
        let mut buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.name == bucket)
            .filter_map(|s| {
                let le = s.labels.iter().find(|(k, _)| k == "le")?;
                let bound = match le.1.as_str() {
                    "+Inf" => f64::INFINITY,
                    b => b.parse().ok()?,
                };
                Some((bound, s.value))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total = samples
            .iter()
            .find(|s| s.name == count)
            .map(|s| s.value)
            .or_else(|| buckets.last().map(|b| b.1))
            .unwrap_or(0.0);
        let mut explicit_bounds = Vec::with_capacity(buckets.len());
        let mut bucket_counts = Vec::with_capacity(buckets.len() + 1);
        let mut below = 0.0;
        for (bound, cumulative) in &buckets {
            if bound.is_infinite() {
                continue;
            }
            explicit_bounds.push(*bound);
            bucket_counts.push((cumulative - below).max(0.0) as u64);
            below = *cumulative;
        }
        bucket_counts.push((total - below).max(0.0) as u64);
        out.push(HistogramDataPoint {
            attributes: attributes(&labels),
            start_time_unix_nano: start,
            time_unix_nano: now,
            count: total as u64,
            sum: samples.iter().find(|s| s.name == sum).map(|s| s.value),
            bucket_counts,
            explicit_bounds,
            ..Default::default()
        });
    }
    out
}

fn summary_points(f: &Family, start: u64, now: u64) -> Vec<SummaryDataPoint> {
    let sum = format!("{}_sum", f.name);
    let count = format!("{}_count", f.name);
    grouped(f, "quantile")
        .into_iter()
        .map(|(labels, samples)| SummaryDataPoint {
            attributes: attributes(&labels),
            start_time_unix_nano: start,
            time_unix_nano: now,
            count: samples
                .iter()
                .find(|s| s.name == count)
                .map_or(0, |s| s.value as u64),
            sum: samples
                .iter()
                .find(|s| s.name == sum)
                .map_or(0.0, |s| s.value),
            quantile_values: samples
                .iter()
                .filter(|s| s.name == f.name)
                .filter_map(|s| {
                    let q = s.labels.iter().find(|(k, _)| k == "quantile")?;
                    Some(ValueAtQuantile {
                        quantile: q.1.parse().ok()?,
                        value: s.value,
                    })
                })
                .collect(),
            ..Default::default()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The exporter
// ---------------------------------------------------------------------------------------------

/// How one export ended: the values of the `result` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The receiver answered 2xx.
    Ok,
    /// The receiver answered with another status (4xx, 5xx).
    Refused,
    /// No answer within the timeout.
    Timeout,
    /// Anything else: connection refused or reset, DNS, TLS, a rendering that failed to parse.
    Error,
}

impl Outcome {
    pub const ALL: [Outcome; 4] = [
        Outcome::Ok,
        Outcome::Refused,
        Outcome::Timeout,
        Outcome::Error,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused => "refused",
            Outcome::Timeout => "timeout",
            Outcome::Error => "error",
        }
    }
}

/// The exporter's own series, registered where the agent's other series are.
#[derive(Clone)]
pub struct OtlpMetrics {
    pub exports: IntCounterVec,
}

impl OtlpMetrics {
    /// `<prefix>_otlp_exports_total{result}` in `registry`, every result at 0 from the start.
    pub fn new(registry: &Registry, prefix: &str) -> prometheus::Result<OtlpMetrics> {
        let exports = IntCounterVec::new(
            Opts::new(
                format!("{prefix}_otlp_exports_total"),
                "OTLP metric exports by how they ended: ok (2xx), refused (another HTTP status), timeout, error (connection, TLS, ...)",
            ),
            &["result"],
        )?;
        registry.register(Box::new(exports.clone()))?;
        for o in Outcome::ALL {
            exports.with_label_values(&[o.label()]);
        }
        Ok(OtlpMetrics { exports })
    }
}

/// The text the agent's `/metrics` serves, rendered anew at each call.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// At most this much of a receiver's answer is read (it goes into the log line).
const ANSWER_KEPT: usize = 512;

/// One export: render, convert, POST, classify; with what to log when it failed.
async fn export_once(
    client: &reqwest::Client,
    cfg: &OtlpConfig,
    render: &Render,
    scope: (&'static str, &'static str),
    start: SystemTime,
) -> (Outcome, String) {
    use prost::Message;
    let r = render.clone();
    let text = match tokio::task::spawn_blocking(move || r()).await {
        Ok(t) => t,
        Err(e) => return (Outcome::Error, format!("rendering the metrics failed: {e}")),
    };
    let families = match parse_text(&text) {
        Ok(f) => f,
        Err(e) => {
            return (
                Outcome::Error,
                format!("the metrics text did not parse: {e}"),
            )
        }
    };
    drop(text);
    let body =
        to_request(&families, &cfg.resource, scope, start, SystemTime::now()).encode_to_vec();
    drop(families);
    let mut req = client
        .post(&cfg.endpoint)
        .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
        .body(body);
    for (k, v) in &cfg.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let send = async {
        let mut resp = req.send().await?;
        let status = resp.status();
        // the start of the answer, for the log; never more than ANSWER_KEPT bytes, whatever the
        // receiver sends (the rest is dropped with the connection)
        let mut body = Vec::new();
        while body.len() < ANSWER_KEPT {
            match resp.chunk().await {
                Ok(Some(c)) => body.extend_from_slice(&c[..c.len().min(ANSWER_KEPT - body.len())]),
                _ => break,
            }
        }
        Ok::<_, reqwest::Error>((status, body))
    };
    match tokio::time::timeout(cfg.timeout, send).await {
        Err(_) => (
            Outcome::Timeout,
            format!("no answer within {:?}", cfg.timeout),
        ),
        Ok(Err(e)) if e.is_timeout() => (Outcome::Timeout, format!("{e}")),
        Ok(Err(e)) => (Outcome::Error, error_chain(&e)),
        Ok(Ok((status, _))) if status.is_success() => (Outcome::Ok, String::new()),
        Ok(Ok((status, body))) => {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            (Outcome::Refused, format!("HTTP {status}: {}", text.trim()))
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Starts the exporter: every `cfg.interval` one export of what `render` returns, at most
/// one in flight, each within `cfg.timeout`; a failed one is dropped and counted. `scope`
/// names the agent (and its version) as the OTLP instrumentation scope.
pub fn spawn(
    cfg: OtlpConfig,
    render: Render,
    metrics: OtlpMetrics,
    scope: (&'static str, &'static str),
) -> Result<tokio::task::JoinHandle<()>, String> {
    cfg.validate()?;
    let client = reqwest::Client::builder()
        .timeout(cfg.timeout)
        .connect_timeout(cfg.timeout)
        .pool_max_idle_per_host(1)
        .build()
        .map_err(|e| format!("OTLP client: {}", error_chain(&e)))?;
    let start = SystemTime::now();
    tracing::info!(
        endpoint = %cfg.endpoint,
        interval = ?cfg.interval,
        timeout = ?cfg.timeout,
        "OTLP metrics push on"
    );
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(cfg.interval);
        // a slow export delays the next one, never piles them up
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: Option<Outcome> = None;
        loop {
            tick.tick().await;
            let (outcome, why) = export_once(&client, &cfg, &render, scope, start).await;
            metrics.exports.with_label_values(&[outcome.label()]).inc();
            if last != Some(outcome) {
                match outcome {
                    Outcome::Ok => tracing::info!(endpoint = %cfg.endpoint, "OTLP export ok"),
                    o => tracing::warn!(
                        endpoint = %cfg.endpoint,
                        result = o.label(),
                        "OTLP export failed (dropped; counted in the exports' result label, logged again when this changes): {why}"
                    ),
                }
                last = Some(outcome);
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::exposition::tests::TEXT;

    #[test]
    fn families_become_otlp_metrics_of_the_same_names() {
        let f = parse_text(TEXT).unwrap();
        let t = UNIX_EPOCH + Duration::from_secs(100);
        let req = to_request(
            &f,
            &[("host.name".into(), "h".into())],
            ("gpufeed-test", "0"),
            t,
            t + Duration::from_secs(1),
        );
        let rm = &req.resource_metrics[0];
        assert_eq!(rm.resource.as_ref().unwrap().attributes[0].key, "host.name");
        let m = &rm.scope_metrics[0].metrics;
        let names: Vec<_> = m.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["a_total", "h_seconds", "g", "loose", "s"]);
        assert!(m.iter().all(|m| m.unit.is_empty()));
        match m[0].data.as_ref().unwrap() {
            Data::Sum(s) => {
                assert!(s.is_monotonic);
                assert_eq!(
                    s.aggregation_temporality,
                    AggregationTemporality::Cumulative as i32
                );
                assert_eq!(s.data_points.len(), 2);
                assert_eq!(s.data_points[0].start_time_unix_nano, 100_000_000_000);
                assert_eq!(s.data_points[0].time_unix_nano, 101_000_000_000);
            }
            d => panic!("{d:?}"),
        }
        match m[1].data.as_ref().unwrap() {
            Data::Histogram(h) => {
                let p = &h.data_points[0];
                assert_eq!(p.attributes.len(), 1);
                assert_eq!(p.attributes[0].key, "p");
                assert_eq!(p.explicit_bounds, [0.5, 1.0]);
                assert_eq!(p.bucket_counts, [1, 2, 1]);
                assert_eq!((p.count, p.sum), (4, Some(2.25)));
                assert_eq!(h.data_points[1].bucket_counts, [0, 0, 0]);
            }
            d => panic!("{d:?}"),
        }
        match m[4].data.as_ref().unwrap() {
            Data::Summary(s) => {
                let p = &s.data_points[0];
                assert_eq!((p.count, p.sum, p.quantile_values.len()), (5, 10.0, 2));
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn a_counter_without_total_is_a_non_monotonic_sum() {
        let f = parse_text("# TYPE c counter\nc 1\n").unwrap();
        let req = to_request(&f, &[], ("t", "0"), UNIX_EPOCH, UNIX_EPOCH);
        match req.resource_metrics[0].scope_metrics[0].metrics[0]
            .data
            .as_ref()
        {
            Some(Data::Sum(s)) => assert!(!s.is_monotonic),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn the_registry_encoders_text_parses() {
        let r = Registry::new();
        let m = OtlpMetrics::new(&r, "gpufeed_test").unwrap();
        m.exports.with_label_values(&["ok"]).inc();
        let h = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new(
            "h_seconds",
            "with \\ and\nnewline",
        ))
        .unwrap();
        r.register(Box::new(h.clone())).unwrap();
        h.observe(0.3);
        let mut text = String::new();
        prometheus::TextEncoder::new()
            .encode_utf8(&r.gather(), &mut text)
            .unwrap();
        let f = parse_text(&text).unwrap();
        assert_eq!(f[0].name, "gpufeed_test_otlp_exports_total");
        assert_eq!(f[0].samples.len(), 4);
        assert_eq!(f[1].help, "with \\ and\nnewline");
        let req = to_request(&f, &[], ("t", "0"), UNIX_EPOCH, UNIX_EPOCH);
        match req.resource_metrics[0].scope_metrics[0].metrics[1]
            .data
            .as_ref()
        {
            Some(Data::Histogram(h)) => {
                assert_eq!(h.data_points[0].count, 1);
                assert_eq!(h.data_points[0].bucket_counts.iter().sum::<u64>(), 1);
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn config_is_checked() {
        let ok = OtlpConfig {
            endpoint: "http://127.0.0.1:4318/v1/metrics".into(),
            headers: vec![("Authorization".into(), "Bearer x".into())],
            interval: DEFAULT_INTERVAL,
            timeout: DEFAULT_TIMEOUT,
            resource: vec![],
        };
        ok.validate().unwrap();
        let bad = |f: &dyn Fn(&mut OtlpConfig)| {
            let mut c = ok.clone();
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert!(bad(&|c| c.endpoint = "collector:4318".into()).contains("scheme"));
        assert!(bad(&|c| c.endpoint = "not a url".into()).contains("not a URL"));
        assert!(bad(&|c| c.headers = vec![("bad name".into(), "v".into())]).contains("name"));
        assert!(bad(&|c| c.headers = vec![("k".into(), "a\nb".into())]).contains("value"));
        assert!(bad(&|c| c.interval = Duration::from_millis(10)).contains("minimum"));
        assert!(bad(&|c| c.timeout = Duration::from_secs(60)).contains("at most"));
        assert_eq!(
            parse_key_value("X-Scope-OrgID=a=b").unwrap(),
            ("X-Scope-OrgID".to_string(), "a=b".to_string())
        );
        assert!(parse_key_value("novalue").is_err());
        assert!(parse_key_value("=v").is_err());
        assert_eq!(
            default_timeout(Duration::from_secs(1)),
            Duration::from_secs(1)
        );
    }
}
