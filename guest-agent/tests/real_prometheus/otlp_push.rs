//! OTLP metrics push (`--otlp-endpoint`) from the real agent binary.
//!
//! * Into a real OTLP receiver (VictoriaMetrics from Debian, translating as Prometheus does):
//!   every series of the agent's /metrics is there under the same name and labels (plus the
//!   resource's), and the values read back equal the agent's /metrics read just before and
//!   just after the export the receiver holds (the kernel probe's histogram buckets included).
//! * Against a receiver that is down, hangs, or refuses: each failed export is counted by
//!   result, the agent's memory and open sockets stay bounded, /metrics answers promptly
//!   throughout, and the log says it once per change of state, not per attempt.

use crate::common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use gpufeed_testkit::otlp_receiver::{bracket, compare, key, OtlpReceiver};

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn pushed_values_equal_the_scrape_at_the_same_moment() {
    let Some(_lock) = require_root() else { return };
    let Some(rx) = OtlpReceiver::start() else {
        return;
    };
    let node = format!("otlp-node-{}", uniq());
    // a 60 s tick: the probe's series move only at ticks, so that two reads of /metrics a few
    // seconds apart can bracket an export and agree
    let agent = Agent::no_kube(
        "60s",
        "sched_latency",
        &[
            "--node-name",
            &node,
            "--otlp-endpoint",
            &rx.url(),
            "--otlp-interval",
            "1s",
            "--otlp-header",
            "X-Gpufeed-Test=1",
        ],
    );
    let ok = key("gpufeed_otlp_exports_total", &[("result", "ok")]);
    // the scrape's own duration is measured anew by each rendering (a scrape's or an export's)
    let own_duration = key("gpufeed_scrape_duration_seconds", &[]);
    let scrape = || agent.try_get("/metrics").expect("/metrics");
    let mut last = String::new();
    for attempt in 0..5 {
        let (before, held, resources, after) = bracket(&rx, &scrape, &ok);
        // the resource: what the agent says it is
        for r in &resources {
            assert_eq!(r.get("k8s_node_name"), Some(&node), "{r:?}");
            assert_eq!(r.get("service_instance_id"), Some(&node), "{r:?}");
            assert_eq!(
                r.get("service_name").map(String::as_str),
                Some("gpufeed-guest")
            );
            assert_eq!(r.get("host_name"), Some(&hostname()), "{r:?}");
        }
        match compare(&before, &held, &after, &[&ok, &own_duration]) {
            Ok(c) => {
                assert!(
                    c.buckets >= 20
                        && before
                            .keys()
                            .any(|k| k.0 == "ebpf_sched_latency_microseconds_sum"),
                    "the probe's histogram is not among the series compared ({} buckets)",
                    c.buckets
                );
                eprintln!(
                    "{} series equal to /metrics ({} histogram buckets), {} exports ok so far",
                    c.series, c.buckets, held[&ok]
                );
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

/// What the stand-in receiver does with each connection.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Accepts and never reads nor answers.
    Hang,
    /// Reads the request and answers with this status.
    Status(u16),
}

/// A receiver on `port` whose behaviour the test switches: hanging, or answering a status.
struct Faulty {
    mode: Arc<Mutex<Mode>>,
    accepted: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
}

impl Faulty {
    fn start(port: u16, mode: Mode) -> Faulty {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let f = Faulty {
            mode: Arc::new(Mutex::new(mode)),
            accepted: Arc::default(),
            requests: Arc::default(),
        };
        let (mode, accepted, requests) = (f.mode.clone(), f.accepted.clone(), f.requests.clone());
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                accepted.fetch_add(1, Ordering::Relaxed);
                match *mode.lock().unwrap() {
                    Mode::Hang => held.push(conn),
                    Mode::Status(code) => {
                        let requests = requests.clone();
                        std::thread::spawn(move || answer(conn, code, &requests));
                    }
                }
            }
        });
        f
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }
}

/// Reads one HTTP request (headers and `Content-Length` body) and answers `code`.
fn answer(mut conn: TcpStream, code: u16, requests: &AtomicUsize) {
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let body_start = loop {
        let Ok(n) = conn.read(&mut chunk) else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..body_start]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < body_start + len {
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    requests.fetch_add(1, Ordering::Relaxed);
    let _ = write!(
        conn,
        "HTTP/1.1 {code} Stand-in\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: close\r\n\r\nnope\n"
    );
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// The agent's open sockets.
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

fn exports(agent: &Agent, result: &str) -> f64 {
    value(
        &agent.scrape(),
        "gpufeed_otlp_exports_total",
        &[("result", result)],
    )
    .unwrap_or(0.0)
}

/// While the receiver is in one state for `d`: /metrics is scraped every 100 ms, the slowest
/// scrape, the agent's largest RSS and socket count returned.
fn hold(agent: &Agent, d: Duration) -> (Duration, u64, usize) {
    let pid = agent.child.id();
    let (mut slowest, mut rss, mut socks) = (Duration::ZERO, 0, 0);
    let end = Instant::now() + d;
    while Instant::now() < end {
        let t = Instant::now();
        let body = agent.try_get("/metrics").expect("/metrics answers");
        slowest = slowest.max(t.elapsed());
        assert!(body.contains("gpufeed_otlp_exports_total"));
        rss = rss.max(rss_kib(pid));
        socks = socks.max(sockets(pid));
        std::thread::sleep(Duration::from_millis(100));
    }
    (slowest, rss, socks)
}

#[test]
fn a_receiver_down_hanging_or_refusing_costs_bounded_memory_and_never_delays_a_scrape() {
    let port = free_port(); // nothing listens there yet: connections are refused
    let interval = Duration::from_millis(100);
    let agent = Agent::no_kube(
        "1s",
        "none",
        &[
            "--otlp-endpoint",
            &format!("http://127.0.0.1:{port}/v1/metrics"),
            "--otlp-interval",
            "100ms",
            "--otlp-timeout",
            "100ms",
        ],
    );
    let pid = agent.child.id();
    let phase = Duration::from_secs(6);
    // at most one export per interval; each failed one is counted (timeouts add their 100 ms)
    let check = |result: &str, before: f64, took: Duration, per: Duration| -> f64 {
        let now = exports(&agent, result);
        let most = took.as_secs_f64() / interval.as_secs_f64() + 2.0;
        let least = 0.7 * took.as_secs_f64() / per.as_secs_f64();
        let n = now - before;
        assert!(
            n >= least && n <= most,
            "{result}: {n} exports counted in {took:?} (expected {least:.0}..{most:.0})"
        );
        n
    };

    // down: connection refused
    std::thread::sleep(Duration::from_secs(1));
    let (rss0, socks0) = (rss_kib(pid), sockets(pid));
    let t = Instant::now();
    let e0 = exports(&agent, "error");
    let (slow_down, rss_down, socks_down) = hold(&agent, phase);
    let n_down = check("error", e0, t.elapsed(), interval);

    // hanging: accepts, never answers
    let rx = Faulty::start(port, Mode::Hang);
    let t = Instant::now();
    let t0 = exports(&agent, "timeout");
    let (slow_hang, rss_hang, socks_hang) = hold(&agent, phase);
    let n_hang = check("timeout", t0, t.elapsed(), interval * 2);
    let accepted_hang = rx.accepted.load(Ordering::Relaxed);

    // refusing: 503, then 400
    rx.set(Mode::Status(503));
    let t = Instant::now();
    let r0 = exports(&agent, "refused");
    let (slow_503, rss_503, socks_503) = hold(&agent, phase / 2);
    rx.set(Mode::Status(400));
    let (slow_400, rss_400, socks_400) = hold(&agent, phase / 2);
    let n_refused = check("refused", r0, t.elapsed(), interval);
    let answered = rx.requests.load(Ordering::Relaxed);
    assert!(
        answered as f64 >= n_refused,
        "{answered} requests read for {n_refused} refusals"
    );

    // and back: 200
    rx.set(Mode::Status(200));
    let o0 = exports(&agent, "ok");
    let t = Instant::now();
    let (slow_ok, _, _) = hold(&agent, Duration::from_secs(2));
    check("ok", o0, t.elapsed(), interval);

    let slowest = [slow_down, slow_hang, slow_503, slow_400, slow_ok]
        .into_iter()
        .max()
        .unwrap();
    let rss_max = [rss_down, rss_hang, rss_503, rss_400]
        .into_iter()
        .max()
        .unwrap();
    let socks_max = [socks_down, socks_hang, socks_503, socks_400]
        .into_iter()
        .max()
        .unwrap();
    eprintln!(
        "exports counted: {n_down} error (down), {n_hang} timeout (hanging; {accepted_hang} connections it accepted), {n_refused} refused (503, 400); \
         slowest scrape {slowest:?} (down {slow_down:?}, hanging {slow_hang:?}, 503 {slow_503:?}, 400 {slow_400:?}); \
         RSS {rss0} KiB at start, at most {rss_max} KiB (down {rss_down}, hanging {rss_hang}, 503 {rss_503}, 400 {rss_400}); \
         sockets {socks0} at start, at most {socks_max}"
    );
    assert!(
        slowest < Duration::from_millis(500),
        "a scrape waited for the exporter: {slowest:?}"
    );
    assert!(
        rss_max.saturating_sub(rss0) < 8 * 1024,
        "RSS grew from {rss0} to {rss_max} KiB"
    );
    // one request in flight at most: the hanging connections are dropped, not piled up
    assert!(
        socks_max <= socks0 + 2,
        "sockets grew from {socks0} to {socks_max}"
    );
    assert!(
        accepted_hang as f64 <= n_hang + 2.0,
        "{accepted_hang} connections for {n_hang} exports"
    );
    // the log says each change of state once, not each attempt
    let log = agent.log_text();
    let failed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("OTLP export failed"))
        .collect();
    assert_eq!(
        failed.len(),
        3,
        "one line each for error, timeout, refused:\n{}",
        failed.join("\n")
    );
    for (line, result) in failed.iter().zip(["error", "timeout", "refused"]) {
        assert!(line.contains(&format!("result=\"{result}\"")), "{line}");
    }
    assert!(failed[2].contains("503"), "{}", failed[2]);
    assert_eq!(
        log.lines().filter(|l| l.contains("OTLP export ok")).count(),
        1,
        "{log}"
    );
}

#[test]
fn bad_otlp_flags_are_refused_at_start() {
    let run = |extra: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
            .args([
                "run",
                "--no-kube",
                "--probes",
                "none",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{extra:?} started");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = run(&["--otlp-endpoint", "collector:4318"]);
    assert!(e.contains("scheme must be http or https"), "{e}");
    let e = run(&[
        "--otlp-endpoint",
        "http://c/v1/metrics",
        "--otlp-header",
        "novalue",
    ]);
    assert!(e.contains("is not KEY=VALUE"), "{e}");
    let e = run(&[
        "--otlp-endpoint",
        "http://c/v1/metrics",
        "--otlp-header",
        "bad name=v",
    ]);
    assert!(e.contains("not a valid HTTP header name"), "{e}");
    let e = run(&[
        "--otlp-endpoint",
        "http://c/v1/metrics",
        "--otlp-interval",
        "10ms",
    ]);
    assert!(e.contains("below the minimum"), "{e}");
    let e = run(&[
        "--otlp-endpoint",
        "http://c/v1/metrics",
        "--otlp-interval",
        "1s",
        "--otlp-timeout",
        "5s",
    ]);
    assert!(e.contains("at most the interval"), "{e}");
    let e = run(&["--otlp-interval", "1s"]);
    assert!(e.contains("need --otlp-endpoint"), "{e}");
}
