//! Soak under a flapping link (a benchmark, not a test): the host agent's stream (routing, spool
//! on disk, QUIC with mutual TLS) in this process, and the real guest release binary (hub,
//! journal, join, page) as a child, on loopback. Ten links flap between speeds and widths as
//! idle GPUs' links do; the events are pushed at RATE per second until EVENTS are sent. Every
//! SAMPLE_S seconds it prints the guest's RSS and peak RSS, its CPU over the interval, the size of
//! `/api/state` and `/events`, the journal's size on disk, and how many events the hub received
//! and the join counted. At the end: every pushed event is received or counted lost, every
//! received event joined, none dropped on the way to the join.
//!
//!     cargo build --release -p gpufeed-guest
//!     cargo run --release -p gpufeed-host --example soak [-- EVENTS RATE SAMPLE_S]
//!
//! Defaults: 500,000 events at 5,000/s (the PCIe watcher at its shortest poll, 100 ms, sees each
//! link change at most ten times a second: ten links flapping at every poll are 100/s), a sample
//! every 10 s. The guest binary is `target/release/gpufeed-guest` (or `GPUFEED_GUEST`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpufeed_host::stream::{self, GuestEndpoint, StreamConfig};
use gpufeed_shared::clock;
use gpufeed_shared::event::samples::gpu_link_change;
use gpufeed_shared::event::{HostEvent, LinkChangeClass, Stamped};
use gpufeed_shared::procstat;
use gpufeed_shared::tls;

/// The `i`th change: link `i % 10` through 16 → 2.5 → 16 GT/s x4 → 8 GT/s x1.
fn flap(i: u64) -> Stamped {
    let state = |r: u64| match r % 4 {
        0 => (Some(16000), 4),
        1 => (Some(2500), 4),
        2 => (Some(16000), 4),
        _ => (Some(8000), 1),
    };
    let (old, new) = (state(i / 10 + 3), state(i / 10));
    let class = match new.1.cmp(&old.1) {
        std::cmp::Ordering::Less => LinkChangeClass::WidthReduction,
        std::cmp::Ordering::Greater => LinkChangeClass::WidthIncrease,
        std::cmp::Ordering::Equal => LinkChangeClass::SpeedOnly,
    };
    let bdf = format!("0000:{:02x}:00.0", 0x0a + i % 10);
    Stamped {
        realtime_ns: clock::realtime_ns(),
        monotonic_ns: clock::monotonic_ns(),
        event: HostEvent::PcieLinkChange(gpu_link_change(&bdf, "0000:09:01.0", old, new, class)),
    }
}

/// A GET on loopback: the body (empty on failure).
fn get(addr: SocketAddr, path: &str) -> Vec<u8> {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return Vec::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    match buf.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(i) => buf.split_off(i + 4),
        None => Vec::new(),
    }
}

/// The sum of a series' samples in a Prometheus text exposition (labels ignored).
fn sum(text: &str, name: &str) -> f64 {
    gpufeed_testkit::prom::sum(&gpufeed_testkit::prom::parse(text), name, &[])
}

fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let total = args.first().copied().unwrap_or(500_000);
    let rate = args.get(1).copied().unwrap_or(5_000).max(1);
    let sample = Duration::from_secs(args.get(2).copied().unwrap_or(10).max(1));
    let guest_bin = std::env::var("GPUFEED_GUEST").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/release/gpufeed-guest"
        )
        .into()
    });

    let dir = tempfile::tempdir().unwrap();
    let dep = tls::Deployment::generate("127.0.0.1", &["pve1".into()]).unwrap();
    dep.write_guest_dir(dir.path()).unwrap();
    dep.write_host_files(dir.path()).unwrap();
    let quic = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let journal = dir.path().join("events.jsonl");
    let mut guest = Command::new(&guest_bin)
        .args(["run", "--probes", "none", "--no-kube"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .args(["--quic-listen", &quic.to_string()])
        .arg("--tls-dir")
        .arg(dir.path())
        .arg("--event-journal")
        .arg(&journal)
        .env("RUST_LOG", "warn,gpufeed_guest=info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{guest_bin}: {e} (cargo build --release -p gpufeed-guest)"));
    let pid = guest.id();
    // the agent logs the address it serves on
    let mut log = BufReader::new(guest.stderr.take().unwrap());
    let addr: SocketAddr = loop {
        let mut line = String::new();
        assert!(log.read_line(&mut line).unwrap() > 0, "the guest exited");
        if let Some(a) = line.split("addr=").nth(1) {
            if line.contains("serving /metrics") {
                break a.trim().parse().unwrap();
            }
        }
    };
    std::thread::spawn(move || std::io::copy(&mut log, &mut std::io::sink()));

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let spool = dir.path().join("spool");
    let cfg = StreamConfig {
        ca: dir.path().join(tls::CA_FILE),
        cert: dir.path().join(tls::host_cert_file("pve1")),
        key: dir.path().join(tls::host_key_file("pve1")),
        spool_dir: spool,
        guests: vec![GuestEndpoint {
            endpoint: quic.to_string(),
            name: "guest".into(),
            server_name: String::new(),
            vmids: vec![],
            devices: vec![],
        }],
        ..StreamConfig::default()
    };
    let host_reg = prometheus::Registry::new();
    let h = rt
        .block_on(async { stream::start(cfg, "pve1".into(), &host_reg) })
        .unwrap();

    println!(
        "soak: {total} link changes of 10 links at {rate}/s into {guest_bin} (pid {pid}), a sample every {} s",
        sample.as_secs()
    );
    println!(
        "| t (s) | pushed | received | joined | guest RSS (MB) | peak RSS (MB) | guest CPU (% of a core) | /api/state (KB) | /events (KB) | journal (MB) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let t0 = Instant::now();
    let mut pushed = 0u64;
    let mut next_sample = t0 + sample;
    let mut cpu_prev = (procstat::cpu_ns(pid), Instant::now());
    let mut report = |pushed: u64| {
        let metrics = String::from_utf8_lossy(&get(addr, "/metrics")).into_owned();
        let state = get(addr, "/api/state").len();
        let events = get(addr, "/events").len();
        let cpu = procstat::cpu_ns(pid);
        let cpu_pct = (cpu - cpu_prev.0) as f64 / cpu_prev.1.elapsed().as_nanos() as f64 * 100.0;
        cpu_prev = (cpu, Instant::now());
        let journal_mb = std::fs::metadata(&journal).map_or(0, |m| m.len()) as f64 / 1e6;
        println!(
            "| {:.0} | {pushed} | {} | {} | {:.1} | {:.1} | {cpu_pct:.1} | {:.0} | {:.0} | {journal_mb:.1} |",
            t0.elapsed().as_secs_f64(),
            sum(&metrics, "gpufeed_stream_events_received_total"),
            sum(&metrics, "gpufeed_host_events_total"),
            procstat::rss_kib(pid) as f64 / 1024.0,
            peak_rss_kib(pid) as f64 / 1024.0,
            state as f64 / 1024.0,
            events as f64 / 1024.0,
        );
        (
            sum(&metrics, "gpufeed_stream_events_received_total"),
            sum(&metrics, "gpufeed_stream_events_lost_total"),
            sum(&metrics, "gpufeed_host_events_total"),
            sum(&metrics, "gpufeed_join_events_dropped_total"),
        )
    };
    // push in batches of 1/100 s at the rate, on schedule
    let batch = (rate / 100).max(1);
    while pushed < total {
        let due = t0 + Duration::from_secs_f64(pushed as f64 / rate as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let n = batch.min(total - pushed);
        let events: Vec<Stamped> = (pushed..pushed + n).map(flap).collect();
        h.push(&events);
        pushed += n;
        if Instant::now() >= next_sample {
            next_sample += sample;
            report(pushed);
        }
    }
    // let the guest take what is in flight
    let settled = Instant::now();
    let (received, lost, joined, dropped) = loop {
        std::thread::sleep(sample.min(Duration::from_secs(2)));
        let r = report(pushed);
        if r.0 + r.1 >= total as f64 && r.2 >= r.0 || settled.elapsed() > Duration::from_secs(120) {
            break r;
        }
    };
    println!(
        "pushed {pushed}, received {received}, counted lost {lost}, joined {joined}, dropped on the way to the join {}; in {:.0} s",
        dropped.abs(),
        t0.elapsed().as_secs_f64()
    );
    let _ = guest.kill();
    let _ = guest.wait();
    assert_eq!(
        received + lost,
        total as f64,
        "every event received or counted lost"
    );
    assert_eq!(joined, received, "every received event joined");
    assert_eq!(dropped, 0.0);
}
