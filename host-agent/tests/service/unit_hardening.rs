//! The shipped systemd unit keeps only the capabilities a feature needs (each justified in a
//! comment there: kmsg, and `setns` for `[bridge] netns`), keeps /sys and /proc/sys read-only,
//! creates private files, and `systemd-analyze security` rates it better than the 3.2 of the
//! unit before these changes.

use std::process::Command;

const UNIT: &str = include_str!("../../../systemd/gpufeed-host.service");

fn directive(key: &str) -> Vec<&'static str> {
    UNIT.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .collect()
}

#[test]
fn unit_keeps_only_the_capabilities_it_needs() {
    assert_eq!(
        directive("CapabilityBoundingSet"),
        vec!["CAP_SYSLOG CAP_SYS_ADMIN"]
    );
    assert_eq!(directive("AmbientCapabilities"), vec![""]);
    assert_eq!(directive("ProtectKernelTunables"), vec!["yes"]);
    assert_eq!(directive("UMask"), vec!["0077"]);
    // tracefs is read-only under /sys in the unit's namespace: a second, writable view of it
    // for the agent's instance (the lab's systemd VMs check that it works under a real
    // systemd: lab/tests/host_package.rs)
    assert_eq!(directive("ReadWritePaths"), Vec::<&str>::new());
    assert_eq!(
        directive("BindPaths"),
        vec!["-/sys/kernel/tracing:/run/gpufeed-host/tracing"]
    );
    assert_eq!(
        gpufeed_host::roots::UNIT_TRACEFS,
        "/run/gpufeed-host/tracing",
        "the agent looks where the unit binds"
    );
}

#[test]
fn systemd_analyze_security_rates_the_unit_at_most_2_6() {
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("gpufeed-host.service");
    std::fs::write(&unit, UNIT).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let level: f64 = text
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for gpufeed-host.service: ")
                .nth(1)
        })
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{text}"));
    eprintln!("systemd-analyze security: {level}");
    assert!(level <= 2.6, "exposure {level}");
}
