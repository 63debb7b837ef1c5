//! What a process costs, read from /proc for the benchmarks of both agents: CPU time
//! (exact, from schedstat), wake-ups and resident memory. A process that is gone reads 0.

/// The threads of `pid` now (`/proc/<pid>/task/*`), each as the text of its file `name`.
fn per_thread(pid: u32, name: &str) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join(name)).ok())
        .collect()
}

/// CPU time of all live threads in ns: the first field of each thread's schedstat, exact,
/// where utime + stime in /proc/<pid>/stat are sampled at the scheduler tick.
pub fn cpu_ns(pid: u32) -> u64 {
    per_thread(pid, "schedstat")
        .iter()
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Wake-ups of all live threads: voluntary and involuntary context switches.
pub fn switches(pid: u32) -> u64 {
    per_thread(pid, "status")
        .iter()
        .flat_map(|s| s.lines())
        .filter(|l| l.contains("ctxt_switches:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// CPU time in clock ticks (utime + stime of /proc/<pid>/stat), as `top` and `ps` see it.
pub fn cpu_ticks(pid: u32) -> u64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // the command name (field 2) may hold spaces and parentheses: fields 14 and 15 count
    // from past its end
    let Some(end) = s.rfind(')') else { return 0 };
    let f: Vec<&str> = s[end + 1..].split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    field(11) + field(12)
}

/// Resident memory in KiB (VmRSS).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_costs_something_and_a_gone_one_nothing() {
        let me = std::process::id();
        let (before, start) = (cpu_ns(me), std::time::Instant::now());
        // spin until 20 ms more are booked, or give up after 10 s (then the assert says so)
        while cpu_ns(me) < before + 20_000_000 && start.elapsed().as_secs() < 10 {
            std::hint::black_box(0);
        }
        assert!(cpu_ns(me) >= before + 20_000_000, "spinning is booked");
        assert!(cpu_ticks(me) > 0, "the spinning shows at the tick too");
        assert!(rss_kib(me) > 1024, "a test binary holds more than 1 MiB");
        assert!(switches(me) > 0);
        // pid_max is at most 2^22: this pid cannot exist
        let gone = 1 << 23;
        assert_eq!(
            (cpu_ns(gone), switches(gone), cpu_ticks(gone), rss_kib(gone)),
            (0, 0, 0, 0)
        );
    }
}
