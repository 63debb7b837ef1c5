//! PCIe link speed/width poller. Reads `current_link_*` only when the device is not
//! runtime-suspended (reading LNKSTA would resume a D3 device).

use super::unit::vm_suffix;
use super::unit::{Cx, Outcome, Poke, Starting, Unit, Watcher};
use crate::attrs::{read_short, AttrFiles};
use crate::config::check::{range, Invalid};
use crate::discovery::Link;
use crate::metrics::{self, vmid_label};
use crate::roots::Roots;
use crate::sysfs::{fmt_speed, parse_link_speed, parse_link_width, read_attr};
use gpufeed_shared::event::{HostEvent, LinkChangeClass, PcieLinkChange, Source};
use gpufeed_shared::hoststate::names;
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Registry};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkState {
    pub speed: Option<u32>,
    pub width: u8,
    pub max_speed: Option<u32>,
    pub max_width: u8,
}

/// Owns the tree it reads and the series it sets: its state is what it last wrote there, so a
/// poll against another tree or registry would report changes that never happened.
pub struct PciePoller {
    roots: Roots,
    metrics: PcieMetrics,
    state: HashMap<String, LinkState>,
    /// Links whose maxima in `state` were read while the device stayed present.
    max_valid: HashSet<String>,
    /// Every link polled, by downstream-end device: what [`PciePoller::retain`] needs to read
    /// a link that discovery dropped.
    watched: HashMap<String, Link>,
    /// Devices skipped on the last poll because they were runtime-suspended.
    pub suspended_skips: u64,
    /// Reads that failed for this agent's own reasons (out of descriptors, say), since the
    /// start: no link state is changed from them.
    pub read_failures: u64,
    /// Whether the last poll had such failures (logged when they start and when they end).
    failing: bool,
    /// Kept handles of the polled devices' directories and (on sysfs) attribute files.
    dirs: AttrFiles,
    /// Links forgotten while down with their device gone (the port came back before the
    /// device was enumerated again): the device's next first sight is their link coming up,
    /// not a baseline.
    left_down: HashMap<String, LinkState>,
}

/// Reads attribute `attr` (a path relative to the device's directory) of device `bdf`.
type ReadAttr<'a> = dyn FnMut(&str, &str) -> std::io::Result<String> + 'a;

/// Attributes read by path under `roots`.
fn by_path(roots: &Roots) -> impl FnMut(&str, &str) -> std::io::Result<String> + '_ {
    move |bdf, attr| read_short(&roots.pci_devices().join(bdf).join(attr))
}

/// True when `power/runtime_status` says the device sleeps (reading would wake it).
pub fn runtime_suspended(roots: &Roots, bdf: &str) -> bool {
    suspended_with(&mut by_path(roots), bdf)
}

fn suspended_with(read: &mut ReadAttr<'_>, bdf: &str) -> bool {
    matches!(
        read(bdf, "power/runtime_status").as_deref(),
        Ok("suspended") | Ok("suspending")
    )
}

/// What one end of a link says about it in `current_link_speed`/`current_link_width`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkStatus {
    /// Values a link can have: (speed in MT/s, width); width 0 is a link that is down.
    Read(Option<u32>, u8),
    /// The attributes exist but tell nothing: the read failed (the kernel answers EINVAL when
    /// the Link Status read fails, as for a disconnected device) or the device answered with
    /// all ones (width 63, speed `Unknown`: it no longer responds to config reads).
    Unreadable,
    /// No such attributes: not a PCIe device, or removed.
    Absent,
    /// The read failed for a reason of this agent's, not the device's (out of file
    /// descriptors or memory, a permission): nothing is known about the link.
    Failed,
}

/// Whether a failed read of a sysfs attribute is the device's answer (the kernel returns
/// EINVAL when the Link Status read fails, EIO/ENODEV/ENXIO for a device that stopped
/// answering or is going away) rather than this process's trouble (EMFILE, ENFILE, ENOMEM,
/// EACCES, EINTR, ...), which says nothing about the link.
fn is_device_answer(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::EIO | libc::ENODEV | libc::ENXIO)
    )
}

/// Read `current_link_*` of `bdf`.
pub fn read_status(roots: &Roots, bdf: &str) -> LinkStatus {
    status_with(&mut by_path(roots), bdf)
}

fn status_with(read_attr: &mut ReadAttr<'_>, bdf: &str) -> LinkStatus {
    let mut read = |f: &str| match read_attr(bdf, f) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(LinkStatus::Absent),
        Err(e) if is_device_answer(&e) => Err(LinkStatus::Unreadable),
        Err(_) => Err(LinkStatus::Failed),
    };
    let (speed, width) = match (read("current_link_speed"), read("current_link_width")) {
        (Ok(s), Ok(w)) => (parse_link_speed(&s), parse_link_width(&w)),
        (Err(LinkStatus::Failed), _) | (_, Err(LinkStatus::Failed)) => return LinkStatus::Failed,
        (Err(e), _) | (_, Err(e)) => return e,
    };
    match width {
        // Down: the speed field then holds the last or the lowest rate, not a link's speed.
        Some(0) => LinkStatus::Read(None, 0),
        Some(w) if valid_width(w) && speed.is_some() => LinkStatus::Read(speed, w),
        _ => LinkStatus::Unreadable,
    }
}

/// Widths a PCIe link can train to (Link Status' 6-bit field reads 63 from a device that
/// answers config reads with all ones).
fn valid_width(w: u8) -> bool {
    matches!(w, 1 | 2 | 4 | 8 | 12 | 16 | 32)
}

/// Current speed (MT/s) and width of the link above `bdf`. When the device's own attributes
/// tell nothing (its config space reads fail or read all ones, as when its link went down),
/// the link's state is read where the kernel still has it: the Link Status of the port at the
/// other end (`parent`), which reads width 0 while the link is down. With neither end
/// readable the link is down (`None`, 0). A device that is gone while that port's link is down
/// left with its link (pciehp removes the device of a link that went down): down too, and so
/// is one gone from a hotplug slot that reads empty or powered off ([`slot_off`]).
/// `None` when the device has no such attributes and its link is not known to be down.
/// A read that failed for this agent's own reasons ([`LinkStatus::Failed`]) gives `None` too.
pub fn read_current(roots: &Roots, bdf: &str, parent: Option<&str>) -> Option<(Option<u32>, u8)> {
    current_with(&mut by_path(roots), bdf, parent, &mut |p| {
        slot_off(roots, p)
    })
    .ok()
    .flatten()
}

/// True when `port` is a hotplug port whose slot (`/sys/bus/pci/slots/<n>`, the one whose
/// `address` is the port's secondary bus) reads empty (`adapter` 0) or powered off (`power`
/// 0): the link below it is down whatever the port's Link Status width says. The width is
/// undefined while a link is down (PCIe spec, Negotiated Link Width); QEMU's root port reads
/// its own maximum there (x32 at 16 GT/s) once its slot is empty. False when there is no such
/// slot or its files cannot be read.
pub fn slot_off(roots: &Roots, port: &str) -> bool {
    let Some(bus) = std::fs::read_dir(roots.pci_devices().join(port).join("pci_bus"))
        .ok()
        .and_then(|mut d| d.next()?.ok()?.file_name().into_string().ok())
    else {
        return false;
    };
    let Ok(slots) = std::fs::read_dir(roots.sys().join("bus/pci/slots")) else {
        return false;
    };
    for slot in slots.flatten() {
        let dir = slot.path();
        // `dddd:bb:ss` (PCIe slots: device 00) or `dddd:bb` (a slot without one)
        let address = read_attr(&dir.join("address")).unwrap_or_default();
        if address != bus && !address.starts_with(&format!("{bus}:")) {
            continue;
        }
        return ["adapter", "power"]
            .iter()
            .any(|f| read_attr(&dir.join(f)).as_deref() == Some("0"));
    }
    false
}

/// A read of a link's attributes failed for this agent's own reasons: no reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadFailed;

fn current_with(
    read: &mut ReadAttr<'_>,
    bdf: &str,
    parent: Option<&str>,
    slot_off: &mut dyn FnMut(&str) -> bool,
) -> Result<Option<(Option<u32>, u8)>, ReadFailed> {
    let own = status_with(read, bdf);
    let mut port = || parent.map(|p| status_with(read, p));
    Ok(match own {
        LinkStatus::Read(s, w) => Some((s, w)),
        LinkStatus::Failed => return Err(ReadFailed),
        LinkStatus::Unreadable => Some(match port() {
            Some(LinkStatus::Read(s, w)) => (s, w),
            Some(LinkStatus::Failed) => return Err(ReadFailed),
            _ => (None, 0),
        }),
        LinkStatus::Absent => match port() {
            Some(LinkStatus::Read(_, 0)) => Some((None, 0)),
            // gone, its slot empty or powered off (pciehp's removal): down with it
            Some(LinkStatus::Read(..)) if parent.is_some_and(&mut *slot_off) => Some((None, 0)),
            Some(LinkStatus::Failed) => return Err(ReadFailed),
            _ => None,
        },
    })
}

/// The link's maximum: the lower of the two ends' `max_link_*` (a x16 GPU behind a x4 port has
/// a x4 link). These come from the Link Capabilities registers and do not change while the
/// device is present.
pub fn read_max(roots: &Roots, bdf: &str, parent: Option<&str>) -> (Option<u32>, u8) {
    let max_of = |dev: &std::path::Path| {
        (
            read_attr(&dev.join("max_link_speed")).and_then(|s| parse_link_speed(&s)),
            read_attr(&dev.join("max_link_width"))
                .and_then(|s| parse_link_width(&s))
                .filter(|w| valid_width(*w)), // 63: all ones from a device that went away
        )
    };
    let (mut ms, mut mw) = max_of(&roots.pci_devices().join(bdf));
    if let Some(p) = parent {
        let (ps, pw) = max_of(&roots.pci_devices().join(p));
        ms = match (ms, ps) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        mw = match (mw, pw) {
            (Some(a), Some(b)) if b > 0 => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    (ms, mw.unwrap_or(0))
}

/// Read a link's state from its downstream-end device ([`read_current`] and [`read_max`]).
pub fn read_link(roots: &Roots, bdf: &str, parent: Option<&str>) -> Option<LinkState> {
    let (speed, width) = read_current(roots, bdf, parent)?;
    let (max_speed, max_width) = read_max(roots, bdf, parent);
    Some(LinkState {
        speed,
        width,
        max_speed,
        max_width,
    })
}

pub fn classify(link: &Link, old: &LinkState, new: &LinkState) -> LinkChangeClass {
    let down = |s: &LinkState| s.width == 0 || s.speed.is_none();
    if link.virtual_tunnel {
        LinkChangeClass::VirtualTunnelLink
    } else if down(new) && !down(old) {
        LinkChangeClass::LinkDown
    } else if down(old) && !down(new) {
        LinkChangeClass::LinkUp
    } else if new.width < old.width {
        LinkChangeClass::WidthReduction
    } else if new.width > old.width {
        LinkChangeClass::WidthIncrease
    } else {
        LinkChangeClass::SpeedOnly
    }
}

/// Take away the gauges of `link` (its change counters stay).
fn remove_series(m: &PcieMetrics, link: &Link) {
    let vm = vmid_label(link.vmid);
    let labels = [link.child.as_str(), vm.as_str()];
    let _ = m.speed.remove_label_values(&labels);
    let _ = m.width.remove_label_values(&labels);
    let _ = m.max_speed.remove_label_values(&labels);
    let _ = m.max_width.remove_label_values(&labels);
}

fn gts(mts: Option<u32>) -> f64 {
    mts.map(|m| m as f64 / 1000.0).unwrap_or(0.0)
}

impl PciePoller {
    pub fn new(roots: Roots, metrics: PcieMetrics) -> Self {
        PciePoller {
            roots,
            metrics,
            state: HashMap::new(),
            max_valid: HashSet::new(),
            watched: HashMap::new(),
            suspended_skips: 0,
            read_failures: 0,
            failing: false,
            dirs: AttrFiles::default(),
            left_down: HashMap::new(),
        }
    }

    pub fn metrics(&self) -> &PcieMetrics {
        &self.metrics
    }

    /// Poll `links`; return change events. The first sight of a link only records its state.
    pub fn poll(&mut self, links: &[Link], source: Source) -> Vec<HostEvent> {
        let mut out = Vec::new();
        let failures = self.read_failures;
        for link in links {
            self.poll_link(link, source, &mut out);
        }
        let failing = self.read_failures > failures;
        if failing != self.failing {
            if failing {
                tracing::warn!(failures = self.read_failures - failures, "pcie: reading link attributes failed for this agent's own reasons (not the device's); the links keep their last state until reads work again");
            } else {
                tracing::info!("pcie: reading link attributes works again");
            }
            self.failing = failing;
        }
        out
    }

    /// Poll one link: its state as read now (`None`: not read), a change event into `out`.
    fn poll_link(
        &mut self,
        link: &Link,
        source: Source,
        out: &mut Vec<HostEvent>,
    ) -> Option<LinkState> {
        let (roots, metrics) = (&self.roots, &self.metrics);
        let current = {
            let dirs = &mut self.dirs;
            let mut read =
                |bdf: &str, attr: &str| dirs.read(bdf, || roots.pci_devices().join(bdf), attr);
            if suspended_with(&mut read, &link.child) {
                self.suspended_skips += 1;
                return None;
            }
            current_with(&mut read, &link.child, link.parent.as_deref(), &mut |p| {
                slot_off(roots, p)
            })
        };
        // This agent could not read (out of descriptors, say): the link keeps its last state,
        // and no change is made up from the failure.
        let Ok(current) = current else {
            self.read_failures += 1;
            return None;
        };
        let Some((speed, width)) = current else {
            self.max_valid.remove(&link.child); // gone: read the maxima again when it is back
            return None;
        };
        if self.watched.get(&link.child) != Some(link) {
            let old = self.watched.insert(link.child.clone(), link.clone());
            if let Some(old) = old.filter(|o| o.vmid != link.vmid) {
                remove_series(metrics, &old); // moved to another VM: no series left behind
            }
        }
        // The maxima are read on first sight and again with every change of the current
        // values (a re-plugged device shows one), not on every poll. A link that went down
        // keeps them: the device's own registers may no longer answer, or it is gone.
        let valid = self.max_valid.contains(&link.child);
        let known = self
            .state
            .get(&link.child)
            .filter(|o| width == 0 || (valid && o.speed == speed && o.width == width));
        let (max_speed, max_width) = match known {
            Some(o) => (o.max_speed, o.max_width),
            None => read_max(roots, &link.child, link.parent.as_deref()),
        };
        if width == 0 && !roots.pci_devices().join(&link.child).exists() {
            self.max_valid.remove(&link.child); // read them again when it is back
        } else {
            self.max_valid.insert(link.child.clone());
        }
        let new = LinkState {
            speed,
            width,
            max_speed,
            max_width,
        };
        let vm = vmid_label(link.vmid);
        let labels = [link.child.as_str(), vm.as_str()];
        metrics.speed.with_label_values(&labels).set(gts(new.speed));
        metrics
            .width
            .with_label_values(&labels)
            .set(new.width as i64);
        metrics
            .max_speed
            .with_label_values(&labels)
            .set(gts(new.max_speed));
        metrics
            .max_width
            .with_label_values(&labels)
            .set(new.max_width as i64);
        let Some(old) = self
            .state
            .insert(link.child.clone(), new)
            .or_else(|| self.left_down.remove(&link.child))
        else {
            return Some(new);
        };
        if old.speed == new.speed && old.width == new.width {
            return Some(new);
        }
        let class = classify(link, &old, &new);
        metrics
            .changes
            .with_label_values(&[link.child.as_str(), vm.as_str(), class.as_str()])
            .inc();
        // Degraded whatever the device does: lanes missing, or down. A speed below the
        // maximum at full width is how GPUs save power while idle (Gen4 to Gen1 and back,
        // many times a minute): a degradation only under load, which the guest knows and the
        // host does not, so it is not flagged here (`class` says speed_only).
        let degraded = !link.virtual_tunnel && (new.width < new.max_width || new.speed.is_none());
        out.push(HostEvent::PcieLinkChange(PcieLinkChange {
            bdf: link.child.clone(),
            upstream_bdf: link.parent.clone(),
            target_bdf: Some(link.target.clone()),
            vmid: link.vmid,
            old_speed_mts: old.speed,
            new_speed_mts: new.speed,
            old_width: old.width,
            new_width: new.width,
            max_speed_mts: new.max_speed,
            max_width: new.max_width,
            class,
            degraded,
            source,
        }));
        Some(new)
    }

    /// Forget the links that are no longer in `links` and take their series away, except
    /// those whose link is down: when a link goes down, pciehp removes the device behind it and
    /// discovery drops the device's links (usually before the next poll, as the removal's
    /// uevent triggers a rescan). Such a link is read once more (the port above shows it down:
    /// the link-down event) and its series stay at 0 while that port's link stays down, so the
    /// link-down rule holds; they go when the port's link is up again or the port is gone.
    /// A device that is back (replugged) while its link is still kept down is read once more
    /// too: its link coming up is an event even when discovery has not seen it yet. `source`
    /// is what prompted the read (a removal's uevent, say).
    pub fn retain(&mut self, links: &[Link], source: Source) -> Vec<HostEvent> {
        let dropped: Vec<Link> = self
            .watched
            .values()
            .filter(|w| !links.iter().any(|l| l.child == w.child))
            .cloned()
            .collect();
        if dropped.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for l in &dropped {
            // A device that is still there was only unassigned: nothing more to read, unless
            // its link was kept down (it left and is back).
            let gone = !self.roots.pci_devices().join(&l.child).exists();
            let was_down = self.state.get(&l.child).is_some_and(|s| s.width == 0);
            let now = (gone || was_down)
                .then(|| self.poll_link(l, source, &mut out))
                .flatten();
            if now.is_none_or(|s| s.width != 0) {
                remove_series(&self.metrics, l);
                if let Some(old) = self.state.remove(&l.child).filter(|s| gone && s.width == 0) {
                    self.left_down.insert(l.child.clone(), old);
                }
                self.max_valid.remove(&l.child);
                self.watched.remove(&l.child);
            }
        }
        // no handles kept for devices no longer polled
        let polled: HashSet<&str> = self
            .watched
            .values()
            .flat_map(|l| std::iter::once(l.child.as_str()).chain(l.parent.as_deref()))
            .collect();
        self.dirs.retain(&polled);
        out
    }
}

// ---- The unit: configuration, series, loop. ----

/// `[pcie]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PcieConfig {
    pub enabled: bool,
    pub poll_interval_ms: u64,
    /// Use `pci:pcie_link_event` / `pci:pci_hp_event` tracepoints when the kernel has them
    /// (read by [`super::tracepoints`], which pokes this watcher).
    pub tracepoints: bool,
}

impl Default for PcieConfig {
    fn default() -> Self {
        PcieConfig {
            enabled: true,
            // A retrain shows in the guest within about 200 ms where the kernel has no
            // pci:pcie_link_event (see docs/benchmarks.md for what this costs).
            poll_interval_ms: 200,
            tracepoints: true,
        }
    }
}

impl PcieConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        range("pcie.poll_interval_ms", self.poll_interval_ms, 10, 600_000)
    }
}

pub struct PcieMetrics {
    pub speed: GaugeVec,
    pub width: IntGaugeVec,
    pub max_speed: GaugeVec,
    pub max_width: IntGaugeVec,
    pub changes: IntCounterVec,
}

impl PcieMetrics {
    pub fn new(r: &Registry) -> PcieMetrics {
        PcieMetrics {
            speed: metrics::gauge_vec(
                r,
                names::PCIE_LINK_SPEED,
                "Current PCIe link speed in GT/s (0 = down)",
                &["bdf", "vmid"],
            ),
            width: metrics::int_gauge_vec(
                r,
                names::PCIE_LINK_WIDTH,
                "Current PCIe link width in lanes (0 = down)",
                &["bdf", "vmid"],
            ),
            max_speed: metrics::gauge_vec(
                r,
                names::PCIE_LINK_MAX_SPEED,
                "Maximum PCIe link speed in GT/s",
                &["bdf", "vmid"],
            ),
            max_width: metrics::int_gauge_vec(
                r,
                names::PCIE_LINK_MAX_WIDTH,
                "Maximum PCIe link width in lanes",
                &["bdf", "vmid"],
            ),
            changes: metrics::int_counter_vec(
                r,
                "gpufeed_host_pcie_link_changes_total",
                "PCIe link changes by class",
                &["bdf", "vmid", "change"],
            ),
        }
    }
}

pub const UNIT: Unit = Unit {
    name: "pcie",
    describe,
};

/// Builds the unit from its section `[pcie]`, registering its series in `r`.
pub fn watcher(r: &Registry, cfg: PcieConfig, rescan_ms: u64) -> Box<dyn Watcher> {
    Box::new(PcieWatcher {
        metrics: PcieMetrics::new(r),
        cfg,
        rescan_ms,
    })
}

struct PcieWatcher {
    metrics: PcieMetrics,
    cfg: PcieConfig,
    /// The discovery's rescan interval, for its log line.
    rescan_ms: u64,
}

impl Watcher for PcieWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            let cfg = self.cfg;
            let mut p = PciePoller::new(a.roots.clone(), self.metrics);
            let t = a.topo.get();
            if t.links.is_empty() {
                tracing::info!(
                    "pcie: no passed-through or configured devices yet; rescanning every {} ms",
                    self.rescan_ms
                );
            }
            p.poll(&t.links, Source::Poll);
            Outcome::On(vec![tokio::spawn(async move {
                let mut pokes = a.pokes(cfg.poll_interval_ms, cx.inbox).await;
                loop {
                    let poke = pokes.next().await;
                    let t = a.topo.get();
                    // A tracepoint names the port whose link changed: read only its links.
                    let (links, source): (Vec<_>, _) = match &poke {
                        Poke::Port(port, src) if !port.is_empty() => (
                            t.links
                                .iter()
                                .filter(|l| l.parent.as_deref() == Some(port) || &l.child == port)
                                .cloned()
                                .collect(),
                            *src,
                        ),
                        // a uevent (hotplug): every link, said to come from it
                        Poke::Port(_, src) => (t.links.clone(), *src),
                        Poke::Tick | Poke::Aer(_) => (t.links.clone(), Source::Poll),
                    };
                    a.emit_all(p.retain(&t.links, source));
                    a.emit_all(p.poll(&links, source));
                }
            })])
        })
    }
}

fn describe(e: &HostEvent) -> Option<String> {
    let HostEvent::PcieLinkChange(l) = e else {
        return None;
    };
    let below_max_speed = matches!((l.new_speed_mts, l.max_speed_mts), (Some(s), Some(m)) if s < m);
    let reading = if l.degraded {
        ", degraded"
    } else if l.class == LinkChangeClass::SpeedOnly && below_max_speed {
        // the host cannot see the GPU's load: the guest reads this against it
        ", full width: power saving if the GPU is idle"
    } else {
        ""
    };
    Some(format!(
        "{}{}: {} x{} -> {} x{} ({}{reading}, max {} x{})",
        l.bdf,
        vm_suffix(l.vmid),
        fmt_speed(l.old_speed_mts),
        l.old_width,
        fmt_speed(l.new_speed_mts),
        l.new_width,
        l.class.as_str(),
        fmt_speed(l.max_speed_mts),
        l.max_width
    ))
}

#[cfg(test)]
mod read_failure_tests {
    use super::*;

    /// Attributes of a device `dev` whose link is up x16 at 16 GT/s, behind port `port`; reads
    /// of `dev` fail with `err` when given.
    fn reader(
        err: Option<i32>,
        port_err: Option<i32>,
    ) -> impl FnMut(&str, &str) -> std::io::Result<String> {
        move |bdf, attr| {
            let e = if bdf == "dev" { err } else { port_err };
            if let Some(e) = e {
                return Err(std::io::Error::from_raw_os_error(e));
            }
            Ok(match attr {
                "current_link_speed" => "16.0 GT/s PCIe".into(),
                "current_link_width" => "16".into(),
                _ => String::new(),
            })
        }
    }

    #[test]
    fn a_failed_read_of_ours_is_not_a_link_going_down() {
        // The device's answer: EINVAL from the Link Status read; the port still reads.
        let mut r = reader(Some(libc::EINVAL), None);
        assert_eq!(
            current_with(&mut r, "dev", Some("port"), &mut |_| false),
            Ok(Some((Some(16000), 16)))
        );
        // Neither end answers: down.
        let mut r = reader(Some(libc::EIO), Some(libc::EINVAL));
        assert_eq!(
            current_with(&mut r, "dev", Some("port"), &mut |_| false),
            Ok(Some((None, 0)))
        );
        // Out of descriptors (or memory): no reading at all, whichever end failed.
        for (own, port) in [
            (Some(libc::EMFILE), None),
            (Some(libc::EINVAL), Some(libc::EMFILE)),
            (Some(libc::ENFILE), Some(libc::ENFILE)),
            (Some(libc::ENOMEM), None),
        ] {
            let mut r = reader(own, port);
            assert_eq!(
                current_with(&mut r, "dev", Some("port"), &mut |_| false),
                Err(ReadFailed),
                "{own:?} {port:?}"
            );
        }
    }
}
