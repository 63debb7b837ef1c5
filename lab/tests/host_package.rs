//! The host agent's Debian package under a real systemd, as a Proxmox VE host runs it: trixie
//! (systemd 257, Proxmox VE 9) and bookworm (systemd 252, Proxmox VE 8) booted with systemd as
//! PID 1 (`lab/scenarios/host-package.sh`). Two packages of the same binary built by
//! `systemd/build-deb.sh`, an old and a new version, go through `apt install`, an upgrade,
//! `apt remove` and `apt purge`; in between the running service is asked what it does: its
//! tracefs instance (the unit's `ProtectKernelTunables=yes` makes /sys/kernel/tracing
//! read-only, so the unit binds a writable view of it elsewhere), `/dev/kmsg`, sysfs, bridges
//! in another network namespace, the spool; its journal records carry their fields; its
//! watchdog restarts it when a watcher wedges; `systemd-analyze security` rates the unit.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use gpufeed_lab::{KernelName, Payload, Variant, Vm, VmSpec};

fn build_deb(out: &Path, version: &str) -> String {
    let r = Command::new(common::repo().join("systemd/build-deb.sh"))
        .arg("--binary")
        .arg(common::binary("gpufeed-host"))
        .arg("--out")
        .arg(out)
        .args(["--version", version])
        .env("DEB_COMPRESSOR", "none")
        .output()
        .expect("systemd/build-deb.sh");
    assert!(
        r.status.success(),
        "build-deb: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8(r.stdout).unwrap().trim().to_string()
}

/// Runs the scenario on one systemd variant; returns its reports (last value per key) and
/// every `watcher` line.
fn run(
    cache: &gpufeed_lab::Cache,
    variant: Variant,
    kernel: KernelName,
    short: bool,
) -> (BTreeMap<String, String>, Vec<String>) {
    let debs = tempfile::tempdir().unwrap();
    let old = build_deb(debs.path(), "0.1.0~lab1");
    let new = build_deb(debs.path(), "0.1.0~lab2");
    let script =
        std::fs::read_to_string(common::repo().join("lab/scenarios/host-package.sh")).unwrap();
    let payload = Payload::new(&script).unwrap();
    payload
        .copy(Path::new(&old), "gpufeed-host_old.deb")
        .unwrap();
    payload
        .copy(Path::new(&new), "gpufeed-host_new.deb")
        .unwrap();
    if short {
        payload.add("short", b"1\n", 0o644).unwrap();
    }
    let mut spec = VmSpec::new(cache, variant.name(), kernel, variant).unwrap();
    spec.deadline = Duration::from_secs(1200);
    let image = payload.image().unwrap();
    let mut vm = Vm::start(cache, &spec, &image).unwrap();
    if let Err(e) = vm.expect("done", Duration::from_secs(1200)) {
        panic!("{e}\nreports so far: {:#?}", vm.port.seen);
    }
    eprintln!(
        "lab: {} done in {:.0} s",
        variant.name(),
        vm.uptime().as_secs_f64()
    );
    let mut last = BTreeMap::new();
    let mut watchers = Vec::new();
    for l in &vm.port.seen {
        if l.key == "watcher" {
            watchers.push(l.value.clone());
        }
        last.insert(l.key.clone(), l.value.clone());
    }
    let _ = vm.wait_exit(Duration::from_secs(60));
    (last, watchers)
}

fn check(
    variant: Variant,
    systemd: &str,
    short: bool,
    r: &BTreeMap<String, String>,
    watchers: &[String],
) {
    let get = |k: &str| r.get(k).map(String::as_str).unwrap_or("");
    let name = variant.name();
    assert!(
        get("systemd").starts_with(systemd),
        "{name}: {}",
        get("systemd")
    );
    assert_eq!(get("installed"), "0.1.0~lab1", "{name}");
    assert_eq!(get("enabled"), "enabled", "{name}: install enables it");
    assert_eq!(get("started"), "active", "{name}: install starts it");
    assert_eq!(
        get("configured"),
        "active",
        "{name}: restarted with the bundle"
    );
    for w in ["tracepoints 1", "kmsg 1", "bridge 1", "vm 1"] {
        assert!(
            watchers.iter().any(|l| l == w),
            "{name}: watcher {w} in {watchers:?}; tracefs said: {}",
            get("tracefs_log")
        );
    }
    assert_eq!(get("instance"), "present", "{name}: its tracefs instance");
    assert_eq!(
        get("instance_events"),
        "1",
        "{name}: ras:aer_event enabled in it"
    );
    assert!(
        get("tracefs_log").contains("using ras:aer_event"),
        "{name}: {}",
        get("tracefs_log")
    );
    let bridge: u32 = get("bridge_series").parse().unwrap_or(0);
    assert!(
        bridge >= 1,
        "{name}: no series of tap100i0 in the other namespace"
    );
    assert!(
        get("spool").contains("spool.meta"),
        "{name}: spool: {}",
        get("spool")
    );
    assert!(
        get("journal_fields").contains("\"WATCHER\":"),
        "{name}: journal fields {}",
        get("journal_fields")
    );
    let exposure: f64 = get("security")
        .split("gpufeed-host.service: ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "{name}: systemd-analyze security said {:?}",
                get("security")
            )
        });
    eprintln!("lab: {name}: systemd-analyze security {exposure}");
    assert!(exposure <= 2.6, "{name}: exposure {exposure}");
    if !short {
        upgrade_and_watchdog(name, r);
    }
    assert_eq!(get("removed"), "not-found stopped config-kept", "{name}");
    assert_eq!(get("purged"), "config-gone spool-gone", "{name}");
}

/// The upgrade restarts the service and keeps its configuration; the watchdog restarts a
/// wedged agent.
fn upgrade_and_watchdog(name: &str, r: &BTreeMap<String, String>) {
    let get = |k: &str| r.get(k).map(String::as_str).unwrap_or("");
    assert_eq!(get("upgraded"), "0.1.0~lab2 active", "{name}");
    let pids: Vec<&str> = get("restarted").split_whitespace().collect();
    assert!(
        pids.len() == 2 && pids[0] != pids[1] && pids[1] != "0",
        "{name}: the upgrade restarts it (main pids {pids:?})"
    );
    assert_eq!(
        get("config_kept"),
        "1",
        "{name}: the upgrade keeps host.toml"
    );
    let restarts: Vec<u32> = get("watchdog")
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    assert!(
        restarts.len() == 2 && restarts[1] > restarts[0],
        "{name}: the watchdog restarts a wedged agent ({restarts:?})"
    );
    assert!(
        !get("watchdog_log").is_empty(),
        "{name}: systemd logs the watchdog timeout"
    );
    assert_eq!(get("recovered"), "active", "{name}");
}

#[test]
fn package_under_systemd_257_on_trixie() {
    let Some((cache, _lock)) = common::lab() else {
        return;
    };
    let (r, w) = run(&cache, Variant::SystemdTrixie, KernelName::Trixie, false);
    check(Variant::SystemdTrixie, "systemd 257", false, &r, &w);
}

#[test]
fn package_under_systemd_252_on_bookworm() {
    let Some((cache, _lock)) = common::lab() else {
        return;
    };
    // install, the sandbox, the journal, the security rating, remove and purge; the upgrade
    // and the watchdog (the same dpkg and sd_notify protocol on every systemd) run on trixie
    let (r, w) = run(&cache, Variant::SystemdBookworm, KernelName::Bookworm, true);
    check(Variant::SystemdBookworm, "systemd 252", true, &r, &w);
}
