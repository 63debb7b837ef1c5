//! Truth targets of the guest agent: each series against the kernel's own
//! accounting in the cases the happy path does not reach (migrating tasks,
//! restarts, sockets older than the agent, slow start, redirects that keep
//! the socket). Each test was seen failing on the code before its fix.

mod common;

use std::time::Duration;

use common::*;

const SCHED: &str = "ebpf_sched_latency_microseconds";

fn pod_labels(p: &Pod) -> Vec<(&'static str, String)> {
    vec![
        ("pod", p.uid.clone()),
        ("container", p.container_id[..12].to_string()),
    ]
}

fn sel<'a>(l: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    l.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Unpinned contention: three times as many spinning tasks as CPUs, no
/// taskset, plus short sleepers that keep the load uneven, so the load
/// balancer moves queued tasks between CPUs. The scheduler adds a moved
/// task's wait so far to run_delay at the move; the pod's histogram sum must
/// still match its tasks' schedstat run_delay within 1%.
#[test]
fn sched_latency_of_migrating_tasks_matches_schedstat() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let agent = Agent::no_kube("200ms", "sched_latency", &["--sched-method", "sched-info"]);
    let mut busy = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let spinners = 3 * cpus;
    for _ in 0..spinners {
        busy.spawn("exec sh -c 'while :; do :; done'");
    }
    for _ in 0..cpus {
        busy.spawn("exec perl -e 'select(undef, undef, undef, 0.003) while 1'");
    }
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        busy.pids().len(),
        spinners + cpus,
        "all tasks joined the pod"
    );
    let migrations = || -> u64 {
        busy.pids()
            .iter()
            .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/sched")).ok())
            .filter_map(|s| {
                s.lines()
                    .find(|l| l.starts_with("se.nr_migrations"))
                    .and_then(|l| l.split(':').nth(1)?.trim().parse::<u64>().ok())
            })
            .sum()
    };

    let bl = pod_labels(&busy);
    let settle = |agent: &Agent| {
        // frozen tasks: neither run_delay nor the histogram moves; two ticks
        std::thread::sleep(Duration::from_millis(700));
        let s = agent.scrape();
        (
            value(&s, &format!("{SCHED}_sum"), &sel(&bl)).expect("busy pod has a series"),
            busy.run_delay_ns(),
        )
    };
    busy.signal_all(libc::SIGSTOP);
    let (sum0, d0) = settle(&agent);
    let m0 = migrations();
    busy.signal_all(libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(4));
    busy.signal_all(libc::SIGSTOP);
    let (sum1, d1) = settle(&agent);
    let moved = migrations() - m0;
    busy.signal_all(libc::SIGCONT);

    let ours_us = sum1 - sum0;
    let kernel_us = (d1 - d0) as f64 / 1000.0;
    let err = (ours_us - kernel_us) / kernel_us;
    eprintln!(
        "unpinned: histogram sum {ours_us:.0} us, schedstat run_delay {kernel_us:.0} us \
         ({:+.2}%), {moved} migrations",
        err * 100.0
    );
    assert!(kernel_us > 4_000_000.0, "the tasks waited for seconds");
    assert!(moved >= 20, "the balancer moved tasks ({moved} migrations)");
    assert!(
        err.abs() < 0.01,
        "histogram sum {ours_us} us vs schedstat {kernel_us} us: {:+.2}%",
        err * 100.0
    );
}
