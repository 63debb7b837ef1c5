//! The incident page and its data: `/` (one self-contained file, `index.html`: no framework,
//! no external assets, its pictures drawn as inline SVG from `/api/state`), `/events` (the
//! recent host events with the pods they hit, shaped as Grafana annotations), `/api/state` and
//! `/api/picture` (one event's picture, for those `/api/state` leaves out).
//!
//! These answers are bounded whatever the history (see [`crate::incident::PICTURES_IN_STATE`]),
//! and each of `/events` and `/api/state` is rendered once and shared: however many clients ask
//! at once (the port is on the host's network, every pod of the node reaches it), the agent
//! holds one rendering, and they wait for it rather than render their own. `/api/state` is
//! rendered at most once per [`FRESH_FOR`]; `/events` again as soon as the join has published
//! new events, at most once per [`EVENTS_EVERY`], so a host event is listed as it is counted.

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

use crate::join::{Answers, Join};

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

/// How long a rendering of `/api/state` is served before the next request renders anew (the
/// page polls every 5 s).
pub const FRESH_FOR: Duration = Duration::from_secs(1);

/// `/events` is rendered again at most this often while the join keeps publishing (in a burst
/// it publishes after every batch of inputs, which can be every event): a bound on the
/// renderings that clients polling through a flapping link's burst cause, at most 50 a second;
/// a rendering of events the join has not replaced since is served however old it is. One
/// kernel incident is often two or three events published a few ms apart (an AER error's
/// counter, its root port's total, a log record): 100 ms here held the second one back in the
/// lab's benchmark (`lab/examples/answer_latency`) by about 100 ms.
pub const EVENTS_EVERY: Duration = Duration::from_millis(20);

/// Renders one JSON answer.
type Render = Box<dyn Fn() -> BoxFuture<'static, Vec<u8>> + Send + Sync>;

/// When a rendering is served again instead of a new one.
enum Fresh {
    /// For this long after it was rendered.
    For(Duration),
    /// While the join's published answers are the ones it was rendered from, and for at least
    /// the given time even when they are not (a bound on renderings in a burst).
    WhilePublished(Join, Duration),
}

/// One rendering and what it was made from.
struct Rendering {
    at: Instant,
    /// the join's answers when it was rendered (kept, so that the pointer cannot be reused)
    from: Option<Arc<Answers>>,
    body: Bytes,
}

/// One JSON answer, rendered once and shared by the requests that come meanwhile (they wait
/// for the rendering under way instead of starting their own), served again while [`Fresh`].
struct Shared {
    render: Render,
    fresh: Fresh,
    last: tokio::sync::Mutex<Option<Rendering>>,
}

impl Shared {
    fn new(render: Render, fresh: Fresh) -> Arc<Self> {
        Arc::new(Shared {
            render,
            fresh,
            last: tokio::sync::Mutex::new(None),
        })
    }

    async fn get(self: Arc<Self>) -> Bytes {
        let mut last = self.last.lock().await;
        let from = match &self.fresh {
            Fresh::WhilePublished(join, _) => Some(join.answers()),
            Fresh::For(_) => None,
        };
        if let Some(r) = &*last {
            let fresh = match &self.fresh {
                Fresh::For(d) => r.at.elapsed() < *d,
                Fresh::WhilePublished(_, at_least) => {
                    r.at.elapsed() < *at_least
                        || matches!((&r.from, &from), (Some(a), Some(b)) if Arc::ptr_eq(a, b))
                }
            };
            if fresh {
                return r.body.clone();
            }
        }
        let body = Bytes::from((self.render)().await);
        *last = Some(Rendering {
            at: Instant::now(),
            from,
            body: body.clone(),
        });
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

/// `/events`, rendered from the join's published events.
fn events_answer(join: Join) -> Arc<Shared> {
    let j = join.clone();
    Shared::new(
        Box::new(move || {
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
        }),
        Fresh::WhilePublished(join, EVENTS_EVERY),
    )
}

/// `/`, `/events`, `/api/state` and `/api/picture`.
pub fn router(join: Join) -> axum::Router {
    let events = events_answer(join.clone());
    let state = {
        let j = join.clone();
        Shared::new(
            Box::new(move || {
                let j = j.clone();
                async move {
                    let state = j.page_state().await;
                    tokio::task::spawn_blocking(move || {
                        serde_json::to_vec(&*state).unwrap_or_default()
                    })
                    .await
                    .unwrap_or_default()
                }
                .boxed()
            }),
            Fresh::For(FRESH_FOR),
        )
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use gpufeed_shared::event::LinkChangeClass;

    use super::*;
    use crate::correlate::events::tests::link;
    use crate::hub::{Delivery, ReceivedEvent};
    use crate::join::{Input, Settings};
    use crate::pods::PodStore;

    fn listed(body: &Bytes) -> usize {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        v.as_array().unwrap().len()
    }

    /// A host event the join publishes is in the next `/events` a client reads (once the
    /// rendering is `EVENTS_EVERY` old), not a second later; while nothing new is published,
    /// every read is served the one rendering, however old.
    #[test]
    fn events_are_listed_as_the_join_publishes_them() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let join = Join::start(Settings::default(), PodStore::default()).unwrap();
        let events = events_answer(join.clone());
        let before = rt.block_on(events.clone().get());
        assert_eq!(listed(&before), 0);
        let rendered = Instant::now();

        let now = gpufeed_shared::clock::realtime_ns();
        let e = ReceivedEvent {
            host: "pve1".into(),
            boot_id: 1,
            seq: 1,
            kind: 0,
            host_realtime_ns: now,
            host_monotonic_ns: 1,
            received_realtime_ns: now,
            clock_offset_ns: Some(0),
            event: link(
                LinkChangeClass::WidthReduction,
                (Some(16), 4),
                (Some(16), 1),
            ),
        };
        join.tx_for_tests()
            .send(Input::Host(Box::new(Delivery::Event(e))))
            .unwrap();
        let sent = Instant::now();
        while join.answers().events.is_empty() {
            assert!(sent.elapsed() < Duration::from_secs(5), "never published");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(EVENTS_EVERY);
        let after = rt.block_on(events.clone().get());
        assert_eq!(
            listed(&after),
            1,
            "the published event is not listed {:?} after the last rendering",
            rendered.elapsed()
        );

        // nothing new published: the same rendering, past both bounds
        std::thread::sleep(EVENTS_EVERY * 2);
        let again = rt.block_on(events.clone().get());
        assert_eq!(
            again.as_ptr(),
            after.as_ptr(),
            "rendered again with nothing new"
        );
    }
}
