//! Host state in the guest's scrape: the real stream client sends the host's own series for a
//! guest, the real hub exports them in the guest's registry with the same names, labels and
//! values; changes follow within a state interval, another VM's series stay out, and a
//! stopped host leaves its last values beside `gpufeed_stream_connected{host} 0`.

use std::collections::BTreeMap;
use std::time::Duration;

use gpufeed_host::stream;
use gpufeed_testkit::stream::*;
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};

/// The host agent's registry shape: every series carries `host`.
fn host_registry() -> (Registry, GaugeVec, IntCounterVec) {
    let r = Registry::new_custom(
        None,
        Some([("host".to_string(), "pve1".to_string())].into()),
    )
    .unwrap();
    let width = GaugeVec::new(
        Opts::new(
            "gpufeed_host_pcie_link_width",
            "Current PCIe link width in lanes (0 = down)",
        ),
        &["bdf", "vmid"],
    )
    .unwrap();
    r.register(Box::new(width.clone())).unwrap();
    let changes = IntCounterVec::new(
        Opts::new(
            "gpufeed_host_pcie_link_changes_total",
            "Link speed/width changes",
        ),
        &["bdf", "vmid"],
    )
    .unwrap();
    r.register(Box::new(changes.clone())).unwrap();
    (r, width, changes)
}

/// `name{labels} value` lines of the families whose name starts with `prefix`.
fn series(reg: &Registry, prefix: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for mf in reg.gather() {
        if !mf.name().starts_with(prefix) {
            continue;
        }
        for m in mf.get_metric() {
            let mut labels: Vec<String> = m
                .get_label()
                .iter()
                .map(|l| format!("{}={}", l.name(), l.value()))
                .collect();
            labels.sort();
            let v = match mf.get_field_type() {
                prometheus::proto::MetricType::COUNTER => m.get_counter().get_value(),
                _ => m.get_gauge().get_value(),
            };
            out.insert(format!("{}{{{}}}", mf.name(), labels.join(",")), v);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_exports_the_hosts_series_for_its_vm() {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let greg = Registry::new();
    let hub = hub::serve(hub_config(fx.path()), &greg).await.unwrap();
    let (hreg, width, changes) = host_registry();
    width.with_label_values(&["0000:0a:00.0", "100"]).set(4.0);
    width.with_label_values(&["0000:01:00.0", "101"]).set(16.0); // another guest's VM
    changes
        .with_label_values(&["0000:0a:00.0", "100"])
        .inc_by(3);
    let mut cfg = fx.stream_config("pve1", hub.local_addr(), None);
    cfg.guests[0].vmids = vec![100];
    cfg.state_interval_ms = 100;
    let h = stream::start(cfg, "pve1".into(), &hreg).unwrap();

    // What the host's own /metrics says about VM 100 is what the guest exports.
    let host_view = |want_vm: &str| -> BTreeMap<String, f64> {
        series(&hreg, "gpufeed_host_pcie")
            .into_iter()
            .filter(|(k, _)| k.contains(&format!("vmid={want_vm}")))
            .collect()
    };
    assert!(
        wait_for(Duration::from_secs(10), || series(
            &greg,
            "gpufeed_host_pcie"
        ) == host_view("100"))
        .await,
        "guest {:?}\nhost {:?}",
        series(&greg, "gpufeed_host_pcie"),
        host_view("100")
    );
    assert_eq!(
        series(&greg, "gpufeed_host_pcie")
            ["gpufeed_host_pcie_link_width{bdf=0000:0a:00.0,host=pve1,vmid=100}"],
        4.0
    );
    // VM 101 is another guest's: not in this guest's scrape.
    assert!(!series(&greg, "gpufeed_host_pcie")
        .keys()
        .any(|k| k.contains("vmid=101")));

    // The link falls to x1: the guest follows within a state interval.
    width.with_label_values(&["0000:0a:00.0", "100"]).set(1.0);
    changes.with_label_values(&["0000:0a:00.0", "100"]).inc();
    assert!(
        wait_for(Duration::from_secs(5), || series(
            &greg,
            "gpufeed_host_pcie"
        ) == host_view("100"))
        .await,
        "{:?}",
        series(&greg, "gpufeed_host_pcie")
    );
    assert_eq!(
        metric(
            &greg,
            "gpufeed_host_pcie_link_changes_total",
            &[("bdf", "0000:0a:00.0"), ("host", "pve1"), ("vmid", "100")]
        ),
        4.0
    );
    // the two link series and this guest's own stream series (gpufeed_host_stream_*{guest})
    let state = hub.host_state("pve1").unwrap();
    assert_eq!(
        metric(
            &greg,
            "gpufeed_stream_host_state_series",
            &[("host", "pve1")]
        ),
        state.len() as f64
    );
    assert!(state
        .families
        .iter()
        .any(|f| f.name == "gpufeed_host_stream_connected"
            && f.series.iter().all(|x| x.label("guest") == Some("guest"))));

    // The host stops: the last values stay, and the guest says the stream is down.
    h.shutdown().await;
    assert!(
        wait_for(Duration::from_secs(10), || metric(
            &greg,
            "gpufeed_stream_connected",
            &[("host", "pve1")]
        ) == 0.0)
        .await
    );
    assert_eq!(
        metric(
            &greg,
            "gpufeed_host_pcie_link_width",
            &[("bdf", "0000:0a:00.0"), ("host", "pve1"), ("vmid", "100")]
        ),
        1.0
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(
        metric(
            &greg,
            "gpufeed_stream_host_state_age_seconds",
            &[("host", "pve1")]
        ) >= 1.0
    );
}

/// An event takes the host state with it: the host's series in the guest's scrape follow the
/// event within a fraction of a second, long before the next state interval (a minute here),
/// and a change with no event waits for that interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_state_follows_each_event_before_the_next_interval() {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let greg = Registry::new();
    let hub = hub::serve(hub_config(fx.path()), &greg).await.unwrap();
    let (hreg, width, _changes) = host_registry();
    width.with_label_values(&["0000:0a:00.0", "100"]).set(4.0);
    let mut cfg = fx.stream_config("pve1", hub.local_addr(), None);
    cfg.guests[0].vmids = vec![100];
    cfg.state_interval_ms = 60_000;
    let h = stream::start(cfg, "pve1".into(), &hreg).unwrap();
    let guest_width = || {
        metric(
            &greg,
            "gpufeed_host_pcie_link_width",
            &[("bdf", "0000:0a:00.0"), ("host", "pve1"), ("vmid", "100")],
        )
    };
    // the state on connect
    assert!(wait_for(Duration::from_secs(10), || guest_width() == 4.0).await);

    // A change of the series alone waits for the state interval.
    width.with_label_values(&["0000:0a:00.0", "100"]).set(1.0);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        guest_width(),
        4.0,
        "no event: the state waits for its interval"
    );

    // An event goes out: the state follows it.
    let t0 = std::time::Instant::now();
    h.push_raw(0, kmsg_lost_raw(1, 2));
    assert!(
        wait_for(Duration::from_secs(5), || guest_width() == 1.0).await,
        "the state did not follow the event"
    );
    let lag = t0.elapsed();
    assert!(lag < Duration::from_secs(2), "state followed after {lag:?}");
    assert_eq!(hub.host_state("pve1").map(|s| s.is_empty()), Some(false));

    // Several events in a burst: still one state at the end that has the last value.
    width.with_label_values(&["0000:0a:00.0", "100"]).set(2.0);
    for i in 0..20 {
        h.push_raw(0, kmsg_lost_raw(10 + i, 11 + i));
    }
    assert!(
        wait_for(Duration::from_secs(5), || guest_width() == 2.0).await,
        "the state did not follow the burst"
    );
    h.shutdown().await;
}
