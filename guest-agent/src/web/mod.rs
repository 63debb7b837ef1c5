//! The incident page and its data: `/` (one self-contained file, `index.html`: no framework,
//! no external assets, its pictures drawn as inline SVG from `/api/state`), `/events` (the
//! recent host events with the pods they hit, shaped as Grafana annotations), `/api/state` and
//! `/api/picture` (one event's picture, for those `/api/state` leaves out).
//!
//! These answers are bounded whatever the history (see [`crate::incident::PICTURES_IN_STATE`]),
//! and each of `/events` and `/api/state` is rendered at most once per [`FRESH_FOR`] and shared:
//! however many clients ask at once (the port is on the host's network, every pod of the node
//! reaches it), the agent holds one rendering, and they wait for it rather than render their own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::Query;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use futures::future::BoxFuture;
use futures::FutureExt;
use serde::Deserialize;

use crate::join::Join;

/// The page at `/`.
pub const PAGE: &str = include_str!("index.html");

/// The page loads nothing from elsewhere and talks only to this agent; it says so to the
/// browser. Links (to a profiler) are plain navigation, which the policy does not restrict.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'";

/// `/events` as JSON: the correlator's events as the join last published them, each affected
/// pod with its profile link when `--profile-url` is set.
pub fn events_json(join: &Join) -> serde_json::Value {
    let answers = join.answers();
    let events = &answers.events;
    let mut v = serde_json::to_value(events).unwrap_or_default();
    for (e, out) in events.iter().zip(v.as_array_mut().into_iter().flatten()) {
        let Some(affected) = out["affected"].as_array_mut() else {
            continue;
        };
        for (a, slot) in e.affected.iter().zip(affected) {
            if let Some(url) = join
                .settings()
                .profile_url(&a.namespace, &a.pod, e.time + a.lag_ms)
            {
                slot["profile_url"] = url.into();
            }
        }
    }
    v
}

/// How long a rendering of `/events` or `/api/state` is served before the next request renders
/// anew (the page polls every 5 s).
pub const FRESH_FOR: Duration = Duration::from_secs(1);

/// Renders one JSON answer.
type Render = Box<dyn Fn() -> BoxFuture<'static, Vec<u8>> + Send + Sync>;

/// One JSON answer, rendered at most once per [`FRESH_FOR`] and shared by the requests that
/// come meanwhile (they wait for the rendering under way instead of starting their own).
struct Shared {
    render: Render,
    last: tokio::sync::Mutex<Option<(Instant, Bytes)>>,
}

impl Shared {
    fn new(render: Render) -> Arc<Self> {
        Arc::new(Shared {
            render,
            last: tokio::sync::Mutex::new(None),
        })
    }

    async fn get(self: Arc<Self>) -> Bytes {
        let mut last = self.last.lock().await;
        if let Some((at, body)) = &*last {
            if at.elapsed() < FRESH_FOR {
                return body.clone();
            }
        }
        let body = Bytes::from((self.render)().await);
        *last = Some((Instant::now(), body.clone()));
        body
    }

    fn route(self: Arc<Self>) -> axum::routing::MethodRouter {
        get(move || {
            let me = self.clone();
            async move { json(me.get().await) }
        })
    }
}

fn json(body: Bytes) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], body)
}

/// `/api/picture`'s query: the event as `/events` names it.
#[derive(Deserialize)]
struct PictureOf {
    host: String,
    event: String,
    time: i64,
}

/// `/`, `/events`, `/api/state` and `/api/picture`.
pub fn router(join: Join) -> axum::Router {
    let events = {
        let j = join.clone();
        Shared::new(Box::new(move || {
            let j = j.clone();
            // serialising a few hundred events: off the async workers
            async move {
                tokio::task::spawn_blocking(move || {
                    serde_json::to_vec(&events_json(&j)).unwrap_or_default()
                })
                .await
                .unwrap_or_default()
            }
            .boxed()
        }))
    };
    let state = {
        let j = join.clone();
        Shared::new(Box::new(move || {
            let j = j.clone();
            async move {
                let state = j.page_state().await;
                tokio::task::spawn_blocking(move || serde_json::to_vec(&*state).unwrap_or_default())
                    .await
                    .unwrap_or_default()
            }
            .boxed()
        }))
    };
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
        .route("/events", events.route())
        .route("/api/state", state.route())
        .route(
            "/api/picture",
            get(move |Query(q): Query<PictureOf>| {
                let j = join.clone();
                async move {
                    match j.picture(q.host, q.event, q.time).await {
                        Ok(Some(p)) => {
                            json(Bytes::from(serde_json::to_vec(&p).unwrap_or_default()))
                                .into_response()
                        }
                        Ok(None) => {
                            (StatusCode::NOT_FOUND, "no such event listed\n").into_response()
                        }
                        Err(busy) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            [(header::RETRY_AFTER, "1")],
                            format!("{busy}\n"),
                        )
                            .into_response(),
                    }
                }
            }),
        )
}
