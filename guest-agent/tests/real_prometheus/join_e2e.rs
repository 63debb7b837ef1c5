//! The join end to end, with the real binaries: the host agent on a recorded Thunderbolt eGPU
//! tree (scripts/demo-egpu.sh, the kernel's sysfs formats), the guest agent with its real
//! probes, QUIC with mutual TLS on loopback.
//!
//! The GPU's link drops from 16 GT/s x4 to 2.5 GT/s x1 while run-queue contention starts in
//! pod A and not in pod B: the correlated count rises for pod A with `link_degraded`, not for
//! pod B. Then contention in pod B with no host event is a spike nobody explains, and a host
//! event with no spike correlates nothing. The host's series in the guest's scrape equal the
//! host's own. (The page at / and its pictures: tests/real_prometheus/incident_page.rs.)
//!
//! A GPU that manages its link's power (2.5 GT/s at full width while idle, up while a pod
//! works on it, NVML through a stand-in library saying which) joins nothing; the same speed
//! drop while the GPU works joins the pod it hit.
//!
//! The GPU's side of a link event: the lanes go while NVML (the stand-in) reports the GPU's
//! PCIe throughput falling to a quarter; the dip is joined to the degradation for the pod on
//! that GPU, and a pod on another GPU whose throughput held shows none.

use crate::common;

use std::path::Path;
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

/// The recorded eGPU tree in `dir/root`, the host agent on it (fast link polls) and the
/// guest agent with `probes` and `extra` flags streaming from it; returned once the stream is
/// up and the host's link state is in the guest's scrape.
struct Scene {
    // dropped in this order: the agents before the tree they read
    agent: Agent,
    host: HostAgent,
    dir: tempfile::TempDir,
}

impl Scene {
    /// `before` runs on the written tree before the host agent starts.
    fn start(probes: &str, extra: &[&str], before: impl FnOnce(&Path)) -> Scene {
        let dir = tempfile::tempdir().unwrap();
        demo(&["tree", dir.path().join("root").to_str().unwrap()]);
        before(dir.path());
        let quic = free_port();
        // A fast link poll and state interval: the scenario's timing is not the defaults' test.
        let host = start_host(dir.path(), quic, HostIntervals::FAST);
        let tls = dir.path().join("certs/guest");
        let mut args = vec![
            "--quic-listen".to_string(),
            format!("127.0.0.1:{quic}"),
            "--tls-dir".to_string(),
            tls.display().to_string(),
            "--simulated-host".to_string(),
            HOST.to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let agent = Agent::no_kube("1s", probes, &args);
        wait_for(Duration::from_secs(30), || {
            let s = agent.scrape();
            (value(&s, "gpufeed_stream_connected", &[("host", HOST)]) == Some(1.0)
                && value(&s, "gpufeed_host_pcie_link_width", &[("bdf", GPU)]).is_some())
            .then_some(())
        })
        .expect("stream connected and host state received");
        Scene { agent, host, dir }
    }

    /// The GPU's link in the recorded tree, e.g. ("2.5 GT/s PCIe", "1").
    fn link(&self, speed: &str, width: &str) {
        demo(&[
            "link",
            self.dir.path().join("root").to_str().unwrap(),
            speed,
            width,
        ]);
    }

    fn host_events(&self, event: &str) -> f64 {
        value(
            &self.agent.scrape(),
            "gpufeed_host_events_total",
            &[("host", HOST), ("event", event)],
        )
        .unwrap_or(0.0)
    }

    /// The GPU link's condition as /api/state reads it.
    fn condition(&self) -> String {
        let st = json(self.agent.addr, "/api/state");
        st["hosts"][0]["links"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|l| l["bdf"] == GPU)
            .and_then(|l| l["condition"].as_str())
            .unwrap_or_default()
            .to_string()
    }
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
    let scene = Scene::start("sched_latency", &[], |_| {});
    let (agent, host) = (&scene.agent, &scene.host);
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut b = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    waker(&mut a, 1);
    waker(&mut b, 0);
    assert_eq!(
        value(
            &agent.scrape(),
            "gpufeed_host_pcie_link_width",
            &[("bdf", GPU)]
        ),
        Some(4.0)
    );
    // Baselines: ten windows of each pod's wakeups (the detector's warm-up), and some margin.
    std::thread::sleep(Duration::from_secs(13));
    let s = agent.scrape();
    assert_eq!(correlated(&s, &a.uid, "link_degraded"), 0.0);

    // The link drops and pod A's CPU is taken at the same moment.
    let t = Instant::now();
    scene.link("2.5 GT/s PCIe", "1");
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
    scene.link("16.0 GT/s PCIe", "4");
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
    let (ok, text) = explain(agent.addr, "5m");
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("{}: run_queue_wait p99", a.uid)),
        "{text}"
    );
    assert!(
        text.contains("demo-egpu [simulated]: stream connected"),
        "{text}"
    );
}

/// `pid` on GPU 0 at 60% SM utilisation in the NVML stand-in's process list, or nothing.
fn gpu_work(nvml: &common::gpu::StandInNvml, pid: Option<u32>) {
    let procs: Vec<(u32, u32, u64, u32)> = pid.map(|p| (p, 0, 1 << 30, 60)).into_iter().collect();
    nvml.set_processes(&procs);
}

/// The GPU manages its link's power: idle at 2.5 GT/s x4 (of 16 GT/s x4), up when pod A
/// starts work on it (NVML, through the stand-in library, reports A's process busy) and A's
/// feeder contends, down again when A stops. Neither change joins A's spike: both are counted
/// and listed as `link_power_managed`, the link reads "power saving" while the GPU idles, and
/// A's spike is the guest's own. Then the same speed drop while A keeps the GPU working is a
/// degradation: `link_degraded`, joined to A's spike.
#[test]
fn power_managed_link_changes_join_nothing_and_a_drop_under_load_does() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let nvml = common::gpu::StandInNvml::new(scratch.path());
    gpu_work(&nvml, None);
    let lib = nvml.path().to_string();
    let scene = Scene::start("sched_latency,nvml", &["--nvml-library", &lib], |dir| {
        demo(&[
            "link",
            dir.join("root").to_str().unwrap(),
            "2.5 GT/s PCIe",
            "4",
        ])
    });
    let agent = &scene.agent;
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    waker(&mut a, 1);
    let feeder = a.pids()[0] as u32;
    assert_eq!(
        value(
            &agent.scrape(),
            "gpufeed_host_pcie_link_speed_gts",
            &[("bdf", GPU)]
        ),
        Some(2.5)
    );
    wait_for(Duration::from_secs(10), || {
        (scene.condition() == "power_saving").then_some(())
    })
    .expect("an idle GPU's slow link reads as power saving");
    std::thread::sleep(Duration::from_secs(13)); // the detector's warm-up, and some margin

    // A starts work: its process on the GPU, its feeder contended, the link up.
    gpu_work(&nvml, Some(feeder));
    scene.link("16.0 GT/s PCIe", "4");
    let mut a_hogs = hogs(&sb, &a, 1, 6, 19);
    let spiked = |s: &[Sample]| {
        value(
            s,
            "gpufeed_latency_spikes_total",
            &[("pod", &a.uid), ("signal", "run_queue_wait")],
        )
        .unwrap_or(0.0)
    };
    wait_for(Duration::from_secs(15), || {
        (spiked(&agent.scrape()) >= 1.0 && scene.host_events("link_power_managed") >= 1.0)
            .then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "A spiked and the rise arrived: /events {}",
            json(agent.addr, "/events")
        )
    });
    // A stops: the GPU idles, the link falls back.
    a_hogs.kill_all();
    gpu_work(&nvml, None);
    std::thread::sleep(Duration::from_secs(2));
    scene.link("2.5 GT/s PCIe", "4");
    wait_for(Duration::from_secs(15), || {
        (scene.host_events("link_power_managed") >= 2.0).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the drop is power-managed: /events {}",
            json(agent.addr, "/events")
        )
    });
    std::thread::sleep(Duration::from_secs(2));
    let s = agent.scrape();
    assert_eq!(
        find(&s, "gpufeed_correlated_spikes_total", &[("pod", &a.uid)]).len(),
        0,
        "/events {}",
        json(agent.addr, "/events")
    );
    for kind in ["link_degraded", "link_changed"] {
        assert_eq!(scene.host_events(kind), 0.0, "{kind}");
    }
    let events = json(agent.addr, "/events");
    let listed: Vec<&serde_json::Value> = events.as_array().unwrap().iter().collect();
    assert!(
        listed.iter().all(|e| e["event"] == "link_power_managed"),
        "{events}"
    );
    assert!(
        listed[0]["text"]
            .as_str()
            .unwrap()
            .contains("16.0 GT/s x4 → 2.5 GT/s x4 (speed_only); at full width, GPU idle: power management, not a cause"),
        "{events}"
    );
    assert!(listed
        .iter()
        .all(|e| e["affected"].as_array().unwrap().is_empty()));
    assert_eq!(scene.condition(), "power_saving");

    // Under load: A works, the link is up; then it drops while A keeps working, and A's
    // feeder suffers.
    gpu_work(&nvml, Some(feeder));
    scene.link("16.0 GT/s PCIe", "4");
    std::thread::sleep(Duration::from_secs(9)); // past the rise's reach, A's baseline quiet
    assert_eq!(scene.condition(), "full");
    scene.link("2.5 GT/s PCIe", "4");
    let _a_hogs = hogs(&sb, &a, 1, 6, 19);
    wait_for(Duration::from_secs(20), || {
        (correlated(&agent.scrape(), &a.uid, "link_degraded") >= 1.0).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the drop under load joins A: /events {}",
            json(agent.addr, "/events")
        )
    });
    assert_eq!(scene.condition(), "degraded");
    let events = json(agent.addr, "/events");
    let degraded = &events[0];
    assert_eq!(degraded["event"], "link_degraded", "{events}");
    assert!(
        degraded["text"]
            .as_str()
            .unwrap()
            .contains("below its maximum while the GPU works"),
        "{events}"
    );
}

/// Pod A's process works on GPU 0, which moves 4 GB/s over its link; pod B's on GPU 1
/// (3 GB/s). The host's link loses lanes (16 GT/s x4 → 2.5 GT/s x1) and NVML reports GPU 0's
/// throughput at a quarter: A's `gpu_link_throughput` dip is a spike joined to
/// `link_degraded`, its impact the quarter NVML reported; B, whose GPU moved as before, has
/// no spike.
#[test]
fn a_link_drop_shows_the_throughput_dip_it_caused_and_a_pod_on_another_gpu_none() {
    const LINK: &str = "gpu_link_throughput";
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let nvml = common::gpu::StandInNvml::new(scratch.path());
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut b = Pod::random(&sb, Layout::Systemd, "burstable");
    a.spawn("exec sleep 120");
    b.spawn("exec sleep 120");
    let (pa, pb) = (a.pids()[0] as u32, b.pids()[0] as u32);
    nvml.set_processes(&[(pa, 0, 1 << 30, 80), (pb, 1, 1 << 30, 80)]);
    // KiB/s, TX and RX: 4 000 000 KiB/s in all on GPU 0, 3 000 000 on GPU 1
    let full = [
        (0, 4, 16, 3_000_000, 1_000_000),
        (1, 4, 16, 2_000_000, 1_000_000),
    ];
    nvml.set_links(&full);
    let lib = nvml.path().to_string();
    let scene = Scene::start("nvml", &["--nvml-library", &lib], |_| {});
    let agent = &scene.agent;
    let pod_bps = |s: &[Sample], uid: &str| {
        value(
            s,
            "gpufeed_nvml_pod_gpu_pcie_bytes_per_second",
            &[("pod", uid)],
        )
    };
    wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        (pod_bps(&s, &a.uid) == Some(4_096_000_000.0)
            && pod_bps(&s, &b.uid) == Some(3_072_000_000.0))
        .then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "each pod's GPU throughput: {:?}",
            find(
                &agent.scrape(),
                "gpufeed_nvml_pod_gpu_pcie_bytes_per_second",
                &[]
            )
        )
    });
    std::thread::sleep(Duration::from_secs(13)); // the detector's warm-up, and some margin

    scene.link("2.5 GT/s PCIe", "1");
    nvml.set_links(&[(0, 1, 1, 750_000, 250_000), full[1]]);
    let joined = |s: &[Sample], uid: &str| {
        value(
            s,
            "gpufeed_correlated_spikes_total",
            &[("pod", uid), ("event", "link_degraded"), ("signal", LINK)],
        )
    };
    wait_for(Duration::from_secs(20), || {
        (joined(&agent.scrape(), &a.uid) == Some(1.0)).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "A's dip joins the degradation: /events {}",
            json(agent.addr, "/events")
        )
    });
    std::thread::sleep(Duration::from_secs(4)); // the dip's later windows, B's too
    let s = agent.scrape();
    let impact = value(
        &s,
        "gpufeed_event_impact_ratio",
        &[
            ("pod", &a.uid),
            ("event", "link_degraded"),
            ("signal", LINK),
        ],
    )
    .expect("A's impact");
    assert!(
        (impact - 0.25).abs() < 0.01,
        "a quarter of the throughput: {impact}"
    );
    assert_eq!(
        find(&s, "gpufeed_latency_spikes_total", &[("pod", &b.uid)]).len(),
        0,
        "B's GPU moved as before: /events {}",
        json(agent.addr, "/events")
    );
    let events = json(agent.addr, "/events");
    let degraded = &events[0];
    assert_eq!(degraded["event"], "link_degraded", "{events}");
    let hit: Vec<(&str, &str)> = degraded["affected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| (h["pod"].as_str().unwrap(), h["signal"].as_str().unwrap()))
        .collect();
    assert_eq!(hit, [(a.uid.as_str(), LINK)], "{events}");
}
