//! Wiring: discovery, watchers, event bus, metrics. [`Agent::start`] performs discovery and the
//! first poll of every watcher (the baseline; no events for it), then runs the loops until the
//! returned [`Running`] is dropped.

use crate::config::Config;
use crate::discovery::{self, DeviceTopology};
use crate::events::EventBus;
use crate::metrics::Metrics;
use crate::roots::Roots;
use crate::watch::aer::{any_aer_files, AerPoller};
use crate::watch::hoststats::HostStats;
use crate::watch::kmsg::{KmsgHandler, KmsgMsg};
use crate::watch::pcie::PciePoller;
use crate::watch::thunderbolt::TbPoller;
use crate::watch::vm::VmPoller;
use crate::watch::{RecentKmsg, Topology};
use gpufeed_shared::event::{AerDetail, DeviceMapped, HostEvent, PciHotplug, Source};
use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

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
    fn set(&self, t: Topology, vmids: BTreeSet<u32>) {
        *self.inner.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(t);
        *self.vmids.write().unwrap_or_else(|e| e.into_inner()) = vmids;
    }
    pub fn vmids(&self) -> BTreeSet<u32> {
        self.vmids.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

pub struct Agent {
    pub cfg: Config,
    pub roots: Roots,
    pub bus: Arc<EventBus>,
    pub metrics: Arc<Metrics>,
    pub recent: Arc<RecentKmsg>,
    pub topo: Arc<TopoCell>,
    host_id: String,
    /// Common phase of the pollers' timers: intervals that divide each other fire in the same
    /// wake-up (pcie, aer and vm each second, thunderbolt every other, host every fifth).
    phase: tokio::time::Instant,
}

/// Handle of a running agent; dropping it stops the loops.
pub struct Running {
    tasks: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    /// Watchers that are on.
    pub enabled: Vec<&'static str>,
    /// Watchers that are off, with the reason (one log line each).
    pub disabled: Vec<(&'static str, String)>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in &self.tasks {
            t.abort();
        }
    }
}

enum Poke {
    Tick,
    Port(String, Source),
    Aer(AerDetail),
}

/// A poller's wake-ups: its timer's ticks merged with the pokes sent to it. Once every sender
/// is gone only the timer is left (a closed channel must not be polled again: it is always
/// ready, and the loop would spin).
struct Pokes {
    timer: tokio::time::Interval,
    rx: mpsc::Receiver<Poke>,
    open: bool,
}

impl Pokes {
    async fn next(&mut self) -> Poke {
        loop {
            tokio::select! {
                _ = self.timer.tick() => return Poke::Tick,
                r = self.rx.recv(), if self.open => match r {
                    Some(p) => return p,
                    None => self.open = false,
                },
            }
        }
    }
}

/// One-line description of a watcher that is off, logged once and emitted as an event.
fn off(
    bus: &EventBus,
    metrics: &Metrics,
    running: &mut Running,
    watcher: &'static str,
    reason: String,
) {
    tracing::warn!("{watcher}: {reason}; {watcher} watcher off");
    metrics.watcher_enabled.with_label_values(&[watcher]).set(0);
    bus.emit(HostEvent::WatcherDisabled {
        watcher: watcher.to_string(),
        reason: reason.clone(),
    });
    running.disabled.push((watcher, reason));
}

fn on(metrics: &Metrics, running: &mut Running, watcher: &'static str) {
    metrics.watcher_enabled.with_label_values(&[watcher]).set(1);
    running.enabled.push(watcher);
}

impl Agent {
    pub fn new(cfg: Config) -> Agent {
        let host_id = cfg.host_id();
        let roots = Roots::new(cfg.root.clone());
        let bus = EventBus::new(cfg.event_capacity);
        Agent {
            metrics: Metrics::new(&host_id),
            roots,
            bus,
            recent: Arc::new(RecentKmsg::default()),
            topo: Arc::new(TopoCell::default()),
            host_id,
            cfg,
            phase: tokio::time::Instant::now(),
        }
    }

    /// A poller's timer: first tick at once, then on the agent's common phase. A late tick is
    /// skipped rather than shifting the phase (`Skip`), which keeps the timers coalesced.
    fn ticker(&self, period_ms: u64) -> tokio::time::Interval {
        let mut iv = tokio::time::interval_at(self.phase, Duration::from_millis(period_ms.max(1)));
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        iv
    }

    /// The poller's timer (past its immediate first tick: the caller polled once already) and
    /// its poke channel.
    async fn pokes(&self, period_ms: u64, rx: mpsc::Receiver<Poke>) -> Pokes {
        let mut timer = self.ticker(period_ms);
        timer.tick().await;
        Pokes {
            timer,
            rx,
            open: true,
        }
    }

    /// Node name used for `mapping=` entries.
    pub fn node(&self) -> &str {
        &self.host_id
    }

    /// Discover devices and publish the topology; emits `DeviceMapped` for new/changed devices.
    fn rescan(&self, known: &mut Vec<DeviceTopology>, warned: &mut HashSet<String>, first: bool) {
        let (scan, devices) = discovery::discover(&self.roots, &self.host_id, &self.cfg.devices);
        for w in &scan.warnings {
            if warned.insert(w.clone()) {
                tracing::warn!("proxmox config: {w}");
            }
        }
        if first && !scan.pve_present {
            tracing::warn!(
                "proxmox: {} not found; proxmox watcher off (only devices from the agent's config are watched)",
                self.roots.pve().display()
            );
            self.metrics
                .watcher_enabled
                .with_label_values(&["proxmox"])
                .set(0);
            self.bus.emit(HostEvent::WatcherDisabled {
                watcher: "proxmox".into(),
                reason: format!("{} not found", self.roots.pve().display()),
            });
        } else if first {
            self.metrics
                .watcher_enabled
                .with_label_values(&["proxmox"])
                .set(1);
        }
        for d in &devices {
            if !d.present {
                if !known.iter().any(|k| k.assignment.bdf == d.assignment.bdf) {
                    tracing::warn!(
                        "device {} ({} of VM {:?}) is not present in sysfs",
                        d.assignment.bdf,
                        d.assignment.origin,
                        d.assignment.vmid
                    );
                }
                continue;
            }
            if known.iter().any(|k| k == d) {
                continue;
            }
            self.bus.emit(HostEvent::DeviceMapped(DeviceMapped {
                bdf: d.assignment.bdf.clone(),
                vmid: d.assignment.vmid,
                origin: d.assignment.origin.clone(),
                path: d.path.clone(),
                root_port: d.path.last().cloned(),
                thunderbolt_router: d.thunderbolt_router.clone(),
            }));
        }
        *known = devices.clone();
        let mut vmids = scan.vmids.clone();
        vmids.extend(scan.assignments.iter().filter_map(|a| a.vmid));
        self.topo.set(Topology::from_devices(devices), vmids);
    }

    /// Start every watcher. Returns after discovery and the baseline polls.
    pub async fn start(self: &Arc<Self>) -> Running {
        let stop = Arc::new(AtomicBool::new(false));
        let mut running = Running {
            tasks: Vec::new(),
            stop: stop.clone(),
            enabled: Vec::new(),
            disabled: Vec::new(),
        };
        let m = self.metrics.clone();

        // Count every event by kind.
        {
            let mut rx = self.bus.subscribe();
            let m = m.clone();
            running.tasks.push(tokio::spawn(async move {
                loop {
                    match rx.recv().await {
                        Ok(ev) => m.events.with_label_values(&[ev.event.kind_name()]).inc(),
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(_) => return,
                    }
                }
            }));
        }

        // Discovery.
        let mut known = Vec::new();
        let mut warned = HashSet::new();
        self.rescan(&mut known, &mut warned, true);
        let (disc_tx, mut disc_rx) = mpsc::channel::<()>(8);
        {
            let me = self.clone();
            let mut iv = self.ticker(self.cfg.discovery.rescan_interval_ms);
            running.tasks.push(tokio::spawn(async move {
                iv.tick().await;
                let mut open = true;
                loop {
                    tokio::select! {
                        _ = iv.tick() => {}
                        r = disc_rx.recv(), if open => if r.is_none() { open = false; continue },
                    }
                    me.rescan(&mut known, &mut warned, false);
                }
            }));
        }

        // PCIe links.
        let (pcie_tx, pcie_rx) = mpsc::channel::<Poke>(64);
        if self.cfg.pcie.enabled {
            let mut p = PciePoller::new();
            let t = self.topo.get();
            if t.links.is_empty() {
                tracing::info!(
                    "pcie: no passed-through or configured devices yet; rescanning every {} ms",
                    self.cfg.discovery.rescan_interval_ms
                );
            }
            p.poll(&self.roots, &t.links, &m, Source::Poll);
            on(&m, &mut running, "pcie");
            running.tasks.push(self.spawn_pcie(p, pcie_rx));
        }

        // AER.
        let (aer_tx, aer_rx) = mpsc::channel::<Poke>(64);
        if self.cfg.aer.enabled {
            let t = self.topo.get();
            let mut p = AerPoller::new();
            if !t.aer_devices.is_empty() && !any_aer_files(&self.roots, &t) {
                off(&self.bus, &m, &mut running, "aer", "no aer_dev_* files on the watched devices (kernel without AER support or no OS AER ownership)".into());
            } else {
                p.poll(
                    &self.roots,
                    &t,
                    &m,
                    &self.recent,
                    Duration::ZERO,
                    None,
                    None,
                );
                on(&m, &mut running, "aer");
                running.tasks.push(self.spawn_aer(p, aer_rx));
            }
        }

        // Thunderbolt.
        let (tb_tx, tb_rx) = mpsc::channel::<Poke>(64);
        if self.cfg.thunderbolt.enabled {
            if !self.roots.thunderbolt_devices().is_dir() {
                off(
                    &self.bus,
                    &m,
                    &mut running,
                    "thunderbolt",
                    format!(
                        "{} not found (no Thunderbolt/USB4 controller or driver)",
                        self.roots.thunderbolt_devices().display()
                    ),
                );
            } else {
                let mut p = TbPoller::new();
                p.poll(&self.roots, &self.topo.get(), &m, Source::Poll);
                on(&m, &mut running, "thunderbolt");
                running.tasks.push(self.spawn_tb(p, tb_rx));
            }
        }

        // Uevents (live system only: a recorded tree has no kernel behind it).
        if self.cfg.thunderbolt.uevents && self.roots.is_live() {
            let (utx, mut urx) = mpsc::channel(256);
            match crate::uevent::spawn_listener(utx) {
                Ok(()) => {
                    on(&m, &mut running, "uevent");
                    let me = self.clone();
                    let (tb_tx, aer_tx, disc_tx) = (tb_tx.clone(), aer_tx.clone(), disc_tx.clone());
                    running.tasks.push(tokio::spawn(async move {
                        while let Some(u) = urx.recv().await {
                            let r = crate::uevent::react(&u);
                            if let Some(t) = r.tunnel {
                                me.bus.emit(HostEvent::ThunderboltTunnel(t));
                            }
                            if let Some(mut rec) = r.recovery {
                                rec.vmid = me.topo.get().vmid_of(&rec.bdf);
                                me.bus.emit(HostEvent::PciErrorRecovery(rec));
                            }
                            if r.poke_thunderbolt {
                                let _ = tb_tx.try_send(Poke::Port(String::new(), Source::Uevent));
                            }
                            if r.poke_aer {
                                let _ = aer_tx.try_send(Poke::Tick);
                            }
                            if r.rediscover {
                                let _ = disc_tx.try_send(());
                            }
                        }
                    }));
                }
                Err(e) => off(
                    &self.bus,
                    &m,
                    &mut running,
                    "uevent",
                    format!("cannot open the uevent netlink socket: {e}"),
                ),
            }
        }

        // Tracepoints.
        let mut want: Vec<(&str, &str)> = Vec::new();
        if self.cfg.aer.enabled && self.cfg.aer.tracepoint {
            want.push(("ras", "aer_event"));
        }
        if self.cfg.pcie.enabled && self.cfg.pcie.tracepoints {
            want.push(("pci", "pcie_link_event"));
            want.push(("pci", "pci_hp_event"));
        }
        if !want.is_empty() {
            match crate::tracefs::setup(&self.roots, &want) {
                None => {
                    tracing::info!(
                        "tracefs: none of {} present under {}; polling only",
                        want.iter()
                            .map(|(a, b)| format!("{a}:{b}"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        self.roots.tracefs().display()
                    );
                    m.watcher_enabled.with_label_values(&["tracepoints"]).set(0);
                }
                Some((inst, enabled)) => {
                    let (ttx, mut trx) = mpsc::channel(256);
                    match crate::tracefs::spawn_reader(inst, ttx) {
                        Ok(()) => {
                            tracing::info!("tracefs: using {}", enabled.join(", "));
                            on(&m, &mut running, "tracepoints");
                            let (pcie_tx, aer_tx) = (pcie_tx.clone(), aer_tx.clone());
                            let me = self.clone();
                            running.tasks.push(tokio::spawn(async move {
                                while let Some(r) = trx.recv().await {
                                    match r.event.as_str() {
                                        "aer_event" => {
                                            if let Some(d) = crate::tracefs::aer_detail(&r) {
                                                let _ = aer_tx.try_send(Poke::Aer(d));
                                            }
                                        }
                                        "pcie_link_event" => {
                                            if let Some(p) = r.fields.get("port_name") {
                                                let _ = pcie_tx.try_send(Poke::Port(
                                                    p.clone(),
                                                    Source::Tracepoint,
                                                ));
                                            }
                                        }
                                        "pci_hp_event" => {
                                            let ev = match r.num("event") {
                                                Some(0) => "LINK_UP".to_string(),
                                                Some(1) => "LINK_DOWN".to_string(),
                                                Some(2) => "CARD_PRESENT".to_string(),
                                                Some(3) => "CARD_NOT_PRESENT".to_string(),
                                                Some(n) => n.to_string(),
                                                None => r
                                                    .fields
                                                    .get("event")
                                                    .cloned()
                                                    .unwrap_or_default(),
                                            };
                                            me.bus.emit(HostEvent::PciHotplug(PciHotplug {
                                                port: r
                                                    .fields
                                                    .get("port_name")
                                                    .cloned()
                                                    .unwrap_or_default(),
                                                slot: r
                                                    .fields
                                                    .get("slot")
                                                    .cloned()
                                                    .unwrap_or_default(),
                                                event: ev,
                                            }));
                                            let _ = pcie_tx.try_send(Poke::Tick);
                                        }
                                        _ => {}
                                    }
                                }
                            }));
                        }
                        Err(e) => {
                            tracing::info!("tracefs: cannot read trace_pipe: {e}; polling only")
                        }
                    }
                }
            }
        }

        // Kernel log.
        if self.cfg.kmsg.enabled {
            let path = self.roots.dev().join("kmsg");
            let (ktx, mut krx) = mpsc::channel::<KmsgMsg>(1024);
            match crate::watch::kmsg::spawn_reader(&path, self.cfg.kmsg.read_history, ktx) {
                Err(e) => off(
                    &self.bus,
                    &m,
                    &mut running,
                    "kmsg",
                    format!("cannot open {}: {e}", path.display()),
                ),
                Ok(()) => {
                    on(&m, &mut running, "kmsg");
                    let me = self.clone();
                    running.tasks.push(tokio::spawn(async move {
                        let mut h = KmsgHandler::default();
                        while let Some(msg) = krx.recv().await {
                            let t = me.topo.get();
                            for ev in h.handle(msg, &t, &me.metrics, &me.recent) {
                                me.bus.emit(ev);
                            }
                        }
                    }));
                }
            }
        }

        // Bridges.
        if self.cfg.bridge.enabled {
            let (rtx, rrx) = std::sync::mpsc::channel();
            match crate::watch::bridge::spawn(
                self.cfg.bridge.clone(),
                m.clone(),
                self.bus.clone(),
                rtx,
                stop.clone(),
            ) {
                Err(e) => off(
                    &self.bus,
                    &m,
                    &mut running,
                    "bridge",
                    format!("cannot start thread: {e}"),
                ),
                Ok(_) => {
                    let r = tokio::task::spawn_blocking(move || {
                        rrx.recv_timeout(Duration::from_secs(5))
                    })
                    .await
                    .ok()
                    .and_then(|r| r.ok());
                    match r {
                        Some(Ok(())) => on(&m, &mut running, "bridge"),
                        Some(Err(e)) => off(&self.bus, &m, &mut running, "bridge", e),
                        None => off(
                            &self.bus,
                            &m,
                            &mut running,
                            "bridge",
                            "no first sample within 5 s".into(),
                        ),
                    }
                }
            }
        }

        // VMs.
        if self.cfg.vm.enabled {
            let mut p = VmPoller::new(self.cfg.vm.qmp);
            let vmids = VmPoller::vmids(&self.roots, &self.topo.vmids());
            let t = self.topo.get();
            p.poll(&self.roots, &vmids, &t, &self.recent, Duration::ZERO, &m);
            on(&m, &mut running, "vm");
            let me = self.clone();
            running.tasks.push(tokio::spawn(async move {
                let mut iv = me.ticker(me.cfg.vm.poll_interval_ms);
                iv.tick().await;
                loop {
                    iv.tick().await;
                    let me2 = me.clone();
                    let mut p2 = std::mem::take(&mut p);
                    // QMP and /proc reads may block briefly: keep them off the runtime thread.
                    let (p3, evs) = tokio::task::spawn_blocking(move || {
                        let vmids = VmPoller::vmids(&me2.roots, &me2.topo.vmids());
                        let t = me2.topo.get();
                        let w = Duration::from_millis(me2.cfg.vm.cause_window_ms);
                        let evs = p2.poll(&me2.roots, &vmids, &t, &me2.recent, w, &me2.metrics);
                        (p2, evs)
                    })
                    .await
                    .unwrap_or_default();
                    p = p3;
                    for ev in evs {
                        me.bus.emit(ev);
                    }
                }
            }));
        }

        // Host CPU, memory, PSI.
        if self.cfg.host.enabled {
            let mut hs = HostStats::new();
            hs.poll(&self.roots, &m);
            on(&m, &mut running, "host");
            let me = self.clone();
            running.tasks.push(tokio::spawn(async move {
                let mut iv = me.ticker(me.cfg.host.interval_ms);
                loop {
                    iv.tick().await;
                    hs.poll(&me.roots, &me.metrics);
                }
            }));
        }
        drop(disc_tx);
        running
    }

    fn spawn_pcie(self: &Arc<Self>, mut p: PciePoller, rx: mpsc::Receiver<Poke>) -> JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut pokes = me.pokes(me.cfg.pcie.poll_interval_ms, rx).await;
            loop {
                let poke = pokes.next().await;
                let t = me.topo.get();
                let (links, source): (Vec<_>, _) = match &poke {
                    Poke::Port(port, src) if !port.is_empty() => (
                        t.links
                            .iter()
                            .filter(|l| l.parent.as_deref() == Some(port) || &l.child == port)
                            .cloned()
                            .collect(),
                        *src,
                    ),
                    _ => (t.links.clone(), Source::Poll),
                };
                p.retain(&t.links);
                for ev in p.poll(&me.roots, &links, &me.metrics, source) {
                    me.bus.emit(ev);
                }
            }
        })
    }

    fn spawn_aer(self: &Arc<Self>, mut p: AerPoller, rx: mpsc::Receiver<Poke>) -> JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut pokes = me.pokes(me.cfg.aer.poll_interval_ms, rx).await;
            let window = Duration::from_millis(me.cfg.aer.kmsg_context_ms);
            loop {
                let poke = pokes.next().await;
                let t = me.topo.get();
                match poke {
                    Poke::Aer(d) => {
                        let evs = p.poll(
                            &me.roots,
                            &t,
                            &me.metrics,
                            &me.recent,
                            window,
                            Some(&d.dev_name),
                            Some(&d),
                        );
                        if evs.is_empty() {
                            me.bus.emit(HostEvent::AerTrace(d));
                        }
                        for ev in evs {
                            me.bus.emit(ev);
                        }
                    }
                    _ => {
                        for ev in p.poll(&me.roots, &t, &me.metrics, &me.recent, window, None, None)
                        {
                            me.bus.emit(ev);
                        }
                    }
                }
            }
        })
    }

    fn spawn_tb(self: &Arc<Self>, mut p: TbPoller, rx: mpsc::Receiver<Poke>) -> JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut pokes = me.pokes(me.cfg.thunderbolt.poll_interval_ms, rx).await;
            loop {
                let source = match pokes.next().await {
                    Poke::Port(_, s) => s,
                    _ => Source::Poll,
                };
                for ev in p.poll(&me.roots, &me.topo.get(), &me.metrics, source) {
                    me.bus.emit(ev);
                }
            }
        })
    }
}
