//! One Proxmox host with two GPU VMs, each a node with its own guest agent, and no routing
//! in the host's configuration: the real `gpufeed-host` on a recorded tree (the Thunderbolt
//! eGPU of scripts/demo-egpu.sh passed to VM 101 through a resource mapping, a plain PCIe GPU
//! on its own root port passed to VM 102), and four real `gpufeed-guest` binaries, each
//! reading its SMBIOS system UUID from its own recorded `class/dmi/id/product_uuid`.
//!
//! Each VM's GPU drops its link in turn (the sysfs link files are written): each guest gets
//! its own VM's drop and never the other's (its /events, its `gpufeed_host_events_total`),
//! while the host emitted both (its own `gpufeed_host_events_total`). An error count of the
//! root port above VM 101's eGPU reaches VM 101's guest as `upstream`, not VM 102's; the
//! host-wide events reach both. The third guest names a UUID that is no VM of this host: the
//! host refuses it (`unknown_vm`) and it counts the refusal; the fourth names VM 101 while VM
//! 101's guest holds it (`vm_taken`). Neither ever connects or gets an event. A guest agent
//! restarted (its VM rebooted: same UUID) is bound to its VM again and gets the next drop.
//! VM 102 migrates to a second host of the site: the first counts what it held for it as
//! moved (`gpufeed_host_stream_events_moved_total`), the second binds its guest.

use crate::common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::host_agent::*;
use common::*;

const U101: &str = "3F0E4A52-9C1D-4B7E-8A21-6D5C0B9E7101";
const U102: &str = "3f0e4a52-9c1d-4b7e-8a21-6d5c0b9e7102";
const UNKNOWN: &str = "11111111-2222-4333-8444-555555555555";
/// VM 102's GPU and the root port above it.
const PLAIN_RP: &str = "pci0000:00/0000:00:01.0";
const PLAIN_GPU: &str = "0000:01:00.0";

fn write(p: &Path, text: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, format!("{text}\n")).unwrap();
}

/// A PCI function in the recorded tree, the way scripts/demo-egpu.sh writes one.
fn pci(root: &Path, devpath: &str, bdf: &str, class: &str, driver: &str, speed: &str, w: u32) {
    let dir = root.join("sys/devices").join(devpath);
    for (f, v) in [
        ("class", class),
        ("vendor", "0x10de"),
        ("device", "0x2684"),
        ("current_link_speed", speed),
        ("current_link_width", &w.to_string()),
        ("max_link_speed", speed),
        ("max_link_width", &w.to_string()),
        ("removable", "fixed"),
        ("power/runtime_status", "active"),
        ("power_state", "D0"),
    ] {
        write(&dir.join(f), v);
    }
    let drv = root.join("sys/bus/pci/drivers").join(driver);
    std::fs::create_dir_all(&drv).unwrap();
    std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
    let _ = std::fs::remove_file(dir.join("driver"));
    std::os::unix::fs::symlink(&drv, dir.join("driver")).unwrap();
    std::os::unix::fs::symlink(
        Path::new("../../../devices").join(devpath),
        root.join("sys/bus/pci/devices").join(bdf),
    )
    .unwrap();
}

/// The eGPU tree, a second GPU on its own root port, and both VMs' configurations.
fn two_vm_tree(root: &Path) {
    demo(&["tree", root.to_str().unwrap()]);
    pci(
        root,
        PLAIN_RP,
        "0000:00:01.0",
        "0x060400",
        "pcieport",
        "16.0 GT/s PCIe",
        16,
    );
    pci(
        root,
        &format!("{PLAIN_RP}/{PLAIN_GPU}"),
        PLAIN_GPU,
        "0x030000",
        "vfio-pci",
        "16.0 GT/s PCIe",
        16,
    );
    write(
        &root.join("etc/pve/mapping/pci.cfg"),
        &format!("egpu\n\tmap id=10de:2684,node={HOST},path={GPU}\n"),
    );
    write(
        &root.join("etc/pve/qemu-server/101.conf"),
        &format!("cores: 8\nhostpci0: mapping=egpu,pcie=1\nsmbios1: uuid={U101}\n[snap]\nsmbios1: uuid={U102}"),
    );
    write(
        &root.join("etc/pve/qemu-server/102.conf"),
        &format!("cores: 4\nhostpci0: {PLAIN_GPU},pcie=1\nsmbios1: base64=0,uuid={U102}"),
    );
}

/// VM 102's GPU link (and its root port's end of it).
fn plain_link(root: &Path, speed: &str, width: &str) {
    for dev in [format!("{PLAIN_RP}/{PLAIN_GPU}"), PLAIN_RP.to_string()] {
        let d = root.join("sys/devices").join(dev);
        write(&d.join("current_link_speed"), speed);
        write(&d.join("current_link_width"), width);
    }
}

/// The host agent on `dir/root`, serving the four guests on `ports`, none with a filter.
fn start_host(dir: &Path, ports: &[u16; 4]) -> (Proc, SocketAddr) {
    let guests = ["vm101", "vm102", "stranger", "twin"];
    start_named_host(
        dir,
        HOST,
        "root",
        &guests.into_iter().zip(*ports).collect::<Vec<_>>(),
    )
}

/// The host agent `host` on `dir/<root>` (its bundle in `dir/certs/hosts/<host>`), serving
/// `guests` (name, port), none with a filter.
fn start_named_host(
    dir: &Path,
    host: &str,
    root: &str,
    guests: &[(&str, u16)],
) -> (Proc, SocketAddr) {
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let tls = dir.join("certs/hosts").join(host).join("tls");
    let guests: String = guests
        .iter()
        .map(|(n, p)| format!("[[stream.guests]]\nname = \"{n}\"\nendpoint = \"127.0.0.1:{p}\"\n"))
        .collect();
    let cfg = format!(
        r#"host_id = "{host}"
root = "{root}"
metrics_listen = "{metrics}"

[pcie]
poll_interval_ms = 200
[aer]
poll_interval_ms = 200
[bridge]
enabled = false
[host]
enabled = false
[vm]
qmp = false
[thunderbolt]
uevents = false

[stream]
ca = "{ca}"
cert = "{cert}"
key = "{key}"
spool_dir = ""
state_interval_ms = 200
{guests}"#,
        root = dir.join(root).display(),
        ca = tls.join("ca.pem").display(),
        cert = tls.join("host.pem").display(),
        key = tls.join("host-key.pem").display(),
    );
    let config = dir.join(format!("{host}.toml"));
    std::fs::write(&config, &cfg).unwrap();
    let child = std::process::Command::new(host_binary())
        .args(["run", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let p = Proc(child);
    wait_for(Duration::from_secs(30), || http_get(metrics, "/metrics"))
        .unwrap_or_else(|| panic!("host agent did not serve /metrics; config:\n{cfg}"));
    (p, metrics)
}

/// A guest agent on `port` whose VM has SMBIOS UUID `uuid` (its own sysfs root).
fn guest(dir: &Path, name: &str, port: u16, uuid: &str) -> Agent {
    let sys = dir.join(name).join("sys");
    write(&sys.join("class/dmi/id/product_uuid"), uuid);
    let listen = format!("127.0.0.1:{port}");
    let tls = dir.join("certs/guest");
    Agent::no_kube(
        "1s",
        "none",
        &[
            "--quic-listen",
            &listen,
            "--tls-dir",
            tls.to_str().unwrap(),
            "--sysfs-root",
            sys.to_str().unwrap(),
        ],
    )
}

fn connected(a: &Agent) -> bool {
    value(&a.scrape(), "gpufeed_stream_connected", &[("host", HOST)]) == Some(1.0)
}

/// The guest's count of the host's link drops (its join's series).
fn drops(a: &Agent) -> f64 {
    value(
        &a.scrape(),
        "gpufeed_host_events_total",
        &[("host", HOST), ("event", "link_degraded")],
    )
    .unwrap_or(0.0)
}

fn events(a: &Agent) -> String {
    http_get(a.addr, "/events").unwrap_or_default()
}

fn host_metric(addr: SocketAddr, name: &str, labels: &[(&str, &str)]) -> f64 {
    value(
        &parse_metrics(&http_get(addr, "/metrics").unwrap_or_default()),
        name,
        labels,
    )
    .unwrap_or(0.0)
}

#[test]
fn each_guest_gets_its_own_vms_events_and_a_stranger_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ports = [free_port(), free_port(), free_port(), free_port()];
    // One certificate for every guest of this test (all on 127.0.0.1): what binds a guest to
    // its VM is the UUID, not the certificate.
    certs_init_ok(&d.join("certs"), &format!("127.0.0.1:{}", ports[0]), HOST);
    two_vm_tree(&d.join("root"));
    let (_host, hm) = start_host(d, &ports);
    let mut a = guest(d, "a", ports[0], U101);
    let mut b = guest(d, "b", ports[1], U102);
    let c = guest(d, "c", ports[2], UNKNOWN);
    wait_for(Duration::from_secs(30), || {
        (connected(&a) && connected(&b)).then_some(())
    })
    .expect("both VMs' guests connected");
    // A fourth guest claims VM 101 too (a clone that kept its UUID): VM 101's guest keeps it.
    let twin = guest(d, "twin", ports[3], U101);
    assert_eq!(
        host_metric(hm, "gpufeed_host_stream_guest_vmid", &[("guest", "vm101")]),
        101.0
    );
    assert_eq!(
        host_metric(hm, "gpufeed_host_stream_guest_vmid", &[("guest", "vm102")]),
        102.0
    );
    // The stranger: refused by the host, counted on both sides, never connected.
    wait_for(Duration::from_secs(30), || {
        (host_metric(
            hm,
            "gpufeed_host_stream_vm_refused_total",
            &[("guest", "stranger"), ("reason", "unknown_vm")],
        ) >= 1.0
            && value(
                &c.scrape(),
                "gpufeed_stream_vm_unbound_total",
                &[("host", HOST)],
            ) >= Some(1.0))
        .then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "stranger refused and counted; host:\n{}",
            http_get(hm, "/metrics").unwrap_or_default()
        )
    });
    assert!(!connected(&c));
    assert_eq!(
        host_metric(
            hm,
            "gpufeed_host_stream_guest_vmid",
            &[("guest", "stranger")]
        ),
        -1.0
    );
    assert_eq!(
        host_metric(
            hm,
            "gpufeed_host_stream_connects_total",
            &[("guest", "stranger"), ("result", "ok")]
        ),
        0.0,
        "the stranger's handshake never counted as a stream"
    );
    wait_for(Duration::from_secs(30), || {
        (host_metric(
            hm,
            "gpufeed_host_stream_vm_refused_total",
            &[("guest", "twin"), ("reason", "vm_taken")],
        ) >= 1.0
            && value(
                &twin.scrape(),
                "gpufeed_stream_vm_unbound_total",
                &[("host", HOST)],
            ) >= Some(1.0))
        .then_some(())
    })
    .expect("the twin refused and counted on both sides");
    assert!(!connected(&twin));
    assert!(connected(&a));
    assert_eq!(
        host_metric(hm, "gpufeed_host_stream_guest_vmid", &[("guest", "vm101")]),
        101.0
    );

    // Each VM's discovery (its GPU mapped, its state) went to its own guest, as its own.
    for g in ["vm101", "vm102"] {
        wait_for(Duration::from_secs(15), || {
            (host_metric(
                hm,
                "gpufeed_host_stream_routed_total",
                &[("guest", g), ("why", "own")],
            ) >= 1.0)
                .then_some(())
        })
        .unwrap_or_else(|| panic!("{g} got its VM's events"));
    }
    assert_eq!(
        host_metric(
            hm,
            "gpufeed_host_stream_routed_total",
            &[("guest", "stranger"), ("why", "own")]
        ),
        0.0
    );

    // VM 101's eGPU drops its link.
    let root = d.join("root");
    demo(&["link", root.to_str().unwrap(), "2.5 GT/s PCIe", "1"]);
    wait_for(Duration::from_secs(15), || (drops(&a) >= 1.0).then_some(()))
        .unwrap_or_else(|| panic!("VM 101's guest got its link drop; /events {}", events(&a)));
    let host_drops = |hm| {
        host_metric(
            hm,
            "gpufeed_host_events_total",
            &[("kind", "pcie_link_change")],
        )
    };
    let emitted = host_drops(hm);
    assert!(emitted >= 1.0, "the host emitted the drop");
    // VM 102's guest heard nothing of it (give it the time the other guest needed, twice).
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(drops(&b), 0.0, "VM 102's guest: /events {}", events(&b));
    assert!(
        !events(&b).contains(GPU),
        "VM 102's guest: /events {}",
        events(&b)
    );

    // VM 102's GPU drops its link.
    plain_link(&root, "2.5 GT/s PCIe", "1");
    wait_for(Duration::from_secs(15), || (drops(&b) >= 1.0).then_some(()))
        .unwrap_or_else(|| panic!("VM 102's guest got its link drop; /events {}", events(&b)));
    assert!(host_drops(hm) > emitted, "the host emitted the second drop");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(drops(&a), 1.0, "VM 101's guest: /events {}", events(&a));
    assert!(
        !events(&a).contains(PLAIN_GPU),
        "VM 101's guest: /events {}",
        events(&a)
    );
    assert!(
        !events(&b).contains(GPU),
        "VM 102's guest: /events {}",
        events(&b)
    );

    // The root port above VM 101's eGPU counts a corrected error: VM 101's guest gets it, as
    // upstream of its GPU; VM 102's GPU is on another root port.
    let routed = |g: &str, why: &str| {
        host_metric(
            hm,
            "gpufeed_host_stream_routed_total",
            &[("guest", g), ("why", why)],
        )
    };
    let (a_up, b_up) = (routed("vm101", "upstream"), routed("vm102", "upstream"));
    write(
        &root.join("sys/devices/pci0000:00/0000:00:1c.4/aer_rootport_total_err_cor"),
        "3",
    );
    wait_for(Duration::from_secs(15), || {
        (routed("vm101", "upstream") > a_up).then_some(())
    })
    .expect("the root port's error went to VM 101's guest as upstream");
    assert!(
        host_metric(
            hm,
            "gpufeed_host_events_total",
            &[("kind", "aer_rootport_total")]
        ) >= 1.0,
        "the host emitted it"
    );
    assert_eq!(routed("vm102", "upstream"), b_up);
    // Host-wide events (a watcher that is off on this tree, from before the guests bound:
    // held and handed over at binding) went to both, and nothing to the stranger.
    assert!(
        host_metric(
            hm,
            "gpufeed_host_events_total",
            &[("kind", "watcher_disabled")]
        ) >= 1.0
    );
    assert!(routed("vm101", "host_wide") >= 1.0);
    assert!(routed("vm102", "host_wide") >= 1.0);
    for why in ["own", "upstream", "host_wide", "unclaimed"] {
        assert_eq!(routed("stranger", why), 0.0, "{why}");
        assert_eq!(routed("twin", why), 0.0, "{why}");
    }

    // VM 101 reboots: its guest agent starts again, with the same UUID, and is bound again.
    drop(a);
    a = guest(d, "a", ports[0], U101);
    wait_for(Duration::from_secs(30), || connected(&a).then_some(()))
        .expect("VM 101's guest connected again");
    assert_eq!(
        host_metric(hm, "gpufeed_host_stream_guest_vmid", &[("guest", "vm101")]),
        101.0
    );
    assert_eq!(
        host_metric(
            hm,
            "gpufeed_host_stream_vm_refused_total",
            &[("guest", "vm101"), ("reason", "vm_taken")]
        ),
        0.0
    );
    demo(&["link", root.to_str().unwrap(), "16.0 GT/s PCIe", "4"]);
    wait_for(Duration::from_secs(15), || {
        (host_metric(hm, "gpufeed_host_pcie_link_width", &[("bdf", GPU)]) == 4.0).then_some(())
    })
    .expect("the host saw the link restored");
    demo(&["link", root.to_str().unwrap(), "2.5 GT/s PCIe", "1"]);
    wait_for(Duration::from_secs(15), || (drops(&a) >= 1.0).then_some(())).unwrap_or_else(|| {
        panic!(
            "VM 101's guest got the drop after its restart; /events {}",
            events(&a)
        )
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(drops(&b), 1.0, "VM 102's guest: /events {}", events(&b));
    assert!(!connected(&c));

    // VM 102 migrates to another host of the cluster (a VM with a passed-through GPU moves
    // shut down): its guest stops, its GPU's link changes meanwhile (held for it here), its
    // configuration leaves this host. Started on the new host, its guest is refused here
    // (unknown_vm) and what this host held for it is counted as moved, neither dropped nor
    // left pending; the new host, from the same CA, binds it to VM 102 and streams to it.
    drop(b);
    let spooled = |g: &str| host_metric(hm, "gpufeed_host_stream_spool_events", &[("guest", g)]);
    plain_link(&root, "16.0 GT/s PCIe", "16");
    wait_for(Duration::from_secs(15), || {
        (spooled("vm102") >= 1.0).then_some(())
    })
    .expect("the link change held for VM 102's stopped guest");
    let held = spooled("vm102");
    let moved = |h: SocketAddr| {
        host_metric(
            h,
            "gpufeed_host_stream_events_moved_total",
            &[("guest", "vm102")],
        )
    };
    assert_eq!(moved(hm), 0.0);
    // the new host: the VM's configuration and GPU, its bundle added to the site
    let new_root = d.join("root-pve2");
    two_vm_tree(&new_root);
    std::fs::remove_file(new_root.join("etc/pve/qemu-server/101.conf")).unwrap();
    std::fs::rename(
        root.join("etc/pve/qemu-server/102.conf"),
        d.join("102.conf.migrated"),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["certs", "add-host", "--out"])
        .arg(d.join("certs"))
        .args(["--host", "pve2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_pve2, h2) = start_named_host(d, "pve2", "root-pve2", &[("vm102", ports[1])]);
    b = guest(d, "b", ports[1], U102);
    wait_for(Duration::from_secs(30), || {
        (moved(hm) >= held && spooled("vm102") == 0.0).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the old host counts its held events as moved: moved {}, held {held}, pending {}",
            moved(hm),
            spooled("vm102")
        )
    });
    assert_eq!(moved(hm), held);
    assert!(
        host_metric(
            hm,
            "gpufeed_host_stream_vm_refused_total",
            &[("guest", "vm102"), ("reason", "unknown_vm")]
        ) >= 1.0
    );
    assert_eq!(
        host_metric(
            hm,
            "gpufeed_host_stream_events_dropped_total",
            &[("guest", "vm102")]
        ),
        0.0
    );
    wait_for(Duration::from_secs(30), || {
        (host_metric(h2, "gpufeed_host_stream_guest_vmid", &[("guest", "vm102")]) == 102.0
            && value(&b.scrape(), "gpufeed_stream_connected", &[("host", "pve2")]) == Some(1.0))
        .then_some(())
    })
    .expect("VM 102's guest bound and streamed to by its new host");
    assert_eq!(moved(h2), 0.0);
}
