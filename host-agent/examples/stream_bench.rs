//! Host → guest stream benchmark over loopback (QUIC + mutual TLS), the real stream client and
//! the real hub in one process, each on its own named runtime threads so that CPU time can be
//! attributed per side (from /proc/self/task/*/stat).
//!
//!     cargo run --release -p gpufeed-host --example stream_bench [-- EVENTS RATE_SECONDS COALESCE_US]
//!
//! 1. Throughput: EVENTS (default 1,000,000) `KmsgLost` events pushed as fast as possible;
//!    sustained events/s until the hub has received them all; CPU per 100k events per side.
//! 2. Latency: 10,000 events/s for RATE_SECONDS (default 5), one event every 100 µs; host
//!    stamp → hub receipt (same clock), p50/p99/max.
//!
//! COALESCE_US is the stream's `coalesce_us` (default 500, as in the configuration).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufeed_host::stream::{self, GuestEndpoint, StreamConfig};
use gpufeed_shared::clock;
use gpufeed_shared::event::{HostEvent, Stamped};
use gpufeed_shared::stream::hub;
use gpufeed_shared::tls;

/// CPU seconds (user + system) of this process's threads whose name starts with `prefix`.
fn cpu_of(prefix: &str) -> f64 {
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut total = 0u64;
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.trim().starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
        let f: Vec<&str> = after.split_whitespace().collect();
        // Fields 14 and 15 of stat (utime, stime) are 11 and 12 after the state field.
        total += f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
    }
    total as f64 / tick
}

/// CPU seconds of the calling thread (the generator's own, read before it exits: an exited
/// thread is no longer in /proc/self/task).
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

fn ev(i: u64) -> Stamped {
    Stamped {
        realtime_ns: clock::realtime_ns(),
        monotonic_ns: clock::monotonic_ns(),
        event: HostEvent::KmsgLost { count: i },
    }
}

fn counter(reg: &prometheus::Registry, name: &str) -> f64 {
    reg.gather()
        .iter()
        .filter(|m| m.name() == name)
        .flat_map(|m| m.get_metric().iter().map(|x| x.get_counter().get_value()))
        .sum()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args
        .get(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let rate_secs: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(5);
    let coalesce_us: u64 = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(500);
    let dir = tempfile::tempdir().unwrap();
    let dep = tls::Deployment::generate("127.0.0.1", &["pve1".into()]).unwrap();
    dep.write_guest_dir(dir.path()).unwrap();
    dep.write_host_files(dir.path()).unwrap();

    let guest_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("guest")
        .enable_all()
        .build()
        .unwrap();
    let host_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("host")
        .enable_all()
        .build()
        .unwrap();
    let greg = prometheus::Registry::new();
    let hub = guest_rt.block_on(async {
        let mut c = hub::HubConfig::new("127.0.0.1:0".parse().unwrap(), dir.path());
        c.recent_capacity = 1024;
        c.sysfs_root = "/nonexistent".into();
        hub::serve(c, &greg).await.unwrap()
    });
    let addr = hub.local_addr();
    let cfg = StreamConfig {
        ca: dir.path().join(tls::CA_FILE),
        cert: dir.path().join(tls::host_cert_file("pve1")),
        key: dir.path().join(tls::host_key_file("pve1")),
        spool_dir: Default::default(),
        memory_events: (n as usize).max(1 << 20),
        coalesce_us,
        guests: vec![GuestEndpoint {
            endpoint: addr.to_string(),
            name: "guest".into(),
            server_name: String::new(),
            vmids: vec![],
            devices: vec![],
        }],
        ..StreamConfig::default()
    };
    let h = Arc::new(
        host_rt
            .block_on(async { stream::start(cfg, "pve1".into(), &prometheus::Registry::new()) })
            .unwrap(),
    );
    let received = || counter(&greg, "gpufeed_stream_events_received_total");
    // Warm up: connect and handshake.
    h.push(&[ev(0)]);
    while received() < 1.0 {
        std::thread::sleep(Duration::from_millis(5));
    }

    // 1. Throughput. The generator's CPU (stamping, encoding, spooling) is counted on the host
    // side beside the stream's runtime thread.
    let (g0, h0) = (cpu_of("guest"), cpu_of("host"));
    let t0 = Instant::now();
    let gen = {
        let h = h.clone();
        std::thread::Builder::new()
            .name("host-gen".into())
            .spawn(move || {
                let c0 = thread_cpu();
                let mut i = 1;
                while i <= n {
                    let to = (i + 1000).min(n + 1);
                    let batch: Vec<Stamped> = (i..to).map(ev).collect();
                    h.push(&batch);
                    i = to;
                }
                thread_cpu() - c0
            })
            .unwrap()
    };
    let gen_cpu = gen.join().unwrap();
    let pushed = t0.elapsed();
    while received() < (n + 1) as f64 {
        std::thread::sleep(Duration::from_millis(1));
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "stalled at {}",
            received()
        );
    }
    let el = t0.elapsed();
    let (g1, h1) = (cpu_of("guest"), cpu_of("host"));
    let rate = n as f64 / el.as_secs_f64();
    let per100k = |c: f64| c / (n as f64 / 100_000.0) * 1000.0;
    println!(
        "throughput: {n} events in {:.3} s (spooled in {:.3} s) = {:.0} events/s",
        el.as_secs_f64(),
        pushed.as_secs_f64(),
        rate
    );
    println!(
        "cpu per 100k events: host {:.1} ms (pushing: stamping+encoding+spool {:.1} ms; stream: spool reads+acks+QUIC send {:.1} ms), guest {:.1} ms (QUIC receive+decode+dedup+metrics)",
        per100k(h1 - h0 + gen_cpu),
        per100k(gen_cpu),
        per100k(h1 - h0),
        per100k(g1 - g0)
    );

    // 2. Latency at 10k events/s.
    let mut rx = hub.intake().expect("the hub's intake");
    let total = rate_secs * 10_000;
    let lat = std::sync::Arc::new(std::sync::Mutex::new(Vec::with_capacity(total as usize)));
    let collector = {
        let lat = lat.clone();
        guest_rt.spawn(async move {
            let mut got = 0;
            while got < total {
                match rx.recv().await {
                    Some(hub::Delivery::Event(e)) => {
                        lat.lock()
                            .unwrap()
                            .push(e.received_realtime_ns - e.host_realtime_ns);
                        got += 1;
                    }
                    Some(_) => got += 1,
                    None => break,
                }
            }
        })
    };
    let (g0, h0) = (cpu_of("guest"), cpu_of("host"));
    let t0 = Instant::now();
    let start = Instant::now();
    for i in 0..total {
        let due = start + Duration::from_micros(100 * i);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        h.push(&[ev(n + 1 + i)]);
    }
    guest_rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(10), collector).await;
    });
    let el = t0.elapsed();
    let (g1, h1) = (cpu_of("guest"), cpu_of("host"));
    let mut v = lat.lock().unwrap().clone();
    v.sort_unstable();
    let q = |p: f64| v[((v.len() as f64 - 1.0) * p) as usize] as f64 / 1e6;
    println!(
        "latency at 10k events/s over {:.1} s ({} samples): p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        el.as_secs_f64(),
        v.len(),
        q(0.5),
        q(0.99),
        q(1.0)
    );
    let per100k = |c: f64| c / (total as f64 / 100_000.0) * 1000.0;
    println!(
        "cpu per 100k events at 10k/s: host {:.1} ms, guest {:.1} ms",
        per100k(h1 - h0),
        per100k(g1 - g0)
    );
    host_rt.block_on(async {
        if let Ok(h) = Arc::try_unwrap(h) {
            h.shutdown().await;
        }
    });
}
