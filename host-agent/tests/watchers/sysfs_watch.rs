//! The real agent against recorded sysfs trees (TB4 eGPU + plain slot): file changes must
//! produce exactly the expected events, with old and new values, within two poll intervals;
//! nothing fires when nothing changed.

use crate::common;

use common::*;
use gpufeed_host::agent::Agent;
use gpufeed_shared::event::*;
use gpufeed_testkit::prom;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::broadcast::Receiver;

const POLL_MS: u64 = 200;

/// Value of the sample `name{labels..., host="testnode"}` (exactly those labels) in a page.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut want = labels.to_vec();
    want.push(("host", "testnode"));
    let samples = prom::parse(text);
    prom::find(&samples, name, &want)
        .into_iter()
        .find(|s| s.labels.len() == want.len())
        .map(|s| s.value)
}

/// Collect events until none arrives for `quiet`.
async fn drain(rx: &mut Receiver<Stamped>, quiet: Duration) -> Vec<HostEvent> {
    let mut v = Vec::new();
    while let Ok(Ok(e)) = tokio::time::timeout(quiet, rx.recv()).await {
        v.push(e.event);
    }
    v
}

/// Wait for the next event; returns it and how long it took.
async fn next(rx: &mut Receiver<Stamped>, start: Instant) -> (HostEvent, Duration) {
    let e = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("an event within 5 s")
        .expect("bus open");
    (e.event, start.elapsed())
}

/// Change something, then expect exactly `n` events within two poll intervals and no more.
async fn expect_events(
    rx: &mut Receiver<Stamped>,
    n: usize,
    change: impl FnOnce(),
) -> Vec<HostEvent> {
    let start = Instant::now();
    change();
    let mut got = Vec::new();
    for _ in 0..n {
        let (e, took) = next(rx, start).await;
        // Two poll intervals, plus 50 ms for a loaded 2-core CI machine's scheduler.
        assert!(
            took <= Duration::from_millis(2 * POLL_MS + 50),
            "event after {took:?}: {e:?}"
        );
        got.push(e);
    }
    let extra = drain(rx, Duration::from_millis(3 * POLL_MS)).await;
    assert!(extra.is_empty(), "unexpected extra events: {extra:?}");
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tb4_egpu_and_plain_slot_events() {
    let t = Tree::new();
    topology(&t);
    pve_basic(&t);
    let agent = Arc::new(Agent::new(base_config(&t, POLL_MS)));
    let mut rx = agent.bus.subscribe();
    let running = agent.start().await;
    assert!(
        running.enabled.contains(&"pcie")
            && running.enabled.contains(&"aer")
            && running.enabled.contains(&"thunderbolt"),
        "{:?}",
        running.disabled
    );

    // Startup: one DeviceMapped per passed-through function, nothing else.
    let init = drain(&mut rx, Duration::from_millis(3 * POLL_MS)).await;
    let mapped: Vec<&DeviceMapped> = init
        .iter()
        .filter_map(|e| match e {
            HostEvent::DeviceMapped(d) => Some(d),
            _ => None,
        })
        .collect();
    assert_eq!(mapped.len(), 3, "{init:?}");
    assert_eq!(init.len(), 3, "{init:?}");
    let egpu = mapped.iter().find(|d| d.bdf == "0000:0a:00.0").unwrap();
    assert_eq!(egpu.vmid, Some(100));
    assert_eq!(egpu.origin, "hostpci0");
    assert_eq!(
        egpu.path,
        [
            "0000:0a:00.0",
            "0000:09:01.0",
            "0000:08:00.0",
            "0000:06:01.0",
            "0000:05:00.0",
            "0000:00:1c.4"
        ]
    );
    assert_eq!(egpu.root_port.as_deref(), Some("0000:00:1c.4"));
    assert_eq!(egpu.thunderbolt_router.as_deref(), Some("0-1"));
    let plain: Vec<_> = mapped
        .iter()
        .filter(|d| d.vmid == Some(101))
        .map(|d| d.bdf.as_str())
        .collect();
    assert_eq!(plain, ["0000:01:00.0", "0000:01:00.1"]);
    assert_eq!(
        mapped
            .iter()
            .find(|d| d.bdf == "0000:01:00.0")
            .unwrap()
            .thunderbolt_router,
        None
    );

    // Nothing changed: nothing fires over several intervals.
    let quiet = drain(&mut rx, Duration::from_millis(4 * POLL_MS)).await;
    assert!(quiet.is_empty(), "{quiet:?}");

    // GPU drops 16 → 2.5 GT/s (idle downclock): speed-only, below max.
    let ev = expect_events(&mut rx, 1, || {
        t.write(
            &format!("sys/devices/{GPU}/current_link_speed"),
            "2.5 GT/s PCIe\n",
        )
    })
    .await;
    match &ev[0] {
        HostEvent::PcieLinkChange(l) => {
            assert_eq!(l.bdf, "0000:0a:00.0");
            assert_eq!(l.upstream_bdf.as_deref(), Some("0000:09:01.0"));
            assert_eq!(l.vmid, Some(100));
            assert_eq!(
                (l.old_speed_mts, l.new_speed_mts),
                (Some(16000), Some(2500))
            );
            assert_eq!((l.old_width, l.new_width), (4, 4));
            assert_eq!((l.max_speed_mts, l.max_width), (Some(16000), 4));
            assert_eq!(l.class, LinkChangeClass::SpeedOnly);
            // at full width: an idle GPU saving power unless under load (the guest tells)
            assert!(!l.degraded);
            assert_eq!(l.source, Source::Poll);
        }
        e => panic!("{e:?}"),
    }

    // Lost lanes: x4 → x2.
    let ev = expect_events(&mut rx, 1, || {
        t.write(&format!("sys/devices/{GPU}/current_link_width"), "2\n")
    })
    .await;
    match &ev[0] {
        HostEvent::PcieLinkChange(l) => {
            assert_eq!((l.old_speed_mts, l.new_speed_mts), (Some(2500), Some(2500)));
            assert_eq!((l.old_width, l.new_width), (4, 2));
            assert_eq!(l.class, LinkChangeClass::WidthReduction);
            assert!(l.degraded);
        }
        e => panic!("{e:?}"),
    }

    // A runtime-suspended device is not read (reading would wake it): no event.
    t.write(
        &format!("sys/devices/{GPU}/power/runtime_status"),
        "suspended\n",
    );
    t.write(&format!("sys/devices/{GPU}/current_link_width"), "4\n");
    t.write(
        &format!("sys/devices/{GPU}/current_link_speed"),
        "16.0 GT/s PCIe\n",
    );
    let none = drain(&mut rx, Duration::from_millis(3 * POLL_MS)).await;
    assert!(none.is_empty(), "{none:?}");
    // Resumed: the change is seen, as one event.
    let ev = expect_events(&mut rx, 1, || {
        t.write(
            &format!("sys/devices/{GPU}/power/runtime_status"),
            "active\n",
        )
    })
    .await;
    match &ev[0] {
        HostEvent::PcieLinkChange(l) => {
            assert_eq!(
                (l.old_speed_mts, l.new_speed_mts),
                (Some(2500), Some(16000))
            );
            assert_eq!((l.old_width, l.new_width), (2, 4));
            assert_eq!(l.class, LinkChangeClass::WidthIncrease);
            assert!(!l.degraded);
        }
        e => panic!("{e:?}"),
    }

    // The tunnel hop reports a synthetic speed: classified as such.
    let ev = expect_events(&mut rx, 1, || {
        t.write(
            &format!("sys/devices/{ENC_USP}/current_link_speed"),
            "5.0 GT/s PCIe\n",
        )
    })
    .await;
    match &ev[0] {
        HostEvent::PcieLinkChange(l) => {
            assert_eq!(l.bdf, "0000:08:00.0");
            assert_eq!(l.upstream_bdf.as_deref(), Some("0000:06:01.0"));
            assert_eq!(l.class, LinkChangeClass::VirtualTunnelLink);
            assert_eq!((l.old_speed_mts, l.new_speed_mts), (Some(2500), Some(5000)));
            assert!(!l.degraded);
        }
        e => panic!("{e:?}"),
    }

    // Plain slot: x16 → x8 and link down.
    let ev = expect_events(&mut rx, 1, || {
        t.write(
            &format!("sys/devices/{PLAIN_GPU}/current_link_width"),
            "8\n",
        )
    })
    .await;
    match &ev[0] {
        HostEvent::PcieLinkChange(l) => {
            assert_eq!(
                (l.bdf.as_str(), l.vmid, l.old_width, l.new_width, l.class),
                (
                    "0000:01:00.0",
                    Some(101),
                    16,
                    8,
                    LinkChangeClass::WidthReduction
                )
            );
        }
        e => panic!("{e:?}"),
    }
    // Link down: both attributes change; written while the device sleeps so the poll sees
    // them together on resume.
    t.write(
        &format!("sys/devices/{PLAIN_GPU}/power/runtime_status"),
        "suspended\n",
    );
    t.write(
        &format!("sys/devices/{PLAIN_GPU}/current_link_width"),
        "0\n",
    );
    t.write(
        &format!("sys/devices/{PLAIN_GPU}/current_link_speed"),
        "Unknown\n",
    );
    let ev = expect_events(&mut rx, 1, || {
        t.write(
            &format!("sys/devices/{PLAIN_GPU}/power/runtime_status"),
            "active\n",
        )
    })
    .await;
    match &ev[0] {
        HostEvent::PcieLinkChange(l) => {
            assert_eq!(
                (
                    l.old_speed_mts,
                    l.new_speed_mts,
                    l.old_width,
                    l.new_width,
                    l.class
                ),
                (Some(16000), None, 8, 0, LinkChangeClass::LinkDown)
            );
        }
        e => panic!("{e:?}"),
    }

    // AER: a kernel log record for the GPU, then the counters move.
    t.append_kmsg(
        "3,2001,88000000,-,caller=T9;pcieport 0000:09:01.0: AER: Correctable error message received from 0000:0a:00.0\n SUBSYSTEM=pci\n DEVICE=+pci:0000:09:01.0\n\
         4,2002,88000010,-,caller=T9;vfio-pci 0000:0a:00.0: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Receiver ID)\n SUBSYSTEM=pci\n DEVICE=+pci:0000:0a:00.0\n",
    );
    let k = drain(&mut rx, Duration::from_millis(3 * POLL_MS)).await;
    assert_eq!(k.len(), 2, "{k:?}");
    assert!(
        matches!(&k[0], HostEvent::Kmsg(r) if r.class == KmsgClass::AerSource && r.bdf.as_deref() == Some("0000:0a:00.0") && r.vmid == Some(100) && r.seq == 2001)
    );
    assert!(
        matches!(&k[1], HostEvent::Kmsg(r) if r.class == KmsgClass::AerDetail && r.bdf.as_deref() == Some("0000:0a:00.0"))
    );
    let ev = expect_events(&mut rx, 2, || {
        t.write(
            &format!("sys/devices/{GPU}/aer_dev_correctable"),
            &Aer::Correctable.text(&[("BadTLP", 3), ("BadDLLP", 1)]),
        );
    })
    .await;
    let mut names: Vec<(String, u64, u64)> = ev
        .iter()
        .map(|e| match e {
            HostEvent::AerCounter(a) => {
                assert_eq!(
                    (a.bdf.as_str(), a.vmid, a.severity),
                    ("0000:0a:00.0", Some(100), AerSeverity::Correctable)
                );
                assert_eq!(a.kmsg_context.len(), 2, "{:?}", a.kmsg_context);
                assert!(a.kmsg_context[0]
                    .contains("Correctable error message received from 0000:0a:00.0"));
                (a.error.clone(), a.delta, a.total)
            }
            e => panic!("{e:?}"),
        })
        .collect();
    names.sort();
    assert_eq!(
        names,
        [("BadDLLP".to_string(), 1, 1), ("BadTLP".to_string(), 3, 3)]
    );
    // Increment again: delta is the difference; the link partner (enclosure DSP) counts too.
    let ev = expect_events(&mut rx, 2, || {
        t.write(
            &format!("sys/devices/{GPU}/aer_dev_correctable"),
            &Aer::Correctable.text(&[("BadTLP", 5), ("BadDLLP", 1)]),
        );
        t.write(
            &format!("sys/devices/{ENC_DSP}/aer_dev_nonfatal"),
            &Aer::Nonfatal.text(&[("CmpltTO", 1)]),
        );
    })
    .await;
    assert!(ev.iter().any(|e| matches!(e, HostEvent::AerCounter(a) if a.bdf == "0000:0a:00.0" && a.error == "BadTLP" && a.delta == 2 && a.total == 5)), "{ev:?}");
    assert!(ev.iter().any(|e| matches!(e, HostEvent::AerCounter(a) if a.bdf == "0000:09:01.0" && a.error == "CmpltTO" && a.severity == AerSeverity::NonFatal && a.delta == 1 && a.vmid == Some(100))), "{ev:?}");
    // Root-port total of the plain slot.
    let ev = expect_events(&mut rx, 1, || {
        t.write(
            &format!("sys/devices/{PLAIN_RP}/aer_rootport_total_err_cor"),
            "2\n",
        )
    })
    .await;
    assert_eq!(
        ev[0],
        HostEvent::AerRootPortTotal(AerRootPortTotal {
            bdf: "0000:00:01.0".into(),
            severity: AerSeverity::Correctable,
            delta: 2,
            total: 2
        })
    );

    // Thunderbolt: the router's receive side drops to one lane.
    let ev = expect_events(&mut rx, 1, || {
        t.write(&format!("sys/devices/{TB_ROUTER}/rx_lanes"), "1\n")
    })
    .await;
    match &ev[0] {
        HostEvent::ThunderboltDevice(d) => {
            assert_eq!(
                (d.device.as_str(), d.action, d.vmids.as_slice()),
                ("0-1", DeviceAction::Changed, &[100u32][..])
            );
            let (o, n) = (d.old.as_ref().unwrap(), d.new.as_ref().unwrap());
            assert_eq!(
                (o.rx_lanes, n.rx_lanes, o.tx_lanes, n.tx_lanes),
                (Some(2), Some(1), Some(2), Some(2))
            );
            assert_eq!(
                (n.rx_speed_gbps_x10, n.generation, n.authorized),
                (Some(200), Some(4), Some(1))
            );
            assert_eq!(n.device_name.as_deref(), Some("Core X V2"));
        }
        e => panic!("{e:?}"),
    }

    // Metrics carry the current values.
    let m = agent.metrics.render();
    for (name, labels, value) in [
        (
            "gpufeed_host_pcie_link_width",
            vec![("bdf", "0000:0a:00.0"), ("vmid", "100")],
            4.0,
        ),
        (
            "gpufeed_host_pcie_link_speed_gts",
            vec![("bdf", "0000:0a:00.0"), ("vmid", "100")],
            16.0,
        ),
        (
            "gpufeed_host_pcie_link_speed_gts",
            vec![("bdf", "0000:08:00.0"), ("vmid", "100")],
            5.0,
        ),
        (
            "gpufeed_host_pcie_link_changes_total",
            vec![
                ("bdf", "0000:0a:00.0"),
                ("vmid", "100"),
                ("change", "width_reduction"),
            ],
            1.0,
        ),
        (
            "gpufeed_host_pcie_link_changes_total",
            vec![
                ("bdf", "0000:0a:00.0"),
                ("vmid", "100"),
                ("change", "speed_only"),
            ],
            1.0,
        ),
        (
            "gpufeed_host_aer_errors_total",
            vec![
                ("bdf", "0000:0a:00.0"),
                ("vmid", "100"),
                ("severity", "correctable"),
                ("error", "BadTLP"),
            ],
            5.0,
        ),
        (
            "gpufeed_host_aer_rootport_errors_total",
            vec![("bdf", "0000:00:01.0"), ("severity", "correctable")],
            2.0,
        ),
        (
            "gpufeed_host_thunderbolt_lanes",
            vec![("device", "0-1"), ("direction", "rx")],
            1.0,
        ),
        (
            "gpufeed_host_thunderbolt_link_speed_gbps",
            vec![("device", "0-1"), ("direction", "tx")],
            20.0,
        ),
        ("gpufeed_host_vm_up", vec![("vmid", "100")], 0.0),
    ] {
        assert_eq!(
            sample(&m, name, &labels),
            Some(value),
            "{name} {labels:?} in\n{m}"
        );
    }

    // The enclosure is unplugged: the router disappears.
    let ev = expect_events(&mut rx, 1, || t.remove_tb(TB_ROUTER, "0-1")).await;
    match &ev[0] {
        HostEvent::ThunderboltDevice(d) => {
            assert_eq!(
                (d.device.as_str(), d.action),
                ("0-1", DeviceAction::Removed)
            );
            assert_eq!(d.new, None);
            assert_eq!(d.old.as_ref().unwrap().rx_lanes, Some(1));
        }
        e => panic!("{e:?}"),
    }
    assert!(!agent.metrics.render().contains("device=\"0-1\""));
    drop(running);
}

#[tokio::test]
async fn missing_subsystems_turn_watchers_off_once() {
    let t = Tree::new();
    std::fs::remove_file(t.p("dev/kmsg")).unwrap();
    let mut cfg = base_config(&t, POLL_MS);
    cfg.devices = vec!["0000:03:00.0".into()];
    // A device without AER files.
    t.add_pci(
        "pci0000:00/0000:00:03.0",
        Dev {
            bdf: "0000:00:03.0",
            class: "0x060400",
            vendor: "0x1022",
            device: "0x1483",
            speed: "8.0 GT/s PCIe",
            width: 4,
            max_speed: "8.0 GT/s PCIe",
            max_width: 4,
            removable: false,
            aer: false,
            root_port: false,
            driver: None,
        },
    );
    t.add_pci(
        "pci0000:00/0000:00:03.0/0000:03:00.0",
        Dev {
            bdf: "0000:03:00.0",
            class: "0x030000",
            vendor: "0x10de",
            device: "0x2684",
            speed: "8.0 GT/s PCIe",
            width: 4,
            max_speed: "16.0 GT/s PCIe",
            max_width: 16,
            removable: false,
            aer: false,
            root_port: false,
            driver: None,
        },
    );
    let agent = Arc::new(Agent::new(cfg));
    let mut rx = agent.bus.subscribe();
    let running = agent.start().await;
    let evs = drain(&mut rx, Duration::from_millis(3 * POLL_MS)).await;
    let off: Vec<&str> = evs
        .iter()
        .filter_map(|e| match e {
            HostEvent::WatcherDisabled { watcher, .. } => Some(watcher.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(off, ["proxmox", "aer", "thunderbolt", "kmsg"], "{evs:?}");
    let mut names: Vec<&str> = running.disabled.iter().map(|d| d.0).collect();
    names.sort();
    assert_eq!(names, ["aer", "kmsg", "thunderbolt"]);
    assert!(running
        .disabled
        .iter()
        .any(|(w, r)| *w == "thunderbolt" && r.contains("sys/bus/thunderbolt/devices not found")));
    // The agent keeps running: the configured device's link is still watched.
    let start = Instant::now();
    t.write(
        "sys/devices/pci0000:00/0000:00:03.0/0000:03:00.0/current_link_speed",
        "2.5 GT/s PCIe\n",
    );
    let (e, _) = next(&mut rx, start).await;
    assert!(
        matches!(e, HostEvent::PcieLinkChange(ref l) if l.bdf == "0000:03:00.0" && l.vmid.is_none() && l.new_speed_mts == Some(2500)),
        "{e:?}"
    );
    let again = drain(&mut rx, Duration::from_millis(3 * POLL_MS)).await;
    assert!(again.is_empty(), "no repeated off events: {again:?}");
    drop(running);
}
