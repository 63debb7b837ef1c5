//! Per-port counters of Linux bridges (vmbr0, ...) from rtnetlink (`RTM_GETLINK` dump,
//! `IFLA_STATS64`, `IFLA_MASTER`, `IFLA_LINKINFO`), sampled every `sample_interval_ms`.
//! Only those attributes are decoded (a small NLA walker), which keeps a 100 ms sample cheap.
//!
//! Ports named like Proxmox's (`tap<vmid>i<n>`, `fwpr<vmid>p<n>`, `veth<vmid>i<n>`) are
//! attributed to their VMID and NIC, and their directions are reported from the VM's side:
//! what the host-side port transmits is what the VM receives. Other ports (uplinks) keep the
//! interface's own rx/tx. The highest per-window byte rate in each period is the microburst
//! figure.

use crate::metrics::{vmid_label, Metrics};
use gpufeed_shared::event::{BridgePortChange, DeviceAction, HostEvent};
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// `tap100i0` → (100, 0); `fwpr100p1` → (100, 1); `veth105i0` → (105, 0).
pub fn parse_port_name(name: &str) -> Option<(u32, u32)> {
    for (pfx, sep) in [("tap", 'i'), ("fwpr", 'p'), ("veth", 'i')] {
        if let Some(rest) = name.strip_prefix(pfx) {
            let (v, n) = rest.split_once(sep)?;
            if v.is_empty() || n.is_empty() || v.len() > 9 || n.len() > 3 {
                return None;
            }
            if !v.bytes().all(|b| b.is_ascii_digit()) || !n.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            return Some((v.parse().ok()?, n.parse().ok()?));
        }
    }
    None
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub rx_dropped: u64,
    pub tx_dropped: u64,
    pub rx_errors: u64,
    pub tx_errors: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkRow {
    pub index: u32,
    pub name: String,
    pub master: Option<u32>,
    pub is_bridge: bool,
    pub stats: Counters,
}

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_STATS64: u16 = 23;
const IFLA_INFO_KIND: u16 = 1;

/// Iterate netlink attributes (`struct nlattr`, 4-byte aligned) of `buf`.
fn nlas(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut off = 0usize;
    std::iter::from_fn(move || {
        let hdr = buf.get(off..off + 4)?;
        let len = u16::from_ne_bytes([hdr[0], hdr[1]]) as usize;
        let ty = u16::from_ne_bytes([hdr[2], hdr[3]]) & 0x3fff;
        if len < 4 {
            return None;
        }
        let payload = buf.get(off + 4..off + len)?;
        off = off.checked_add((len + 3) & !3)?;
        Some((ty, payload))
    })
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    b.get(i * 8..i * 8 + 8)
        .map(|x| u64::from_ne_bytes(x.try_into().unwrap_or([0; 8])))
        .unwrap_or(0)
}

/// Decode one `RTM_NEWLINK` payload (`struct ifinfomsg` + attributes). `None` if malformed.
pub fn parse_newlink(payload: &[u8]) -> Option<LinkRow> {
    let ifi = payload.get(..16)?;
    let index = u32::from_ne_bytes(ifi[4..8].try_into().ok()?);
    let mut row = LinkRow {
        index,
        name: String::new(),
        master: None,
        is_bridge: false,
        stats: Counters::default(),
    };
    for (ty, v) in nlas(&payload[16..]) {
        match ty {
            IFLA_IFNAME => {
                row.name =
                    String::from_utf8_lossy(v.split(|b| *b == 0).next().unwrap_or(&[])).into_owned()
            }
            IFLA_MASTER => {
                row.master = v
                    .get(..4)
                    .and_then(|x| x.try_into().ok())
                    .map(u32::from_ne_bytes)
            }
            IFLA_LINKINFO => {
                row.is_bridge = nlas(v).any(|(t, k)| {
                    t == IFLA_INFO_KIND && k.split(|b| *b == 0).next() == Some(b"bridge")
                })
            }
            IFLA_STATS64 => {
                // struct rtnl_link_stats64: rx_packets, tx_packets, rx_bytes, tx_bytes,
                // rx_errors, tx_errors, rx_dropped, tx_dropped, ...
                row.stats = Counters {
                    rx_packets: u64_at(v, 0),
                    tx_packets: u64_at(v, 1),
                    rx_bytes: u64_at(v, 2),
                    tx_bytes: u64_at(v, 3),
                    rx_errors: u64_at(v, 4),
                    tx_errors: u64_at(v, 5),
                    rx_dropped: u64_at(v, 6),
                    tx_dropped: u64_at(v, 7),
                }
            }
            _ => {}
        }
    }
    Some(row)
}

/// Parse a buffer of netlink messages of a dump with sequence `seq`.
/// Returns the rows and whether `NLMSG_DONE` was seen; `Err` on `NLMSG_ERROR`.
pub fn parse_dump_chunk(buf: &[u8], seq: u32, rows: &mut Vec<LinkRow>) -> std::io::Result<bool> {
    let mut off = 0usize;
    while let Some(h) = buf.get(off..off + NLMSG_HDRLEN) {
        let len = u32::from_ne_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let ty = u16::from_ne_bytes([h[4], h[5]]);
        let mseq = u32::from_ne_bytes([h[8], h[9], h[10], h[11]]);
        if len < NLMSG_HDRLEN {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "short netlink message",
            ));
        }
        let Some(payload) = buf.get(off + NLMSG_HDRLEN..off + len) else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "truncated netlink message",
            ));
        };
        if mseq == seq {
            match ty {
                NLMSG_DONE => return Ok(true),
                NLMSG_ERROR => {
                    let code = payload
                        .get(..4)
                        .map(|x| i32::from_ne_bytes([x[0], x[1], x[2], x[3]]))
                        .unwrap_or(0);
                    return Err(std::io::Error::from_raw_os_error(-code));
                }
                RTM_NEWLINK => {
                    if let Some(r) = parse_newlink(payload) {
                        rows.push(r);
                    }
                }
                _ => {}
            }
        }
        off = match off.checked_add((len + 3) & !3) {
            Some(o) => o,
            None => break,
        };
    }
    Ok(false)
}

/// Dump all links of the socket's network namespace (`RTM_GETLINK`, `NLM_F_DUMP`).
/// With `master`, the kernel returns only the ports of that bridge (`IFLA_MASTER` dump filter),
/// which keeps the 100 ms samples cheap on hosts with many interfaces.
pub fn dump_links(
    sock: &netlink_sys::Socket,
    seq: u32,
    buf: &mut Vec<u8>,
    master: Option<u32>,
) -> std::io::Result<Vec<LinkRow>> {
    let len: u32 = if master.is_some() { 40 } else { 32 };
    let mut req = Vec::with_capacity(40);
    req.extend_from_slice(&len.to_ne_bytes());
    req.extend_from_slice(&RTM_GETLINK.to_ne_bytes());
    req.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
    req.extend_from_slice(&seq.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&[0u8; 16]); // struct ifinfomsg, AF_UNSPEC
    if let Some(m) = master {
        req.extend_from_slice(&8u16.to_ne_bytes());
        req.extend_from_slice(&IFLA_MASTER.to_ne_bytes());
        req.extend_from_slice(&m.to_ne_bytes());
    }
    sock.send(&req, 0)?;
    let mut rows = Vec::new();
    loop {
        buf.clear();
        let n = sock.recv(buf, 0)?;
        if parse_dump_chunk(&buf[..n.min(buf.len())], seq, &mut rows)? {
            return Ok(rows);
        }
        if n == 0 {
            return Ok(rows);
        }
    }
}

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
    pub fn step(&mut self, rows: &[LinkRow], now: Instant, metrics: &Metrics) -> Vec<HostEvent> {
        let bridges: HashMap<u32, &str> = rows
            .iter()
            .filter(|r| r.is_bridge && (self.bridges.is_empty() || self.bridges.contains(&r.name)))
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
                metrics.bridge_bytes.with_label_values(&l).inc_by(b);
                metrics.bridge_packets.with_label_values(&l).inc_by(p);
                metrics.bridge_drops.with_label_values(&l).inc_by(dr);
                metrics.bridge_errors.with_label_values(&l).inc_by(e);
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
                    .bridge_microburst
                    .with_label_values(&[*bridge, r.name.as_str(), vm.as_str(), "rx"])
                    .set(mrx);
                metrics
                    .bridge_microburst
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
            if !new.contains_key(name) {
                events.push(HostEvent::BridgePort(BridgePortChange {
                    bridge: p.bridge.clone(),
                    port: name.clone(),
                    vmid: p.vmid,
                    nic: p.nic,
                    action: DeviceAction::Removed,
                }));
                let vm = vmid_label(p.vmid);
                for dir in ["rx", "tx"] {
                    let _ = metrics.bridge_microburst.remove_label_values(&[
                        p.bridge.as_str(),
                        name.as_str(),
                        vm.as_str(),
                        dir,
                    ]);
                }
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
    cfg: crate::config::BridgeConfig,
    metrics: std::sync::Arc<Metrics>,
    bus: std::sync::Arc<crate::events::EventBus>,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
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
            // A full dump once per period finds the bridges; in between, one filtered dump
            // per bridge returns only its ports.
            let mut bridge_rows: Vec<LinkRow> = Vec::new();
            let mut last_full: Option<Instant> = None;
            let full_every = std::time::Duration::from_millis(cfg.period_ms);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                seq = seq.wrapping_add(1);
                let full =
                    last_full.is_none_or(|t| t.elapsed() >= full_every) || bridge_rows.is_empty();
                let res = if full {
                    last_full = Some(Instant::now());
                    dump_links(&sock, seq, &mut buf, None).inspect(|rows| {
                        bridge_rows = rows
                            .iter()
                            .filter(|r| {
                                r.is_bridge
                                    && (cfg.bridges.is_empty() || cfg.bridges.contains(&r.name))
                            })
                            .cloned()
                            .collect();
                    })
                } else {
                    let mut all = bridge_rows.clone();
                    let mut err = None;
                    for b in bridge_rows.iter().map(|b| b.index).collect::<Vec<_>>() {
                        seq = seq.wrapping_add(1);
                        match dump_links(&sock, seq, &mut buf, Some(b)) {
                            Ok(rows) => {
                                all.extend(rows.into_iter().filter(|r| r.master == Some(b)))
                            }
                            Err(e) => err = Some(e),
                        }
                    }
                    match err {
                        Some(e) => {
                            last_full = None;
                            Err(e)
                        }
                        None => Ok(all),
                    }
                };
                match res {
                    Ok(rows) => {
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
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    next = now;
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_names() {
        assert_eq!(parse_port_name("tap100i0"), Some((100, 0)));
        assert_eq!(parse_port_name("fwpr101p2"), Some((101, 2)));
        assert_eq!(parse_port_name("veth102i1"), Some((102, 1)));
        assert_eq!(parse_port_name("tap100"), None);
        assert_eq!(parse_port_name("tapxi0"), None);
        assert_eq!(parse_port_name("enp1s0"), None);
        assert_eq!(parse_port_name("vethab12"), None);
    }

    #[test]
    fn directions_deltas_and_microburst() {
        let m = Metrics::new("t");
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
            m.bridge_bytes
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
        let ev = s.step(
            &[
                row(1, "vmbr0", None, 0, 0),
                row(3, "tap101i0", Some(1), 7, 9),
            ],
            t0 + ms(300),
            &m,
        );
        assert_eq!(v("rx"), 115_000);
        assert_eq!(ev.len(), 2, "{ev:?}");
        // highest window: 100 kB in 100 ms = 1 MB/s (period ended at the step that removed it)
        let added = ev.iter().any(|e| matches!(e, HostEvent::BridgePort(p) if p.port == "tap101i0" && p.action == DeviceAction::Added && p.vmid == Some(101)));
        let removed = ev.iter().any(|e| matches!(e, HostEvent::BridgePort(p) if p.port == "tap100i0" && p.action == DeviceAction::Removed));
        assert!(added && removed);
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
            .bridge_microburst
            .with_label_values(&["vmbr0", "tap100i0", "100", "rx"])
            .get();
        assert!((mb - 1_000_000.0).abs() < 1.0, "{mb}");
    }
}
