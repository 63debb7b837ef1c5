//! Readiness: `/readyz` answers 200 when the agent does all it was asked to, 503 with the
//! reason otherwise; `/doctor` serves the latest doctor findings as JSON.
//!
//! The host stream (`--quic-listen`) is the part that can be asked for and not be possible yet:
//! its TLS files come from a Secret that may be missing or wrong. The agent then keeps serving
//! the pods' metrics, says once why the stream is not up, fails readiness, and retries (the
//! kubelet fills an optional Secret volume when the Secret appears): never a crash loop.

use std::sync::Arc;

use anyhow::Context;
use axum::http::StatusCode;
use axum::routing::get;

use crate::doctor::Latest;
pub use crate::host_stream::{Stream, StreamState};
use crate::hub::{self, HubConfig, HubError};
use crate::join::Join;

/// What the stream-off line says (once, at start).
pub const STREAM_OFF: &str =
    "host event stream off (no --quic-listen): no TLS files are read; pod metrics only";

/// Starts the hub. Its TLS files missing or unusable is not fatal: the reason is logged once
/// (again only when it changes), `/readyz` fails with it, and the hub is retried every
/// `tls_reload_interval` until it starts. Any other failure at the first attempt (the address
/// in use, the journal) is returned: that is a configuration to fix, not a Secret to wait for.
pub async fn start_stream(
    cfg: HubConfig,
    registry: &prometheus::Registry,
    joined: Join,
) -> anyhow::Result<Stream> {
    match hub::serve(cfg.clone(), registry).await {
        Ok(h) => {
            joined.attach_hub(h.clone());
            Ok(Stream::new(StreamState::Up(h)))
        }
        Err(e @ HubError::Tls { .. }) => {
            let why = e.to_string();
            log_waiting(&why);
            let stream = Stream::new(StreamState::Waiting(why));
            tokio::spawn(retry(cfg, registry.clone(), joined, stream.clone()));
            Ok(stream)
        }
        Err(e) => Err(e).context("starting the hub (--quic-listen)"),
    }
}

fn log_waiting(why: &str) {
    tracing::error!(
        "host stream not started: {why}; pod metrics go on, /readyz fails until the TLS files \
         (Secret gpufeed-guest-tls, made by `gpufeed-guest certs init`) are there and valid"
    );
}

async fn retry(cfg: HubConfig, registry: prometheus::Registry, joined: Join, stream: Stream) {
    loop {
        tokio::time::sleep(cfg.tls_reload_interval).await;
        match hub::serve(cfg.clone(), &registry).await {
            Ok(h) => {
                tracing::info!("host stream started: its TLS files are there now");
                joined.attach_hub(h.clone());
                stream.set(StreamState::Up(h));
                return;
            }
            Err(e) => {
                let why = e.to_string();
                let same = matches!(stream.get(), StreamState::Waiting(w) if w == why);
                if !same {
                    log_waiting(&why);
                    stream.set(StreamState::Waiting(why));
                }
                if !matches!(e, HubError::Tls { .. }) {
                    // Past the TLS files the hub may have registered metrics: a second
                    // attempt would only fail on those. Readiness keeps the reason.
                    return;
                }
            }
        }
    }
}

/// `/readyz` and `/doctor`, merged into the metrics server's routes. A probe that the
/// kernel refused does not make the agent unready (the others run and are served): `/readyz`
/// names it and its reason below its answer.
pub fn router(
    stream: Stream,
    healthy: Arc<dyn Fn() -> bool + Send + Sync>,
    findings: Latest,
    probes_down: Vec<String>,
) -> axum::Router {
    readyz_router(stream, healthy, probes_down).route(
        "/doctor",
        get(move || {
            let f = findings.get();
            async move { axum::Json(f) }
        }),
    )
}

/// `/readyz` alone (also served on the probe listener). A probe that the kernel refused does
/// not make the agent unready: `/readyz` names it and its reason below its answer.
pub fn readyz_router(
    stream: Stream,
    healthy: Arc<dyn Fn() -> bool + Send + Sync>,
    probes_down: Vec<String>,
) -> axum::Router {
    let notes: String = probes_down.iter().map(|l| format!("{l}\n")).collect();
    axum::Router::new().route(
        "/readyz",
        get(move || {
            let answer = if !healthy() {
                Err("stalled: the map-reading tick is late".to_string())
            } else {
                stream.not_ready().map_or(Ok(()), Err)
            };
            let notes = notes.clone();
            async move {
                match answer {
                    Ok(()) => (StatusCode::OK, format!("ready\n{notes}")),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n{notes}")),
                }
            }
        }),
    )
}
