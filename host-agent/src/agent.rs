//! Wiring: discovery, the watcher units, event bus, metrics. [`Agent::new`] builds every unit
//! of [`crate::watch::UNITS`] from its section (registering its series) and the [`Context`]
//! they share; [`Agent::start`] performs discovery, then starts the units in order (each takes
//! its baseline: no events for it) and runs their loops until the returned [`Running`] is
//! dropped.

use crate::config::Config;
use crate::discovery::{self, DeviceTopology};
use crate::events::EventBus;
use crate::heartbeat::Heartbeats;
use crate::metrics::Metrics;
use crate::roots::Roots;
use crate::watch::context::{Context, DISCOVERY};
use crate::watch::topology::Topology;
use crate::watch::unit::{Cx, Inbox, Outcome, Poke, Watcher};
use crate::watch::UNITS;
use gpufeed_shared::event::{DeviceMapped, HostEvent};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub struct Agent {
    pub cfg: Config,
    /// The event bus (the units emit on it through [`Context`]).
    pub bus: Arc<EventBus>,
    pub metrics: Arc<Metrics>,
    /// What the units share.
    pub ctx: Arc<Context>,
    host_id: String,
    /// The built units and their poke receivers, taken by [`Agent::start`].
    pending: Mutex<Vec<Pending>>,
    discovery_inbox: Mutex<Option<mpsc::Receiver<Poke>>>,
}

struct Pending {
    name: &'static str,
    watcher: Box<dyn Watcher>,
    inbox: mpsc::Receiver<Poke>,
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

impl Agent {
    pub fn new(cfg: Config) -> Agent {
        let host_id = cfg.host_id();
        let roots = Roots::new(cfg.root.clone());
        let bus = EventBus::new(cfg.event_capacity);
        let metrics = Metrics::new(&host_id);
        let mut pokes = HashMap::new();
        let mut pending = Vec::new();
        for u in UNITS {
            let (tx, inbox) = mpsc::channel(64);
            pokes.insert(u.unit.name, tx);
            pending.push(Pending {
                name: u.unit.name,
                watcher: u.watcher(&metrics.registry, &cfg),
                inbox,
            });
        }
        let (tx, discovery_inbox) = mpsc::channel(8);
        pokes.insert(DISCOVERY, tx);
        Agent {
            metrics,
            ctx: Arc::new(Context::new(roots, bus.clone(), pokes)),
            bus,
            host_id,
            cfg,
            pending: Mutex::new(pending),
            discovery_inbox: Mutex::new(Some(discovery_inbox)),
        }
    }

    /// The periodic loops' progress, for the watchdog.
    pub fn heartbeats(&self) -> &Heartbeats {
        &self.ctx.heartbeats
    }

    /// Node name used for `mapping=` entries.
    pub fn node(&self) -> &str {
        &self.host_id
    }

    /// Discover devices and publish the topology; emits `DeviceMapped` for new/changed devices.
    fn rescan(&self, known: &mut Vec<DeviceTopology>, warned: &mut HashSet<String>, first: bool) {
        let (scan, devices) =
            discovery::discover(&self.ctx.roots, &self.host_id, &self.cfg.devices);
        for w in &scan.warnings {
            if warned.insert(w.clone()) {
                tracing::warn!("proxmox config: {w}");
            }
        }
        if first && !scan.pve_present {
            tracing::warn!(
                watcher = "proxmox",
                "proxmox: {} not found; proxmox watcher off (only devices from the agent's config are watched)",
                self.ctx.roots.pve().display()
            );
            self.metrics
                .watcher_enabled
                .with_label_values(&["proxmox"])
                .set(0);
            self.bus.emit(HostEvent::WatcherDisabled {
                watcher: "proxmox".into(),
                reason: format!("{} not found", self.ctx.roots.pve().display()),
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
                        bdf = d.assignment.bdf,
                        vmid = d.assignment.vmid,
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
        self.ctx.topo.set(Topology::from_devices(devices), vmids);
    }

    /// Start discovery and every unit. Returns after discovery and the baseline polls.
    pub async fn start(self: &Arc<Self>) -> Running {
        let stop = Arc::new(AtomicBool::new(false));
        let mut running = Running {
            tasks: vec![self.count_events(), self.spawn_discovery()],
            stop: stop.clone(),
            enabled: Vec::new(),
            disabled: Vec::new(),
        };
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        for p in pending {
            let cx = Cx {
                ctx: self.ctx.clone(),
                inbox: Inbox {
                    name: p.name,
                    rx: p.inbox,
                },
                stop: stop.clone(),
            };
            tracing::trace!(watcher = p.name, "starting watcher");
            let enabled = self.metrics.watcher_enabled.with_label_values(&[p.name]);
            match p.watcher.start(cx).await {
                Outcome::Skipped => {}
                Outcome::On(tasks) => {
                    enabled.set(1);
                    running.enabled.push(p.name);
                    running.tasks.extend(tasks);
                }
                Outcome::Off(reason) => {
                    self.off(p.name, &reason);
                    running.disabled.push((p.name, reason));
                }
                Outcome::Absent => enabled.set(0),
            }
        }
        running
    }

    /// A watcher that is off: one warning, the gauge at 0, a `WatcherDisabled` event.
    fn off(&self, watcher: &str, reason: &str) {
        tracing::warn!(
            watcher,
            reason,
            "{watcher}: {reason}; {watcher} watcher off"
        );
        self.metrics
            .watcher_enabled
            .with_label_values(&[watcher])
            .set(0);
        self.bus.emit(HostEvent::WatcherDisabled {
            watcher: watcher.to_string(),
            reason: reason.to_string(),
        });
    }

    /// Count every event by kind (`gpufeed_host_events_total`).
    fn count_events(&self) -> JoinHandle<()> {
        let mut rx = self.bus.subscribe();
        let m = self.metrics.clone();
        tokio::spawn(async move {
            loop {
                match rx.recv().await {
                    Ok(ev) => m.events.with_label_values(&[ev.event.kind_name()]).inc(),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(_) => return,
                }
            }
        })
    }

    /// First discovery now; then again every `rescan_interval_ms` and when poked.
    fn spawn_discovery(self: &Arc<Self>) -> JoinHandle<()> {
        let mut known = Vec::new();
        let mut warned = HashSet::new();
        self.rescan(&mut known, &mut warned, true);
        let inbox = self
            .discovery_inbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let me = self.clone();
        tokio::spawn(async move {
            let Some(rx) = inbox else { return };
            let inbox = Inbox {
                name: DISCOVERY,
                rx,
            };
            let mut pokes = me
                .ctx
                .pokes(me.cfg.discovery.rescan_interval_ms, inbox)
                .await;
            loop {
                pokes.next().await;
                me.rescan(&mut known, &mut warned, false);
            }
        })
    }
}
