//! Host-local Prometheus view (`/metrics`). Series names are a contract (see docs/metrics.md
//! and docs/host-agent.md). Every series carries the constant label `host`.

use prometheus::core::Collector;
use prometheus::{
    CounterVec, Encoder, Gauge, GaugeVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
    TextEncoder,
};
use std::collections::HashMap;
use std::sync::Arc;

/// The registry and the agent's own series. Each watcher registers its series itself (see
/// the `*Metrics` struct in its unit under [`crate::watch`]) with the helpers below.
pub struct Metrics {
    pub registry: Registry,
    pub events: IntCounterVec,
    pub watcher_enabled: IntGaugeVec,
}

fn register<T: Collector + Clone + 'static>(r: &Registry, c: prometheus::Result<T>) -> T {
    // Names are literals of this crate: a clash or a bad name is a bug caught by every test
    // that builds an agent, not a runtime condition.
    let c = c.expect("valid metric definition");
    r.register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

pub fn gauge(r: &Registry, name: &str, help: &str) -> Gauge {
    register(r, Gauge::new(name, help))
}

pub fn int_counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    register(r, IntCounter::new(name, help))
}

pub fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    register(r, GaugeVec::new(Opts::new(name, help), labels))
}

pub fn int_gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register(r, IntGaugeVec::new(Opts::new(name, help), labels))
}

pub fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> CounterVec {
    register(r, CounterVec::new(Opts::new(name, help), labels))
}

pub fn int_counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(r, IntCounterVec::new(Opts::new(name, help), labels))
}

impl Metrics {
    pub fn new(host: &str) -> Arc<Metrics> {
        let mut labels = HashMap::new();
        labels.insert("host".to_string(), host.to_string());
        let r = Registry::new_custom(None, Some(labels)).expect("valid registry");
        Arc::new(Metrics {
            events: int_counter_vec(
                &r,
                "gpufeed_host_events_total",
                "Events emitted by kind",
                &["kind"],
            ),
            watcher_enabled: int_gauge_vec(
                &r,
                "gpufeed_host_watcher_enabled",
                "1 if the watcher runs, 0 if it is off",
                &["watcher"],
            ),
            registry: r,
        })
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

pub fn vmid_label(v: Option<u32>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// The host's HTTP caps: its scrapers are a Prometheus or two on the host or the
/// management network. 256 connections stay far below the unit's `LimitNOFILE`, so a flood of
/// idle connections cannot take the descriptors the spool, the certificates and sysfs need.
pub const HTTP_LIMITS: gpufeed_shared::http::HttpLimits = gpufeed_shared::http::HttpLimits {
    max_connections: 256,
    max_per_address: 64,
};

/// Serve `/metrics` until the process ends, within [`HTTP_LIMITS`] (the guest's limits:
/// header read timeout, fair per-address shares; see [`gpufeed_shared::http`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    use axum::{http::header, response::IntoResponse, routing::get, Router};
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        m.render(),
                    )
                        .into_response()
                }
            }),
        )
        .route("/", get(|| async { "gpufeed-host: see /metrics\n" }));
    gpufeed_shared::http::serve_bounded(listener, app, HTTP_LIMITS, "metrics").await
}

/// (family, value of `label`) of every series in `r`, consecutive repeats removed: which
/// things a registry still has series for (tests of series removal).
#[cfg(test)]
pub fn series_by_label(r: &Registry, label: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = r
        .gather()
        .iter()
        .flat_map(|mf| {
            mf.get_metric().iter().map(|m| {
                let v = m.get_label().iter().find(|l| l.name() == label);
                (
                    mf.name().to_string(),
                    v.map_or("", |l| l.value()).to_string(),
                )
            })
        })
        .collect();
    out.dedup();
    out
}
