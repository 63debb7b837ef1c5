//! The devices the agent watches, as the last discovery scan found them: [`Topology`], and
//! [`TopoCell`], the shared snapshot each scan replaces and every watcher reads.

use crate::discovery::{DeviceTopology, Link};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};

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

    /// A VM's passed-through devices, and the bridges and ports above them up to the root
    /// ports (each once, none of the VM's own devices): whose events reach the guest bound to
    /// that VM.
    pub fn devices_of_vm(&self, vmid: u32) -> (Vec<String>, Vec<String>) {
        let mine = || {
            self.devices
                .iter()
                .filter(move |d| d.assignment.vmid == Some(vmid))
        };
        let devices: BTreeSet<String> = mine().map(|d| d.assignment.bdf.clone()).collect();
        let upstream: BTreeSet<String> = mine()
            .flat_map(|d| d.path.iter())
            .filter(|b| !devices.contains(*b))
            .cloned()
            .collect();
        (
            devices.into_iter().collect(),
            upstream.into_iter().collect(),
        )
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

/// Shared, replaceable topology snapshot.
#[derive(Debug, Default)]
pub struct TopoCell {
    inner: RwLock<Arc<Topology>>,
    vmids: RwLock<BTreeSet<u32>>,
}

impl TopoCell {
    pub fn get(&self) -> Arc<Topology> {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub fn set(&self, t: Topology, vmids: BTreeSet<u32>) {
        *self.inner.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(t);
        *self.vmids.write().unwrap_or_else(|e| e.into_inner()) = vmids;
    }
    pub fn vmids(&self) -> BTreeSet<u32> {
        self.vmids.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
