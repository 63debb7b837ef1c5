//! A small fake kube-apiserver for tests: serves recorded Pod JSON over plain HTTP on
//! 127.0.0.1 (random port) to the real kube-rs client.
//!
//! * `GET /api/v1/pods[?fieldSelector=spec.nodeName%3D<node>]` answers a PodList (items filtered
//!   by the field selector exactly as the API server does; any other field selector is a 400).
//! * `GET /api/v1/pods?watch=true&resourceVersion=<rv>...` streams newline-delimited watch events
//!   with a resourceVersion above `<rv>` (objects filtered by the field selector; BOOKMARKs only
//!   with `allowWatchBookmarks=true`), then holds the stream open for further
//!   [`FakeKube::push_event`]s until `timeoutSeconds` passes or [`FakeKube::end_watches`].
//!   Without a resourceVersion (or "0") it first sends ADDED for every current object.
//! * The list reflects the events that have "happened": the initial `watch_events` happen when
//!   they are first streamed to a watcher, pushed events when pushed. A relist therefore sees
//!   modifications and deletions, with the resourceVersion of the last of them.
//! * [`FakeKube::set_unavailable`] makes every request fail with a 503 Status (API outage).
//!
//! Use from a test crate with `#[path = "common/fake_kube.rs"] mod fake_kube;`.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode, Uri};
use axum::response::Response;
use axum::Router;
use serde_json::Value;

/// Directory of the recorded API fixtures.
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kube")
}

/// A fixture file's text.
pub fn fixture(name: &str) -> String {
    let p = fixture_dir().join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

/// A newline-delimited fixture file as one string per non-empty line.
pub fn fixture_lines(name: &str) -> Vec<String> {
    fixture(name)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// One request as the fake saw it.
#[derive(Debug, Clone)]
pub struct Request {
    pub path: String,
    /// Decoded query parameters in order.
    pub query: Vec<(String, String)>,
    /// The raw `path?query`.
    pub raw: String,
}

impl Request {
    pub fn param(&self, key: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
    pub fn is_watch(&self) -> bool {
        matches!(self.param("watch"), Some("true" | "1"))
    }
}

struct Event {
    rv: u64,
    /// watch event type
    kind: String,
    /// the compact JSON line sent to watchers
    line: String,
    object: Value,
}

struct Inner {
    /// The PodList as given (metadata, kind...) with `items` replaced by the current state.
    list: Value,
    list_rv: u64,
    events: Vec<Event>,
    /// How many of `events` have happened (are applied to `list`).
    committed: usize,
    /// Watches from a resourceVersion below this get a 410 Expired ERROR event.
    compacted_rv: u64,
    requests: Vec<Request>,
}

struct State {
    inner: Mutex<Inner>,
    /// Bumped on every push and on end_watches; watchers wait on it.
    tick: tokio::sync::watch::Sender<u64>,
    /// Incremented by end_watches: streams opened under an older generation end.
    generation: std::sync::atomic::AtomicU64,
    unavailable: AtomicBool,
}

pub struct FakeKube {
    pub addr: SocketAddr,
    pub node: String,
    state: Arc<State>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl FakeKube {
    /// Serve `list_json` (a PodList) and then `watch_events` (one watch event JSON each).
    /// `node` is the node the test's agent runs on; it is only informative here (the list is
    /// filtered by whatever node the client's field selector names).
    pub async fn start(node: &str, list_json: String, watch_events: Vec<String>) -> Self {
        let list: Value = serde_json::from_str(&list_json).expect("list_json is not JSON");
        let list_rv = rv_of(&list).expect("list_json has no metadata.resourceVersion");
        assert!(
            list.get("items").is_some_and(Value::is_array),
            "list_json has no items array"
        );
        let mut inner = Inner {
            list,
            list_rv,
            events: Vec::new(),
            committed: 0,
            compacted_rv: 0,
            requests: Vec::new(),
        };
        for e in watch_events {
            inner.add_event(e);
        }
        let (tick, _) = tokio::sync::watch::channel(0u64);
        let state = Arc::new(State {
            inner: Mutex::new(inner),
            tick,
            generation: Default::default(),
            unavailable: AtomicBool::new(false),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().unwrap();
        let st = state.clone();
        let app = Router::new().fallback(move |uri: Uri| {
            let st = st.clone();
            async move { handle(st, uri) }
        });
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeKube {
            addr,
            node: node.to_string(),
            state,
            server,
        }
    }

    /// `http://127.0.0.1:<port>`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Write a kubeconfig pointing at this server (token auth, plain HTTP) as
    /// `<dir>/kubeconfig` and return its path.
    pub fn write_kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: fake\n  cluster:\n    server: {url}\n\
             contexts:\n\
             - name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\n\
             users:\n\
             - name: fake\n  user:\n    token: fake-token\n",
            url = self.url()
        );
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// A further watch event (JSON, one line); streamed to connected watchers whose field
    /// selector matches, and applied to what later lists return.
    pub fn push_event(&self, json: String) {
        {
            let mut g = self.state.inner.lock().unwrap();
            g.add_event(json);
            let n = g.events.len();
            g.commit(n);
        }
        self.state.tick.send_modify(|t| *t += 1);
    }

    /// End all open watch streams cleanly (as the API server does on timeout); clients
    /// reconnect from their last resourceVersion.
    pub fn end_watches(&self) {
        self.state.generation.fetch_add(1, Ordering::SeqCst);
        self.state.tick.send_modify(|t| *t += 1);
    }

    /// While true every request gets a 503 Status and open watches end.
    pub fn set_unavailable(&self, down: bool) {
        self.state.unavailable.store(down, Ordering::SeqCst);
        if down {
            self.end_watches();
        }
    }

    /// Forget the watch history (etcd compaction): a watch from an older resourceVersion gets
    /// a `410 Expired` ERROR event, so the client has to relist.
    pub fn compact(&self) {
        let mut g = self.state.inner.lock().unwrap();
        g.compacted_rv = g.current_rv();
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Request> {
        self.state.inner.lock().unwrap().requests.clone()
    }
}

impl Inner {
    fn add_event(&mut self, line: String) {
        let v: Value = serde_json::from_str(&line).expect("watch event is not JSON");
        let kind = v["type"]
            .as_str()
            .expect("watch event has no type")
            .to_string();
        let object = v["object"].clone();
        let rv = rv_of(&object).expect("watch event object has no metadata.resourceVersion");
        let line = serde_json::to_string(&v).unwrap(); // compact, one line
        self.events.push(Event {
            rv,
            kind,
            line,
            object,
        });
    }

    /// Apply events `[committed, upto)` to the list state.
    fn commit(&mut self, upto: usize) {
        while self.committed < upto.min(self.events.len()) {
            let ev = &self.events[self.committed];
            self.committed += 1;
            let Some(uid) = ev.object["metadata"]["uid"].as_str().map(str::to_string) else {
                continue; // BOOKMARK
            };
            let mut obj = ev.object.clone();
            if let Some(m) = obj.as_object_mut() {
                // list items carry no kind/apiVersion
                m.remove("kind");
                m.remove("apiVersion");
            }
            let kind = ev.kind.clone();
            let items = self.list["items"].as_array_mut().unwrap();
            items.retain(|i| i["metadata"]["uid"].as_str() != Some(uid.as_str()));
            if kind != "DELETED" {
                items.push(obj);
            }
        }
    }

    fn current_rv(&self) -> u64 {
        self.events[..self.committed]
            .iter()
            .map(|e| e.rv)
            .fold(self.list_rv, u64::max)
    }
}

fn rv_of(v: &Value) -> Option<u64> {
    v["metadata"]["resourceVersion"].as_str()?.parse().ok()
}

fn node_of(obj: &Value) -> Option<&str> {
    obj["spec"]["nodeName"].as_str()
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16()
    });
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

fn json_response(v: String) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(v))
        .unwrap()
}

fn handle(st: Arc<State>, uri: Uri) -> Response {
    let req = Request {
        path: uri.path().to_string(),
        query: uri.query().map(parse_query).unwrap_or_default(),
        raw: uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_default(),
    };
    st.inner.lock().unwrap().requests.push(req.clone());
    if st.unavailable.load(Ordering::SeqCst) {
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
        );
    }
    if req.path != "/api/v1/pods" {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        );
    }
    // fieldSelector: only spec.nodeName=<x> (what a node-scoped watcher sends)
    let node = match req.param("fieldSelector") {
        None | Some("") => None,
        Some(sel) => match sel.strip_prefix("spec.nodeName=") {
            Some(n) if !n.contains(',') => Some(n.to_string()),
            _ => {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("unable to parse requested fieldSelector {sel:?} (fake supports only spec.nodeName=)"),
                )
            }
        },
    };
    let matches = move |obj: &Value| node.as_deref().is_none_or(|n| node_of(obj) == Some(n));
    if req.is_watch() {
        watch_response(st, &req, matches)
    } else {
        let g = st.inner.lock().unwrap();
        let mut list = g.list.clone();
        list["metadata"]["resourceVersion"] = Value::String(g.current_rv().to_string());
        list["items"].as_array_mut().unwrap().retain(|i| matches(i));
        json_response(list.to_string())
    }
}

fn watch_response(
    st: Arc<State>,
    req: &Request,
    matches: impl Fn(&Value) -> bool + Send + Sync + 'static,
) -> Response {
    let bookmarks = req.param("allowWatchBookmarks") == Some("true");
    let timeout = req
        .param("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1800));
    let from_rv = req
        .param("resourceVersion")
        .and_then(|r| r.parse::<u64>().ok())
        .unwrap_or(0);
    let generation = st.generation.load(Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + timeout;
    // Without a resourceVersion the API server starts with the current state as ADDED.
    let mut initial: Vec<String> = Vec::new();
    let cursor = {
        let g = st.inner.lock().unwrap();
        if from_rv != 0 && from_rv < g.compacted_rv {
            // what kube-apiserver sends for a compacted resourceVersion: 200 + ERROR event
            let ev = serde_json::json!({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("too old resource version: {from_rv} ({})", g.compacted_rv),
                "reason": "Expired", "code": 410}});
            return json_response(ev.to_string() + "\n");
        }
        if from_rv == 0 {
            for item in g.list["items"].as_array().unwrap() {
                if matches(item) {
                    let mut obj = item.clone();
                    obj["kind"] = "Pod".into();
                    obj["apiVersion"] = "v1".into();
                    initial.push(serde_json::json!({"type": "ADDED", "object": obj}).to_string());
                }
            }
            g.committed
        } else {
            0
        }
    };
    initial.reverse(); // popped from the back
    let matches = Arc::new(matches);
    let rx = st.tick.subscribe();
    let s = futures::stream::unfold(
        (st, rx, cursor, initial),
        move |(st, mut rx, mut cursor, mut initial)| {
            let matches = matches.clone();
            async move {
                loop {
                    if let Some(line) = initial.pop() {
                        return Some((
                            Ok::<_, Infallible>(Bytes::from(line + "\n")),
                            (st, rx, cursor, initial),
                        ));
                    }
                    if st.generation.load(Ordering::SeqCst) != generation {
                        return None;
                    }
                    rx.borrow_and_update();
                    let next = {
                        let mut g = st.inner.lock().unwrap();
                        let mut found = None;
                        while cursor < g.events.len() {
                            let i = cursor;
                            cursor += 1;
                            let ev = &g.events[i];
                            let send = ev.rv > from_rv
                                && if ev.kind == "BOOKMARK" {
                                    bookmarks
                                } else {
                                    matches(&ev.object)
                                };
                            if send {
                                found = Some((i, ev.line.clone()));
                                break;
                            }
                        }
                        if let Some((i, _)) = found {
                            g.commit(i + 1);
                        }
                        found.map(|(_, l)| l)
                    };
                    if let Some(line) = next {
                        return Some((Ok(Bytes::from(line + "\n")), (st, rx, cursor, initial)));
                    }
                    match tokio::time::timeout_at(deadline, rx.changed()).await {
                        Ok(Ok(())) => continue,
                        _ => return None, // timeout or server gone: end the stream cleanly
                    }
                }
            }
        },
    );
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(s))
        .unwrap()
}

fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16)
                {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
