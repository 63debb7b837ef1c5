//! Host link change → visible in the guest (not a test), with the real release binaries: the
//! host agent on the recorded Thunderbolt eGPU tree (scripts/demo-egpu.sh), the guest agent
//! (no probes, no Kubernetes API: only the hub and the join), QUIC with mutual TLS on
//! loopback.
//!
//! For each PCIe poll interval (`LINK_POLL_MS`, default `1000,100`): the host agent's idle CPU
//! over `LINK_IDLE_S` seconds (default 30; all threads' schedstat run time, exact) and
//! wake-ups, then `LINK_CHANGES` changes (default 60) of the GPU's link, alternately
//! 16 GT/s x4 → 2.5 GT/s x1 and back, 300–1300 ms apart. Each change is timed from the write of
//! the sysfs files to the moment the guest shows it: in `/events` (the events' `count`s add up
//! to one more), in `/metrics` (`gpufeed_host_events_total{host}` one more), and in the
//! host-state gauge `gpufeed_host_pcie_link_width{bdf}` of the guest's /metrics (sent right
//! after events and every `stream.state_interval_ms`). Target: p99 ≤ 250 ms for /events and /metrics; host idle CPU
//! ≤ 0.2% of a core.
//!
//!   cargo build --release -p gpufeed-host
//!   cargo bench -p gpufeed-guest --bench link_latency

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::host_agent::{demo, start_host, HostIntervals, GPU, HOST};
use common::{find, free_port, parse_metrics, value, wait_for, Agent};
use gpufeed_shared::procstat::{cpu_ns, switches};

/// The enclosure's downstream port: the other end of the GPU's link.
const PORT: &str = "0000:09:01.0";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// Writes a sysfs value the way the kernel's file changes for a reader: whole, at once.
fn write_attr(dev: &Path, attr: &str, v: &str) {
    let tmp = dev.join(format!("{attr}.tmp~"));
    std::fs::write(&tmp, format!("{v}\n")).unwrap();
    std::fs::rename(&tmp, dev.join(attr)).unwrap();
}

fn set_link(root: &Path, speed: &str, width: u32) {
    for dev in [GPU, PORT] {
        let d = root.join("sys/bus/pci/devices").join(dev);
        write_attr(&d, "current_link_speed", speed);
        write_attr(&d, "current_link_width", &width.to_string());
    }
}

/// Host events the guest's /metrics counts from the host, and its link width gauge.
fn metrics_view(agent: &Agent) -> (f64, Option<f64>) {
    let s = parse_metrics(&agent.try_get("/metrics").unwrap_or_default());
    let events = find(&s, "gpufeed_host_events_total", &[("host", HOST)])
        .iter()
        .map(|x| x.value)
        .sum();
    let width = value(
        &s,
        "gpufeed_host_pcie_link_width",
        &[("bdf", GPU), ("host", HOST)],
    );
    (events, width)
}

/// Host events in the guest's /events (coalesced bursts count each event).
fn events_view(agent: &Agent) -> u64 {
    let v: serde_json::Value =
        serde_json::from_str(&agent.try_get("/events").unwrap_or_default()).unwrap_or_default();
    v.as_array()
        .map(|a| {
            a.iter()
                .filter(|e| e["host"] == HOST)
                .filter_map(|e| e["count"].as_u64())
                .sum()
        })
        .unwrap_or(0)
}

/// (p50, p99, max) in ms.
fn summary(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (q(0.5), q(0.99), q(1.0))
}

struct Run {
    poll_ms: u64,
    idle_cpu: f64,
    wakeups: f64,
    events: Vec<f64>,
    metrics: Vec<f64>,
    gauge: Vec<f64>,
}

fn run(poll_ms: u64, idle_s: u64, changes: usize) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    demo(&["tree", root.to_str().unwrap()]);
    let quic = free_port();
    let host = start_host(
        dir.path(),
        quic,
        HostIntervals {
            pcie_poll_ms: Some(poll_ms),
            state_ms: None,
        },
    );
    let tls = dir.path().join("certs/guest");
    let agent = Agent::start(
        &[
            "--probes",
            "none",
            "--no-kube",
            "--quic-listen",
            &format!("127.0.0.1:{quic}"),
            "--tls-dir",
            tls.to_str().unwrap(),
        ],
        &[],
    );
    wait_for(Duration::from_secs(30), || {
        (metrics_view(&agent).1 == Some(4.0)).then_some(())
    })
    .expect("stream connected and host state received");

    let pid = host.proc.0.id();
    std::thread::sleep(Duration::from_secs(3));
    let (c0, s0, t0) = (cpu_ns(pid), switches(pid), Instant::now());
    std::thread::sleep(Duration::from_secs(idle_s));
    let wall = t0.elapsed().as_secs_f64();
    let idle_cpu = (cpu_ns(pid) - c0) as f64 / 1e9 / wall * 100.0;
    let wakeups = (switches(pid) - s0) as f64 / wall;

    let mut rng = fastrand::Rng::with_seed(7);
    let (mut events, mut metrics, mut gauge) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..changes {
        std::thread::sleep(Duration::from_millis(rng.u64(300..1300)));
        let (before_m, _) = metrics_view(&agent);
        let before_e = events_view(&agent);
        let (speed, width) = if i % 2 == 0 {
            ("2.5 GT/s PCIe", 1)
        } else {
            ("16.0 GT/s PCIe", 4)
        };
        let start = Instant::now();
        set_link(&root, speed, width);
        let (mut e, mut m, mut g) = (None, None, None);
        while (e.is_none() || m.is_none() || g.is_none())
            && start.elapsed() < Duration::from_secs(5)
        {
            let at = start.elapsed().as_secs_f64() * 1e3;
            if e.is_none() && events_view(&agent) > before_e {
                e = Some(at);
            }
            let (n, w) = metrics_view(&agent);
            if m.is_none() && n > before_m {
                m = Some(at);
            }
            if g.is_none() && w == Some(width as f64) {
                g = Some(at);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        events.push(e.expect("change reached /events within 5 s"));
        metrics.push(m.expect("change reached /metrics within 5 s"));
        gauge.push(g.expect("link width gauge changed within 5 s"));
    }
    drop(agent);
    drop(host);
    Run {
        poll_ms,
        idle_cpu,
        wakeups,
        events,
        metrics,
        gauge,
    }
}

fn main() {
    let polls: Vec<u64> = env_or("LINK_POLL_MS", "1000,100")
        .split(',')
        .filter_map(|p| p.trim().parse().ok())
        .collect();
    let idle_s: u64 = env_or("LINK_IDLE_S", "30").parse().unwrap_or(30);
    let changes: usize = env_or("LINK_CHANGES", "60").parse().unwrap_or(60);
    let runs: Vec<Run> = polls.iter().map(|p| run(*p, idle_s, changes)).collect();
    println!(
        "| pcie.poll_interval_ms | host idle CPU ({idle_s} s) | host wake-ups/s | → /events p50 / p99 / max | → /metrics (host_events_total) p50 / p99 / max | → host link gauge in /metrics p50 / p99 / max |"
    );
    println!("|---|---|---|---|---|---|");
    for mut r in runs {
        let n = r.events.len();
        let f = |v: &mut Vec<f64>| {
            let (p50, p99, max) = summary(v);
            format!("{p50:.0} / {p99:.0} / {max:.0} ms")
        };
        println!(
            "| {} | {:.3}% | {:.1} | {} | {} | {} (n = {n}) |",
            r.poll_ms,
            r.idle_cpu,
            r.wakeups,
            f(&mut r.events),
            f(&mut r.metrics),
            f(&mut r.gauge),
        );
    }
}
