//! The export task: on its own interval, renders the agent's page, converts it and POSTs it,
//! at most one request in flight, each with a timeout; counts and logs how each ended.

use std::sync::Arc;
use std::time::SystemTime;

use prometheus::{IntCounterVec, Opts, Registry};

use super::config::OtlpConfig;
use super::request::to_request;
use crate::exposition::parse_text;

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
