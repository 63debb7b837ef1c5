//! A real OTLP metrics receiver for both agents' OTLP push tests: VictoriaMetrics 1.112 from
//! Debian 13 (trixie), fetched by `scripts/otlp-receiver.sh` on first use (`setup.sh` runs it
//! too). Debian builds its Prometheus packages without the OTLP endpoint; VictoriaMetrics takes
//! OTLP over HTTP (protobuf) at `/opentelemetry/v1/metrics`, translates names and labels as
//! Prometheus does (`-opentelemetry.usePrometheusNaming`), stores what it gets at once
//! (`-search.latencyOffset=0s`) and answers PromQL at `/api/v1/query` as Prometheus does.
//!
//! Beside it, what the tests compare with it: a page's series keyed as the receiver's are
//! ([`exposition`]), two reads of /metrics around an export the receiver holds ([`bracket`])
//! and the comparison of the three ([`compare`]).
//!
//! Behind the kit's `otlp_receiver` feature (a JSON reader for the receiver's answers, a temp
//! dir for its storage).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::http::{get_status as get, query_encode};
use crate::prom;

/// A series: its name and its labels with a value (Prometheus and the receiver drop labels
/// whose value is empty).
pub type Key = (String, BTreeMap<String, String>);

/// The labels the receiver adds from the OTLP resource and scope.
pub const RESOURCE_LABELS: &[&str] = &[
    "service_name",
    "service_instance_id",
    "k8s_node_name",
    "host_name",
    "scope_name",
    "scope_version",
    // the one the host agent's test adds in its `[otlp]` section
    "deployment_environment",
];

/// The receiver running on loopback with its storage in a temp dir; killed when dropped.
pub struct OtlpReceiver {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The receiver's binary. `None` with a SKIP line when it cannot be had; with `CI=true` a
/// panic.
pub fn receiver_bin() -> Option<PathBuf> {
    let script = crate::repo().join("scripts/otlp-receiver.sh");
    let why = match Command::new(&script).stderr(Stdio::piped()).output() {
        Ok(o) if o.status.success() => {
            let bin = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            if bin.is_file() {
                return Some(bin);
            }
            format!("{} printed no binary", script.display())
        }
        Ok(o) => format!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => format!("{}: {e}", script.display()),
    };
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI=true and no OTLP receiver: {why}");
    }
    eprintln!("SKIP: no OTLP receiver: {why}");
    None
}

impl OtlpReceiver {
    /// Started on a free loopback port and ready; `None` (a SKIP line) when the receiver
    /// cannot be had, a panic with `CI=true`.
    pub fn start() -> Option<OtlpReceiver> {
        let bin = receiver_bin()?;
        let dir = tempfile::tempdir().unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], crate::free_port()));
        let child = Command::new(&bin)
            .arg(format!("-httpListenAddr={addr}"))
            .arg(format!(
                "-storageDataPath={}",
                dir.path().join("data").display()
            ))
            .args([
                "-search.latencyOffset=0s",
                "-search.disableCache",
                "-opentelemetry.usePrometheusNaming",
                "-loggerLevel=ERROR",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let r = OtlpReceiver {
            child,
            addr,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while get(addr, "/health").map(|(c, _)| c) != Some(200) {
            assert!(Instant::now() < deadline, "the OTLP receiver is not ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(r)
    }

    /// Where it takes OTLP metrics (HTTP, protobuf).
    pub fn url(&self) -> String {
        format!("http://{}/opentelemetry/v1/metrics", self.addr)
    }

    /// Instant query: the result vector.
    pub fn query(&self, q: &str) -> Vec<serde_json::Value> {
        let (code, body) = get(
            self.addr,
            &format!("/api/v1/query?query={}", query_encode(q)),
        )
        .expect("query the receiver");
        assert_eq!(code, 200, "{q}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Every series it holds now (its latest value), keyed without the resource's labels; and
    /// the resource's labels of each.
    pub fn series(&self) -> (BTreeMap<Key, f64>, Vec<BTreeMap<String, String>>) {
        let mut out = BTreeMap::new();
        let mut resources = Vec::new();
        for r in self.query("{__name__=~\".+\"}") {
            let mut labels: BTreeMap<String, String> = r["metric"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect();
            let name = labels.remove("__name__").unwrap();
            let resource = labels
                .iter()
                .filter(|(k, _)| RESOURCE_LABELS.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            labels.retain(|k, _| !RESOURCE_LABELS.contains(&k.as_str()));
            let v: f64 = r["value"][1].as_str().unwrap().parse().unwrap();
            out.insert((name, labels), v);
            resources.push(resource);
        }
        (out, resources)
    }
}

/// The series of a text exposition, keyed as [`OtlpReceiver::series`] keys them (empty
/// labels left out).
pub fn exposition(text: &str) -> BTreeMap<Key, f64> {
    prom::parse(text)
        .into_iter()
        .map(|mut x| {
            x.labels.retain(|_, v| !v.is_empty());
            ((x.name, x.labels), x.value)
        })
        .collect()
}

/// A series' key from its name and labels.
pub fn key(name: &str, labels: &[(&str, &str)]) -> Key {
    (
        name.to_string(),
        labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// What [`compare`] found.
pub struct Compared {
    pub series: usize,
    pub buckets: usize,
    pub ok_exports: f64,
}

/// The first read of /metrics, the receiver's series, their resources, the second read.
pub type Bracket = (
    BTreeMap<Key, f64>,
    BTreeMap<Key, f64>,
    Vec<BTreeMap<String, String>>,
    BTreeMap<Key, f64>,
);

/// Reads the agent's /metrics (`scrape`), waits for an export rendered after that read to
/// reach the receiver (its own `ok` count, `ok`, is higher), reads /metrics again, and
/// returns the receiver's series with both reads. The export it holds lies between the two
/// reads.
pub fn bracket(rx: &OtlpReceiver, scrape: &dyn Fn() -> String, ok: &Key) -> Bracket {
    let before = exposition(&scrape());
    let n = before[ok];
    let deadline = Instant::now() + Duration::from_secs(20);
    let (held, resources) = loop {
        let s = rx.series();
        if s.0.get(ok).copied().unwrap_or(0.0) > n {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "no export after the first read reached the receiver"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let after = exposition(&scrape());
    assert!(
        held[ok] <= after[ok],
        "the export the receiver holds was rendered before the second read"
    );
    (before, held, resources, after)
}

/// The receiver holds exactly /metrics' series, and, for every series that did not move
/// between the two reads (all but `moving`), exactly its value. `Err` names the series that
/// moved (read again).
pub fn compare(
    before: &BTreeMap<Key, f64>,
    held: &BTreeMap<Key, f64>,
    after: &BTreeMap<Key, f64>,
    moving: &[&Key],
) -> Result<Compared, String> {
    let scraped: Vec<&Key> = before.keys().collect();
    let pushed: Vec<&Key> = held.keys().collect();
    assert_eq!(
        pushed, scraped,
        "the receiver's series are not /metrics' series"
    );
    let moved: Vec<&Key> = before
        .keys()
        .filter(|k| before.get(*k) != after.get(*k) && !moving.contains(k))
        .collect();
    if !moved.is_empty() {
        return Err(format!("series moved between the two reads: {moved:?}"));
    }
    let mut c = Compared {
        series: 0,
        buckets: 0,
        ok_exports: 0.0,
    };
    let mut unequal = Vec::new();
    for (k, v) in before {
        if moving.contains(&k) {
            continue;
        }
        c.series += 1;
        if k.0.ends_with("_bucket") {
            c.buckets += 1;
        }
        let got = held[k];
        if got != *v && !(got.is_nan() && v.is_nan()) {
            unequal.push(format!("{k:?}: /metrics {v}, receiver {got}"));
        }
    }
    assert!(
        unequal.is_empty(),
        "values differ from /metrics:\n{}",
        unequal.join("\n")
    );
    Ok(c)
}
