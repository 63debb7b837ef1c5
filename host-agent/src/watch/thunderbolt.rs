//! Thunderbolt/USB4 routers from `/sys/bus/thunderbolt/devices`: names, generation,
//! authorized, per-lane rx/tx speed and lanes. Rescanned on a timer and on every
//! `SUBSYSTEM=thunderbolt` uevent; add/remove/change become events.

use crate::discovery::is_router_name;
use crate::metrics::Metrics;
use crate::roots::Roots;
use crate::sysfs::{parse_tb_speed, read_attr};
use crate::watch::Topology;
use gpufeed_shared::event::{DeviceAction, HostEvent, Source, ThunderboltDevice, ThunderboltInfo};
use std::collections::BTreeMap;

pub fn read_router(roots: &Roots, name: &str) -> ThunderboltInfo {
    let d = roots.thunderbolt_devices().join(name);
    let u8a = |f: &str| read_attr(&d.join(f)).and_then(|s| s.parse::<u8>().ok());
    ThunderboltInfo {
        vendor_name: read_attr(&d.join("vendor_name")),
        device_name: read_attr(&d.join("device_name")),
        generation: u8a("generation"),
        authorized: u8a("authorized"),
        rx_speed_gbps_x10: read_attr(&d.join("rx_speed")).and_then(|s| parse_tb_speed(&s)),
        tx_speed_gbps_x10: read_attr(&d.join("tx_speed")).and_then(|s| parse_tb_speed(&s)),
        rx_lanes: u8a("rx_lanes"),
        tx_lanes: u8a("tx_lanes"),
    }
}

pub fn list_routers(roots: &Roots) -> Option<Vec<String>> {
    let rd = std::fs::read_dir(roots.thunderbolt_devices()).ok()?;
    let mut v: Vec<String> = rd
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| is_router_name(n))
        .collect();
    v.sort();
    Some(v)
}

#[derive(Debug, Default)]
pub struct TbPoller {
    state: Option<BTreeMap<String, ThunderboltInfo>>,
}

fn set_metrics(m: &Metrics, name: &str, i: &ThunderboltInfo) {
    let f = |x: Option<u32>| x.map(|v| v as f64 / 10.0).unwrap_or(0.0);
    m.tb_speed
        .with_label_values(&[name, "rx"])
        .set(f(i.rx_speed_gbps_x10));
    m.tb_speed
        .with_label_values(&[name, "tx"])
        .set(f(i.tx_speed_gbps_x10));
    m.tb_lanes
        .with_label_values(&[name, "rx"])
        .set(i.rx_lanes.unwrap_or(0) as i64);
    m.tb_lanes
        .with_label_values(&[name, "tx"])
        .set(i.tx_lanes.unwrap_or(0) as i64);
    m.tb_authorized
        .with_label_values(&[name])
        .set(i.authorized.unwrap_or(0) as i64);
}

fn clear_metrics(m: &Metrics, name: &str) {
    for dir in ["rx", "tx"] {
        let _ = m.tb_speed.remove_label_values(&[name, dir]);
        let _ = m.tb_lanes.remove_label_values(&[name, dir]);
    }
    let _ = m.tb_authorized.remove_label_values(&[name]);
}

impl TbPoller {
    pub fn new() -> Self {
        Self::default()
    }

    /// Rescan; the first scan records the state without events.
    pub fn poll(
        &mut self,
        roots: &Roots,
        topo: &Topology,
        metrics: &Metrics,
        source: Source,
    ) -> Vec<HostEvent> {
        let names = list_routers(roots).unwrap_or_default();
        let now: BTreeMap<String, ThunderboltInfo> = names
            .iter()
            .map(|n| (n.clone(), read_router(roots, n)))
            .collect();
        for (n, i) in &now {
            set_metrics(metrics, n, i);
        }
        let vmids_of = |name: &str| -> Vec<u32> {
            let mut v: Vec<u32> = topo
                .devices
                .iter()
                .filter(|d| d.thunderbolt_router.as_deref() == Some(name))
                .filter_map(|d| d.assignment.vmid)
                .collect();
            v.sort();
            v.dedup();
            v
        };
        let mut out = Vec::new();
        if let Some(old) = &self.state {
            for (n, o) in old {
                match now.get(n) {
                    None => {
                        clear_metrics(metrics, n);
                        out.push(HostEvent::ThunderboltDevice(ThunderboltDevice {
                            device: n.clone(),
                            action: DeviceAction::Removed,
                            old: Some(o.clone()),
                            new: None,
                            vmids: vmids_of(n),
                            source,
                        }))
                    }
                    Some(i) if i != o => {
                        out.push(HostEvent::ThunderboltDevice(ThunderboltDevice {
                            device: n.clone(),
                            action: DeviceAction::Changed,
                            old: Some(o.clone()),
                            new: Some(i.clone()),
                            vmids: vmids_of(n),
                            source,
                        }))
                    }
                    Some(_) => {}
                }
            }
            for (n, i) in &now {
                if !old.contains_key(n) {
                    out.push(HostEvent::ThunderboltDevice(ThunderboltDevice {
                        device: n.clone(),
                        action: DeviceAction::Added,
                        old: None,
                        new: Some(i.clone()),
                        vmids: vmids_of(n),
                        source,
                    }));
                }
            }
        }
        self.state = Some(now);
        out
    }
}
