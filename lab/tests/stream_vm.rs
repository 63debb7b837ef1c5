//! A real QEMU for the host agent to watch, and the stream across the VM boundary.
//!
//! The VM is started as Proxmox starts one: its pid file and a QMP socket where
//! `/run/qemu-server/<vmid>.{pid,qmp}` are under the host agent's root, its config in
//! `/etc/pve/qemu-server/<vmid>.conf` (the recorded Thunderbolt eGPU passed through, its NIC
//! on a bridge), its NIC a tap `tap<vmid>i0` on a bridge this test makes. The host agent runs
//! on this machine on that root (the recorded eGPU tree for PCIe, this machine's /proc and
//! /sys/class/net for the QEMU process and the bridge); the guest agent runs in the VM
//! (`lab/scenarios/guest-stream.sh`) and takes the host's stream over the bridge:
//!
//! * `stop`/`cont` over QMP are VM-state events, delivered to the guest once it runs again;
//! * the vCPU run delay is the real vCPU threads' (`CPU n/TCG`) schedstat;
//! * the VM's bytes on its bridge port equal the VM's own interface counters within 1%;
//! * the guest is bound to its VM by the SMBIOS UUID QEMU gives it (`-smbios type=1,uuid=`,
//!   the VM config's `smbios1: uuid=`), with no VM ids in the host's configuration;
//! * a link change of the host reaches the VM's /events and /metrics;
//! * while the link keeps changing, the host agent is SIGKILLed and restarted and so is the
//!   guest agent: the guest's journal holds every event the host emitted once, no holes, no
//!   duplicates;
//! * the VM restarted (a new QEMU pid, the same vmid and UUID) is bound and watched again, and
//!   the host's next link change reaches it.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpufeed_lab::{KernelName, Payload, Variant, Vm, VmSpec};
use gpufeed_testkit::http::get as http_get;
use gpufeed_testkit::{free_port, prom};

const GPU: &str = "0000:0a:00.0";
const HOST: &str = "labhost";

fn sh(cmd: &str) -> String {
    let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(
        o.status.success(),
        "`{cmd}`: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs `cleanup` when dropped, passed or failed.
struct OnDrop(String);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = Command::new("sh").arg("-c").arg(&self.0).status();
    }
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value of the series `name` whose labels include all of `labels` (summed).
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    prom::value(&prom::parse(text), name, labels)
}

/// `f`'s value once it is `Some`; the test fails naming `what` after `within`.
fn wait_for<T>(what: &str, within: Duration, f: impl FnMut() -> Option<T>) -> T {
    gpufeed_testkit::wait::expect_within(what, within, f)
}

/// The run delay (ns) of the vCPU threads of `pid`, read from /proc.
fn vcpu_delay_ns(pid: u32) -> (u64, usize) {
    let mut sum = 0;
    let mut n = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("CPU ") {
            continue;
        }
        let stat = std::fs::read_to_string(e.path().join("schedstat")).unwrap_or_default();
        if let Some(d) = stat
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<u64>().ok())
        {
            sum += d;
            n += 1;
        }
    }
    (sum, n)
}

struct Host {
    config: PathBuf,
    metrics: SocketAddr,
    proc: Option<Proc>,
}

impl Host {
    fn start(&mut self) {
        let child = Command::new(common::binary("gpufeed-host"))
            .args(["run", "--config"])
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        self.proc = Some(Proc(child));
        let m = self.metrics;
        wait_for("the host agent's /metrics", Duration::from_secs(30), || {
            http_get(m, "/metrics")
        });
    }

    fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            // SIGKILL: no flush, no goodbye
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
    }

    fn scrape(&self) -> String {
        http_get(self.metrics, "/metrics").unwrap_or_default()
    }
}

#[test]
fn a_real_qemu_watched_like_proxmox_and_the_stream_across_the_vm_boundary() {
    let Some((cache, _lock)) = common::lab() else {
        return;
    };
    let tag = std::process::id() % 10_000;
    let vmid = 9000 + tag % 1000;
    let net = 1 + tag % 250;
    let (bridge, tap) = (format!("gfbr{tag}"), format!("tap{vmid}i0"));
    let (host_ip, guest_ip) = (format!("10.232.{net}.1"), format!("10.232.{net}.2"));
    let _net = OnDrop(format!("ip link del {tap}; ip link del {bridge}"));
    sh(&format!(
        "ip link add {bridge} type bridge && ip addr add {host_ip}/24 dev {bridge} && \
         ip link set {bridge} up && ip tuntap add dev {tap} mode tap && \
         ip link set {tap} master {bridge} && ip link set {tap} up"
    ));

    // the host agent's root: the recorded eGPU for PCIe, this machine's /proc and network
    // devices for the QEMU process and the bridge, Proxmox's files for the VM
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let st = Command::new(common::repo().join("scripts/demo-egpu.sh"))
        .arg("tree")
        .arg(&root)
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::remove_dir(root.join("proc")).unwrap();
    std::os::unix::fs::symlink("/proc", root.join("proc")).unwrap();
    std::fs::create_dir_all(root.join("sys")).unwrap();
    std::os::unix::fs::symlink("/sys/class", root.join("sys/class")).unwrap();
    let qs = root.join("run/qemu-server");
    std::fs::create_dir_all(&qs).unwrap();
    std::fs::create_dir_all(root.join("etc/pve/qemu-server")).unwrap();
    let mac = format!("BC:24:11:00:{:02X}:{:02X}", tag / 256 % 256, tag % 256);
    // the VM's SMBIOS UUID as Proxmox sets it (`smbios1: uuid=` → `-smbios type=1,uuid=`): the
    // guest agent reads it from the VM's firmware tables and the host binds it to this VM by
    // it (no vmids in the host's configuration); a second VM of the host, with its own UUID
    // and another GPU, is not this guest's
    let uuid = format!("6a1b0c2d-3e4f-4a5b-8c6d-{:012x}", 0x1ab0_0000 + tag);
    std::fs::write(
        root.join(format!("etc/pve/qemu-server/{vmid}.conf")),
        format!(
            "name: lab\nsmbios1: uuid={uuid}\nhostpci0: {GPU},pcie=1\n\
             net0: virtio={mac},bridge={bridge}\n"
        ),
    )
    .unwrap();
    std::fs::write(
        root.join(format!("etc/pve/qemu-server/{}.conf", vmid + 1)),
        "name: other\nsmbios1: uuid=0b9f8e7d-6c5b-4a39-8827-160514030201\n\
         hostpci0: 0000:41:00.0,pcie=1\n",
    )
    .unwrap();

    // certificates as the user makes them
    let certs = dir.path().join("certs");
    let out = Command::new(common::binary("gpufeed-guest"))
        .args(["certs", "init", "--out"])
        .arg(&certs)
        .args(["--guest-addr", &format!("{guest_ip}:7845"), "--host", HOST])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let script =
        std::fs::read_to_string(common::repo().join("lab/scenarios/guest-stream.sh")).unwrap();
    let payload = Payload::new(&script).unwrap();
    payload
        .copy(&common::binary("gpufeed-guest"), "gpufeed-guest")
        .unwrap();
    for f in ["ca.pem", "guest.pem", "guest-key.pem", "allowed-hosts"] {
        payload
            .copy(&certs.join("guest").join(f), &format!("tls/{f}"))
            .unwrap();
    }
    payload
        .add("guest-addr", format!("{guest_ip}\n").as_bytes(), 0o644)
        .unwrap();
    let mut spec = VmSpec::new(&cache, "stream", KernelName::Trixie, Variant::Minbase).unwrap();
    spec.deadline = Duration::from_secs(600);
    spec.args = vec![
        "-pidfile".into(),
        qs.join(format!("{vmid}.pid")).display().to_string(),
        "-qmp".into(),
        format!(
            "unix:{},server=on,wait=off",
            qs.join(format!("{vmid}.qmp")).display()
        ),
        "-netdev".into(),
        format!("tap,id=n0,ifname={tap},script=no,downscript=no"),
        "-device".into(),
        format!("virtio-net-pci,netdev=n0,mac={mac}"),
        "-smbios".into(),
        format!("type=1,uuid={uuid}"),
    ];
    let image = payload.image().unwrap();
    let mut vm = Vm::start(&cache, &spec, &image).unwrap();
    vm.expect("ready", Duration::from_secs(300)).unwrap();
    let guest: SocketAddr = format!("{guest_ip}:9745").parse().unwrap();
    let guest_metrics = || http_get(guest, "/metrics").unwrap_or_default();

    let b = certs.join("hosts").join(HOST).join("tls");
    let mut host = Host {
        config: dir.path().join("host.toml"),
        metrics: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        proc: None,
    };
    std::fs::write(
        &host.config,
        format!(
            r#"host_id = "{HOST}"
root = "{root}"
metrics_listen = "{metrics}"

[pcie]
poll_interval_ms = 200

[vm]
poll_interval_ms = 200

[bridge]
bridges = ["{bridge}"]
sample_interval_ms = 200

[kmsg]
enabled = false

[host]
enabled = false

[thunderbolt]
uevents = false

[stream]
ca = "{b}/ca.pem"
cert = "{b}/host.pem"
key = "{b}/host-key.pem"
spool_dir = "{spool}"

[[stream.guests]]
name = "guest"
endpoint = "{guest_ip}:7845"
"#,
            root = root.display(),
            metrics = host.metrics,
            b = b.display(),
            spool = dir.path().join("spool").display(),
        ),
    )
    .unwrap();
    host.start();
    wait_for(
        "the stream up on both sides",
        Duration::from_secs(60),
        || {
            let up_host = value(&host.scrape(), "gpufeed_host_stream_connected", &[]) == Some(1.0);
            let up_guest = value(
                &guest_metrics(),
                "gpufeed_stream_connected",
                &[("host", HOST)],
            ) == Some(1.0);
            (up_host && up_guest).then_some(())
        },
    );

    // bound by the UUID QEMU gave the VM's firmware
    wait_for(
        "the guest bound to its VM by its SMBIOS UUID",
        Duration::from_secs(30),
        || {
            let m = host.scrape();
            (value(&m, "gpufeed_host_stream_guest_vmid", &[("guest", "guest")])
                == Some(f64::from(vmid)))
            .then_some(())
        },
    );
    assert_eq!(
        value(
            &guest_metrics(),
            "gpufeed_stream_vm_unbound_total",
            &[("host", HOST)]
        )
        .unwrap_or(0.0),
        0.0
    );

    // the VM's QEMU, found the Proxmox way, and its state
    let qemu = vm.pid();
    let vm_label = vmid.to_string();
    wait_for(
        "the VM running in the host's series",
        Duration::from_secs(30),
        || {
            let m = host.scrape();
            (value(&m, "gpufeed_host_vm_up", &[("vmid", &vm_label)]) == Some(1.0)).then_some(())
        },
    );

    // vCPU run delay: the real vCPU threads' schedstat, counted from the agent's first look
    let scrape_delay = |h: &Host| {
        let m = h.scrape();
        let (s, n) = vcpu_delay_ns(qemu);
        let a = value(
            &m,
            "gpufeed_host_vcpu_run_delay_seconds_total",
            &[("vmid", &vm_label)],
        );
        (a.unwrap_or(0.0), s as f64 / 1e9, n)
    };
    let (a0, s0, n) = scrape_delay(&host);
    assert!(n >= 2, "vCPU threads of the VM's QEMU: {n}");
    std::thread::sleep(Duration::from_secs(10));
    let (a1, s1, _) = scrape_delay(&host);
    // the agent's figure is at most one poll (200 ms) behind /proc at each end, per thread
    let slack = 2.0 * 0.2 * n as f64;
    assert!(
        ((a1 - a0) - (s1 - s0)).abs() <= slack + 0.02 * (s1 - s0),
        "vCPU run delay over 10 s: agent {:.3} s, schedstat {:.3} s",
        a1 - a0,
        s1 - s0
    );

    // the VM's bytes on its bridge port against the VM's own counters
    let counters = |vm: &mut Vm| -> (f64, f64) {
        vm.send("counters").unwrap();
        let v = vm.expect("counters", Duration::from_secs(30)).unwrap();
        let mut w = v.split_whitespace().map(|x| x.parse::<f64>().unwrap());
        (w.next().unwrap(), w.next().unwrap())
    };
    let bridge_bytes = |h: &Host| -> BTreeMap<String, f64> {
        let m = h.scrape();
        ["rx", "tx"]
            .into_iter()
            .map(|d| {
                let v = value(
                    &m,
                    "gpufeed_host_bridge_bytes_total",
                    &[("vmid", &vm_label), ("direction", d)],
                );
                (d.to_string(), v.unwrap_or(0.0))
            })
            .collect()
    };
    std::thread::sleep(Duration::from_secs(1));
    let (g_rx0, g_tx0) = counters(&mut vm);
    let h0 = bridge_bytes(&host);
    // one upload each way; the VM's iperf3 server (trixie's) takes one test at a time and
    // may still be closing the last when the next asks: a refused start is tried again
    for reverse in ["", "-R"] {
        sh(&format!(
            "for i in 1 2 3 4 5; do iperf3 -c {guest_ip} -t 3 {reverse} >/dev/null && exit 0; \
             sleep 1; done; exit 1"
        ));
    }
    std::thread::sleep(Duration::from_secs(2));
    let (g_rx1, g_tx1) = counters(&mut vm);
    let h1 = bridge_bytes(&host);
    let (g_rx, g_tx) = (g_rx1 - g_rx0, g_tx1 - g_tx0);
    let (h_rx, h_tx) = (h1["rx"] - h0["rx"], h1["tx"] - h0["tx"]);
    assert!(
        g_rx > 1e6 && g_tx > 1e6,
        "the uploads moved bytes: {g_rx} {g_tx}"
    );
    // direction from the VM's side: what the VM received, what it sent
    assert!(
        (h_rx - g_rx).abs() <= 0.01 * g_rx && (h_tx - g_tx).abs() <= 0.01 * g_tx,
        "bridge port: rx {h_rx} tx {h_tx}; the VM's own NIC: rx {g_rx} tx {g_tx}"
    );

    // stop/cont over QMP: VM-state events, the guest gets them when it runs again
    let mut qmp = vm.qmp().unwrap();
    qmp.execute("stop", serde_json::json!({})).unwrap();
    wait_for(
        "the VM paused in the host's series",
        Duration::from_secs(20),
        || {
            let m = host.scrape();
            (value(&m, "gpufeed_host_vm_up", &[("vmid", &vm_label)]) == Some(0.0)).then_some(())
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    qmp.execute("cont", serde_json::json!({})).unwrap();
    wait_for(
        "the VM-state events in the guest's /events",
        Duration::from_secs(60),
        || {
            let ev = http_get(guest, "/events")?;
            let v: serde_json::Value = serde_json::from_str(&ev).ok()?;
            let n = v
                .as_array()?
                .iter()
                .filter(|e| e["host_kind"] == "vm_state")
                .map(|e| e["count"].as_u64().unwrap_or(1))
                .sum::<u64>();
            (n >= 2).then_some(())
        },
    );

    // a link change of the host: in the guest's /events and its scrape
    let link = |speed: &str, width: &str| {
        let st = Command::new(common::repo().join("scripts/demo-egpu.sh"))
            .arg("link")
            .arg(&root)
            .args([speed, width])
            .status()
            .unwrap();
        assert!(st.success());
    };
    link("2.5 GT/s PCIe", "1");
    wait_for(
        "the degraded link in the guest's scrape",
        Duration::from_secs(30),
        || {
            let m = guest_metrics();
            (value(
                &m,
                "gpufeed_host_pcie_link_width",
                &[("bdf", GPU), ("host", HOST)],
            ) == Some(1.0))
            .then_some(())
        },
    );
    wait_for(
        "the link change in the guest's /events",
        Duration::from_secs(30),
        || {
            let ev = http_get(guest, "/events")?;
            ev.contains("pcie_link_change").then_some(())
        },
    );
    link("16.0 GT/s PCIe", "4");

    // nothing lost across kills: the link keeps changing while each side is killed and
    // started again
    let flapping = Arc::new(AtomicBool::new(true));
    let flapper = {
        let (root, flapping) = (root.clone(), flapping.clone());
        std::thread::spawn(move || {
            let mut down = false;
            let mut n = 0u32;
            while flapping.load(Ordering::Relaxed) {
                down = !down;
                let (s, w) = if down {
                    ("8.0 GT/s PCIe", "2")
                } else {
                    ("16.0 GT/s PCIe", "4")
                };
                let _ = Command::new(common::repo().join("scripts/demo-egpu.sh"))
                    .arg("link")
                    .arg(&root)
                    .args([s, w])
                    .status();
                n += 1;
                std::thread::sleep(Duration::from_millis(700));
            }
            n
        })
    };
    std::thread::sleep(Duration::from_secs(3));
    host.kill();
    std::thread::sleep(Duration::from_secs(2));
    host.start();
    std::thread::sleep(Duration::from_secs(3));
    vm.send("kill-agent").unwrap();
    vm.expect("killed", Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    vm.send("start-agent").unwrap();
    vm.expect("started", Duration::from_secs(120)).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    flapping.store(false, Ordering::Relaxed);
    let flaps = flapper.join().unwrap();
    // everything sent and acknowledged
    wait_for("the host's spool drained", Duration::from_secs(60), || {
        let m = host.scrape();
        (value(&m, "gpufeed_host_stream_connected", &[]) == Some(1.0)
            && value(&m, "gpufeed_host_stream_spool_events", &[]).unwrap_or(1.0) == 0.0)
            .then_some(())
    });
    vm.send("journal").unwrap();
    vm.expect("journal_end", Duration::from_secs(60)).unwrap();
    let mut by_boot: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for l in vm.port.all("journal") {
        let mut w = l.split_whitespace().filter_map(|x| x.parse::<u64>().ok());
        if let (Some(boot), Some(seq)) = (w.next(), w.next()) {
            by_boot.entry(boot).or_default().push(seq);
        }
    }
    let lost = value(
        &guest_metrics(),
        "gpufeed_stream_events_lost_total",
        &[("host", HOST)],
    );
    assert_eq!(
        by_boot.len(),
        1,
        "one sequence space across the host's restart (its spool keeps it): {by_boot:?}"
    );
    let seqs = by_boot.values().next().unwrap();
    let mut sorted = seqs.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), seqs.len(), "no event accepted twice");
    let (first, last) = (sorted[0], *sorted.last().unwrap());
    assert_eq!(
        sorted.len() as u64,
        last - first + 1,
        "no hole in {first}..={last} ({} accepted)",
        sorted.len()
    );
    assert_eq!(lost.unwrap_or(0.0), 0.0, "nothing counted lost");
    let acked = value(&host.scrape(), "gpufeed_host_stream_acked_seq", &[]).unwrap_or(0.0);
    assert_eq!(
        acked as u64, last,
        "the host's last acknowledged sequence is the guest's last"
    );
    eprintln!(
        "lab: stream: {} events accepted once each through a host SIGKILL and a guest SIGKILL \
         ({flaps} link changes provoked)",
        sorted.len()
    );
    vm.send("quit").unwrap();
    let _ = vm.expect("done", Duration::from_secs(60));

    // the VM restarted (a new QEMU, a new pid, the same vmid and UUID): bound again, watched
    // again, and the host's link changes reach its new guest agent
    let _ = vm.wait_exit(Duration::from_secs(60));
    drop(vm);
    let mut vm = Vm::start(&cache, &spec, &image).unwrap();
    vm.expect("ready", Duration::from_secs(300)).unwrap();
    assert_ne!(vm.pid(), qemu, "a new QEMU process");
    wait_for(
        "the restarted VM's guest bound again and its VM running",
        Duration::from_secs(60),
        || {
            let m = host.scrape();
            (value(&m, "gpufeed_host_stream_guest_vmid", &[("guest", "guest")])
                == Some(f64::from(vmid))
                && value(&m, "gpufeed_host_vm_up", &[("vmid", &vm_label)]) == Some(1.0)
                && value(
                    &guest_metrics(),
                    "gpufeed_stream_connected",
                    &[("host", HOST)],
                ) == Some(1.0))
            .then_some(())
        },
    );
    link("2.5 GT/s PCIe", "1");
    wait_for(
        "the link change in the restarted VM's guest",
        Duration::from_secs(30),
        || {
            (value(
                &guest_metrics(),
                "gpufeed_host_pcie_link_width",
                &[("bdf", GPU), ("host", HOST)],
            ) == Some(1.0))
            .then_some(())
        },
    );
    vm.send("quit").unwrap();
    let _ = vm.expect("done", Duration::from_secs(60));
}
