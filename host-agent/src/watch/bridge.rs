//! Bridge watcher: per-port counters of Linux bridges (vmbr0, ...) sampled every
//! `sample_interval_ms` from rtnetlink dumps ([`crate::rtnetlink`]).
//!
//! Ports named like Proxmox's (`tap<vmid>i<n>`, `fwpr<vmid>p<n>`, `veth<vmid>i<n>`) are
//! attributed to their VMID and NIC, and their directions are reported from the VM's side:
//! what the host-side port transmits is what the VM receives. Other ports (uplinks) keep the
//! interface's own rx/tx. The highest per-window byte rate in each period is the microburst
//! figure.
//!
//! Each VM NIC is counted once: Proxmox's firewall bridges (`fwbr<vmid>i<n>`) are left out of
//! the default (every bridge), so a NIC with the firewall on is counted at `fwpr<vmid>p<n>` on
//! the bridge its VM's config names and not again at its tap
//! ([`crate::portname::bridge_watched`] says why).

use super::unit::vm_suffix;
use super::unit::{Cx, Outcome, Starting, Unit, Watcher};
use crate::config::check::{range, Invalid};
use crate::metrics::{self, vmid_label};
use crate::portname::{bridge_watched, parse_port_name};
use crate::rtnetlink::{bridges_and_ports, dump_links, dump_stats, refresh, Counters, LinkRow};
use gpufeed_shared::event::{BridgePortChange, DeviceAction, HostEvent};
use prometheus::{GaugeVec, IntCounterVec, Registry};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct PortState {
    index: u32,
    bridge: String,
    vmid: Option<u32>,
    nic: Option<u32>,
    last: Counters,
    /// Highest byte rates (VM-side rx, tx) in the current period.
    max_rx_rate: f64,
    max_tx_rate: f64,
}

/// The bridge sampler's state machine (I/O free apart from the rows passed in).
#[derive(Debug)]
pub struct BridgeSampler {
    bridges: Vec<String>,
    ports: Option<BTreeMap<String, PortState>>,
    last_t: Option<Instant>,
    period_start: Option<Instant>,
    period: std::time::Duration,
}

/// (VM-side rx, VM-side tx) view of interface counters for a port.
fn vm_side(c: &Counters, vm_port: bool) -> Counters {
    if vm_port {
        Counters {
            rx_bytes: c.tx_bytes,
            tx_bytes: c.rx_bytes,
            rx_packets: c.tx_packets,
            tx_packets: c.rx_packets,
            rx_dropped: c.tx_dropped,
            tx_dropped: c.rx_dropped,
            rx_errors: c.tx_errors,
            tx_errors: c.rx_errors,
        }
    } else {
        *c
    }
}

impl BridgeSampler {
    pub fn new(bridges: Vec<String>, period: std::time::Duration) -> Self {
        BridgeSampler {
            bridges,
            ports: None,
            last_t: None,
            period_start: None,
            period,
        }
    }

    /// Feed one dump taken at `now`; updates metrics, returns port appear/disappear events.
    pub fn step(
        &mut self,
        rows: &[LinkRow],
        now: Instant,
        metrics: &BridgeMetrics,
    ) -> Vec<HostEvent> {
        let bridges: HashMap<u32, &str> = rows
            .iter()
            .filter(|r| r.is_bridge && bridge_watched(&r.name, &self.bridges))
            .map(|r| (r.index, r.name.as_str()))
            .collect();
        let dt = self
            .last_t
            .map(|t| now.duration_since(t).as_secs_f64())
            .unwrap_or(0.0);
        self.last_t = Some(now);
        let period_start = *self.period_start.get_or_insert(now);
        let end_period = now.duration_since(period_start) >= self.period;
        let first = self.ports.is_none();
        let old = self.ports.take().unwrap_or_default();
        let mut new: BTreeMap<String, PortState> = BTreeMap::new();
        let mut events = Vec::new();
        for r in rows {
            let Some(bridge) = r.master.and_then(|m| bridges.get(&m)) else {
                continue;
            };
            let parsed = parse_port_name(&r.name);
            let vmid = parsed.map(|p| p.0);
            let cur = vm_side(&r.stats, parsed.is_some());
            let prev = old
                .get(&r.name)
                .filter(|p| p.index == r.index && p.bridge == *bridge);
            // Delta since the last sample; a new interface (or a reset) counts from zero.
            let base = prev.map(|p| p.last).unwrap_or_default();
            let d = |a: u64, b: u64| if a >= b { a - b } else { a };
            let delta = Counters {
                rx_bytes: d(cur.rx_bytes, base.rx_bytes),
                tx_bytes: d(cur.tx_bytes, base.tx_bytes),
                rx_packets: d(cur.rx_packets, base.rx_packets),
                tx_packets: d(cur.tx_packets, base.tx_packets),
                rx_dropped: d(cur.rx_dropped, base.rx_dropped),
                tx_dropped: d(cur.tx_dropped, base.tx_dropped),
                rx_errors: d(cur.rx_errors, base.rx_errors),
                tx_errors: d(cur.tx_errors, base.tx_errors),
            };
            let vm = vmid_label(vmid);
            for (dir, b, p, dr, e) in [
                (
                    "rx",
                    delta.rx_bytes,
                    delta.rx_packets,
                    delta.rx_dropped,
                    delta.rx_errors,
                ),
                (
                    "tx",
                    delta.tx_bytes,
                    delta.tx_packets,
                    delta.tx_dropped,
                    delta.tx_errors,
                ),
            ] {
                let l = [*bridge, r.name.as_str(), vm.as_str(), dir];
                metrics.bytes.with_label_values(&l).inc_by(b);
                metrics.packets.with_label_values(&l).inc_by(p);
                metrics.drops.with_label_values(&l).inc_by(dr);
                metrics.errors.with_label_values(&l).inc_by(e);
            }
            let (mut mrx, mut mtx) = prev
                .map(|p| (p.max_rx_rate, p.max_tx_rate))
                .unwrap_or((0.0, 0.0));
            if prev.is_some() && dt > 0.0 {
                mrx = mrx.max(delta.rx_bytes as f64 / dt);
                mtx = mtx.max(delta.tx_bytes as f64 / dt);
            }
            if end_period {
                metrics
                    .microburst
                    .with_label_values(&[*bridge, r.name.as_str(), vm.as_str(), "rx"])
                    .set(mrx);
                metrics
                    .microburst
                    .with_label_values(&[*bridge, r.name.as_str(), vm.as_str(), "tx"])
                    .set(mtx);
                mrx = 0.0;
                mtx = 0.0;
            }
            if !first && !old.contains_key(&r.name) {
                events.push(HostEvent::BridgePort(BridgePortChange {
                    bridge: bridge.to_string(),
                    port: r.name.clone(),
                    vmid,
                    nic: parsed.map(|p| p.1),
                    action: DeviceAction::Added,
                }));
            }
            new.insert(
                r.name.clone(),
                PortState {
                    index: r.index,
                    bridge: bridge.to_string(),
                    vmid,
                    nic: parsed.map(|p| p.1),
                    last: cur,
                    max_rx_rate: mrx,
                    max_tx_rate: mtx,
                },
            );
        }
        for (name, p) in &old {
            let now_on = new.get(name).map(|n| n.bridge.as_str());
            if now_on.is_none() {
                events.push(HostEvent::BridgePort(BridgePortChange {
                    bridge: p.bridge.clone(),
                    port: name.clone(),
                    vmid: p.vmid,
                    nic: p.nic,
                    action: DeviceAction::Removed,
                }));
            }
            if now_on != Some(p.bridge.as_str()) {
                metrics.remove_port(&p.bridge, name, p.vmid);
            }
        }
        if end_period {
            self.period_start = Some(now);
        }
        self.ports = Some(new);
        events
    }
}

/// Run the sampler on its own thread (optionally inside another network namespace).
/// `ready` receives `Ok(())` after the first sample or the error that stopped it.
pub fn spawn(
    cfg: BridgeConfig,
    metrics: BridgeMetrics,
    bus: std::sync::Arc<crate::events::EventBus>,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    beat: std::sync::Arc<crate::heartbeat::Beat>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("bridge".into())
        .spawn(move || {
            if let Some(ns) = &cfg.netns {
                let res = std::fs::File::open(ns)
                    .map_err(|e| e.to_string())
                    .and_then(|f| {
                        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
                            .map_err(|e| e.to_string())
                    });
                if let Err(e) = res {
                    let _ = ready.send(Err(format!(
                        "cannot enter network namespace {}: {e}",
                        ns.display()
                    )));
                    return;
                }
            }
            let sock = match netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_ROUTE)
                .and_then(|mut s| {
                    s.bind_auto()?;
                    s.connect(&netlink_sys::SocketAddr::new(0, 0))?;
                    Ok(s)
                }) {
                Ok(s) => s,
                Err(e) => {
                    let _ = ready.send(Err(format!("rtnetlink socket: {e}")));
                    return;
                }
            };
            let mut sampler = BridgeSampler::new(
                cfg.bridges.clone(),
                std::time::Duration::from_millis(cfg.period_ms),
            );
            let interval = std::time::Duration::from_millis(cfg.sample_interval_ms);
            let mut buf = Vec::with_capacity(65536);
            let mut seq: u32 = 0;
            let mut ready = Some(ready);
            let mut next = Instant::now();
            // A link dump once per period finds the bridges and their ports; the samples in
            // between refresh those rows' counters from a stats dump. A host without bridges
            // is dumped once per period only.
            let mut rows: Vec<LinkRow> = Vec::new();
            let mut last_full: Option<Instant> = None;
            let full_every = std::time::Duration::from_millis(cfg.period_ms);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                beat.now();
                seq = seq.wrapping_add(1);
                let have_bridge = rows.iter().any(|r| r.is_bridge);
                let full = !have_bridge || last_full.is_none_or(|t| t.elapsed() >= full_every);
                let res = if full {
                    last_full = Some(Instant::now());
                    dump_links(&sock, seq, &mut buf)
                        .map(|all| rows = bridges_and_ports(all, &cfg.bridges))
                } else {
                    dump_stats(&sock, seq, &mut buf)
                        .map(|st| refresh(&mut rows, &st))
                        .inspect_err(|_| last_full = None)
                };
                match res {
                    Ok(()) => {
                        for ev in sampler.step(&rows, Instant::now(), &metrics) {
                            bus.emit(ev);
                        }
                        if let Some(r) = ready.take() {
                            let _ = r.send(Ok(()));
                        }
                    }
                    Err(e) => {
                        if let Some(r) = ready.take() {
                            let _ = r.send(Err(format!("rtnetlink dump: {e}")));
                            return;
                        }
                        tracing::warn!("bridge: rtnetlink dump failed: {e}");
                    }
                }
                next += interval;
                // Without a bridge there is nothing to sample: sleep until the next full dump
                // looks for one again (once per period, at most 1 s).
                if let (false, Some(t)) = (rows.iter().any(|r| r.is_bridge), last_full) {
                    next = next.max(t + full_every.min(std::time::Duration::from_secs(1)));
                }
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    next = now;
                }
            }
        })
}

// ---- The unit: configuration, series, start. ----

/// `[bridge]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeConfig {
    pub enabled: bool,
    /// Bridges to watch; empty = every bridge but Proxmox's firewall bridges (`fwbr…`).
    pub bridges: Vec<String>,
    /// Counter sampling interval, 100..=1000 ms; the microburst window.
    pub sample_interval_ms: u64,
    /// Period over which the highest sample-window rate is kept as the microburst figure.
    pub period_ms: u64,
    /// Read the bridge of another network namespace (path such as `/run/netns/NAME`).
    pub netns: Option<PathBuf>,
}

impl Default for BridgeConfig {
    fn default() -> Self {
        BridgeConfig {
            enabled: true,
            bridges: Vec::new(),
            sample_interval_ms: 200,
            period_ms: 1000,
            netns: None,
        }
    }
}

impl BridgeConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        range(
            "bridge.sample_interval_ms",
            self.sample_interval_ms,
            100,
            1000,
        )?;
        range("bridge.period_ms", self.period_ms, 100, 3_600_000)?;
        if self.period_ms < self.sample_interval_ms {
            return Err(Invalid {
                key: "bridge.period_ms".into(),
                problem: format!(
                    "must be at least bridge.sample_interval_ms ({}), got {}",
                    self.sample_interval_ms, self.period_ms
                ),
            });
        }
        for (i, b) in self.bridges.iter().enumerate() {
            if b.is_empty() || b.len() > 15 || b.contains('/') {
                return Err(Invalid {
                    key: format!("bridge.bridges[{i}]"),
                    problem: format!("`{b}` is not an interface name"),
                });
            }
        }
        Ok(())
    }
}

pub struct BridgeMetrics {
    pub bytes: IntCounterVec,
    pub packets: IntCounterVec,
    pub drops: IntCounterVec,
    pub errors: IntCounterVec,
    pub microburst: GaugeVec,
}

impl BridgeMetrics {
    /// Drops the series of a port that left `bridge` (gone, or moved to another bridge):
    /// tap ports come and go with every VM start, and /metrics would otherwise keep every
    /// port that ever existed. A port that comes back starts its counters from zero, which
    /// Prometheus reads as a counter reset.
    pub fn remove_port(&self, bridge: &str, port: &str, vmid: Option<u32>) {
        let vm = vmid_label(vmid);
        for dir in ["rx", "tx"] {
            let l = [bridge, port, vm.as_str(), dir];
            for c in [&self.bytes, &self.packets, &self.drops, &self.errors] {
                let _ = c.remove_label_values(&l);
            }
            let _ = self.microburst.remove_label_values(&l);
        }
    }

    pub fn new(r: &Registry) -> BridgeMetrics {
        const L: &[&str] = &["bridge", "port", "vmid", "direction"];
        BridgeMetrics {
            bytes: metrics::int_counter_vec(
                r,
                "gpufeed_host_bridge_bytes_total",
                "Bytes through a bridge port; direction from the VM's side for VM ports",
                L,
            ),
            packets: metrics::int_counter_vec(
                r,
                "gpufeed_host_bridge_packets_total",
                "Packets through a bridge port",
                L,
            ),
            drops: metrics::int_counter_vec(
                r,
                "gpufeed_host_bridge_drops_total",
                "Dropped packets on a bridge port",
                L,
            ),
            errors: metrics::int_counter_vec(
                r,
                "gpufeed_host_bridge_errors_total",
                "Errors on a bridge port",
                L,
            ),
            microburst: metrics::gauge_vec(
                r,
                "gpufeed_host_bridge_microburst_bytes_per_second",
                "Highest sample-window byte rate in the last period",
                L,
            ),
        }
    }
}

pub const UNIT: Unit = Unit {
    name: "bridge",
    describe,
};

/// Builds the unit from its section `[bridge]`, registering its series in `r`.
pub fn watcher(r: &Registry, cfg: BridgeConfig) -> Box<dyn Watcher> {
    Box::new(BridgeWatcher {
        metrics: BridgeMetrics::new(r),
        cfg,
    })
}

struct BridgeWatcher {
    metrics: BridgeMetrics,
    cfg: BridgeConfig,
}

impl Watcher for BridgeWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            let cfg = self.cfg;
            let (tx, rx) = std::sync::mpsc::channel();
            // The sampler wakes every sample interval, and at least once a second without a
            // bridge (see `spawn`). Its beat is watched once it runs: a sampler that could
            // not start is off, not wedged.
            let c = &cfg;
            let period = Duration::from_millis(c.sample_interval_ms.max(c.period_ms.min(1000)));
            let beat = std::sync::Arc::new(crate::heartbeat::Beat::default());
            beat.now();
            if let Err(e) = spawn(
                c.clone(),
                self.metrics,
                a.bus.clone(),
                tx,
                cx.stop,
                beat.clone(),
            ) {
                return Outcome::Off(format!("cannot start thread: {e}"));
            }
            // The sampler runs on its own thread (it may enter another network namespace);
            // wait for its first sample off the runtime thread.
            let first =
                tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(5)))
                    .await
                    .ok()
                    .and_then(|r| r.ok());
            match first {
                Some(Ok(())) => {
                    a.heartbeats.add("bridge", period, beat);
                    Outcome::On(Vec::new())
                }
                Some(Err(e)) => Outcome::Off(e),
                None => Outcome::Off("no first sample within 5 s".into()),
            }
        })
    }
}

fn describe(e: &HostEvent) -> Option<String> {
    let HostEvent::BridgePort(b) = e else {
        return None;
    };
    Some(format!(
        "{} port {}{} {}",
        b.bridge,
        b.port,
        vm_suffix(b.vmid),
        b.action.as_str()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directions_deltas_and_microburst() {
        let reg = Registry::new();
        let m = BridgeMetrics::new(&reg);
        let mut s = BridgeSampler::new(vec!["vmbr0".into()], std::time::Duration::from_millis(300));
        let row = |idx, name: &str, master, rx, tx| LinkRow {
            index: idx,
            name: name.into(),
            master,
            is_bridge: name == "vmbr0",
            stats: Counters {
                rx_bytes: rx,
                tx_bytes: tx,
                ..Default::default()
            },
        };
        let t0 = Instant::now();
        let ms = std::time::Duration::from_millis;
        assert!(s
            .step(
                &[
                    row(1, "vmbr0", None, 0, 0),
                    row(2, "tap100i0", Some(1), 1000, 5000)
                ],
                t0,
                &m
            )
            .is_empty());
        let v = |dir| {
            m.bytes
                .with_label_values(&["vmbr0", "tap100i0", "100", dir])
                .get()
        };
        // VM side: port tx 5000 = VM rx.
        assert_eq!((v("rx"), v("tx")), (5000, 1000));
        s.step(
            &[
                row(1, "vmbr0", None, 0, 0),
                row(2, "tap100i0", Some(1), 1000, 105_000),
            ],
            t0 + ms(100),
            &m,
        );
        s.step(
            &[
                row(1, "vmbr0", None, 0, 0),
                row(2, "tap100i0", Some(1), 1000, 115_000),
            ],
            t0 + ms(200),
            &m,
        );
        assert_eq!(v("rx"), 115_000);
        let ev = s.step(
            &[
                row(1, "vmbr0", None, 0, 0),
                row(3, "tap101i0", Some(1), 7, 9),
            ],
            t0 + ms(300),
            &m,
        );
        assert_eq!(ev.len(), 2, "{ev:?}");
        // highest window: 100 kB in 100 ms = 1 MB/s (period ended at the step that removed it)
        let added = ev.iter().any(|e| matches!(e, HostEvent::BridgePort(p) if p.port == "tap101i0" && p.action == DeviceAction::Added && p.vmid == Some(101)));
        let removed = ev.iter().any(|e| matches!(e, HostEvent::BridgePort(p) if p.port == "tap100i0" && p.action == DeviceAction::Removed));
        assert!(added && removed);
        // The gone port's series are gone from /metrics; the new port's are there.
        let ports = |r: &Registry| metrics::series_by_label(r, "port");
        let after = ports(&reg);
        assert!(after.iter().all(|(_, p)| p == "tap101i0"), "{after:?}");
        assert_eq!(after.len(), 5, "{after:?}");
        // A port moved to another bridge leaves no series under the old one.
        let mut s3 = BridgeSampler::new(vec![], std::time::Duration::from_millis(300));
        let on = |master| {
            [
                row(1, "vmbr0", None, 0, 0),
                LinkRow {
                    is_bridge: true,
                    ..row(4, "vmbr1", None, 0, 0)
                },
                row(5, "tap102i0", Some(master), 1, 1),
            ]
        };
        let reg3 = Registry::new();
        let m3 = BridgeMetrics::new(&reg3);
        s3.step(&on(1), t0, &m3);
        s3.step(&on(4), t0 + ms(100), &m3);
        let bridges: Vec<String> = metrics::series_by_label(&reg3, "bridge")
            .into_iter()
            .map(|(_, b)| b)
            .collect();
        assert!(
            !bridges.is_empty() && bridges.iter().all(|b| b == "vmbr1"),
            "{bridges:?}"
        );
        let mut s2 = BridgeSampler::new(vec![], std::time::Duration::from_millis(300));
        let rows = |tx| {
            [
                row(1, "vmbr0", None, 0, 0),
                row(2, "tap100i0", Some(1), 0, tx),
            ]
        };
        s2.step(&rows(0), t0, &m);
        s2.step(&rows(100_000), t0 + ms(100), &m);
        s2.step(&rows(110_000), t0 + ms(200), &m);
        s2.step(&rows(120_000), t0 + ms(300), &m);
        let mb = m
            .microburst
            .with_label_values(&["vmbr0", "tap100i0", "100", "rx"])
            .get();
        assert!((mb - 1_000_000.0).abs() < 1.0, "{mb}");
    }
}
