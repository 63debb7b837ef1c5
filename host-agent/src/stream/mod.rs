//! Host → guest event stream (client side): the agent's event bus, routed to the guests each
//! event concerns ([`route`]), into the stream library's spools and connection tasks
//! ([`gpufeed_shared::stream::client`], which documents the protocol side).
//!
//! [`spawn`] subscribes to the agent's event bus; every event is encoded once
//! ([`EncodedEvent`]) and shared by the spools of every guest it is routed to.
//!
//! Metrics (all with label `guest`): `gpufeed_host_stream_connected`,
//! `gpufeed_host_stream_events_spooled_total`, `gpufeed_host_stream_events_sent_total`,
//! `gpufeed_host_stream_events_dropped_total`, `gpufeed_host_stream_spool_events`,
//! `gpufeed_host_stream_spool_disk_bytes`, `gpufeed_host_stream_acked_seq`,
//! `gpufeed_host_stream_connects_total{result}`; and `gpufeed_host_stream_bus_lagged_total`.

pub mod route;
pub mod state;

use std::sync::Arc;

use gpufeed_shared::clock::{ReferenceClock, SystemClock};
use gpufeed_shared::event::Stamped;
use gpufeed_shared::proto::{self, EncodedEvent};
use gpufeed_shared::stream::client;
use prometheus::Registry;
use tokio::sync::broadcast;

pub use client::{GuestEndpoint, RawEvent, SpoolStatus, StreamConfig, StreamError};
use route::{Filter, Route};

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
    filters: Arc<[Filter]>,
    spools: client::Spools,
}

impl Router {
    fn push(&self, events: &[Stamped]) {
        let clock = self.spools.clock();
        let mut per_guest: Vec<Vec<Arc<EncodedEvent>>> = vec![Vec::new(); self.filters.len()];
        for ev in events {
            let targets = route::targets(&self.filters, &Route::of(&ev.event));
            if targets.is_empty() {
                continue;
            }
            // An oversized kmsg context is cut (and says so), the event is not dropped.
            let encoded =
                proto::encode_event(clock.report(ev.realtime_ns), ev.monotonic_ns, &ev.event);
            let encoded = match encoded {
                Ok((e, _)) => Arc::new(e),
                Err(e) => {
                    tracing::error!(kind = ev.event.kind_name(), error = %e, "cannot encode host event; skipped");
                    continue;
                }
            };
            for i in targets {
                per_guest[i].push(encoded.clone());
            }
        }
        for (i, evs) in per_guest.iter().enumerate() {
            if !evs.is_empty() {
                self.spools.push_encoded(i, evs);
            }
        }
    }
}

/// Starts streaming the events of `events` (the agent's bus) to every guest of `cfg`, as
/// `host_id` (which must be the identity in the client certificate). Must be called inside a
/// tokio runtime.
pub fn spawn(
    cfg: StreamConfig,
    host_id: String,
    mut events: broadcast::Receiver<Stamped>,
    registry: &Registry,
) -> Result<StreamHandle, StreamError> {
    let mut h = start(cfg, host_id, registry)?;
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
    let filters = filters_of(&cfg);
    // Each guest also gets the host's own series that concern it (stream::state), so that
    // one scrape of the guest holds the host's side.
    let names: Vec<String> = cfg.guests.iter().map(|g| g.label().to_owned()).collect();
    let state_filters: Vec<Filter> = filters_of(&cfg);
    let reg = registry.clone();
    let source: client::StateSource =
        Arc::new(move |guest, now_ns| state::snapshot(&reg, guest, &state_filters, &names, now_ns));
    let inner = client::start(cfg, host_id, registry, clock, Some(source))?;
    Ok(StreamHandle {
        router: Router {
            filters: filters.into(),
            spools: inner.spools().clone(),
        },
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
