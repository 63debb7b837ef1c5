//! The guest's HTTP server listens on the node address, which every pod can reach: 5,000
//! connections that send half a request and stall must not grow the process by more than
//! 40 MB, must not keep a normal scrape from answering, and must be closed after the header
//! read timeout; slow clients from 64 addresses, reopening what the server closes, must not
//! keep the kubelet's probes or a scrape from answering within 1 s. The server runs in this
//! test process (the RSS covers the clients' side too); the tests run one at a time.
//!
//! Then the real agent under the same flood, with its probes and a host streaming to it:
//! probes, scrapes, its own memory, its probes' series and a host restarted meanwhile.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const SLOW: usize = 5_000;

/// This test process's resident memory.
fn rss_bytes() -> u64 {
    rss_of(std::process::id())
}

/// A process's resident memory (`VmRSS`), bytes.
fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

async fn slow_client(from: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(from.parse().unwrap())?;
    let mut s = sock.connect(to).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: node\r\nUser-Agent: slo")
        .await?;
    Ok(s)
}

async fn scrape(to: SocketAddr) -> String {
    let mut s = TcpStream::connect(to).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The tests measure the process's memory and load: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_cost_bounded_memory_and_a_scrape_still_answers() {
    let _serial = SERIAL.lock().await;
    let reg = prometheus::Registry::new();
    let g = prometheus::IntGauge::new("slow_clients_test_gauge", "a value to scrape").unwrap();
    g.set(42);
    reg.register(Box::new(g)).unwrap();
    let listener = gpufeed_shared::http::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gpufeed_guest::exporter::serve(
        listener,
        reg,
        Arc::new(|| true),
        axum::Router::new(),
    ));
    assert!(scrape(addr).await.contains("slow_clients_test_gauge 42"));
    let base = rss_bytes();

    let mut held = Vec::with_capacity(SLOW);
    for _ in 0..SLOW {
        // A connection the server closes at once is fine: the point is what it keeps.
        if let Ok(s) = slow_client("127.0.0.2:0", addr).await {
            held.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    let body = tokio::time::timeout(Duration::from_secs(5), scrape(addr))
        .await
        .expect("scrape answered while slow clients are held");
    let scrape_time = t0.elapsed();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("slow_clients_test_gauge 42"));
    let grown = rss_bytes().saturating_sub(base);
    eprintln!(
        "{} slow connections held: RSS grew {} KiB, scrape took {scrape_time:?}",
        held.len(),
        grown >> 10
    );
    assert!(grown < 40 << 20, "RSS grew {} MiB", grown >> 20);

    // Every slow connection is closed by the server within the header read timeout (5 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut open = 0;
    for s in &mut held {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut b = [0u8; 512];
        match tokio::time::timeout(left, s.read(&mut b)).await {
            Ok(_) => {}
            Err(_) => open += 1,
        }
    }
    assert_eq!(open, 0, "slow connections still open after 10 s");
}

/// One GET from `from` with the kubelet's probe timeout (1 s): whether a 200 with `expect` in
/// the body came back in time.
async fn answered_within_1s(from: &str, to: SocketAddr, path: &str, expect: &str) -> bool {
    get_within_1s(from, to, path)
        .await
        .is_some_and(|body| body.contains(expect))
}

/// One GET from `from` with a 1 s timeout: the whole response if it was a 200 in time.
async fn get_within_1s(from: &str, to: SocketAddr, path: &str) -> Option<String> {
    let get = async {
        let sock = TcpSocket::new_v4()?;
        sock.bind(from.parse().unwrap())?;
        let mut s = sock.connect(to).await?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        std::io::Result::Ok(out)
    };
    match tokio::time::timeout(Duration::from_secs(1), get).await {
        Ok(Ok(body)) if body.starts_with("HTTP/1.1 200") => Some(body),
        _ => None,
    }
}

/// Addresses of the flood, and connections each keeps open (half-sent requests, reopened as
/// the server closes them): 64 x 12 = 768, more than the 512 places of the listener.
const FLOOD_ADDRESSES: u8 = 64;
const FLOOD_PER_ADDRESS: usize = 12;
/// Probes and scrapes, one each per 200 ms.
const PROBES: usize = 100;

/// Keeps [`FLOOD_PER_ADDRESS`] half-sent requests open to `to` from each of
/// [`FLOOD_ADDRESSES`] addresses (127.0.1.10 and on), each reopened 250 ms after the server
/// closes it (evicted, refused, or at the header read timeout), until `stop`; counts the
/// connections opened.
fn flood(
    to: SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
    opened: Arc<std::sync::atomic::AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut flood = Vec::new();
    for a in 0..FLOOD_ADDRESSES {
        for _ in 0..FLOOD_PER_ADDRESS {
            let (stop, opened) = (stop.clone(), opened.clone());
            let from = format!("127.0.1.{}:0", 10 + a);
            flood.push(tokio::spawn(async move {
                use std::sync::atomic::Ordering::Relaxed;
                while !stop.load(Relaxed) {
                    if let Ok(mut s) = slow_client(&from, to).await {
                        opened.fetch_add(1, Relaxed);
                        let mut b = [0u8; 256];
                        let _ = tokio::time::timeout(Duration::from_secs(30), s.read(&mut b)).await;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }));
        }
    }
    flood
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_from_64_addresses_cannot_starve_probes_or_scrapes() {
    let _serial = SERIAL.lock().await;
    let reg = prometheus::Registry::new();
    let g = prometheus::IntGauge::new("flood_test_gauge", "a value to scrape").unwrap();
    g.set(7);
    reg.register(Box::new(g)).unwrap();
    let listener = gpufeed_shared::http::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let metrics = listener.local_addr().unwrap();
    let healthy: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(|| true);
    tokio::spawn(gpufeed_guest::exporter::serve(
        listener,
        reg,
        healthy.clone(),
        axum::Router::new(),
    ));
    // The probe listener of its own, as the agent runs it (loopback).
    let probe_listener = gpufeed_shared::http::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let probes = probe_listener.local_addr().unwrap();
    tokio::spawn(gpufeed_guest::exporter::serve_health(
        probe_listener,
        gpufeed_guest::exporter::health_router(healthy),
    ));
    assert!(answered_within_1s("127.0.0.1:0", metrics, "/metrics", "flood_test_gauge 7").await);
    let base = rss_bytes();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let flood = flood(metrics, stop.clone(), opened.clone());
    // The flood holds every place before the first probe.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (mut healthz, mut probe_port, mut scrapes) = (0, 0, 0);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    for _ in 0..PROBES {
        tick.tick().await;
        // The kubelet (another address) on the metrics port and on the probe port, and a
        // Prometheus on the metrics port, concurrently.
        let (h, p, m) = tokio::join!(
            answered_within_1s("127.0.0.200:0", metrics, "/healthz", "ok"),
            answered_within_1s("127.0.0.1:0", probes, "/healthz", "ok"),
            answered_within_1s("127.0.0.201:0", metrics, "/metrics", "flood_test_gauge 7"),
        );
        healthz += h as usize;
        probe_port += p as usize;
        scrapes += m as usize;
    }
    let grown = rss_bytes().saturating_sub(base);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in flood {
        t.abort();
    }
    let opened = opened.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "flood of {FLOOD_ADDRESSES} addresses x {FLOOD_PER_ADDRESS} ({opened} connections opened): \
         /healthz {healthz}/{PROBES} on the metrics port, {probe_port}/{PROBES} on the probe port, \
         scrapes {scrapes}/{PROBES} within 1 s; RSS grew {} KiB",
        grown >> 10
    );
    // The flood did reach the listener's limit (its connections were closed and reopened).
    assert!(
        opened > 512 + 64,
        "the flood opened only {opened} connections"
    );
    assert!(healthz * 100 >= PROBES * 99, "/healthz {healthz}/{PROBES}");
    assert!(
        probe_port * 100 >= PROBES * 99,
        "probe port {probe_port}/{PROBES}"
    );
    assert!(scrapes * 100 >= PROBES * 99, "scrapes {scrapes}/{PROBES}");
    assert!(grown < 40 << 20, "RSS grew {} MiB", grown >> 20);
}

/// The DaemonSet's memory limit (talos/kubernetes/base/daemonset.yaml).
const MEMORY_LIMIT: u64 = 256 << 20;

/// The run-queue observations counted for `uid` in a scrape's body.
fn run_queue_count(body: &str, uid: &str) -> f64 {
    let text = body.split_once("\r\n\r\n").map_or(body, |(_, b)| b);
    common::value(
        &common::parse_metrics(text),
        "ebpf_sched_latency_microseconds_count",
        &[("pod", uid)],
    )
    .unwrap_or(0.0)
}

/// The real `gpufeed-guest` (run-queue probe on, a host agent streaming to it over QUIC) under
/// the flood above on its metrics port: the kubelet's probes on the probe port and a
/// Prometheus scrape answer at least 99 of 100 within 1 s, the agent stays far under the
/// DaemonSet's memory limit, its probe keeps counting a busy pod's run-queue waits, and the
/// host, killed and restarted in the middle of the flood, streams again within 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_binary_under_the_flood_keeps_its_probes_series_memory_and_host() {
    use common::host_agent::{demo, guest_of_host, host_binary, start_host, HostIntervals, HOST};
    let Some(_lock) = common::require_root() else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let quic = common::free_port();
    let (agent, host, sb, pod) = tokio::task::block_in_place(|| {
        demo(&["tree", dir.path().join("root").to_str().unwrap()]);
        let host = start_host(dir.path(), quic, HostIntervals::FAST);
        let agent = guest_of_host(dir.path(), quic, "1s", "sched_latency", &[]);
        let sb = common::CgroupSandbox::new();
        let mut pod = common::Pod::random(&sb, common::Layout::Cgroupfs, "burstable");
        pod.spawn("exec sh -c 'while :; do sleep 0.005; done'");
        (agent, host, sb, pod)
    });
    let log = agent.log.lock().unwrap().clone();
    let probes: SocketAddr = log
        .lines()
        .find(|l| l.contains("serving the probes"))
        .and_then(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("addr=")?.parse().ok())
        })
        .expect("the probe listener's address in the log");
    let metrics = agent.addr;
    let received = |body: &str| {
        let text = body.split_once("\r\n\r\n").map_or(body, |(_, b)| b);
        common::value(
            &common::parse_metrics(text),
            "gpufeed_stream_events_received_total",
            &[("host", HOST)],
        )
        .unwrap_or(0.0)
    };

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let flood = flood(metrics, stop.clone(), opened.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = get_within_1s("127.0.0.201:0", metrics, "/metrics")
        .await
        .expect("a scrape as the flood starts");
    let (mut healthz, mut scrapes, mut max_rss) = (0, 0, 0);
    let mut host = Some(host);
    let mut restarted: Option<(Instant, f64)> = None;
    let mut reconnected = None;
    let mut last = first.clone();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    for i in 0..PROBES {
        tick.tick().await;
        if i == 25 {
            // The host dies and comes back (systemd's restart) while the flood goes on.
            drop(host.take());
            let before = received(&last);
            let child = std::process::Command::new(host_binary())
                .args(["run", "--config"])
                .arg(dir.path().join("host.toml"))
                .env("RUST_LOG", "warn")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::inherit())
                .spawn()
                .unwrap();
            host = Some(common::host_agent::HostAgent {
                proc: common::Proc(child),
                metrics: "127.0.0.1:1".parse().unwrap(),
            });
            restarted = Some((Instant::now(), before));
        }
        let (h, m) = tokio::join!(
            answered_within_1s("127.0.0.1:0", probes, "/healthz", "ok"),
            get_within_1s("127.0.0.201:0", metrics, "/metrics"),
        );
        healthz += h as usize;
        if let Some(body) = m {
            scrapes += 1;
            if let (Some((at, before)), None) = (restarted, reconnected) {
                if received(&body) > before {
                    reconnected = Some(at.elapsed());
                }
            }
            last = body;
        }
        max_rss = max_rss.max(rss_of(agent.child.id()));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in flood {
        t.abort();
    }
    let opened = opened.load(std::sync::atomic::Ordering::Relaxed);
    let (w0, w1) = (
        run_queue_count(&first, &pod.uid),
        run_queue_count(&last, &pod.uid),
    );
    eprintln!(
        "the agent under {FLOOD_ADDRESSES} x {FLOOD_PER_ADDRESS} slow clients ({opened} opened): \
         probe port /healthz {healthz}/{PROBES}, scrapes {scrapes}/{PROBES} within 1 s; RSS at \
         most {:.1} MB; the pod's run-queue observations {w0} -> {w1}; the restarted host \
         streamed again after {reconnected:?}",
        max_rss as f64 / 1e6
    );
    assert!(
        opened > 512 + 64,
        "the flood opened only {opened} connections"
    );
    assert!(healthz * 100 >= PROBES * 99, "/healthz {healthz}/{PROBES}");
    assert!(scrapes * 100 >= PROBES * 99, "scrapes {scrapes}/{PROBES}");
    assert!(max_rss < MEMORY_LIMIT / 4, "RSS {max_rss}");
    assert!(w1 > w0 + 100.0, "the probe kept counting: {w0} -> {w1}");
    let took = reconnected.expect("the restarted host streamed again");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    drop(pod);
    drop(sb);
}
