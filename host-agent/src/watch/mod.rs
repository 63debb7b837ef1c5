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
    use gpufeed_shared::event::samples::one_of_each;

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
