//! The incident page and its data: `/` (one self-contained file, `index.html`: no framework,
//! no external assets, its pictures drawn as inline SVG from `/api/state`), `/events` (the
//! recent host events with the pods they hit, shaped as Grafana annotations) and `/api/state`.

use std::sync::Arc;

use axum::http::header;
use axum::routing::get;

use crate::join::Join;

/// The page at `/`.
pub const PAGE: &str = include_str!("index.html");

/// The page loads nothing from elsewhere and talks only to this agent; it says so to the
/// browser. Links (to a profiler) are plain navigation, which the policy does not restrict.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'";

/// `/events` as JSON: the correlator's events, each affected pod with its profile link when
/// `--profile-url` is set.
pub fn events_json(join: &Join) -> serde_json::Value {
    let events = join.events();
    let mut v = serde_json::to_value(&events).unwrap_or_default();
    for (e, out) in events.iter().zip(v.as_array_mut().into_iter().flatten()) {
        let Some(affected) = out["affected"].as_array_mut() else {
            continue;
        };
        for (a, slot) in e.affected.iter().zip(affected) {
            if let Some(url) = join.profile_url(&a.namespace, &a.pod, e.time + a.lag_ms) {
                slot["profile_url"] = url.into();
            }
        }
    }
    v
}

/// `/`, `/events` and `/api/state`.
pub fn router(join: Arc<Join>) -> axum::Router {
    let (j1, j2) = (join.clone(), join);
    axum::Router::new()
        .route(
            "/",
            get(|| async {
                (
                    [
                        (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                        (header::CONTENT_SECURITY_POLICY, CSP),
                        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                        (header::REFERRER_POLICY, "no-referrer"),
                    ],
                    PAGE,
                )
            }),
        )
        .route(
            "/events",
            get(move || {
                let j = j1.clone();
                async move { axum::Json(events_json(&j)) }
            }),
        )
        .route(
            "/api/state",
            get(move || {
                let j = j2.clone();
                async move { axum::Json(j.page_state()) }
            }),
        )
}
