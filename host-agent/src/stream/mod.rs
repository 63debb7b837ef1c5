//! Host → guest event stream (client side): the agent's event bus, routed to the guests each
//! event concerns ([`route`]), into the stream library's spools and connection tasks
//! ([`gpufeed_shared::stream::client`], which documents the protocol side).
//!
//! [`spawn`] subscribes to the agent's event bus; every event is encoded once
//! ([`EncodedEvent`]) and shared by the spools of every guest it is routed to.
//!
//! Given the host's VMs ([`Vms`]), a guest without a configured filter is bound to the VM it
//! names in its handshake ([`bind`]) and gets that VM's events: those of its devices, of the
//! ports and bridges above them (from the topology), of its VM id (state, vCPU threads,
//! bridge ports), and the host-wide ones. Until its first handshake it gets nothing; the
//! router holds the last [`HELD_EVENTS`] events meanwhile and hands it those that concern
//! it when it binds. A guest the host cannot bind is refused (the connection is closed with
//! the reason) and gets nothing.
//!
//! Metrics (all with label `guest`): `gpufeed_host_stream_connected`,
//! `gpufeed_host_stream_events_spooled_total`, `gpufeed_host_stream_events_sent_total`,
//! `gpufeed_host_stream_events_dropped_total`, `gpufeed_host_stream_spool_events`,
//! `gpufeed_host_stream_spool_disk_bytes`, `gpufeed_host_stream_acked_seq`,
//! `gpufeed_host_stream_connects_total{result}`; and `gpufeed_host_stream_bus_lagged_total`.
//! With VMs: `gpufeed_host_stream_guest_vmid{guest}` (the VM a guest is bound to, -1 before),
//! `gpufeed_host_stream_vm_refused_total{guest,reason}` (`unknown_vm`, `vm_taken`),
//! `gpufeed_host_stream_events_moved_total{guest}` (held for a guest whose VM left this host)
//! and
//! `gpufeed_host_stream_routed_total{guest,why}` (`own`, `upstream`, `host_wide`,
//! `unclaimed`: why events went to the guest).

pub mod bind;
pub mod route;
pub mod state;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use gpufeed_shared::clock::{ReferenceClock, SystemClock};
use gpufeed_shared::event::Stamped;
use gpufeed_shared::proto::{self, EncodedEvent};
use gpufeed_shared::stream::client;
use prometheus::Registry;
use tokio::sync::broadcast;

use bind::{Bindings, Bound, Slot};
pub use client::{GuestEndpoint, RawEvent, SpoolStatus, StreamConfig, StreamError};
use route::{Filter, Reach, Route, Why};

use crate::roots::Roots;
use crate::watch::topology::{TopoCell, Topology};

/// The host's VMs, to bind guests to: the root under which `/etc/pve` lies (each VM's
/// `smbios1: uuid=`) and the watched devices' topology (each VM's devices and the ports
/// above them).
#[derive(Clone)]
pub struct Vms {
    pub roots: Roots,
    pub topo: Arc<TopoCell>,
}

/// Events the router keeps while a guest waits for its binding (about 1 KiB each at most
/// for the usual kinds; an older event is forgotten first).
pub const HELD_EVENTS: usize = 4096;

/// The running stream: the library's handle and the router. Dropping it leaves the tasks
/// running; call [`shutdown`](Self::shutdown) on exit so that the spools' state is on disk.
pub struct StreamHandle {
    inner: client::StreamHandle,
    router: Router,
    bus: Option<tokio::task::JoinHandle<()>>,
    /// The bus task's progress (it beats at least every [`BUS_BEAT`]).
    bus_beat: Arc<client::Beat>,
}

/// The bus task beats at least this often, also without events.
const BUS_BEAT: std::time::Duration = std::time::Duration::from_secs(1);

/// Routes events to the guests' spools, encoding each once.
#[derive(Clone)]
struct Router {
    routing: Arc<Mutex<Routing>>,
    topo: Option<Arc<TopoCell>>,
    spools: client::Spools,
    m: Arc<RouteMetrics>,
}

/// What routing decides by: each guest's binding, and the events held for those waiting.
struct Routing {
    bindings: Bindings,
    held: VecDeque<(Route, EncodedEvent)>,
}

impl Routing {
    fn reaches(&self, topo: &Topology) -> Vec<Reach> {
        let devices_of = |v: u32| topo.devices_of_vm(v);
        (0..self.bindings.slots().len())
            .map(|i| self.bindings.reach(i, &devices_of))
            .collect()
    }
}

impl Router {
    fn new(
        bindings: Bindings,
        topo: Option<Arc<TopoCell>>,
        spools: client::Spools,
        m: RouteMetrics,
    ) -> Self {
        Router {
            routing: Arc::new(Mutex::new(Routing {
                bindings,
                held: VecDeque::new(),
            })),
            topo,
            spools,
            m: Arc::new(m),
        }
    }

    fn topology(&self) -> Arc<Topology> {
        self.topo.as_ref().map(|t| t.get()).unwrap_or_default()
    }

    fn routing(&self) -> std::sync::MutexGuard<'_, Routing> {
        // every change to the routing is one assignment: a panic elsewhere leaves it whole
        self.routing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn push(&self, events: &[Stamped]) {
        let clock = self.spools.clock();
        let topo = self.topology();
        // Spooled under the routing lock, so that a guest binding meanwhile gets the held
        // events before the ones routed to it afterwards.
        let mut routing = self.routing();
        let reach = routing.reaches(&topo);
        let hold = routing.bindings.waiting();
        let mut per_guest: Vec<Vec<EncodedEvent>> = vec![Vec::new(); reach.len()];
        for ev in events {
            let route = Route::of(&ev.event);
            let targets = route::targets(&reach, &route);
            if targets.is_empty() && !hold {
                continue;
            }
            // An oversized kmsg context is cut (and says so), the event is not dropped.
            let encoded =
                proto::encode_event(clock.report(ev.realtime_ns), ev.monotonic_ns, &ev.event);
            let encoded = match encoded {
                Ok((e, _)) => e,
                Err(e) => {
                    tracing::error!(kind = ev.event.kind_name(), error = %e, "cannot encode host event; skipped");
                    continue;
                }
            };
            for (i, why) in targets {
                self.m.routed(i, why);
                per_guest[i].push(encoded.clone());
            }
            if hold {
                if routing.held.len() == HELD_EVENTS {
                    routing.held.pop_front();
                }
                routing.held.push_back((route, encoded));
            }
        }
        if !hold {
            routing.held.clear();
        }
        for (i, evs) in per_guest.iter().enumerate() {
            if !evs.is_empty() {
                self.spools.push_encoded(i, evs);
            }
        }
    }

    /// A handshake of guest `guest` that named `uuid`: binds it (handing it the held events
    /// that concern it when it is newly bound) or refuses it, logged and counted.
    fn bind(&self, guest: usize, uuid: Option<&str>, roots: &Roots) -> Result<(), String> {
        let vms = match uuid {
            Some(_) => crate::discovery::vm_smbios_uuids(roots),
            None => Default::default(),
        };
        let topo = self.topology();
        let mut routing = self.routing();
        let label = self.m.label(guest);
        let was = routing.bindings.slots().get(guest).cloned();
        match routing.bindings.bind(guest, uuid, &vms) {
            Err(refusal) => {
                self.m.refused(guest, refusal.reason());
                self.m.vmid(guest, -1);
                // bound to a VM whose configuration is no longer on this host: the VM moved
                // (a migration) or was removed; what this host held for it is counted as
                // moved, not lost
                if let Some(Slot::Vm(vmid)) = was {
                    if !vms.contains_key(&vmid) {
                        let moved = self.spools.give_up(guest);
                        self.m.moved(guest, moved);
                        tracing::info!(guest = %label, vmid, moved, "host stream: VM left this host (migrated or removed); the events held for its guest are counted as moved");
                    }
                }
                let why = refusal.to_string();
                // once per guest and reason: the guest tries again at every backoff
                if self.m.note_refusal(guest, &why) {
                    tracing::warn!(guest = %label, vm_uuid = ?uuid, reason = refusal.reason(), "host stream: not streaming to this guest: {why}");
                }
                Err(why)
            }
            Ok(Bound::Unchanged) => {
                self.m.note_refusal(guest, "");
                Ok(())
            }
            Ok(bound) => {
                self.m.note_refusal(guest, "");
                match bound {
                    Bound::Vm(vmid) => {
                        self.m.vmid(guest, vmid as i64);
                        tracing::info!(guest = %label, vm_uuid = ?uuid, vmid, "host stream: guest bound to its VM; it gets that VM's events");
                    }
                    _ => {
                        self.m.vmid(guest, -1);
                        tracing::warn!(guest = %label, "host stream: guest named no VM (an older guest, or it cannot read its SMBIOS UUID) and its configuration lists no vmids or devices: it gets every event");
                    }
                }
                let reach = routing.reaches(&topo);
                let mut mine = Vec::new();
                for (route, ev) in &routing.held {
                    if let Some((_, why)) = route::targets(&reach, route)
                        .into_iter()
                        .find(|(i, _)| *i == guest)
                    {
                        self.m.routed(guest, why);
                        mine.push(ev.clone());
                    }
                }
                if !mine.is_empty() {
                    self.spools.push_encoded(guest, &mine);
                }
                Ok(())
            }
        }
    }

    /// Guest `guest`'s filter for the host's own series.
    fn state_filter(&self, guest: usize) -> Filter {
        let topo = self.topology();
        self.routing()
            .bindings
            .state_filter(guest, &|v| topo.devices_of_vm(v))
    }
}

/// The router's series (see the module docs).
struct RouteMetrics {
    labels: Vec<String>,
    routed: prometheus::IntCounterVec,
    refused: prometheus::IntCounterVec,
    vmid: prometheus::IntGaugeVec,
    moved: prometheus::IntCounterVec,
    /// `routed` of each guest, by [`Why`] in its order.
    per_guest: Vec<[prometheus::IntCounter; 4]>,
    /// Each guest's last refusal ("" after a binding), so that a guest refused again at
    /// every reconnect is logged once.
    last_refusal: Mutex<Vec<String>>,
}

impl RouteMetrics {
    fn new(registry: &Registry, labels: Vec<String>, by_vm: bool) -> prometheus::Result<Self> {
        use prometheus::{IntCounterVec, IntGaugeVec, Opts};
        let mut m = RouteMetrics {
            routed: IntCounterVec::new(
                Opts::new(
                    "gpufeed_host_stream_routed_total",
                    "Events routed to the guest, by why (own: its VM or device; upstream: a port or bridge above its VM's devices; host_wide; unclaimed: it takes everything, or nothing configured matched)",
                ),
                &["guest", "why"],
            )?,
            refused: IntCounterVec::new(
                Opts::new(
                    "gpufeed_host_stream_vm_refused_total",
                    "Handshakes after which the guest was not streamed to, by reason (unknown_vm: its SMBIOS UUID is no VM of this host; vm_taken: another guest is bound to that VM)",
                ),
                &["guest", "reason"],
            )?,
            vmid: IntGaugeVec::new(
                Opts::new(
                    "gpufeed_host_stream_guest_vmid",
                    "The VM the guest is bound to by its SMBIOS UUID (-1: not bound)",
                ),
                &["guest"],
            )?,
            moved: IntCounterVec::new(
                Opts::new(
                    "gpufeed_host_stream_events_moved_total",
                    "Events held for the guest and given up because its VM left this host (migrated to another host of the cluster, or removed): not lost, not delivered by this host",
                ),
                &["guest"],
            )?,
            last_refusal: Mutex::new(vec![String::new(); labels.len()]),
            per_guest: Vec::new(),
            labels,
        };
        m.per_guest = m
            .labels
            .iter()
            .map(|l| Why::ALL.map(|w| m.routed.with_label_values(&[l.as_str(), w.name()])))
            .collect();
        registry.register(Box::new(m.routed.clone()))?;
        if by_vm {
            registry.register(Box::new(m.refused.clone()))?;
            registry.register(Box::new(m.vmid.clone()))?;
            registry.register(Box::new(m.moved.clone()))?;
            for l in &m.labels {
                m.vmid.with_label_values(&[l]).set(-1);
                m.moved.with_label_values(&[l]);
                for r in ["unknown_vm", "vm_taken"] {
                    m.refused.with_label_values(&[l, r]);
                }
            }
        }
        Ok(m)
    }

    fn label(&self, guest: usize) -> &str {
        self.labels.get(guest).map(String::as_str).unwrap_or("")
    }

    /// Counts one event routed (the handles are looked up once: this runs per event).
    fn routed(&self, guest: usize, why: Why) {
        if let Some(c) = self.per_guest.get(guest) {
            c[why as usize].inc();
        }
    }

    fn moved(&self, guest: usize, n: u64) {
        self.moved.with_label_values(&[self.label(guest)]).inc_by(n);
    }

    fn refused(&self, guest: usize, reason: &str) {
        self.refused
            .with_label_values(&[self.label(guest), reason])
            .inc();
    }

    /// Records guest `guest`'s refusal (`""`: none); true when it differs from the last.
    fn note_refusal(&self, guest: usize, why: &str) -> bool {
        let mut last = self
            .last_refusal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match last.get_mut(guest) {
            Some(l) if l != why => {
                why.clone_into(l);
                true
            }
            _ => false,
        }
    }

    fn vmid(&self, guest: usize, vmid: i64) {
        self.vmid.with_label_values(&[self.label(guest)]).set(vmid);
    }
}

/// Starts streaming the events of `events` (the agent's bus) to every guest of `cfg`, as
/// `host_id` (which must be the identity in the client certificate); with `vms`, guests
/// without a configured filter are bound to their VMs. Must be called inside a tokio runtime.
pub fn spawn(
    cfg: StreamConfig,
    host_id: String,
    mut events: broadcast::Receiver<Stamped>,
    registry: &Registry,
    vms: Option<Vms>,
) -> Result<StreamHandle, StreamError> {
    let mut h = start_inner(cfg, host_id, registry, Arc::new(SystemClock), vms)?;
    let lagged = h.inner.bus_lagged().clone();
    let router = h.router.clone();
    let beat = h.bus_beat.clone();
    beat.now();
    h.bus = Some(tokio::spawn(async move {
        let mut batch = Vec::with_capacity(1024);
        let mut tick = tokio::time::interval(BUS_BEAT);
        loop {
            beat.now();
            let next = tokio::select! {
                r = events.recv() => r,
                _ = tick.tick() => continue,
            };
            match next {
                Ok(ev) => batch.push(ev),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(
                        missed = n,
                        "host stream fell behind the event bus; events lost"
                    );
                    lagged.inc_by(n);
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => break,
            }
            while batch.len() < 1024 {
                match events.try_recv() {
                    Ok(ev) => batch.push(ev),
                    Err(broadcast::error::TryRecvError::Lagged(n)) => {
                        tracing::warn!(
                            missed = n,
                            "host stream fell behind the event bus; events lost"
                        );
                        lagged.inc_by(n);
                    }
                    Err(_) => break,
                }
            }
            router.push(&batch);
            batch.clear();
        }
    }));
    Ok(h)
}

/// Like [`spawn`] without a bus: events are given with [`StreamHandle::push`].
pub fn start(
    cfg: StreamConfig,
    host_id: String,
    registry: &Registry,
) -> Result<StreamHandle, StreamError> {
    start_with_clock(cfg, host_id, registry, Arc::new(SystemClock))
}

/// [`start`] with another reference clock for the host's timestamps (tests shift it to check
/// the guest's offset estimate).
pub fn start_with_clock(
    cfg: StreamConfig,
    host_id: String,
    registry: &Registry,
    clock: Arc<dyn ReferenceClock>,
) -> Result<StreamHandle, StreamError> {
    start_inner(cfg, host_id, registry, clock, None)
}

/// [`start`] for a host with VMs: guests without a configured filter are bound to the VM
/// they name (see the module docs).
pub fn start_with_vms(
    cfg: StreamConfig,
    host_id: String,
    registry: &Registry,
    vms: Vms,
) -> Result<StreamHandle, StreamError> {
    start_inner(cfg, host_id, registry, Arc::new(SystemClock), Some(vms))
}

fn start_inner(
    cfg: StreamConfig,
    host_id: String,
    registry: &Registry,
    clock: Arc<dyn ReferenceClock>,
    vms: Option<Vms>,
) -> Result<StreamHandle, StreamError> {
    let names: Vec<String> = cfg.guests.iter().map(|g| g.label().to_owned()).collect();
    let bindings = Bindings::new(filters_of(&cfg), names.clone(), vms.is_some());
    let metrics = RouteMetrics::new(registry, names.clone(), vms.is_some())?;
    // The connection tasks ask the router (binding, the host's series for a guest), which
    // needs their spools: it is set right after they start, before any handshake is done.
    let router: Arc<std::sync::OnceLock<Router>> = Arc::default();
    // Each guest also gets the host's own series that concern it (stream::state), so that
    // one scrape of the guest holds the host's side.
    let reg = registry.clone();
    let r = router.clone();
    let source: client::StateSource = Arc::new(move |guest, now_ns| {
        let filters: Vec<Filter> = match r.get() {
            Some(r) => (0..names.len()).map(|i| r.state_filter(i)).collect(),
            None => vec![Filter::default(); names.len()],
        };
        state::snapshot(&reg, guest, &filters, &names, now_ns)
    });
    let binder: Option<client::Binder> = vms.as_ref().map(|v| {
        let roots = v.roots.clone();
        let r = router.clone();
        let b: client::Binder = Arc::new(move |guest, uuid| match r.get() {
            Some(r) => r.bind(guest, uuid, &roots),
            None => Err("the host's stream is starting".into()),
        });
        b
    });
    let inner = client::start(cfg, host_id, registry, clock, Some(source), binder)?;
    let r = Router::new(
        bindings,
        vms.map(|v| v.topo),
        inner.spools().clone(),
        metrics,
    );
    let _ = router.set(r.clone());
    Ok(StreamHandle {
        router: r,
        inner,
        bus: None,
        bus_beat: Arc::default(),
    })
}

/// Each guest's routing filter, in the order of the configuration.
fn filters_of(cfg: &StreamConfig) -> Vec<Filter> {
    cfg.guests
        .iter()
        .map(|g| Filter {
            vmids: g.vmids.clone(),
            devices: g.devices.clone(),
        })
        .collect()
}

impl StreamHandle {
    /// The stream's liveness for the watchdog: the library's tasks and spools, and the task
    /// that reads the event bus (stuck when routing blocks).
    pub fn liveness(&self) -> client::Liveness {
        let l = self.inner.liveness();
        match &self.bus {
            Some(bus) => l.with_task(
                "the event bus reader of the stream",
                bus.abort_handle(),
                self.bus_beat.clone(),
            ),
            None => l,
        }
    }

    /// Routes and spools events directly (without the bus). Each event is encoded once, for
    /// every guest it goes to.
    pub fn push(&self, events: &[Stamped]) {
        self.router.push(events);
    }

    /// Spools raw `(kind, payload)` events for the guest at `guest_index` (tests, benchmarks).
    /// `host_realtime_ns` is used as given.
    pub fn push_raw(&self, guest_index: usize, events: Vec<RawEvent>) {
        self.inner.spools().push_raw(guest_index, events);
    }

    pub fn status(&self) -> Vec<SpoolStatus> {
        self.inner.status()
    }

    /// Stops the bus reader and the connection tasks (closing connections) and writes every
    /// spool's state to disk.
    pub async fn shutdown(self) {
        if let Some(b) = self.bus {
            b.abort();
            let _ = b.await;
        }
        self.inner.shutdown().await;
    }
}
