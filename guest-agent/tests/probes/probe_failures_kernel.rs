//! One probe's failure is never the agent's, on this machine's kernel: the objects the test
//! names are refused at load as a verifier's EINVAL would refuse them
//! (`GPUFEED_TEST_REFUSE_OBJECTS`, checked after everything before the load ran), so
//! that the path a real refusal takes on another kernel runs here. The VM lab shows real
//! refusals (cgroup-local storage forced on 6.1: lab/tests/guest_kernels.rs).
//!
//! And the fallback storage: with `--cgroup-storage by-id` (the hash map keyed by cgroup id
//! that 6.1 uses) a pod's run-queue sum still equals its tasks' schedstat run_delay.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::*;

const SCHED_SUM: &str = "ebpf_sched_latency_microseconds_sum";

fn spin(pod: &mut Pod, n: usize) {
    let cpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        - 1;
    for _ in 0..n {
        pod.spawn(&format!(
            "exec taskset -c {cpu} sh -c 'while :; do :; done'"
        ));
    }
}

#[test]
fn a_refused_probe_is_down_with_its_reason_and_the_others_are_served() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let refuse = ("GPUFEED_TEST_REFUSE_OBJECTS", "cuda,tc");
    let agent = Agent::start(
        &["--interval", "200ms", "--no-kube", "--probes", "all"],
        &[refuse],
    );
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    spin(&mut pod, 3);
    std::thread::sleep(Duration::from_secs(2));
    pod.signal_all(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(700));
    let s = agent.scrape();
    let up = |p: &str| value(&s, "gpufeed_probe_up", &[("probe", p)]);
    for p in ["cuda", "tc_bytes", "tc_drops"] {
        assert_eq!(up(p), Some(0.0), "{p} is down");
        let info = find(&s, "gpufeed_probe_info", &[("probe", p)]);
        assert_eq!(info.len(), 1, "{p}: one info series");
        assert!(
            info[0]
                .label("reason")
                .contains("load failed: Invalid argument"),
            "{p}: the reason is the load's: {:?}",
            info[0].label("reason")
        );
    }
    for p in [
        "sched_latency",
        "tcp_rtt",
        "tcp_retransmit",
        "gpu_driver",
        "nvml",
    ] {
        assert_eq!(up(p), Some(1.0), "{p} still runs");
    }
    // the probes that run are served: the pod's run-queue sum is its tasks' run_delay
    let kernel_us = pod.run_delay_ns() as f64 / 1000.0;
    let ours_us = value(&s, SCHED_SUM, &[("pod", &pod.uid)]).expect("the pod's series");
    assert!(kernel_us > 1_000_000.0, "{kernel_us}");
    assert!(
        (ours_us - kernel_us).abs() / kernel_us < 0.05,
        "{ours_us} us vs schedstat {kernel_us} us"
    );
    pod.signal_all(libc::SIGCONT);
    // ready, and saying which probes are down
    let (code, body) = http_get_status(agent.addr, "/readyz").unwrap();
    assert_eq!(code, 200, "{body}");
    for p in ["cuda", "tc_bytes", "tc_drops"] {
        assert!(body.contains(&format!("probe {p} is down: ")), "{body}");
    }
    // one log line per refused probe
    let log = agent.log.lock().unwrap().clone();
    assert_eq!(
        log.matches("probe down, the others run").count(),
        3,
        "{log}"
    );
    // the running agent's doctor says it too
    let doctor = http_get(agent.addr, "/doctor").unwrap();
    assert!(doctor.contains("3 of 8 will not load here"), "{doctor}");
    // and the doctor command says so before an agent starts, by loading the probes
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["doctor", "--local"])
        .env(refuse.0, refuse.1)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("probes"))
        .unwrap_or_else(|| panic!("no probes check in:\n{text}"));
    assert!(line.starts_with("FAIL"), "{line}");
    for p in ["cuda:", "tc_bytes:", "tc_drops:"] {
        assert!(line.contains(p), "{line}");
    }
    assert!(
        !out.status.success(),
        "the doctor exits non-zero on a failed check"
    );
}

#[test]
fn run_queue_sums_from_the_id_map_agree_with_schedstat() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let agent = Agent::no_kube("200ms", "sched_latency", &["--cgroup-storage", "by-id"]);
    let s = agent.scrape();
    let info = find(&s, "gpufeed_probe_info", &[("probe", "sched_latency")]);
    assert_eq!(info[0].label("storage"), "hash-by-id", "the id map in use");
    let mut pod = Pod::random(&sb, Layout::Systemd, "burstable");
    spin(&mut pod, 3);
    std::thread::sleep(Duration::from_secs(2));
    pod.signal_all(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(700));
    let kernel_us = pod.run_delay_ns() as f64 / 1000.0;
    let ours_us = value(&agent.scrape(), SCHED_SUM, &[("pod", &pod.uid)]).expect("the pod");
    assert!(kernel_us > 1_000_000.0, "{kernel_us}");
    let err = (ours_us - kernel_us).abs() / kernel_us;
    assert!(
        err < 0.02,
        "id map: {ours_us} us vs schedstat {kernel_us} us ({:.2}% apart)",
        err * 100.0
    );
    pod.signal_all(libc::SIGCONT);
    // a removed pod's entry leaves the id map: its last numbers were drained
    pod.kill_all();
    pod.remove();
    std::thread::sleep(Duration::from_millis(700));
    let entries = value(
        &agent.scrape(),
        "gpufeed_map_entries",
        &[("map", "sched_hist")],
    );
    assert!(entries.is_some(), "the map's fill is exported");
}
