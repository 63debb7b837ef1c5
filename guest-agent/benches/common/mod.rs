//! What the benchmarks share.

use std::process::{Child, Command};

/// µs per round trip of a pipe ping-pong pinned to CPU 0 (`perf bench sched
/// pipe`: two switches and two wakeups per round trip), 200 000 round trips.
pub fn pingpong_us() -> f64 {
    let out = Command::new("taskset")
        .args(["-c", "0", "perf", "bench", "sched", "pipe", "-l", "200000"])
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
