//! Watchers, one unit each. A unit file holds the watcher's configuration section (its serde
//! struct, defaults and checks), its series (a `*Metrics` struct registered by the unit), its
//! synchronous `poll`-style core that returns events (tested against recorded trees) and the
//! loop that drives that core, all tied together by a [`unit::Unit`] in [`UNITS`].
//!
//! Adding a watcher: a new file here with those parts and a `pub const UNIT`, its line in
//! [`UNITS`], and its section's field in [`crate::config::Config`] (docs/host-agent.md walks
//! through one).

pub mod aer;
mod aer_hold;
pub mod bridge;
pub mod hoststats;
pub mod kmsg;
pub mod pcie;
pub mod thunderbolt;
pub mod tracepoints;
pub mod uevents;
pub mod unit;
pub mod vm;

use crate::discovery::{DeviceTopology, Link};
use gpufeed_shared::event::{HostEvent, KmsgRecord};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The watchers, in the order the agent starts them (and lists them in its logs).
pub const UNITS: &[unit::Unit] = &[
    pcie::UNIT,
    aer::UNIT,
    thunderbolt::UNIT,
    uevents::UNIT,
    tracepoints::UNIT,
    kmsg::UNIT,
    bridge::UNIT,
    vm::UNIT,
    hoststats::UNIT,
];

/// One line for a person: the unit that emits the event describes it.
pub fn describe(e: &HostEvent) -> String {
    UNITS
        .iter()
        .find_map(|u| (u.describe)(e))
        .or_else(|| crate::agent::describe(e))
        .unwrap_or_else(|| format!("{e:?}"))
}

/// ` vm <id>` when the event has a VM, for [`describe`].
pub fn vm_suffix(v: Option<u32>) -> String {
    v.map(|v| format!(" vm {v}")).unwrap_or_default()
}

/// Current view of the watched devices (replaced on every discovery scan).
#[derive(Debug, Default, Clone)]
pub struct Topology {
    pub devices: Vec<DeviceTopology>,
    /// Every link on every path, deduplicated by downstream-end device.
    pub links: Vec<Link>,
    /// Every device on every path (AER is counted by the reporting device, so the link
    /// partner may hold the errors): bdf → (vmid of the first device it serves, is root port).
    pub aer_devices: BTreeMap<String, (Option<u32>, bool)>,
}

impl Topology {
    pub fn from_devices(devices: Vec<DeviceTopology>) -> Topology {
        let mut links: Vec<Link> = Vec::new();
        let mut aer_devices = BTreeMap::new();
        for d in &devices {
            for l in &d.links {
                if !links.iter().any(|x| x.child == l.child) {
                    links.push(l.clone());
                }
            }
            for (i, b) in d.path.iter().enumerate() {
                let root = i + 1 == d.path.len() && d.present;
                aer_devices
                    .entry(b.clone())
                    .or_insert((d.assignment.vmid, root));
            }
        }
        Topology {
            devices,
            links,
            aer_devices,
        }
    }

    /// VMID a device (or a bridge on its path) serves.
    pub fn vmid_of(&self, bdf: &str) -> Option<u32> {
        self.aer_devices.get(bdf).and_then(|x| x.0)
    }

    /// All BDFs on the paths of a VM's devices.
    pub fn bdfs_of_vm(&self, vmid: u32) -> Vec<String> {
        self.devices
            .iter()
            .filter(|d| d.assignment.vmid == Some(vmid))
            .flat_map(|d| d.path.iter().cloned())
            .collect()
    }
}

/// Recent classified kernel log records, for AER context and VM stop causes.
#[derive(Debug, Default)]
pub struct RecentKmsg {
    inner: Mutex<VecDeque<(Instant, KmsgRecord)>>,
}

impl RecentKmsg {
    const CAP: usize = 512;

    pub fn push(&self, r: KmsgRecord) {
        let mut q = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= Self::CAP {
            q.pop_front();
        }
        q.push_back((Instant::now(), r));
    }

    /// Records within `window` for which `pred` holds.
    pub fn matching(
        &self,
        window: Duration,
        pred: impl Fn(&KmsgRecord) -> bool,
    ) -> Vec<KmsgRecord> {
        let q = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        q.iter()
            .filter(|(t, r)| now.duration_since(*t) <= window && pred(r))
            .map(|(_, r)| r.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufeed_shared::event::*;

    /// One event of every kind (the match below has no wildcard: a new kind is a compile
    /// error here until it has a sample).
    fn one_of_each() -> Vec<HostEvent> {
        let samples = vec![
            HostEvent::PcieLinkChange(PcieLinkChange {
                bdf: "0000:0a:00.0".into(),
                upstream_bdf: Some("0000:09:01.0".into()),
                target_bdf: Some("0000:0a:00.0".into()),
                vmid: Some(100),
                old_speed_mts: Some(16000),
                new_speed_mts: Some(2500),
                old_width: 4,
                new_width: 4,
                max_speed_mts: Some(16000),
                max_width: 16,
                class: LinkChangeClass::SpeedOnly,
                degraded: true,
                source: Source::Poll,
            }),
            HostEvent::AerCounter(AerCounter {
                bdf: "0000:0a:00.0".into(),
                vmid: Some(100),
                severity: AerSeverity::Correctable,
                error: "RxErr".into(),
                delta: 2,
                total: 5,
                detail: None,
                kmsg_context: vec![],
                source: Source::Poll,
            }),
            HostEvent::AerRootPortTotal(AerRootPortTotal {
                bdf: "0000:00:1c.0".into(),
                severity: AerSeverity::Fatal,
                delta: 1,
                total: 1,
            }),
            HostEvent::AerTrace(AerDetail {
                dev_name: "0000:0a:00.0".into(),
                severity: AerSeverity::NonFatal,
                status: 0x4000,
                tlp_header: None,
                trace_ns: None,
            }),
            HostEvent::PciErrorRecovery(PciErrorRecovery {
                bdf: "0000:0a:00.0".into(),
                vmid: None,
                event: "BEGIN_RECOVERY".into(),
                device_online: Some(false),
            }),
            HostEvent::PciHotplug(PciHotplug {
                port: "0000:00:1c.0".into(),
                slot: "4".into(),
                event: "LINK_DOWN".into(),
            }),
            HostEvent::ThunderboltDevice(ThunderboltDevice {
                device: "0-1".into(),
                action: DeviceAction::Removed,
                old: Some(ThunderboltInfo::default()),
                new: None,
                vmids: vec![100],
                source: Source::Uevent,
            }),
            HostEvent::ThunderboltTunnel(ThunderboltTunnel {
                device: "0-1".into(),
                event: "activated".into(),
                details: None,
            }),
            HostEvent::Kmsg(KmsgRecord {
                seq: 1,
                usec: 2,
                level: 3,
                facility: 0,
                class: KmsgClass::Dpc,
                bdf: None,
                vmid: None,
                text: "DPC: containment event".into(),
            }),
            HostEvent::KmsgLost { count: 3 },
            HostEvent::VmState(VmStateChange {
                vmid: 100,
                old: VmRunState::Running,
                new: VmRunState::Error,
                detail: Some("internal-error".into()),
                cause: vec![],
            }),
            HostEvent::BridgePort(BridgePortChange {
                bridge: "vmbr0".into(),
                port: "tap100i0".into(),
                vmid: Some(100),
                nic: Some(0),
                action: DeviceAction::Added,
            }),
            HostEvent::DeviceMapped(DeviceMapped {
                bdf: "0000:0a:00.0".into(),
                vmid: Some(100),
                origin: "hostpci0".into(),
                path: vec!["0000:0a:00.0".into(), "0000:00:1c.0".into()],
                root_port: Some("0000:00:1c.0".into()),
                thunderbolt_router: None,
            }),
            HostEvent::WatcherDisabled {
                watcher: "aer".into(),
                reason: "no aer_dev_* files".into(),
            },
        ];
        for e in &samples {
            match e {
                HostEvent::PcieLinkChange(_)
                | HostEvent::AerCounter(_)
                | HostEvent::AerRootPortTotal(_)
                | HostEvent::AerTrace(_)
                | HostEvent::PciErrorRecovery(_)
                | HostEvent::PciHotplug(_)
                | HostEvent::ThunderboltDevice(_)
                | HostEvent::ThunderboltTunnel(_)
                | HostEvent::Kmsg(_)
                | HostEvent::KmsgLost { .. }
                | HostEvent::VmState(_)
                | HostEvent::BridgePort(_)
                | HostEvent::DeviceMapped(_)
                | HostEvent::WatcherDisabled { .. } => {}
            }
        }
        samples
    }

    /// Every kind is described by exactly one unit (or the agent), not by the debug fallback.
    #[test]
    fn every_kind_has_one_describer() {
        let all = one_of_each();
        let kinds: std::collections::BTreeSet<u16> = all.iter().map(HostEvent::kind).collect();
        assert_eq!(kinds.len(), 14, "one sample per kind");
        for e in &all {
            let by: Vec<String> = UNITS
                .iter()
                .filter_map(|u| (u.describe)(e).map(|_| u.name.to_string()))
                .chain(crate::agent::describe(e).map(|_| "agent".to_string()))
                .collect();
            assert_eq!(by.len(), 1, "{}: described by {by:?}", e.kind_name());
        }
        assert_eq!(
            describe(&all[0]),
            "0000:0a:00.0 vm 100: 16.0 GT/s x4 -> 2.5 GT/s x4 (speed_only, degraded, max 16.0 GT/s x16)"
        );
        // at full width the host cannot tell power saving from a degradation under load
        let HostEvent::PcieLinkChange(mut full) = all[0].clone() else {
            unreachable!()
        };
        (full.max_width, full.degraded) = (4, false);
        assert_eq!(
            describe(&HostEvent::PcieLinkChange(full)),
            "0000:0a:00.0 vm 100: 16.0 GT/s x4 -> 2.5 GT/s x4 (speed_only, full width: power \
             saving if the GPU is idle, max 16.0 GT/s x4)"
        );
        assert_eq!(describe(&all[9]), "3 kernel log records lost");
        assert_eq!(describe(&all[13]), "aer off: no aer_dev_* files");
    }
}
