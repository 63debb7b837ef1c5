//! The uevent listener on the real kernel: a veth pair made for the test (unique names, deleted
//! even on failure) must come through as `add`, a synthetic `change` written to its `uevent`
//! file with a UUID and an argument, and `remove`, each with the kernel's DEVPATH and
//! SUBSYSTEM. The routing ignores network devices, so the agent would not rescan for them.
//! Thunderbolt and PCI uevents cannot be produced without the hardware; their routing is tested
//! on the kernel's exact messages in `uevent.rs`.

use crate::common;

use gpufeed_host::uevent::{react, spawn_listener, Uevent};
use std::process::Command;
use std::time::Duration;

struct Veth(String);
impl Drop for Veth {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.0])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip(8)");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The next uevent for `devpath` with `action`, skipping the machine's other uevents.
async fn next_for(
    rx: &mut tokio::sync::mpsc::Receiver<Uevent>,
    devpath: &str,
    action: &str,
) -> Uevent {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let u = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no {action}@{devpath} uevent within 10 s"))
            .expect("listener alive");
        if u.devpath == devpath && u.action == action {
            return u;
        }
    }
}

#[tokio::test]
async fn real_uevents_arrive_parsed() {
    if !common::require_root("real_uevents_arrive_parsed") {
        return;
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    spawn_listener(tx).expect("uevent socket");

    // IFNAMSIZ is 16: "gfu" + 8 hex digits + "a"/"b".
    let tag = format!(
        "{:08x}",
        std::process::id() ^ (gpufeed_shared::clock::realtime_ns() as u32)
    );
    let (a, b) = (format!("gfu{tag}a"), format!("gfu{tag}b"));
    let _guard = Veth(a.clone());
    ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]);
    let devpath = format!("/devices/virtual/net/{a}");

    let add = next_for(&mut rx, &devpath, "add").await;
    assert_eq!(add.get("SUBSYSTEM"), Some("net"));
    assert_eq!(add.get("INTERFACE"), Some(a.as_str()));
    assert_eq!(add.get("ACTION"), Some("add"));
    assert!(add
        .get("SEQNUM")
        .and_then(|s| s.parse::<u64>().ok())
        .is_some());
    assert!(
        react(&add).is_empty(),
        "a network device must not trigger rescans"
    );

    // A synthetic uevent (Documentation/ABI/testing/sysfs-uevent): the kernel echoes the UUID
    // and the argument back as SYNTH_UUID / SYNTH_ARG_*.
    let uuid = "4f1c2a7e-9b3d-4c5e-8a6f-0123456789ab";
    std::fs::write(
        format!("/sys/class/net/{a}/uevent"),
        format!("change {uuid} GPUFEED={tag}"),
    )
    .unwrap();
    let change = next_for(&mut rx, &devpath, "change").await;
    assert_eq!(change.get("SYNTH_UUID"), Some(uuid));
    assert_eq!(change.get("SYNTH_ARG_GPUFEED"), Some(tag.as_str()));

    ip(&["link", "del", &a]);
    let remove = next_for(&mut rx, &devpath, "remove").await;
    assert_eq!(remove.get("SUBSYSTEM"), Some("net"));
    assert!(
        remove.get("SEQNUM").unwrap().parse::<u64>().unwrap()
            > add.get("SEQNUM").unwrap().parse::<u64>().unwrap()
    );
}
