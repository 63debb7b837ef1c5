//! Signal windows on the real kernel, through the library: units loaded from
//! the registry, the collector ticking over real cgroups, and the per-tick
//! windows a correlator reads: run-queue waits compared with the kernel's own
//! schedstat run_delay, GPU synchronisation waits with what a stand-in CUDA
//! client measured around its calls.

use crate::common;

use std::time::Duration;

use common::gpu;
use common::*;
use gpufeed_guest::cgroups::CgroupTree;
use gpufeed_guest::collect::{Collector, Owner, TickReport};
use gpufeed_guest::pods::PodStore;
use gpufeed_guest::probes::signal::{SignalWindow, WindowValue};
use gpufeed_guest::probes::unit::LoadContext;
use gpufeed_guest::probes::{self, KernelBtf, UnitOptions};

fn collector(probes: &str) -> Collector {
    let btf = KernelBtf::load();
    let mut options = UnitOptions::defaults();
    probes::tc::pod_interfaces_only(&mut options);
    let ctx = LoadContext {
        btf: &btf,
        options: &options,
        interval: Duration::from_millis(200),
        lockdown: None,
    };
    let selected = probes::select(probes).unwrap();
    let (units, statuses) = probes::load(&ctx, &selected).unwrap();
    assert_eq!(statuses.len(), 1);
    assert!(statuses[0].up, "{:?}", statuses[0]);
    Collector::new(
        CgroupTree::new(cgroup2_root()),
        units,
        PodStore::default(),
        Duration::from_secs(60),
    )
}

/// One run-queue window, in microseconds.
struct Window {
    count: u64,
    sum: f64,
    p50: f64,
    p99: f64,
    max: f64,
    length: Duration,
}

/// This tick's run-queue windows of one pod.
fn pod_windows(r: &TickReport, uid: &str) -> Vec<Window> {
    signal_windows(r, "run_queue_wait", uid)
}

/// This tick's windows of one latency signal of one pod.
fn signal_windows(r: &TickReport, signal: &str, uid: &str) -> Vec<Window> {
    r.windows
        .iter()
        .filter(|w: &&SignalWindow| {
            w.signal == signal && matches!(&w.owner, Owner::Pod { uid: u, .. } if &**u == uid)
        })
        .map(|w| match w.value {
            WindowValue::Latency {
                count,
                sum_us: sum,
                p50_us: p50,
                p99_us: p99,
                max_us: max,
            } => Window {
                count,
                sum,
                p50,
                p99,
                max,
                length: w.window,
            },
            WindowValue::Rate { .. } | WindowValue::Level { .. } => {
                panic!("{signal} is a latency signal")
            }
        })
        .collect()
}

#[test]
fn run_queue_windows_add_up_to_schedstat_and_separate_busy_from_idle() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut c = collector("sched_latency");
    assert!(
        c.tick().unwrap().windows.is_empty(),
        "the first tick has no window"
    );

    let mut busy = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut idle = Pod::random(&sb, Layout::Systemd, "besteffort");
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    for _ in 0..4 {
        busy.spawn(&format!(
            "exec taskset -c {} sh -c 'while :; do :; done'",
            cpus - 1
        ));
    }
    idle.spawn("exec taskset -c 0 sh -c 'while :; do sleep 0.02; done'");
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(busy.pids().len(), 4, "all busy tasks joined the pod cgroup");

    // Frozen, neither run_delay nor the histogram moves between the two reads.
    busy.signal_all(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(100));
    c.tick().unwrap();
    let d0 = busy.run_delay_ns();
    busy.signal_all(libc::SIGCONT);
    let (mut busy_w, mut idle_w) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(200));
        let r = c.tick().unwrap();
        busy_w.extend(pod_windows(&r, &busy.uid));
        idle_w.extend(pod_windows(&r, &idle.uid));
    }
    busy.signal_all(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(100));
    let r = c.tick().unwrap();
    busy_w.extend(pod_windows(&r, &busy.uid));
    let d1 = busy.run_delay_ns();
    busy.signal_all(libc::SIGCONT);

    let ours_us: f64 = busy_w.iter().map(|w| w.sum).sum();
    let kernel_us = (d1 - d0) as f64 / 1000.0;
    eprintln!(
        "{} busy windows, sum {ours_us:.0} us; schedstat run_delay {kernel_us:.0} us",
        busy_w.len()
    );
    assert!(busy_w.len() >= 8, "a window in (nearly) every tick");
    assert!(
        kernel_us > 1_000_000.0,
        "4 tasks on one CPU wait for seconds"
    );
    let err = (ours_us - kernel_us).abs() / kernel_us;
    assert!(
        err < 0.10,
        "window sums {ours_us} vs schedstat {kernel_us}: {:.1}% apart",
        err * 100.0
    );
    for w in busy_w.iter().chain(&idle_w) {
        let (sum, p50, p99, max, window) = (w.sum, w.p50, w.p99, w.max, w.length);
        assert!(w.count > 0);
        assert!(p50 <= p99 && p99 <= max, "p50 {p50} p99 {p99} max {max}");
        assert!(max <= sum + 1e-6, "max {max} above the window's sum {sum}");
        // ticks 200 ms apart, the last one 100 ms after the one before
        assert!(window >= Duration::from_millis(90), "{window:?}");
    }
    // the median window: one noisy tick does not decide
    let median = |w: &[Window], pick: fn(&Window) -> f64| {
        let mut p: Vec<f64> = w.iter().map(pick).collect();
        p.sort_by(f64::total_cmp);
        p.get(p.len() / 2).copied().unwrap_or(0.0)
    };
    let (busy_p50, idle_p50) = (median(&busy_w, |x| x.p50), median(&idle_w, |x| x.p50));
    let busy_p99 = median(&busy_w, |x| x.p99);
    eprintln!("median window p50: busy {busy_p50:.0} us, idle {idle_p50:.0} us; busy p99 {busy_p99:.0} us");
    assert!(!idle_w.is_empty(), "the idle pod wakes every 20 ms");
    assert!(busy_p99 >= 4_000.0, "busy p99 {busy_p99} us");
    // the idle pod's typical wait stays far below the busy one's, even on a
    // machine busy with other work (its tail does not: it shares CPU 0)
    assert!(
        busy_p50 >= 4.0 * idle_p50,
        "busy p50 {busy_p50} us not far above idle {idle_p50} us"
    );
}

/// The CUDA unit offers the time a pod blocks in the synchronisation calls
/// as the `gpu_sync_wait` latency signal: the client's four waits arrive in
/// its pod's windows (and in no other pod's), summing to what the client
/// measured around the calls.
#[test]
fn gpu_sync_waits_reach_the_correlator_as_a_latency_signal() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let cuda = gpu::StandInCuda::new(dir);
    let client = gpu::BusyClient::new(dir);
    let sb = CgroupSandbox::new();
    let mut c = collector("cuda");
    let mut waiting = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let other = Pod::random(&sb, Layout::Systemd, "besteffort");
    let (go, out) = (dir.join("go"), dir.join("busy.out"));
    waiting.spawn(&client.command(&cuda, &go, &out, 1));
    // the unit attaches to the library the client mapped at its next tick
    let attached = wait_for(Duration::from_secs(10), || {
        c.tick().unwrap();
        let shared = c.store.lock().unwrap();
        let mut libraries = shared.stats.units.iter().flat_map(|u| &u.series);
        libraries
            .find(|s| s.name == "gpufeed_cuda_libraries" && s.value == 1.0)
            .map(|_| ())
    });
    assert!(attached.is_some(), "the cuda unit attached to the library");
    std::fs::File::create(&go).unwrap();
    let (mut mine, mut others) = (Vec::new(), Vec::new());
    let done = wait_for(Duration::from_secs(15), || {
        std::thread::sleep(Duration::from_millis(200));
        let r = c.tick().unwrap();
        mine.extend(signal_windows(&r, "gpu_sync_wait", &waiting.uid));
        others.extend(signal_windows(&r, "gpu_sync_wait", &other.uid));
        (out.exists() && mine.iter().map(|w| w.count).sum::<u64>() >= 4).then_some(())
    });
    assert!(
        done.is_some(),
        "the client's waits arrived: {} windows",
        mine.len()
    );
    let (_, measured) = gpu::measured(&out);
    let (count, sum_us) = mine
        .iter()
        .fold((0, 0.0), |(n, s), w| (n + w.count, s + w.sum));
    let max_us = mine.iter().map(|w| w.max).fold(0.0, f64::max);
    eprintln!(
        "{} windows: {count} waits, {sum_us:.0} us (largest {max_us:.0} us); measured {} us",
        mine.len(),
        measured / 1000
    );
    assert_eq!(count, 4, "the four synchronisation calls");
    assert!(
        gpu::within_10_percent(sum_us, measured as f64 / 1e3),
        "sum {sum_us} us vs measured {measured} ns"
    );
    // the longest wait is phase 1's 100 ms of kernels (a bucket's upper bound)
    assert!((100_000.0..=140_000.0).contains(&max_us), "max {max_us} us");
    assert!(others.is_empty(), "no waits in the other pod");
}
