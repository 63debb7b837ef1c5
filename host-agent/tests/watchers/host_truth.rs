//! Host series that must keep agreeing with the kernel's own accounting through what happens in
//! production: vCPU threads that exit or cannot be read, a GPU link that goes down and takes its
//! config space with it, a device replugged under the same address, the Thunderbolt host
//! router. Each test drives the watcher's core (`*Poller::poll`) on a recorded tree in the
//! kernel's exact formats (`tests/common`).

use crate::common;

use common::*;
use gpufeed_host::discovery::discover;
use gpufeed_host::roots::Roots;
use gpufeed_host::watch::aer::{AerMetrics, AerPoller};
use gpufeed_host::watch::pcie::{PcieMetrics, PciePoller};
use gpufeed_host::watch::thunderbolt::{TbMetrics, TbPoller};
use gpufeed_host::watch::vm::{VmMetrics, VmPoller};
use gpufeed_host::watch::{RecentKmsg, Topology};
use gpufeed_shared::event::*;
use prometheus::Registry;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

fn topo(t: &Tree) -> Topology {
    Topology::from_devices(discover(&Roots::new(t.root()), "testnode", &[]).1)
}

/// The recorded host: its devices and its Proxmox configuration.
fn host_tree() -> Tree {
    let t = Tree::new();
    topology(&t);
    pve_basic(&t);
    t
}

/// Everything `reg` exports, in the text format.
fn exposition(reg: &Registry) -> String {
    prometheus::TextEncoder::new()
        .encode_to_string(&reg.gather())
        .unwrap()
}

// ---- vCPU run delay ----

/// QEMU of VM 100 (pid 4242) with its threads: (tid, comm, schedstat wait ns).
fn qemu(t: &Tree, threads: &[(u32, &str, u64)]) {
    t.write("run/qemu-server/100.pid", "4242\n");
    t.write(
        "proc/4242/cmdline",
        "/usr/bin/kvm\0-id\x00100\0-name\0gpu,debug-threads=on\0",
    );
    t.write("proc/4242/comm", "kvm\n");
    for (tid, comm, wait) in threads {
        set_wait(t, *tid, comm, *wait);
    }
}

/// `/proc/<pid>/task/<tid>/schedstat`: run time, wait time (run delay), timeslices.
fn set_wait(t: &Tree, tid: u32, comm: &str, wait_ns: u64) {
    t.write(&format!("proc/4242/task/{tid}/comm"), &format!("{comm}\n"));
    t.write(
        &format!("proc/4242/task/{tid}/schedstat"),
        &format!("987654321 {wait_ns} 77\n"),
    );
}

#[test]
fn vcpu_run_delay_follows_each_thread_through_exits_failed_reads_and_hotplug() {
    let t = Tree::new();
    const S: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;
    qemu(
        &t,
        &[
            (4242, "kvm", 9 * S),
            (4250, "CPU 0/KVM", S),
            (4251, "CPU 1/KVM", S / 2),
            (4252, "CPU 2/KVM", 2 * S),
        ],
    );
    let roots = Roots::new(t.root());
    let m = VmMetrics::new(&Registry::new());
    let mut p = VmPoller::new(false);
    let vmids = BTreeSet::from([100]);
    let (topo, recent) = (Topology::default(), RecentKmsg::default());
    let counter = || m.vcpu_run_delay.with_label_values(&["100"]).get();
    // Each step sleeps 100 ms of wall time, then moves the threads by less than that (what a
    // vCPU can wait in 100 ms) and polls; the counter must grow by exactly that.
    let mut step = |change: &dyn Fn()| -> f64 {
        std::thread::sleep(Duration::from_millis(100));
        change();
        let before = counter();
        p.poll(&roots, &vmids, &topo, &recent, Duration::ZERO, &m);
        counter() - before
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;

    // Start: the vCPU threads' run delay so far (not the I/O thread's 9 s).
    let first = step(&|| {});
    assert!(close(first, 3.5), "{first}");
    // vCPU 0 waits 30 ms.
    let d = step(&|| set_wait(&t, 4250, "CPU 0/KVM", S + 30 * MS));
    assert!(close(d, 0.030), "{d}");
    // vCPU 2 is unplugged (its thread exits) while vCPU 0 waits 20 ms: the sum over the
    // threads falls by 2 s, the counter still grows by 20 ms only.
    let d = step(&|| {
        std::fs::remove_dir_all(t.p("proc/4242/task/4252")).unwrap();
        set_wait(&t, 4250, "CPU 0/KVM", S + 50 * MS);
    });
    assert!(close(d, 0.020), "unplugged vCPU: {d}");
    // The read of vCPU 1 fails (the kernel's read of an exiting task; here a schedstat that
    // cannot be read) while vCPU 0 waits 10 ms.
    let d = step(&|| {
        let f = t.p("proc/4242/task/4251/schedstat");
        std::fs::remove_file(&f).unwrap();
        std::fs::create_dir(&f).unwrap(); // read(2) fails with EISDIR
        set_wait(&t, 4250, "CPU 0/KVM", S + 60 * MS);
    });
    assert!(close(d, 0.010), "failed read: {d}");
    // vCPU 1 reads again, 40 ms more than its last good read: counted once, then.
    let d = step(&|| {
        std::fs::remove_dir(t.p("proc/4242/task/4251/schedstat")).unwrap();
        set_wait(&t, 4251, "CPU 1/KVM", S / 2 + 40 * MS);
    });
    assert!(close(d, 0.040), "read again: {d}");
    // A vCPU is plugged: a new thread with 25 ms of run delay in its short life.
    let d = step(&|| set_wait(&t, 4253, "CPU 3/KVM", 25 * MS));
    assert!(close(d, 0.025), "new vCPU: {d}");
    // The I/O thread exits: not a vCPU, nothing changes.
    let d = step(&|| std::fs::remove_dir_all(t.p("proc/4242/task/4242")).unwrap());
    assert!(close(d, 0.0), "I/O thread exit: {d}");
    // An impossible jump (a thread that reads 60 s more after ~0.1 s): never more than the
    // wall time of the interval per vCPU thread.
    let t0 = Instant::now();
    let d = step(&|| set_wait(&t, 4250, "CPU 0/KVM", 61 * S));
    let wall = t0.elapsed().as_secs_f64();
    assert!(d > 0.0 && d <= wall + 0.005, "jump {d} s in {wall} s");
    assert!(
        counter() < 3.5 + 0.125 + 3.0 * wall,
        "counter {}",
        counter()
    );
}

// ---- PCIe link down ----

fn pcie_poller(t: &Tree, reg: &Registry) -> PciePoller {
    PciePoller::new(Roots::new(t.root()), PcieMetrics::new(reg))
}

fn gauge(p: &PciePoller, bdf: &str, vm: &str) -> (f64, i64) {
    let m = p.metrics();
    (
        m.speed.with_label_values(&[bdf, vm]).get(),
        m.width.with_label_values(&[bdf, vm]).get(),
    )
}

/// Of the link of `bdf` only its change counters are left: no stale gauge.
fn assert_only_change_counters(reg: &Registry, bdf: &str) {
    let text = exposition(reg);
    let label = format!("bdf=\"{bdf}\"");
    assert!(
        !text
            .lines()
            .any(|l| l.contains(&label) && !l.contains("changes_total")),
        "{text}"
    );
}

/// Both forms of a link that went down with the device's config space: the device's own
/// `current_link_*` fail to read (the kernel: EINVAL), or read all ones (width 63, speed
/// `Unknown`). The port above keeps the link's state (width 0 while down): the gauges read 0
/// (the link-down rule is `gpufeed_host_pcie_link_width == 0`) and the event is the one a
/// width-0 read of the device gives.
#[test]
fn link_down_with_unreadable_or_all_ones_config_space_reads_the_port() {
    for form in ["failing read", "all ones"] {
        let t = host_tree();
        let topo = topo(&t);
        let mut p = pcie_poller(&t, &Registry::new());
        assert!(p.poll(&topo.links, Source::Poll).is_empty());
        assert_eq!(gauge(&p, "0000:01:00.0", "101"), (16.0, 16), "{form}");

        // The link of the plain-slot GPU goes down: the root port's Link Status reads width 0
        // (its speed field keeps a rate, as on real ports; a down link has no speed).
        t.set_link(PLAIN_RP, "0", "2.5 GT/s PCIe");
        let gpu = |f: &str| t.p(&format!("sys/devices/{PLAIN_GPU}/{f}"));
        match form {
            "failing read" => {
                // read(2) fails with EIO, as the kernel's does for a device that stopped
                // answering: /proc/self/mem at offset 0 (nothing is mapped there). A failure
                // of the agent's own (EMFILE, EACCES, a directory) says nothing of the link.
                for f in ["current_link_width", "current_link_speed"] {
                    std::fs::remove_file(gpu(f)).unwrap();
                    std::os::unix::fs::symlink("/proc/self/mem", gpu(f)).unwrap();
                }
            }
            _ => {
                t.set_link(PLAIN_GPU, "63", "Unknown");
                t.write(&format!("sys/devices/{PLAIN_GPU}/max_link_width"), "63\n");
            }
        }
        let ev = p.poll(&topo.links, Source::Poll);
        assert_eq!(ev.len(), 1, "{form}: {ev:?}");
        let HostEvent::PcieLinkChange(l) = &ev[0] else {
            panic!("{form}: {ev:?}")
        };
        assert_eq!(
            (
                l.bdf.as_str(),
                l.vmid,
                l.old_speed_mts,
                l.new_speed_mts,
                l.old_width,
                l.new_width,
                l.class,
                l.degraded,
                l.max_width,
            ),
            (
                "0000:01:00.0",
                Some(101),
                Some(16000),
                None,
                16,
                0,
                LinkChangeClass::LinkDown,
                true,
                16
            ),
            "{form}"
        );
        assert_eq!(gauge(&p, "0000:01:00.0", "101"), (0.0, 0), "{form}");
        assert_eq!(
            p.metrics()
                .max_width
                .with_label_values(&["0000:01:00.0", "101"])
                .get(),
            16,
            "{form}: the maximum is kept while the device cannot be read"
        );
        // Still down on the next poll: no new event, the gauges stay at 0.
        assert!(p.poll(&topo.links, Source::Poll).is_empty());
        assert_eq!(gauge(&p, "0000:01:00.0", "101").1, 0, "{form}");

        // The same link going down as a width-0 read of the GPU itself gives the same event.
        let t2 = host_tree();
        let mut p2 = pcie_poller(&t2, &Registry::new());
        p2.poll(&topo.links, Source::Poll);
        t2.set_link(PLAIN_GPU, "0", "2.5 GT/s PCIe");
        let ev2 = p2.poll(&topo.links, Source::Poll);
        assert_eq!(ev, ev2, "{form}");

        // The link comes back and the device answers again: link up, values from the device.
        for f in ["current_link_width", "current_link_speed"] {
            if gpu(f).is_dir() {
                std::fs::remove_dir(gpu(f)).unwrap();
            }
        }
        t.set_link(PLAIN_GPU, "16", "16.0 GT/s PCIe");
        t.write(&format!("sys/devices/{PLAIN_GPU}/max_link_width"), "16\n");
        let ev = p.poll(&topo.links, Source::Poll);
        assert!(
            matches!(&ev[..], [HostEvent::PcieLinkChange(l)] if l.class == LinkChangeClass::LinkUp && l.new_width == 16),
            "{form}: {ev:?}"
        );
        assert_eq!(gauge(&p, "0000:01:00.0", "101"), (16.0, 16), "{form}");
    }
}

/// The other way a link goes down: pciehp removes the device behind a link that went down,
/// and discovery (on the removal's uevent) drops its links, before or after the next poll.
/// The port above still shows the link down: one link-down event, gauges at 0 while the port's
/// link stays down, and gone when it is up again.
#[test]
fn link_down_with_the_device_removed_reads_the_port() {
    for rescan_first in [true, false] {
        let t = host_tree();
        let before = topo(&t);
        let reg = Registry::new();
        let mut p = pcie_poller(&t, &reg);
        p.poll(&before.links, Source::Poll);
        t.set_link(PLAIN_RP, "0", "2.5 GT/s PCIe");
        for (path, bdf) in [(PLAIN_GPU, "0000:01:00.0"), (PLAIN_AUDIO, "0000:01:00.1")] {
            std::fs::remove_file(t.pci(bdf)).unwrap();
            std::fs::remove_dir_all(t.p(&format!("sys/devices/{path}"))).unwrap();
        }
        let after = topo(&t);
        assert!(after.links.iter().all(|l| l.child != "0000:01:00.0"));
        let ev = if rescan_first {
            let mut ev = p.retain(&after.links, Source::Poll);
            ev.extend(p.poll(&after.links, Source::Poll));
            ev
        } else {
            let mut ev = p.poll(&before.links, Source::Poll);
            ev.extend(p.retain(&after.links, Source::Poll));
            ev
        };
        assert!(
            matches!(&ev[..], [HostEvent::PcieLinkChange(l)] if l.bdf == "0000:01:00.0"
                && l.class == LinkChangeClass::LinkDown && l.new_width == 0 && l.new_speed_mts.is_none()
                && l.max_width == 16),
            "rescan first {rescan_first}: {ev:?}"
        );
        for _ in 0..2 {
            assert!(p.retain(&after.links, Source::Poll).is_empty());
            assert!(p.poll(&after.links, Source::Poll).is_empty());
            assert_eq!(gauge(&p, "0000:01:00.0", "101"), (0.0, 0));
        }
        // The port trains a link again (a card is back, not yet rescanned): no stale series.
        t.set_link(PLAIN_RP, "16", "16.0 GT/s PCIe");
        assert!(p.retain(&after.links, Source::Poll).is_empty());
        assert_only_change_counters(&reg, "0000:01:00.0");
        // A device that is only unassigned (still there) takes its series away too.
        assert!(p.retain(&[], Source::Poll).is_empty());
        let text = exposition(&reg);
        assert!(!text.contains("gpufeed_host_pcie_link_width{"), "{text}");
    }
}

/// A safe removal (pciehp's attention button or slot `power`, as QEMU's `device_del` asks for):
/// pciehp removes the functions, then powers the slot off, and the port's Link Status width
/// stays what it was (QEMU's root port reads its own x32 maximum once empty; the width is
/// undefined while a link is down). The slot's `power`/`adapter` say the link is down: one
/// link-down event once the slot is off (none while it still reads powered). The replug is a
/// link-up event whichever comes first: the functions enumerated before discovery has seen
/// them (6.12 in the lab: the `add` uevent), or the slot powered on before the functions are
/// there (7.3: the `pci_hp_event` tracepoint's read comes first).
#[test]
fn safe_removal_reads_the_slot_and_a_replug_is_a_link_up() {
    for enumerated_first in [true, false] {
        let t = host_tree();
        t.write("sys/bus/pci/slots/1/address", "0000:01:00\n");
        t.write("sys/bus/pci/slots/1/adapter", "1\n");
        t.write("sys/bus/pci/slots/1/power", "1\n");
        std::fs::create_dir_all(t.p(&format!("sys/devices/{PLAIN_RP}/pci_bus/0000:01"))).unwrap();
        let before = topo(&t);
        let reg = Registry::new();
        let mut p = pcie_poller(&t, &reg);
        p.poll(&before.links, Source::Poll);
        let functions = [(PLAIN_GPU, "0000:01:00.0"), (PLAIN_AUDIO, "0000:01:00.1")];
        // removed: kept aside to be plugged back as they were
        for (path, bdf) in functions {
            std::fs::remove_file(t.pci(bdf)).unwrap();
            std::fs::rename(t.p(&format!("sys/devices/{path}")), t.p(bdf)).unwrap();
        }
        // the removal's uevent, before pciehp has powered the slot off: nothing known yet
        assert!(p.poll(&before.links, Source::Uevent).is_empty());
        t.write("sys/bus/pci/slots/1/power", "0\n");
        t.write("sys/bus/pci/slots/1/adapter", "0\n");
        let ev = p.poll(&before.links, Source::Uevent);
        assert!(
            matches!(&ev[..], [HostEvent::PcieLinkChange(l)] if l.bdf == "0000:01:00.0"
                && l.class == LinkChangeClass::LinkDown && l.old_width == 16 && l.new_width == 0
                && l.source == Source::Uevent),
            "{ev:?}"
        );
        let after = topo(&t);
        assert!(p.retain(&after.links, Source::Uevent).is_empty());
        assert_eq!(gauge(&p, "0000:01:00.0", "101"), (0.0, 0));
        let plug = || {
            for (path, bdf) in functions {
                std::fs::rename(t.p(bdf), t.p(&format!("sys/devices/{path}"))).unwrap();
                std::os::unix::fs::symlink(format!("../../../devices/{path}"), t.pci(bdf)).unwrap();
            }
        };
        // plugged back: the slot powered and occupied
        t.write("sys/bus/pci/slots/1/power", "1\n");
        t.write("sys/bus/pci/slots/1/adapter", "1\n");
        let source = if enumerated_first {
            plug();
            Source::Uevent
        } else {
            // read before the functions are there: the link is no longer known down, its
            // series go (no stale 0), and no event yet
            assert!(p.retain(&after.links, Source::Tracepoint).is_empty());
            assert_only_change_counters(&reg, "0000:01:00.0");
            plug();
            Source::Tracepoint
        };
        let mut ev = p.retain(&after.links, source);
        let again = topo(&t);
        ev.extend(p.retain(&again.links, source));
        ev.extend(p.poll(&again.links, source));
        assert!(
            matches!(&ev[..], [HostEvent::PcieLinkChange(l)] if l.bdf == "0000:01:00.0"
                && l.class == LinkChangeClass::LinkUp && l.old_width == 0 && l.new_width == 16
                && l.source == source),
            "enumerated first {enumerated_first}: {ev:?}"
        );
        // discovery has caught up: no second event
        assert!(p.retain(&again.links, Source::Poll).is_empty());
        assert!(p.poll(&again.links, Source::Poll).is_empty());
        assert_eq!(gauge(&p, "0000:01:00.0", "101"), (16.0, 16));
    }
}

// ---- AER after a replug ----

#[test]
fn aer_device_replugged_starts_from_its_new_baseline() {
    let t = host_tree();
    let topo = topo(&t);
    let roots = Roots::new(t.root());
    let m = AerMetrics::new(&Registry::new());
    let recent = RecentKmsg::default();
    let mut p = AerPoller::new();
    let mut poll = || p.poll(&roots, &topo, &m, &recent, Duration::ZERO, None, None);
    let set = |path: &str, bad_tlp: u64| {
        t.write(
            &format!("sys/devices/{path}/aer_dev_correctable"),
            &Aer::Correctable.text(&[("BadTLP", bad_tlp)]),
        )
    };
    let series = || {
        m.errors
            .with_label_values(&["0000:01:00.0", "101", "correctable", "BadTLP"])
            .get()
    };
    let bad_tlp = |ev: &[HostEvent]| -> Vec<(u64, u64)> {
        ev.iter()
            .filter_map(|e| match e {
                HostEvent::AerCounter(a) if a.bdf == "0000:01:00.0" && a.error == "BadTLP" => {
                    Some((a.delta, a.total))
                }
                _ => None,
            })
            .collect()
    };
    set(PLAIN_GPU, 5);
    assert!(poll().is_empty());
    assert_eq!(series(), 5);

    // Replugged, seen gone: the device's directory disappears, then a new device (counters
    // from zero in the kernel) appears with 7 errors already counted, then 2 more.
    let saved = tempfile::tempdir().unwrap();
    let dir = t.p(&format!("sys/devices/{PLAIN_GPU}"));
    let keep = saved.path().join("gpu");
    std::fs::rename(&dir, &keep).unwrap();
    assert!(poll().is_empty());
    std::fs::rename(&keep, &dir).unwrap();
    set(PLAIN_GPU, 7);
    let ev = poll();
    assert_eq!(
        bad_tlp(&ev),
        [],
        "the first read after the return is a baseline"
    );
    assert_eq!(
        series(),
        5 + 7,
        "the new device's errors are counted, not 7 - 5"
    );
    set(PLAIN_GPU, 9);
    assert_eq!(bad_tlp(&poll()), [(2, 9)]);
    assert_eq!(series(), 14);

    // Replugged between two polls (never seen gone): the count falls to 3. Those are the new
    // device's errors; the next one is an event at once, not after the count passes 9.
    set(PLAIN_GPU, 3);
    assert_eq!(bad_tlp(&poll()), []);
    assert_eq!(series(), 17);
    set(PLAIN_GPU, 4);
    assert_eq!(bad_tlp(&poll()), [(1, 4)]);
    assert_eq!(series(), 18);

    // A device that leaves the topology (VM config changed) and comes back: a new baseline too.
    let empty = Topology::default();
    p.poll(&roots, &empty, &m, &recent, Duration::ZERO, None, None);
    set(PLAIN_GPU, 6);
    let ev = p.poll(&roots, &topo, &m, &recent, Duration::ZERO, None, None);
    assert_eq!(bad_tlp(&ev), []);
    assert_eq!(series(), 24);
}

// ---- Thunderbolt host router ----

#[test]
fn thunderbolt_host_router_exports_no_speed_or_lanes() {
    let t = host_tree();
    let roots = Roots::new(t.root());
    let reg = Registry::new();
    let m = TbMetrics::new(&reg);
    let mut p = TbPoller::new();
    p.poll(&roots, &topo(&t), &m, Source::Poll);
    let text = exposition(&reg);
    // The host router 0-0 (route 0) has no rx/tx speed or lane attributes: no series.
    let host: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("device=\"0-0\""))
        .collect();
    assert_eq!(
        host,
        ["gpufeed_host_thunderbolt_authorized{device=\"0-0\"} 1"],
        "{text}"
    );
    // The enclosure's router has them all.
    for (name, dir, v) in [
        ("gpufeed_host_thunderbolt_link_speed_gbps", "rx", "20"),
        ("gpufeed_host_thunderbolt_link_speed_gbps", "tx", "20"),
        ("gpufeed_host_thunderbolt_lanes", "rx", "2"),
        ("gpufeed_host_thunderbolt_lanes", "tx", "2"),
    ] {
        let line = format!("{name}{{device=\"0-1\",direction=\"{dir}\"}} {v}");
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    // An attribute that goes away takes its series with it.
    std::fs::remove_file(t.p(&format!("sys/devices/{TB_ROUTER}/rx_lanes"))).unwrap();
    p.poll(&roots, &topo(&t), &m, Source::Poll);
    let text = exposition(&reg);
    assert!(
        !text.contains("gpufeed_host_thunderbolt_lanes{device=\"0-1\",direction=\"rx\"}"),
        "{text}"
    );
}
