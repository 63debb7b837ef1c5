//! `gpufeed-host doctor`: what the field gets wrong on a Proxmox host, checked through the
//! agent's roots (`--root`) so that tests can hand the checks a recorded tree. Each check
//! passes or fails with its fix (docs/doctor.md); the running agent evaluates them at start
//! and every [`PERIOD`] and exports `gpufeed_check_ok{check}` (with its `host` label).

pub mod aer;
pub mod link;

use std::time::Duration;

use gpufeed_shared::doctor::{
    self as common, Capability, CAP_SYSLOG, CAP_SYS_ADMIN, TRACEFS_MAGIC,
};
pub use gpufeed_shared::doctor::{any_failed, render, CheckGauge, Finding, Status};

use crate::config::Config;
use crate::roots::Roots;

/// How often the running agent re-evaluates (a few sysfs reads and the kernel log's history).
pub const PERIOD: Duration = Duration::from_secs(300);

const KMSG: Capability = Capability {
    number: CAP_SYSLOG,
    name: "CAP_SYSLOG",
    used_for: "reading /dev/kmsg (kernel.dmesg_restrict=1 on Proxmox)",
    or: None,
};

const SETNS: Capability = Capability {
    number: CAP_SYS_ADMIN,
    name: "CAP_SYS_ADMIN",
    used_for: "setns into [bridge] netns",
    or: None,
};

/// Every check for `cfg`, in report order.
pub fn checks(cfg: &Config) -> Vec<Finding> {
    let roots = Roots::new(&cfg.root);
    let needed: Vec<Capability> = if cfg.bridge.netns.is_some() {
        vec![KMSG, SETNS]
    } else {
        vec![KMSG]
    };
    vec![
        common::capabilities(
            &roots.proc().join("self"),
            &needed,
            "run it as systemd/gpufeed-host.service does (CapabilityBoundingSet=CAP_SYSLOG \
             CAP_SYS_ADMIN, as root): a unit drop-in that narrows the set removes what it needs",
        ),
        common::mounted(
            "tracefs",
            "tracefs",
            &[&roots.tracefs()],
            TRACEFS_MAGIC,
            "mount tracefs at /sys/kernel/tracing (systemd's sys-kernel-tracing.mount does); \
             without it AER errors and PCIe hotplug are seen only through the kernel log",
        ),
        common::lockdown(&roots.path("/sys/kernel/security/lockdown"), |mode| {
            (mode == "confidentiality").then(|| {
                "tracefs (the ras:aer_event and pci tracepoints: AER errors are then seen only \
                 in the kernel log and the aer_dev_* counters)"
                    .to_string()
            })
        }),
        aer::owner(&roots),
        link::degraded(&roots, &cfg.host_id(), &cfg.devices),
    ]
}
