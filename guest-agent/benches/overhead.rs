//! Overhead benchmark (not a test): a pinned pipe ping-pong (`perf bench sched
//! pipe`, two switches and two wakeups per round trip) with, in the same run,
//! nothing attached, empty tp_btf programs on the same hooks (the floor),
//! libbpf-tools `runqlat`, and `gpufeed-guest` with all probes. Reports the
//! ping-pong time and BPF ns per event (kernel.bpf_stats_enabled), then the
//! agent's idle CPU and memory. Needs root, perf and runqlat.
//!
//! cargo bench -p gpufeed-guest --bench overhead
//!
//! On another kernel (the lab's `bench` VM, lab/scenarios/sched-bench.sh) the built binary
//! runs alone: `GPUFEED_BENCH_AGENT` names the agent's binary there.

mod common;

use common::Killed;
use gpufeed_shared::procstat::{cpu_ns, rss_kib};

mod empty {
    include!(concat!(env!("OUT_DIR"), "/bench_empty.skel.rs"));
}

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::pingpong_us;
use libbpf_rs::skel::SkelBuilder;

const ROUNDS: usize = 5;

/// (run_time_ns, run_cnt) per program name, summed over programs of that name.
fn bpf_stats() -> HashMap<String, (u64, u64)> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "-j"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let mut m: HashMap<String, (u64, u64)> = HashMap::new();
    for p in v.as_array().into_iter().flatten() {
        let name = p["name"].as_str().unwrap_or("").to_string();
        let e = m.entry(name).or_default();
        e.0 += p["run_time_ns"].as_u64().unwrap_or(0);
        e.1 += p["run_cnt"].as_u64().unwrap_or(0);
    }
    m
}

/// ns per event for programs whose name contains `pat`, between two snapshots.
fn per_event(
    before: &HashMap<String, (u64, u64)>,
    after: &HashMap<String, (u64, u64)>,
    pat: &[&str],
    exclude: &str,
) -> f64 {
    let (mut t, mut c) = (0u64, 0u64);
    for (name, (at, ac)) in after {
        if !pat.iter().any(|p| name.contains(p)) || (!exclude.is_empty() && name.contains(exclude))
        {
            continue;
        }
        let (bt, bc) = before.get(name).copied().unwrap_or((0, 0));
        t += at - bt;
        c += ac - bc;
    }
    if c == 0 {
        f64::NAN
    } else {
        t as f64 / c as f64
    }
}

/// Where the measured agents listen: /readyz says when the probes are attached.
const READY_AT: &str = "127.0.0.1:9799";

/// Waits until the agent at READY_AT answers /readyz with "ready" (at most 300 s).
fn wait_ready(agent: &mut Killed, name: &str) {
    use std::io::{Read, Write};
    let until = Instant::now() + Duration::from_secs(300);
    while Instant::now() < until {
        if let Ok(Some(status)) = agent.0.try_wait() {
            panic!("{name}: the agent exited ({status}) before the measurement");
        }
        if let Ok(mut s) = std::net::TcpStream::connect(READY_AT) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let mut body = String::new();
            if s.write_all(b"GET /readyz HTTP/1.0\r\nHost: bench\r\n\r\n")
                .is_ok()
                && s.read_to_string(&mut body).is_ok()
                && body
                    .split("\r\n\r\n")
                    .nth(1)
                    .unwrap_or("")
                    .starts_with("ready")
            {
                // one tick more: the first tick's reads are done
                std::thread::sleep(Duration::from_secs(1));
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("{name}: the agent was not ready within 300 s");
}

struct Row {
    name: &'static str,
    us_per_op: f64,
    wakeup_ns: f64,
    switch_ns: f64,
}

fn set_stats(on: bool) {
    std::fs::write(
        "/proc/sys/kernel/bpf_stats_enabled",
        if on { "1" } else { "0" },
    )
    .unwrap();
}

/// Ping-pong time with BPF run-time accounting off (it costs two clock reads
/// per program run and would inflate the slowdown), then BPF ns per event in a
/// separate pass with accounting on.
fn measure(name: &'static str, baseline: Option<f64>) -> Row {
    std::thread::sleep(Duration::from_millis(500));
    let mut runs: Vec<f64> = (0..ROUNDS).map(|_| pingpong_us()).collect();
    runs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let us = runs[ROUNDS / 2];
    set_stats(true);
    let before = bpf_stats();
    pingpong_us();
    let after = bpf_stats();
    set_stats(false);
    let r = Row {
        name,
        us_per_op: us,
        wakeup_ns: per_event(&before, &after, &["wakeup"], ""),
        switch_ns: per_event(&before, &after, &["switch"], ""),
    };
    let slow = baseline
        .map(|b| format!("{:+.1}%", (us / b - 1.0) * 100.0))
        .unwrap_or_default();
    eprintln!(
        "{name:<28} {us:>7.3} us/op {slow:>8}  wakeup {:>6.0} ns  switch {:>6.0} ns",
        r.wakeup_ns, r.switch_ns
    );
    r
}

fn main() {
    if std::env::args().any(|a| a == "--list") || unsafe { libc::geteuid() } != 0 {
        eprintln!("overhead benchmark: needs root; skipped");
        return;
    }
    let agent_bin = std::env::var("GPUFEED_BENCH_AGENT")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_gpufeed-guest").to_string());
    let agent_bin = agent_bin.as_str();
    set_stats(false);
    let mut rows = Vec::new();

    let base = measure("nothing attached", None);
    let b = base.us_per_op;
    rows.push(base);
    {
        let mut storage = MaybeUninit::uninit();
        let open = empty::BenchEmptySkelBuilder::default()
            .open(&mut storage)
            .unwrap();
        let mut skel = gpufeed_guest::probes::object::load("bench_empty", open).unwrap();
        libbpf_rs::skel::Skel::attach(&mut skel).unwrap();
        rows.push(measure("empty tp_btf programs", Some(b)));
    }
    // Debian 13 renamed libbpf-tools' programs (`runqlat-libbpf`)
    let runqlat = |name: &str| {
        Command::new(name)
            .args(["60", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
    };
    match runqlat("runqlat").or_else(|_| runqlat("runqlat-libbpf")) {
        Ok(c) => {
            let _k = Killed(c);
            std::thread::sleep(Duration::from_secs(1));
            rows.push(measure("libbpf-tools runqlat", Some(b)));
        }
        Err(e) => eprintln!("runqlat not available ({e}); install libbpf-tools"),
    }
    // The scheduler, TCP and tc probes without the GPU ones, then every probe: the ping-pong is
    // nothing but syscalls, so the difference between the two rows is what the GPU probes cost
    // a process that never touches a GPU (their hooks side by side: the gpu_overhead bench).
    const NO_GPU: &str = "sched_latency,tcp_rtt,tcp_retransmit,tc";
    // The storage row is what a 6.1 kernel (no cgroup storage) runs: every per-cgroup value in
    // a bounded hash keyed by cgroup id, one lookup more per event than cgroup-local storage.
    for (name, method, probes, storage) in [
        ("gpufeed-guest (sched, TCP, tc)", "auto", NO_GPU, "auto"),
        (
            "gpufeed-guest (all probes, GPU included)",
            "auto",
            "all",
            "auto",
        ),
        (
            "gpufeed-guest (stamp fallback; sched, TCP, tc)",
            "stamp",
            NO_GPU,
            "auto",
        ),
        (
            "gpufeed-guest (map by cgroup id, as on 6.1; sched, TCP, tc)",
            "auto",
            NO_GPU,
            "by-id",
        ),
    ] {
        let mut agent = Killed(
            Command::new(agent_bin)
                .args([
                    "run",
                    "--no-kube",
                    "--metrics-listen",
                    READY_AT,
                    "--sched-method",
                    method,
                    "--probes",
                    probes,
                    "--cgroup-storage",
                    storage,
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        // its probes attached (a second here, much longer under TCG, where the verifier is
        // emulated too)
        wait_ready(&mut agent, name);
        rows.push(measure(name, Some(b)));
        drop(agent);
    }
    // a second baseline, to show the noise of the machine within this run
    rows.push(measure("nothing attached (again)", Some(b)));

    // Idle footprint at default settings.
    let agent = Killed(
        Command::new(agent_bin)
            .args(["run", "--no-kube", "--metrics-listen", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = agent.0.id();
    std::thread::sleep(Duration::from_secs(2));
    let t0 = (Instant::now(), cpu_ns(pid));
    std::thread::sleep(Duration::from_secs(30));
    let used = cpu_ns(pid) - t0.1;
    let cpu_pct = used as f64 / 1e9 / t0.0.elapsed().as_secs_f64() * 100.0;
    let rss = rss_kib(pid);
    drop(agent);

    println!("| configuration | ping-pong µs/op | slowdown | BPF ns/wakeup | BPF ns/switch |");
    println!("|---|---|---|---|---|");
    for r in &rows {
        let fmt = |v: f64| {
            if v.is_nan() {
                "–".to_string()
            } else {
                format!("{v:.0}")
            }
        };
        println!(
            "| {} | {:.3} | {:+.1}% | {} | {} |",
            r.name,
            r.us_per_op,
            (r.us_per_op / b - 1.0) * 100.0,
            fmt(r.wakeup_ns),
            fmt(r.switch_ns)
        );
    }
    println!();
    println!(
        "agent idle (default 1 s interval, 30 s): {cpu_pct:.3}% of one core, RSS {:.1} MB",
        rss as f64 / 1024.0
    );
}
