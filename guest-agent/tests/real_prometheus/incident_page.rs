//! The incident page with the real binaries: the host agent on a recorded Thunderbolt eGPU tree
//! (scripts/demo-egpu.sh, the kernel's sysfs formats), the guest agent with its real run-queue
//! probe, QUIC with mutual TLS on loopback, the page rendered by headless Chromium.
//!
//! The GPU's link drops from 16 GT/s x4 to 2.5 GT/s x1 while CPU hogs start in a pod, and comes
//! back when they stop. The link-degraded event's picture in `/api/state` must hold the link's
//! three states at the times the test wrote them, and the pod's windows: near its quiet level
//! before, at the hogs' run-queue waits during (the kernel's own schedstat says how long they
//! waited), with a baseline band. The SVG Chromium draws must carry exactly those points and
//! steps, the strip of the last hour the event and the spike, and the profile link the pod's
//! names and the spike's time. Screenshots at 390 px (a phone) and 1200 px go to the test's
//! directory, and to docs/ with GPUFEED_SCREENSHOT_DIR.

use crate::common;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::chromium::{attr, elements, Chromium};
use common::host_agent::*;
use common::*;
use serde_json::Value;

fn json(addr: std::net::SocketAddr, path: &str) -> Value {
    serde_json::from_str(&http_get(addr, path).unwrap_or_default()).unwrap_or_default()
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Σ run_delay (ns) and Σ switch-ins of every thread of `pids`, from schedstat.
fn waits(pids: &[i32]) -> (u64, u64) {
    let (mut delay, mut runs) = (0, 0);
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for s in tasks.flatten().filter_map(|t| schedstat(&t.path())) {
            delay += s.run_delay_ns;
            runs += s.runs;
        }
    }
    (delay, runs)
}

const PROFILE: &str = "http://parca.example:7070/?expression_a=parca_agent:samples:count:cpu:nanoseconds:delta{namespace=\"{namespace}\",pod=\"{pod}\"}&from_a={from_ms}&to_a={to_ms}";

#[test]
fn the_page_draws_the_link_and_the_pods_windows_around_the_event() {
    let Some(_lock) = require_root() else { return };
    let chromium = Chromium::find();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    demo(&["tree", root.to_str().unwrap()]);
    let quic = free_port();
    let _host = start_host(dir.path(), quic, HostIntervals::FAST);
    let agent = guest_of_host(
        dir.path(),
        quic,
        "1s",
        "sched_latency",
        &["--simulated-host", HOST, "--profile-url", PROFILE],
    );
    let sb = CgroupSandbox::new();
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    // steady wakeups at SCHED_FIFO: whatever else the machine runs, its own waits stay short
    pod.spawn("exec chrt -f 10 taskset -c 1 perl -e 'select(undef, undef, undef, 0.001) while 1'");
    // the detector's warm-up (ten windows) and some margin
    std::thread::sleep(Duration::from_secs(14));

    // The link drops and the pod's CPU is taken at the same moment, for 12 s.
    let t_drop = now_ms();
    demo(&["link", root.to_str().unwrap(), "2.5 GT/s PCIe", "1"]);
    let mut hogs = Pod::new(&sb, Layout::Cgroupfs, "burstable", &pod.uid, &random_cid());
    for _ in 0..6 {
        hogs.spawn("exec nice -n 19 taskset -c 1 sh -c 'while :; do :; done'");
    }
    let t_drop_done = now_ms();
    std::thread::sleep(Duration::from_secs(2));
    let all = || [pod.pids(), hogs.pids()].concat();
    let (before, before_all) = (waits(&hogs.pids()), waits(&all()));
    std::thread::sleep(Duration::from_secs(8));
    let (after, after_all) = (waits(&hogs.pids()), waits(&all()));
    std::thread::sleep(Duration::from_secs(2));
    // the kernel's own figures over the 8 s in the middle: the hogs' mean wait per run, and
    // the pod's (the hogs' and the feeder's many short ones: what its windows average)
    let mean_wait_us = (after.0 - before.0) as f64 / (after.1 - before.1).max(1) as f64 / 1000.0;
    let pod_mean_us =
        (after_all.0 - before_all.0) as f64 / (after_all.1 - before_all.1).max(1) as f64 / 1000.0;
    hogs.kill_all();
    let t_up = now_ms();
    demo(&["link", root.to_str().unwrap(), "16.0 GT/s PCIe", "4"]);
    let t_up_done = now_ms();
    eprintln!("hogs' mean run-queue wait (schedstat): {mean_wait_us:.0} µs");
    // the pod settles; its windows after the restore are in the picture too
    std::thread::sleep(Duration::from_secs(6));

    let events = json(agent.addr, "/events");
    let drop_ev = events
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"] == "link_degraded")
        .unwrap_or_else(|| panic!("a link_degraded event: {events}"))
        .clone();
    let state = json(agent.addr, "/api/state");
    let pic = state["timelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["event"] == "link_degraded" && p["time"] == drop_ev["time"])
        .unwrap_or_else(|| panic!("the drop's picture: {state}"))
        .clone();
    let t_ev = pic["time"].as_i64().unwrap();
    // the host saw the write within its 200 ms poll (and the clocks agree on one machine)
    assert!(
        t_ev >= t_drop - 1000 && t_ev <= t_drop_done + 2000,
        "event at {t_ev}, written {t_drop}..{t_drop_done}"
    );
    assert_eq!(pic["from"].as_i64(), Some(t_ev - 60_000));
    assert_eq!(pic["to"].as_i64(), Some(t_ev + 60_000));

    // The link: 16 x4 before, 2.5 x1 from the drop, 16 x4 again from the restore.
    let link = pic["links"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["bdf"] == GPU)
        .unwrap_or_else(|| panic!("the GPU's link: {pic}"))
        .clone();
    let steps: Vec<(i64, f64, f64)> = link["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["t"].as_i64().unwrap(),
                s["speed_gts"].as_f64().unwrap(),
                s["width"].as_f64().unwrap(),
            )
        })
        .collect();
    // The host polls the GPU's files: it may see the speed change before the width (the demo
    // writes one, then the other), so a change can come in two steps; each step it saw is drawn.
    let in_drop = |t: i64| t >= t_drop - 1000 && t <= t_drop_done + 2000;
    let in_up = |t: i64| t >= t_up - 1000 && t <= t_up_done + 2000;
    assert_eq!(
        (steps[0].0, steps[0].1, steps[0].2),
        (t_ev - 60_000, 16.0, 4.0),
        "{steps:?}"
    );
    assert_eq!(
        steps[1].0, t_ev,
        "the picture's event is the link's first change: {steps:?}"
    );
    let dropped: Vec<_> = steps.iter().filter(|s| in_drop(s.0)).collect();
    let restored: Vec<_> = steps.iter().filter(|s| in_up(s.0)).collect();
    assert_eq!(dropped.len() + restored.len() + 1, steps.len(), "{steps:?}");
    assert!(dropped.iter().all(|s| s.1 == 2.5), "{steps:?}");
    assert_eq!(
        dropped.last().map(|s| (s.1, s.2)),
        Some((2.5, 1.0)),
        "{steps:?}"
    );
    assert_eq!(
        restored.last().map(|s| (s.1, s.2)),
        Some((16.0, 4.0)),
        "{steps:?}"
    );

    // The pod's windows.
    let trace = pic["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["pod"] == pod.uid.as_str() && t["signal"] == "run_queue_wait")
        .unwrap_or_else(|| panic!("pod {} in the picture: {pic}", pod.uid))
        .clone();
    let points: Vec<(i64, f64)> = trace["points"]
        .as_array()
        .unwrap()
        .iter()
        // the value the detector tested against the band: the window's mean
        .map(|p| (p["t"].as_i64().unwrap(), p["tested"].as_f64().unwrap()))
        .collect();
    let quiet: Vec<f64> = points
        .iter()
        .filter(|(t, _)| *t < t_drop - 1000)
        .map(|(_, v)| *v)
        .collect();
    let loaded: Vec<f64> = points
        .iter()
        .filter(|(t, _)| *t >= t_drop_done + 2000 && *t <= t_up - 1000)
        .map(|(_, v)| *v)
        .collect();
    assert!(quiet.len() >= 10 && loaded.len() >= 8, "{points:?}");
    // every loaded window at the pod's waits as schedstat has them (the window's mean is the
    // pod's waits over their count: the hogs' long ones and the feeder's many short ones; how
    // many of each depends on what else the machine runs, so the truth is the pod's own)...
    for v in &loaded {
        assert!(
            *v >= pod_mean_us / 2.0 && *v <= pod_mean_us * 2.0,
            "loaded window mean {v} µs vs the pod's mean wait {pod_mean_us:.0} µs (the hogs' {mean_wait_us:.0} µs): {points:?}"
        );
    }
    // ...and every quiet one far below them
    for v in &quiet {
        assert!(
            *v < mean_wait_us / 4.0,
            "quiet window mean {v} µs vs {mean_wait_us:.0} µs: {points:?}"
        );
    }
    // the band the quiet windows were tested against: its median among them, its upper level
    // above the median and below the loaded windows
    let band = trace["points"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|p| p["t"].as_i64().unwrap() < t_drop - 1000 && !p["median"].is_null())
        .unwrap_or_else(|| panic!("a quiet window with a band: {trace}"))
        .clone();
    let (median, upper) = (
        band["median"].as_f64().unwrap(),
        band["upper"].as_f64().unwrap(),
    );
    let (qlo, qhi) = quiet
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), v| (a.min(*v), b.max(*v)));
    assert!(
        median >= qlo && median <= qhi,
        "median {median} of {quiet:?}"
    );
    let lowest_loaded = loaded.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(
        upper > median && upper < lowest_loaded,
        "upper {upper}, the loaded windows from {lowest_loaded}"
    );
    // the profile link: this pod, from 30 s before the spike to 60 s after
    let spike = t_ev + trace["lag_ms"].as_i64().unwrap();
    let url = trace["profile_url"].as_str().expect("a profile link");
    assert!(
        url.contains(&format!("pod=%22{}%22", pod.uid))
            || url.contains(&format!("pod=\"{}\"", pod.uid)),
        "{url}"
    );
    assert!(url.contains(&format!("from_a={}", spike - 30_000)), "{url}");
    assert!(url.contains(&format!("to_a={}", spike + 60_000)), "{url}");
    let affected = &drop_ev["affected"][0];
    assert_eq!(affected["profile_url"].as_str(), Some(url));
    // the strip: the event and the pod's spike, joined
    let strip = &state["strip"];
    assert!(
        strip["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["t"] == t_ev && e["event"] == "link_degraded"),
        "{strip}"
    );
    assert!(
        strip["spikes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["pod"] == pod.uid.as_str() && s["explained"] == true),
        "{strip}"
    );

    // explain: the same picture as sparklines
    let (ok, text) = explain(agent.addr, "5m");
    assert!(ok, "{text}");
    let line = text
        .lines()
        .find(|l| l.contains(&format!("{} run_queue_wait (", pod.uid)))
        .unwrap_or_else(|| panic!("the pod's sparkline: {text}"));
    assert!(line.contains('█') && line.contains('▁'), "{line}");
    assert!(
        text.contains(&format!("link {GPU} 16 → 2.5 → 16 GT/s")),
        "{text}"
    );

    let Some(chromium) = chromium else { return };
    let page = format!("http://{}/", agent.addr);
    let dom = chromium.dom(&page, 1200);
    // the link-degraded event's card and its picture
    let open = "<div class=\"ev hit\" data-event=\"link_degraded\"";
    let card_at = dom
        .find(open)
        .unwrap_or_else(|| panic!("the event's card: {dom}"));
    let card = &dom[card_at..];
    let card = &card[..card[1..]
        .find("<div class=\"ev")
        .map_or(card.len(), |i| i + 1)];
    let drawn: Vec<(i64, f64)> = elements(card, "circle", "pt")
        .iter()
        .map(|a| {
            (
                attr(a, "data-t").unwrap().parse().unwrap(),
                attr(a, "data-v").unwrap().parse().unwrap(),
            )
        })
        .collect();
    // the page fetched its data after this test's /api/state: up to the last window the test
    // read, it drew exactly those
    let mine_until = points.last().unwrap().0;
    let drawn_until: Vec<(i64, f64)> = drawn
        .into_iter()
        .filter(|(t, _)| *t <= mine_until)
        .collect();
    // (times exact; values as JSON numbers read twice, by the browser and by serde_json, whose
    // float parser may differ in the last bit)
    let same = drawn_until.len() == points.len()
        && drawn_until
            .iter()
            .zip(&points)
            .all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() <= 1e-9 * b.1.abs());
    assert!(
        same,
        "the SVG's points are /api/state's:\n{drawn_until:?}\n{points:?}"
    );
    let drawn_steps: Vec<(i64, f64, f64)> = elements(card, "line", "step")
        .iter()
        .map(|a| {
            (
                attr(a, "data-t").unwrap().parse().unwrap(),
                attr(a, "data-speed").unwrap().parse().unwrap(),
                attr(a, "data-width").unwrap().parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(drawn_steps, steps, "the SVG's link steps");
    assert_eq!(elements(card, "line", "event").len(), 1);
    assert!(
        !elements(card, "polygon", "band").is_empty(),
        "the baseline band is drawn"
    );
    assert!(
        card.contains(&format!("href=\"{}\"", url.replace('&', "&amp;"))),
        "profile link: {card}"
    );
    let strip_events = elements(&dom, "line", "strip-ev");
    assert!(
        strip_events
            .iter()
            .any(|a| attr(a, "data-t") == Some(&t_ev.to_string())
                && attr(a, "data-event") == Some("link_degraded")),
        "the strip's event marks: {strip_events:?}"
    );
    assert!(
        elements(&dom, "circle", "strip-spike")
            .iter()
            .any(|a| attr(a, "data-pod") == Some(pod.uid.as_str())
                && attr(a, "data-explained") == Some("true")),
        "the strip's spike"
    );
    // pictures are drawn at the width the window has (text stays readable on a phone rather
    // than a desktop picture shrunk): 500 px is the narrowest window headless Chromium lays
    // out for --dump-dom (the 390 px phone goes to the screenshot below)
    let width_of = |dom: &str| -> Vec<f64> {
        elements(dom, "svg", "timeline")
            .iter()
            .map(|a| attr(a, "width").unwrap().parse().unwrap())
            .collect()
    };
    let wide = width_of(&dom);
    let narrow = width_of(&chromium.dom(&page, 500));
    assert!(
        !wide.is_empty() && wide.len() == narrow.len(),
        "{wide:?} {narrow:?}"
    );
    for (w, n) in wide.iter().zip(&narrow) {
        assert!(
            (900.0..=1000.0).contains(w) && (280.0..=480.0).contains(n),
            "drawn {w} px at 1200, {n} px at 500"
        );
    }

    let shots = std::env::var("GPUFEED_SCREENSHOT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| dir.path().to_path_buf());
    chromium.screenshot(&page, 390, 1500, &shots.join("incident-page-phone.png"));
    chromium.screenshot(&page, 1200, 1100, &shots.join("incident-page.png"));
}

/// The page leads with each pod's GPU feed stall by cause, as `/metrics` counts it: a pod's
/// thread copies its input to the stand-in device (over the recorded eGPU tree's link, dropped
/// to x1, so its copies crawl) and runs 1 ms kernels for 3 s; the page's first section lists
/// the pod with its stall and each cause, `pcie_link` among them and marked as the host's.
#[test]
fn the_page_leads_with_each_pods_feed_stall_by_cause() {
    use common::gpu::{with_copies, FeedClient, StandInCuda};
    let Some(_lock) = require_root() else { return };
    let chromium = Chromium::find();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    demo(&["tree", root.to_str().unwrap()]);
    let quic = free_port();
    let _host = start_host(dir.path(), quic, HostIntervals::FAST);
    let agent = guest_of_host(dir.path(), quic, "200ms", "cuda", &["--cuda-launches"]);
    let cuda = StandInCuda::with_gaps(dir.path());
    let client = FeedClient::new(dir.path());
    let (ctl, link_file) = (dir.path().join("feed-ctl"), dir.path().join("link-bps"));
    std::fs::create_dir(&ctl).unwrap();
    // the link at x1: a quarter of 16 GT/s x4
    std::fs::write(&link_file, format!("{}", 16e9 * 128.0 / 130.0 / 8.0)).unwrap();
    demo(&["link", root.to_str().unwrap(), "16.0 GT/s PCIe", "1"]);
    wait_for(Duration::from_secs(10), || {
        (value(
            &agent.scrape(),
            "gpufeed_host_pcie_link_width",
            &[("bdf", GPU)],
        ) == Some(1.0))
        .then_some(())
    })
    .expect("the guest sees the link at x1");
    let sb = CgroupSandbox::new();
    let mut feeder = Pod::random(&sb, Layout::Systemd, "burstable");
    feeder.spawn(&with_copies(
        client.command(&cuda, &ctl, &dir.path().join("gaps"), 0, 1, 3000, 1000),
        2 << 20,
        &link_file,
        &dir.path().join("copies"),
    ));
    wait_for(Duration::from_secs(10), || {
        value(&agent.scrape(), "gpufeed_cuda_libraries", &[])
            .filter(|v| *v >= 1.0)
            .map(|_| ())
    })
    .expect("the agent attached to the stand-in library");
    std::fs::File::create(ctl.join("go0")).unwrap();
    common::gpu::wait_file(&ctl.join("paused0"), "the feeding loop's phase");
    // the join has split every tick: the series stay as they are
    let causes = ["cpu", "host_event", "pcie_link", "unexplained"];
    let series = || {
        let s = agent.scrape();
        causes.map(|c| {
            value(
                &s,
                "gpufeed_gpu_feed_stall_seconds_total",
                &[("pod", feeder.uid.as_str()), ("cause", c)],
            )
        })
    };
    let mut last = series();
    loop {
        std::thread::sleep(Duration::from_millis(600));
        let now = series();
        if now == last && now.iter().all(Option::is_some) {
            break;
        }
        last = now;
    }
    let metrics: Vec<f64> = last.iter().map(|v| v.unwrap()).collect();
    eprintln!("/metrics: {causes:?} = {metrics:?} s");
    assert!(
        metrics[2] > 0.3,
        "pcie_link {} s over 3 s on x1",
        metrics[2]
    );

    // /api/state: the pod first (the only one), its causes the largest first
    let state = json(agent.addr, "/api/state");
    let feed = state["feed_stall"].as_array().cloned().unwrap_or_default();
    assert_eq!(feed.len(), 1, "{feed:?}");
    assert_eq!(feed[0]["pod"], feeder.uid.as_str());
    let total: f64 = metrics.iter().sum();
    assert!((feed[0]["seconds"].as_f64().unwrap() - total).abs() < 1e-6);

    let Some(chromium) = chromium else { return };
    let dom = chromium.dom(&format!("http://{}/", agent.addr), 1200);
    // the feed section comes before every other
    let (feed_at, strip_at) = (dom.find("id=\"feed\""), dom.find("id=\"strip\""));
    assert!(
        feed_at.is_some() && feed_at < strip_at,
        "the page leads with the feed stall"
    );
    let rows = elements(&dom, "tr", "feed");
    assert_eq!(rows.len(), 1, "one pod's row");
    assert_eq!(attr(&rows[0], "data-pod"), Some(feeder.uid.as_str()));
    let shown: f64 = attr(&rows[0], "data-seconds").unwrap().parse().unwrap();
    assert!(
        (shown - total).abs() < 1e-6,
        "row {shown} s vs /metrics {total} s"
    );
    let spans = elements(&dom, "span", "feed-cause");
    assert_eq!(spans.len(), 4, "every cause");
    let mut prev = f64::INFINITY;
    for s in &spans {
        let cause = attr(s, "data-cause").unwrap();
        let secs: f64 = attr(s, "data-seconds").unwrap().parse().unwrap();
        let i = causes.iter().position(|c| *c == cause).unwrap();
        assert!(
            (secs - metrics[i]).abs() < 1e-6,
            "{cause}: page {secs} s, /metrics {}",
            metrics[i]
        );
        assert!(secs <= prev, "the largest cause first");
        prev = secs;
        let class = attr(s, "class").unwrap();
        assert_eq!(
            class.split_whitespace().any(|c| c == "bad"),
            cause == "pcie_link",
            "{cause}: {class} (a host cause with stall stands out)"
        );
    }
}
