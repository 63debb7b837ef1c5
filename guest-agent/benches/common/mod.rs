//! What the benchmarks share (each bench uses its part of it).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command};
use std::time::Duration;

/// µs per round trip of a pipe ping-pong pinned to CPU 0 (`perf bench sched
/// pipe`: two switches and two wakeups per round trip), 200 000 round trips
/// (`GPUFEED_BENCH_LOOPS` sets fewer where a round trip is slow, as in a TCG VM).
pub fn pingpong_us() -> f64 {
    let loops = std::env::var("GPUFEED_BENCH_LOOPS").unwrap_or_else(|_| "200000".into());
    let out = Command::new("taskset")
        .args(["-c", "0", "perf", "bench", "sched", "pipe", "-l", &loops])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.contains("usecs/op"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("perf bench output: {text}"))
}

/// A child process killed and reaped when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// CPU time of this thread, ns: what a busy machine's preemptions do not inflate.
pub fn thread_cpu_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// A file under `tests/fixtures`.
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// Compiles the fixture `src` to `out` with `cc -O2` and `extra` flags.
pub fn cc(src: &str, out: &Path, extra: &[&str]) {
    let ok = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(out)
        .arg(fixture(src))
        .args(extra)
        .status()
        .unwrap()
        .success();
    assert!(ok, "cc {src}");
}

/// The address an agent started with `--metrics-listen 127.0.0.1:0` serves on, from its log
/// (`addr=` in its stderr, which a thread keeps reading so that the agent never blocks on it).
pub fn served_addr(stderr: ChildStderr) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(a) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr=")?.parse::<SocketAddr>().ok())
            {
                let _ = tx.send(a);
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the agent serves /metrics")
}
