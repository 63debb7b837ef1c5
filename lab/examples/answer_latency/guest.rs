//! The guest agent on this machine (the real binary: hub, journal, join, page; no probes, no
//! Kubernetes API) and what a user of it sees: `/events` and `/metrics`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use gpufeed_testkit::http::get;
use gpufeed_testkit::prom;

pub struct Guest {
    child: Child,
    pub metrics: SocketAddr,
    pub journal: PathBuf,
}

impl Guest {
    pub fn start(bin: &Path, dir: &Path, quic: u16, tls: &Path) -> Guest {
        let metrics: SocketAddr = format!("127.0.0.1:{}", gpufeed_testkit::free_port())
            .parse()
            .unwrap();
        let journal = dir.join("events.jsonl");
        let child = Command::new(bin)
            .args(["run", "--probes", "none", "--no-kube"])
            .arg("--metrics-listen")
            .arg(metrics.to_string())
            .arg("--quic-listen")
            .arg(format!("127.0.0.1:{quic}"))
            .arg("--tls-dir")
            .arg(tls)
            .arg("--event-journal")
            .arg(&journal)
            .env("RUST_LOG", "warn")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("guest.log")).unwrap())
            .spawn()
            .unwrap();
        Guest {
            child,
            metrics,
            journal,
        }
    }

    pub fn scrape(&self) -> Vec<prom::Sample> {
        prom::parse(&get(self.metrics, "/metrics").unwrap_or_default())
    }

    /// The newest `time` of the listed events of `host` whose correlation kind is `event`.
    pub fn newest_event(&self, host: &str, event: &str) -> Option<i64> {
        let v: serde_json::Value =
            serde_json::from_str(&get(self.metrics, "/events")?).unwrap_or_default();
        v.as_array()?
            .iter()
            .filter(|e| e["host"] == host && e["event"] == event)
            .filter_map(|e| e["time"].as_i64())
            .max()
    }

    /// The journal's lines so far (the events as the hub accepted them, host stamps kept).
    pub fn journal(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.journal)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
