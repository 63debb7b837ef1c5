//! The join end to end, with the real binaries: the host agent on a recorded Thunderbolt eGPU
//! tree (scripts/demo-egpu.sh, the kernel's sysfs formats), the guest agent with its real
//! probes, QUIC with mutual TLS on loopback.
//!
//! The GPU's link drops from 16 GT/s x4 to 2.5 GT/s x1 while run-queue contention starts in
//! pod A and not in pod B: the correlated count rises for pod A with `link_degraded`, not for
//! pod B. Then contention in pod B with no host event is a spike nobody explains, and a host
//! event with no spike correlates nothing. The host's series in the guest's scrape equal the
//! host's own. The page at / renders the scenario in headless Chromium (a screenshot goes to
//! the test's directory, and to docs/ with GPUFEED_SCREENSHOT_DIR).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::host_agent::*;
use common::*;

fn json(addr: std::net::SocketAddr, path: &str) -> serde_json::Value {
    serde_json::from_str(&http_get(addr, path).unwrap_or_default()).unwrap_or_default()
}

/// A pod's steady wakeups: a task that sleeps 1 ms in a loop, pinned to `cpu`. It runs
/// SCHED_FIFO, so whatever else the machine runs (other builds, the agents) does not make it
/// wait: the pod's baseline stays at microseconds, and only the pod's own contention moves it.
/// With about 900 wakeups per 1 s window, a stall of the whole VM (its vCPU descheduled by the
/// hypervisor) touches a few samples and leaves the window's p99 alone; contention does not.
fn waker(pod: &mut Pod, cpu: u32) {
    pod.spawn(&format!(
        "exec chrt -f 10 taskset -c {cpu} perl -e 'select(undef, undef, undef, 0.001) while 1'"
    ));
}

/// `n` CPU hogs at `nice` in a second container of the pod, pinned to `cpu`: each waits for
/// the others' slices, milliseconds to tens of milliseconds.
fn hogs(sb: &CgroupSandbox, pod: &Pod, cpu: u32, n: usize, nice: i32) -> Pod {
    let mut c = Pod::new(sb, Layout::Cgroupfs, "burstable", &pod.uid, &random_cid());
    for _ in 0..n {
        c.spawn(&format!(
            "exec nice -n {nice} taskset -c {cpu} sh -c 'while :; do :; done'"
        ));
    }
    c
}

fn correlated(s: &[Sample], uid: &str, event: &str) -> f64 {
    value(
        s,
        "gpufeed_correlated_spikes_total",
        &[("pod", uid), ("event", event), ("signal", "run_queue_wait")],
    )
    .unwrap_or(0.0)
}

#[test]
fn link_drop_joins_the_contended_pod_only() {
    let Some(_lock) = require_root() else { return };
    let dir = tempfile::tempdir().unwrap();
    demo(&["tree", dir.path().join("root").to_str().unwrap()]);
    let quic = free_port();
    // A fast link poll and state interval: the scenario's timing is not the defaults' test.
    let host = start_host(
        dir.path(),
        quic,
        HostIntervals {
            pcie_poll_ms: Some(200),
            state_ms: Some(200),
        },
    );
    let tls = dir.path().join("certs/guest");
    let agent = Agent::no_kube(
        "1s",
        "sched_latency",
        &[
            "--quic-listen",
            &format!("127.0.0.1:{quic}"),
            "--tls-dir",
            tls.to_str().unwrap(),
            "--simulated-host",
            HOST,
        ],
    );
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut b = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    waker(&mut a, 1);
    waker(&mut b, 0);

    // The stream is up and the host's link state is in the guest's scrape.
    wait_for(Duration::from_secs(30), || {
        let s = agent.scrape();
        (value(&s, "gpufeed_stream_connected", &[("host", HOST)]) == Some(1.0)
            && value(&s, "gpufeed_host_pcie_link_width", &[("bdf", GPU)]) == Some(4.0))
        .then_some(())
    })
    .expect("stream connected and host state received");
    // Baselines: ten windows of each pod's wakeups (the detector's warm-up), and some margin.
    std::thread::sleep(Duration::from_secs(13));
    let s = agent.scrape();
    assert_eq!(correlated(&s, &a.uid, "link_degraded"), 0.0);

    // The link drops and pod A's CPU is taken at the same moment.
    let t = Instant::now();
    demo(&[
        "link",
        dir.path().join("root").to_str().unwrap(),
        "2.5 GT/s PCIe",
        "1",
    ]);
    // At nice 19 they weigh little: the rest of the machine (the agents, pod B) is not pushed
    // off CPU 1 and does not spike too.
    let mut a_hogs = hogs(&sb, &a, 1, 6, 19);
    let ticks = wait_for(Duration::from_secs(15), || {
        (correlated(&agent.scrape(), &a.uid, "link_degraded") >= 1.0).then_some(t.elapsed())
    })
    .unwrap_or_else(|| {
        let text = http_get(agent.addr, "/metrics").unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(&a.uid) && (l.contains("_count") || l.contains("spike")))
            .collect();
        panic!(
            "pod A's spike joined the link drop; /events {}\n/api/state {}\npod A: {lines:#?}",
            json(agent.addr, "/events"),
            json(agent.addr, "/api/state")
        )
    });
    eprintln!("link drop joined to pod A after {ticks:?}");
    let s = agent.scrape();
    assert_eq!(
        correlated(&s, &b.uid, "link_degraded"),
        0.0,
        "pod B did not spike: {:?}",
        find(&s, "gpufeed_correlated_spikes_total", &[("pod", &b.uid)])
    );
    assert!(
        value(
            &s,
            "gpufeed_host_events_total",
            &[("host", HOST), ("event", "link_degraded")]
        ) >= Some(1.0)
    );
    let impact = value(
        &s,
        "gpufeed_event_impact_ratio",
        &[
            ("pod", &a.uid),
            ("event", "link_degraded"),
            ("signal", "run_queue_wait"),
        ],
    )
    .expect("impact of the latest link_degraded on pod A");
    assert!(impact > 2.0, "p99 after ÷ baseline = {impact}");
    // The host's series in the guest's scrape are the host's own.
    let own = parse_metrics(&http_get(host.metrics, "/metrics").unwrap());
    for name in [
        "gpufeed_host_pcie_link_width",
        "gpufeed_host_pcie_link_speed_gts",
        "gpufeed_host_pcie_link_changes_total",
    ] {
        let want = value(&own, name, &[("bdf", GPU)]);
        assert!(want.is_some(), "host has {name}");
        assert_eq!(
            value(&s, name, &[("bdf", GPU), ("host", HOST)]),
            want,
            "{name}"
        );
    }
    assert_eq!(
        value(&s, "gpufeed_host_pcie_link_width", &[("bdf", GPU)]),
        Some(1.0)
    );
    let events = json(agent.addr, "/events");
    let ev = &events[0];
    assert_eq!(ev["event"], "link_degraded");
    assert!(ev["tags"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t == "simulated"));
    assert!(
        ev["affected"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["pod"] == a.uid.as_str()),
        "{ev}"
    );

    // Contention in pod B with no host event: a spike nobody explains.
    a_hogs.kill_all();
    // past the link drop's reach (5 s after it, by default), so that B's spike cannot join it
    std::thread::sleep(Duration::from_secs(9).saturating_sub(t.elapsed()));
    let mut b_hogs = hogs(&sb, &b, 0, 10, 0);
    wait_for(Duration::from_secs(15), || {
        let st = json(agent.addr, "/api/state");
        st["unexplained"]
            .as_array()?
            .iter()
            .any(|x| x["pod"] == b.uid.as_str() && x["signal"] == "run_queue_wait")
            .then_some(())
    })
    .unwrap_or_else(|| {
        let text = http_get(agent.addr, "/metrics").unwrap_or_default();
        let spikes: Vec<&str> = text
            .lines()
            .filter(|l| {
                l.starts_with("gpufeed_latency_spikes_total") || l.starts_with("gpufeed_correlated")
            })
            .collect();
        panic!(
            "pod B ({}) has an unexplained spike (pod A is {}): {}\n{spikes:#?}",
            b.uid,
            a.uid,
            json(agent.addr, "/api/state")
        )
    });
    let s = agent.scrape();
    assert!(
        value(
            &s,
            "gpufeed_latency_spikes_total",
            &[("pod", &b.uid), ("signal", "run_queue_wait")]
        ) >= Some(1.0)
    );
    assert_eq!(
        find(&s, "gpufeed_correlated_spikes_total", &[("pod", &b.uid)]).len(),
        0,
        "{:?}\n/events {}",
        find(&s, "gpufeed_correlated_spikes_total", &[("pod", &b.uid)]),
        json(agent.addr, "/events")
    );

    // A host event with no spike near it correlates nothing: the contention ends, the pods
    // settle, then the link comes back.
    b_hogs.kill_all();
    std::thread::sleep(Duration::from_secs(6));
    demo(&[
        "link",
        dir.path().join("root").to_str().unwrap(),
        "16.0 GT/s PCIe",
        "4",
    ]);
    let restored = wait_for(Duration::from_secs(10), || {
        let ev = json(agent.addr, "/events");
        let first = ev.as_array()?.first()?.clone();
        (first["event"] != "link_degraded").then_some(first)
    })
    .expect("the restore reached /events");
    std::thread::sleep(Duration::from_secs(2));
    let latest = json(agent.addr, "/events")[0].clone();
    assert_eq!(latest["time"], restored["time"]);
    assert_eq!(latest["affected"].as_array().unwrap().len(), 0, "{latest}");

    // explain says the same for a terminal.
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args([
            "explain",
            "--since",
            "5m",
            "--url",
            &format!("http://{}", agent.addr),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("{}: run_queue_wait p99", a.uid)),
        "{text}"
    );
    assert!(
        text.contains("demo-egpu [simulated]: stream connected"),
        "{text}"
    );

    page_in_chromium(agent.addr, &a.uid, dir.path());
    drop(host.proc);
}

/// The page at / in headless Chromium: its DOM, after the scripts ran, shows the event and
/// the pod it hit; a screenshot is kept.
fn page_in_chromium(addr: std::net::SocketAddr, pod: &str, dir: &Path) {
    let chromium = ["chromium", "chromium-browser"].into_iter().find(|c| {
        Command::new("sh")
            .args(["-c", &format!("command -v {c}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let Some(chromium) = chromium else {
        assert!(
            std::env::var("CI").is_err(),
            "chromium is not installed (scripts/setup.sh installs it)"
        );
        eprintln!("skipping the page check: no chromium");
        return;
    };
    let url = format!("http://{addr}/");
    let common = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--virtual-time-budget=5000",
    ];
    let dom = Command::new(chromium)
        .args(common)
        .arg("--dump-dom")
        .arg(&url)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(
        dom.contains("PCIe link 0000:0a:00.0") || dom.contains("link_degraded"),
        "{dom}"
    );
    assert!(
        dom.contains(pod),
        "the page names the pod the drop hit: {dom}"
    );
    assert!(
        dom.contains("DEGRADED") || dom.contains("degraded") || dom.contains("GT/s x4"),
        "{dom}"
    );
    let shot_dir = std::env::var("GPUFEED_SCREENSHOT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| dir.to_path_buf());
    let shot = shot_dir.join("incident-page.png");
    let st = Command::new(chromium)
        .args(common)
        .arg("--window-size=420,900")
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .stderr(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(
        st.success() && shot.exists(),
        "screenshot {}",
        shot.display()
    );
}
