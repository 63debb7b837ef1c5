//! OTLP metrics push from the real `gpufeed-host run` on a recorded eGPU host, configured by its
//! `[otlp]` section (endpoint, interval, a resource attribute) and a `--otlp-header` flag, into a
//! real OTLP receiver (VictoriaMetrics from Debian, translating as Prometheus does; the test kit's
//! `otlp_receiver`): every series of the host's /metrics is there under the same name and labels,
//! with the value /metrics had just before and just after the export the receiver holds; the
//! resource names the host. And with a receiver that accepts and never answers: the agent (one
//! current-thread runtime for everything) counts each timed-out export and still answers every
//! scrape promptly, its memory and sockets bounded.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gpufeed_testkit::otlp_receiver::{self, bracket, compare, key, OtlpReceiver};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The agent on the recorded eGPU host with `otlp` as its `[otlp]` section and `flags` after
/// `run`; serving its link series. Returns it, its /metrics address, its log and its tree.
fn start(otlp: &str, flags: &[&str]) -> (Killed, String, std::path::PathBuf, Tree) {
    let t = Tree::new();
    topology(&t);
    pve_basic(&t);
    let (cfg, addr) = recorded_host_config(&t, "otlptest", &format!("[otlp]\n{otlp}"));
    let log = t.p("agent.log");
    let agent = Killed(
        Command::new(env!("CARGO_BIN_EXE_gpufeed-host"))
            .args(["run", "--config"])
            .arg(&cfg)
            .args(flags)
            .env("RUST_LOG", "info")
            .env_remove("JOURNAL_STREAM")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_get(addr, "/metrics").is_some_and(|m| m.contains("gpufeed_host_pcie_link_width{")) {
        assert!(
            Instant::now() < deadline,
            "the agent did not serve its series; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (agent, addr.to_string(), log, t)
}

#[test]
fn pushed_values_equal_the_hosts_metrics_at_the_same_moment() {
    let Some(rx) = OtlpReceiver::start() else {
        return;
    };
    let (_agent, addr, log, _t) = start(
        &format!(
            "endpoint = \"{}\"\ninterval_ms = 1000\n\
             resource = {{ \"deployment.environment\" = \"test\" }}\n",
            rx.url()
        ),
        &["--otlp-header", "X-Gpufeed-Test=1"],
    );
    let ok = key(
        "gpufeed_host_otlp_exports_total",
        &[("host", "otlptest"), ("result", "ok")],
    );
    let scrape = || http_get(&addr, "/metrics").expect("/metrics");
    let mut last = String::new();
    for attempt in 0..5 {
        let (before, held, resources, after) = bracket(&rx, &scrape, &ok);
        for r in &resources {
            let get = |k: &str| r.get(k).map(String::as_str);
            assert_eq!(get("service_name"), Some("gpufeed-host"), "{r:?}");
            assert_eq!(get("service_instance_id"), Some("otlptest"), "{r:?}");
            assert_eq!(get("deployment_environment"), Some("test"), "{r:?}");
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
            assert_eq!(get("host_name"), Some(host.trim()), "{r:?}");
            assert_eq!(get("k8s_node_name"), None, "{r:?}");
        }
        match compare(&before, &held, &after, &[&ok]) {
            Ok(c) => {
                assert!(
                    before.keys().any(|k| k.0 == "gpufeed_host_pcie_link_width"),
                    "the link series are not among those compared"
                );
                eprintln!(
                    "{} series equal to the host's /metrics ({} histogram buckets), {} exports ok so far",
                    c.series, c.buckets, held[&ok]
                );
                let log = std::fs::read_to_string(&log).unwrap();
                assert!(log.contains("OTLP metrics push on"), "{log}");
                return;
            }
            Err(e) => {
                eprintln!("attempt {attempt}: {e}; again");
                last = e;
            }
        }
    }
    panic!("{last}");
}

fn status_of(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .map(|l| l.to_string_lossy().starts_with("socket:"))
                .unwrap_or(false)
        })
        .count()
}

#[test]
fn a_hanging_receiver_never_delays_the_hosts_scrape() {
    // accepts every connection and never reads nor answers
    let hang = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = hang.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in hang.incoming().flatten() {
            held.push(c);
        }
    });
    let (agent, addr, log, _t) = start(
        &format!(
            "endpoint = \"http://127.0.0.1:{port}/v1/metrics\"\ninterval_ms = 100\ntimeout_ms = 100\n"
        ),
        &[],
    );
    let pid = agent.0.id();
    let timeouts = || {
        let m = http_get(&addr, "/metrics").expect("/metrics");
        otlp_receiver::exposition(&m)
            .get(&key(
                "gpufeed_host_otlp_exports_total",
                &[("host", "otlptest"), ("result", "timeout")],
            ))
            .copied()
            .unwrap_or(0.0)
    };
    std::thread::sleep(Duration::from_secs(1));
    let (rss0, socks0, t0) = (status_of(pid, "VmRSS:"), sockets(pid), timeouts());
    let start = Instant::now();
    let (mut slowest, mut rss, mut socks) = (Duration::ZERO, 0, 0);
    while start.elapsed() < Duration::from_secs(8) {
        let t = Instant::now();
        assert!(http_get(&addr, "/metrics").is_some(), "/metrics answers");
        slowest = slowest.max(t.elapsed());
        rss = rss.max(status_of(pid, "VmRSS:"));
        socks = socks.max(sockets(pid));
        std::thread::sleep(Duration::from_millis(100));
    }
    let n = timeouts() - t0;
    let took = start.elapsed().as_secs_f64();
    eprintln!(
        "{n} timed-out exports in {took:.1} s; slowest scrape {slowest:?}; RSS {rss0} KiB at start, at most {rss} KiB; sockets {socks0} at start, at most {socks}"
    );
    // one per 100 ms timeout at most, and most of them
    assert!(
        n >= took / 0.2 * 0.7 && n <= took / 0.1 + 2.0,
        "{n} timeouts in {took} s"
    );
    assert!(slowest < Duration::from_millis(500), "{slowest:?}");
    assert!(
        rss.saturating_sub(rss0) < 8 * 1024,
        "RSS {rss0} -> {rss} KiB"
    );
    assert!(socks <= socks0 + 2, "sockets {socks0} -> {socks}");
    let log = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        log.matches("OTLP export failed").count(),
        1,
        "once per change of state:\n{log}"
    );
}
