//! Proxmox configs in every documented hostpci form → the right VMID and devices; bad lines
//! warn with file and line and the rest is still used. VM state from pid files, /proc and QMP,
//! with the AER cause of a stop and the vCPU run delay.

use crate::common;

use common::*;
use gpufeed_host::agent::Agent;
use gpufeed_host::discovery::{discover, scan_pve, Assignment};
use gpufeed_host::roots::Roots;
use gpufeed_shared::event::*;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn a(bdf: &str, vmid: u32, origin: &str) -> Assignment {
    Assignment {
        bdf: bdf.into(),
        vmid: Some(vmid),
        origin: origin.into(),
    }
}

#[test]
fn hostpci_forms_and_bad_lines() {
    let t = Tree::new();
    topology(&t);
    t.write(
        "etc/pve/mapping/pci.cfg",
        "egpu\n\tmap id=10de:2bb1,iommugroup=20,node=testnode,path=0000:0a:00.0,subsystem-id=10de:204b\n\tdescription TB4 enclosure\n\
         multi\n\tmap id=10de:2684,node=othernode,path=0000:02:00.0\n\tmap id=10de:2684,node=testnode,path=0000:03:00.0;0000:03:00.1\n\
         wrongid\n\tmap id=1234:5678,node=testnode,path=0000:01:00.0\n",
    );
    t.write(
        "etc/pve/qemu-server/100.conf",
        "# GPU VM\nboot: order=scsi0\nhostpci0: mapping=egpu,pcie=1\nhostpci1: 0000:01:00.0,rombar=0\nnet0: virtio=BC:24:11:00:00:01,bridge=vmbr0,firewall=1\n\n[snap1]\nhostpci0: 02:00.0\n",
    );
    t.write(
        "etc/pve/qemu-server/101.conf",
        "hostpci0: 01:00,pcie=1,x-vga=1\nhostpci1: host=03:00.0;0000:04:00.1,pcie=1\nhostpci2: 01:00.0:bad\nhostpciX: 01:00.0\nhostpci3: mapping=nope\nhostpci4: 05:00.0,mdev=nvidia-35\n",
    );
    t.write(
        "etc/pve/qemu-server/102.conf",
        "hostpci0: mapping=multi\nhostpci5: mapping=wrongid\n",
    );
    t.write("etc/pve/qemu-server/notavm.conf", "hostpci0: 09:00.0\n");
    let roots = Roots::new(t.root());
    let scan = scan_pve(&roots, "testnode");
    assert!(scan.pve_present);
    assert_eq!(
        scan.vmids.iter().copied().collect::<Vec<_>>(),
        [100, 101, 102]
    );
    assert_eq!(
        scan.assignments,
        vec![
            a("0000:0a:00.0", 100, "hostpci0"),
            a("0000:01:00.0", 100, "hostpci1"),
            a("0000:01:00.0", 101, "hostpci0"),
            a("0000:01:00.1", 101, "hostpci0"),
            a("0000:03:00.0", 101, "hostpci1"),
            a("0000:04:00.1", 101, "hostpci1"),
            a("0000:05:00.0", 101, "hostpci4"),
            a("0000:03:00.0", 102, "hostpci0"),
            a("0000:03:00.1", 102, "hostpci0"),
            a("0000:01:00.0", 102, "hostpci5"),
        ]
    );
    let f101 = t.p("etc/pve/qemu-server/101.conf").display().to_string();
    let f102 = t.p("etc/pve/qemu-server/102.conf").display().to_string();
    assert_eq!(
        scan.warnings,
        vec![
            format!("{f101}:3: hostpci2: bad PCI address `01:00.0:bad`"),
            format!("{f101}:4: bad hostpci index `hostpciX`"),
            format!("{f101}:5: hostpci3: mapping `nope` not found in /etc/pve/mapping/pci.cfg"),
            format!("{f102}:2: hostpci5: mapping `wrongid` expects id 1234:5678 at 0000:01:00.0, sysfs has 10de:2684"),
        ]
    );

    // Topology: links and the tunnel hop of the eGPU.
    let (_, topo) = discover(&roots, "testnode", &[]);
    let egpu = topo
        .iter()
        .find(|d| d.assignment.bdf == "0000:0a:00.0")
        .unwrap();
    let links: Vec<(&str, Option<&str>, bool)> = egpu
        .links
        .iter()
        .map(|l| (l.child.as_str(), l.parent.as_deref(), l.virtual_tunnel))
        .collect();
    assert_eq!(
        links,
        [
            ("0000:0a:00.0", Some("0000:09:01.0"), false),
            ("0000:08:00.0", Some("0000:06:01.0"), true),
            ("0000:05:00.0", Some("0000:00:1c.4"), false)
        ]
    );
    assert_eq!(egpu.thunderbolt_router.as_deref(), Some("0-1"));
    // The audio function shares function 0's link.
    let audio = topo
        .iter()
        .find(|d| d.assignment.bdf == "0000:01:00.1")
        .unwrap();
    assert_eq!(audio.links[0].child, "0000:01:00.0");
    // Absent devices are listed as not present.
    assert!(
        !topo
            .iter()
            .find(|d| d.assignment.bdf == "0000:04:00.1")
            .unwrap()
            .present
    );
}

/// Minimal QMP server: greeting, capabilities, query-status with a settable status.
fn fake_qmp(path: std::path::PathBuf, status: Arc<Mutex<String>>) {
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut r = BufReader::new(s.try_clone().unwrap());
            let _ = s.write_all(b"{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 2, \"minor\": 2, \"major\": 9}}, \"capabilities\": []}}\r\n");
            let mut line = String::new();
            while r.read_line(&mut line).unwrap_or(0) > 0 {
                let reply = if line.contains("qmp_capabilities") {
                    "{\"return\": {}}\r\n".to_string()
                } else if line.contains("query-status") {
                    let st = status.lock().unwrap().clone();
                    format!("{{\"return\": {{\"status\": \"{st}\", \"singlestep\": false, \"running\": {}}}}}\r\n", st == "running")
                } else {
                    "{\"error\": {}}\r\n".to_string()
                };
                let _ = s.write_all(reply.as_bytes());
                line.clear();
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_stop_with_aer_cause_and_run_delay() {
    let t = Tree::new();
    topology(&t);
    pve_basic(&t);
    // QEMU of VM 100: pid 4242 with two vCPU threads and an I/O thread.
    t.write("run/qemu-server/100.pid", "4242\n");
    t.write(
        "proc/4242/cmdline",
        "/usr/bin/kvm\0-id\x00100\0-name\0gpu,debug-threads=on\0",
    );
    t.write("proc/4242/comm", "kvm\n");
    for (tid, comm, wait) in [
        (4242, "kvm", 9_000_000_000u64),
        (4250, "CPU 0/KVM", 1_000_000_000),
        (4251, "CPU 1/KVM", 500_000_000),
    ] {
        t.write(&format!("proc/4242/task/{tid}/comm"), &format!("{comm}\n"));
        t.write(
            &format!("proc/4242/task/{tid}/schedstat"),
            &format!("123456789 {wait} 42\n"),
        );
    }
    let status = Arc::new(Mutex::new("running".to_string()));
    fake_qmp(t.p("run/qemu-server/100.qmp"), status.clone());
    let mut cfg = base_config(&t, 200);
    cfg.vm.qmp = true;
    let agent = Arc::new(Agent::new(cfg));
    let mut rx = agent.bus.subscribe();
    let running = agent.start().await;
    let m = agent.metrics.render();
    assert!(
        m.contains("gpufeed_host_vm_up{vmid=\"100\",host=\"testnode\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("gpufeed_host_vm_up{vmid=\"101\",host=\"testnode\"} 0"),
        "{m}"
    );
    // vCPU threads only: 1.0 + 0.5 s.
    assert!(
        m.contains("gpufeed_host_vcpu_run_delay_seconds_total{vmid=\"100\",host=\"testnode\"} 1.5"),
        "{m}"
    );
    while tokio::time::timeout(Duration::from_millis(500), rx.recv())
        .await
        .is_ok()
    {}

    // vCPU 1 waits 50 ms more (less than the 200 ms between two polls: a thread cannot wait
    // longer than the wall time, and the counter never grows faster).
    t.write("proc/4242/task/4251/schedstat", "123456789 550000000 50\n");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let m = agent.metrics.render();
    assert!(
        m.contains(
            "gpufeed_host_vcpu_run_delay_seconds_total{vmid=\"100\",host=\"testnode\"} 1.55"
        ),
        "{m}"
    );

    // An uncorrectable AER on the GPU, then QEMU stops the guest (internal-error).
    t.append_kmsg(
        "3,3001,9000000000,-,caller=T98;pcieport 0000:09:01.0: AER: Uncorrectable (Non-Fatal) error message received from 0000:0a:00.0\n SUBSYSTEM=pci\n DEVICE=+pci:0000:09:01.0\n\
         3,3002,9000000100,-,caller=T98;vfio-pci 0000:0a:00.0: PCIe Bus Error: severity=Uncorrectable (Non-Fatal), type=Transaction Layer, (Requester ID)\n",
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    *status.lock().unwrap() = "internal-error".into();
    let mut vm_ev = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while vm_ev.is_none() && tokio::time::Instant::now() < deadline {
        if let Ok(Ok(e)) = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await {
            if let HostEvent::VmState(v) = e.event {
                vm_ev = Some(v);
            }
        }
    }
    let v = vm_ev.expect("a VM state event");
    assert_eq!(
        (v.vmid, v.old, v.new, v.detail.as_deref()),
        (
            100,
            VmRunState::Running,
            VmRunState::Error,
            Some("internal-error")
        )
    );
    assert_eq!(v.cause.len(), 2, "{:?}", v.cause);
    assert!(
        v.cause[0].contains("Uncorrectable (Non-Fatal) error message received from 0000:0a:00.0")
    );
    assert!(agent
        .metrics
        .render()
        .contains("gpufeed_host_vm_state{state=\"error\",vmid=\"100\",host=\"testnode\"} 1"));

    // The process exits: stopped.
    std::fs::remove_file(t.p("run/qemu-server/100.pid")).unwrap();
    let mut stop = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while stop.is_none() && tokio::time::Instant::now() < deadline {
        if let Ok(Ok(e)) = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await {
            if let HostEvent::VmState(v) = e.event {
                stop = Some(v);
            }
        }
    }
    let s = stop.expect("stopped event");
    assert_eq!(
        (s.vmid, s.old, s.new),
        (100, VmRunState::Error, VmRunState::Stopped)
    );
    drop(running);
}
