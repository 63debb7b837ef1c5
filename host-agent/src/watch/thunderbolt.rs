//! Thunderbolt/USB4 routers from `/sys/bus/thunderbolt/devices`: names, generation,
//! authorized, per-lane rx/tx speed and lanes. Rescanned on a timer and on every
//! `SUBSYSTEM=thunderbolt` uevent; add/remove/change become events.

use super::topology::Topology;
use super::unit::{Cx, Outcome, Poke, Starting, Unit, Watcher};
use crate::config::check::{range, Invalid};
use crate::discovery::is_router_name;
use crate::metrics;
use crate::roots::Roots;
use crate::sysfs::{parse_tb_speed, read_attr};
use gpufeed_shared::event::{DeviceAction, HostEvent, Source, ThunderboltDevice, ThunderboltInfo};
use prometheus::{GaugeVec, IntGaugeVec, Registry};
use serde::Deserialize;
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

/// Series only for the attributes the router has: the host router (route 0, `0-0`) has no
/// rx/tx speed or lane attributes (the kernel hides them: it has no upstream link), and
/// `authorized` is hidden in the `nopcie`/`dponly` security levels. A missing attribute is no
/// series, not a 0 that reads like a dead link.
fn set_metrics(m: &TbMetrics, name: &str, i: &ThunderboltInfo) {
    let speed = |x: Option<u32>| x.map(|v| v as f64 / 10.0);
    for (dir, s, l) in [
        ("rx", speed(i.rx_speed_gbps_x10), i.rx_lanes),
        ("tx", speed(i.tx_speed_gbps_x10), i.tx_lanes),
    ] {
        set_or_remove(&m.speed, &[name, dir], s);
        set_or_remove(&m.lanes, &[name, dir], l.map(i64::from));
    }
    set_or_remove(&m.authorized, &[name], i.authorized.map(i64::from));
}

fn set_or_remove<P: prometheus::core::Atomic>(
    v: &prometheus::core::GenericGaugeVec<P>,
    labels: &[&str],
    value: Option<P::T>,
) {
    match value {
        Some(x) => v.with_label_values(labels).set(x),
        None => {
            let _ = v.remove_label_values(labels);
        }
    }
}

fn clear_metrics(m: &TbMetrics, name: &str) {
    set_metrics(m, name, &ThunderboltInfo::default());
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
        metrics: &TbMetrics,
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

// ---- The unit: configuration, series, loop. ----

/// `[thunderbolt]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ThunderboltConfig {
    pub enabled: bool,
    /// sysfs rescan interval (uevents trigger an immediate rescan).
    pub poll_interval_ms: u64,
    /// Listen to kernel uevents (netlink) for add/remove/change (the [`super::uevents`] unit).
    pub uevents: bool,
}

impl Default for ThunderboltConfig {
    fn default() -> Self {
        ThunderboltConfig {
            enabled: true,
            poll_interval_ms: 2000,
            uevents: true,
        }
    }
}

impl ThunderboltConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        range(
            "thunderbolt.poll_interval_ms",
            self.poll_interval_ms,
            10,
            600_000,
        )
    }
}

pub struct TbMetrics {
    pub speed: GaugeVec,
    pub lanes: IntGaugeVec,
    pub authorized: IntGaugeVec,
}

impl TbMetrics {
    pub fn new(r: &Registry) -> TbMetrics {
        TbMetrics {
            speed: metrics::gauge_vec(
                r,
                "gpufeed_host_thunderbolt_link_speed_gbps",
                "Thunderbolt/USB4 per-lane link speed in Gb/s",
                &["device", "direction"],
            ),
            lanes: metrics::int_gauge_vec(
                r,
                "gpufeed_host_thunderbolt_lanes",
                "Thunderbolt/USB4 lanes in use",
                &["device", "direction"],
            ),
            authorized: metrics::int_gauge_vec(
                r,
                "gpufeed_host_thunderbolt_authorized",
                "Thunderbolt router authorized value (0,1,2)",
                &["device"],
            ),
        }
    }
}

pub const UNIT: Unit = Unit {
    name: "thunderbolt",
    describe,
};

/// Builds the unit from its section `[thunderbolt]`, registering its series in `r`.
pub fn watcher(r: &Registry, cfg: ThunderboltConfig) -> Box<dyn Watcher> {
    Box::new(TbWatcher {
        metrics: TbMetrics::new(r),
        cfg,
    })
}

struct TbWatcher {
    metrics: TbMetrics,
    cfg: ThunderboltConfig,
}

impl Watcher for TbWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            let cfg = self.cfg;
            if !a.roots.thunderbolt_devices().is_dir() {
                return Outcome::Off(format!(
                    "{} not found (no Thunderbolt/USB4 controller or driver)",
                    a.roots.thunderbolt_devices().display()
                ));
            }
            let m = self.metrics;
            let mut p = TbPoller::new();
            p.poll(&a.roots, &a.topo.get(), &m, Source::Poll);
            Outcome::On(vec![tokio::spawn(async move {
                let mut pokes = a.pokes(cfg.poll_interval_ms, cx.inbox).await;
                loop {
                    let source = match pokes.next().await {
                        Poke::Port(_, s) => s,
                        Poke::Tick | Poke::Aer(_) => Source::Poll,
                    };
                    a.emit_all(p.poll(&a.roots, &a.topo.get(), &m, source));
                }
            })])
        })
    }
}

fn describe(e: &HostEvent) -> Option<String> {
    let HostEvent::ThunderboltDevice(t) = e else {
        return None;
    };
    let i = t.new.as_ref().or(t.old.as_ref());
    let lanes = |l: Option<u8>, s: Option<u32>| {
        format!("{}x{:?}", l.unwrap_or(0), s.map(|v| v as f64 / 10.0))
    };
    Some(format!(
        "{} {} {} {}{}",
        t.device,
        t.action.as_str(),
        i.and_then(|i| i.vendor_name.clone()).unwrap_or_default(),
        i.and_then(|i| i.device_name.clone()).unwrap_or_default(),
        match (&t.old, &t.new) {
            (Some(o), Some(n)) => format!(
                " rx {} -> {}, tx {} -> {}",
                lanes(o.rx_lanes, o.rx_speed_gbps_x10),
                lanes(n.rx_lanes, n.rx_speed_gbps_x10),
                lanes(o.tx_lanes, o.tx_speed_gbps_x10),
                lanes(n.tx_lanes, n.tx_speed_gbps_x10),
            ),
            _ => String::new(),
        }
    ))
}
