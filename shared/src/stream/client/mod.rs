//! Host end of the event stream: one bounded [`spool::Spool`] and one QUIC connection task per
//! guest.
//!
//! The host agent routes every event to the guests it concerns, encodes it once
//! ([`EncodedEvent`]) and hands it to [`Spools::push_encoded`]; each guest's spool keeps
//! it until that guest acknowledges it, and that guest's task ([`conn`]) streams it: connect
//! with mutual TLS (ALPN `gpufeed/1`), `Hello` → `Welcome`, resume from the guest's
//! `resume_from`, send frames in sequence order, drop what the guest acknowledges, reconnect
//! with exponential backoff and jitter. The protocol decisions are in
//! [`crate::proto::HostConnection`]; the task only moves bytes.
//!
//! Metrics (all with label `guest`): `gpufeed_host_stream_connected`,
//! `gpufeed_host_stream_events_spooled_total`, `gpufeed_host_stream_events_sent_total`,
//! `gpufeed_host_stream_events_dropped_total`, `gpufeed_host_stream_spool_events`,
//! `gpufeed_host_stream_spool_disk_bytes`, `gpufeed_host_stream_acked_seq`,
//! `gpufeed_host_stream_connects_total{result}`; and `gpufeed_host_stream_bus_lagged_total`
//! (counted by the agent's bus subscriber, see [`StreamHandle::bus_lagged`]).

pub mod conn;
pub mod meta;
pub mod spool;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use serde::Deserialize;
use tokio::sync::{watch, Notify};

use crate::clock::ReferenceClock;
use crate::proto::EncodedEvent;
use spool::{Spool, SpoolLimits};

/// `[stream]` section of the host configuration. Every key is optional.
///
/// ```toml
/// [stream]
/// ca = "/etc/gpufeed/tls/ca.pem"
/// cert = "/etc/gpufeed/tls/host.pem"
/// key = "/etc/gpufeed/tls/host-key.pem"
/// spool_dir = "/var/lib/gpufeed/spool"
///
/// [[stream.guests]]
/// name = "talos-gpu"
/// endpoint = "10.0.0.20:7845"
/// vmids = [100]
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamConfig {
    /// Deployment CA certificate (PEM); the only trusted root. Default
    /// `/etc/gpufeed/tls/ca.pem`.
    pub ca: PathBuf,
    /// This host's client certificate (PEM). Default `/etc/gpufeed/tls/host.pem`.
    pub cert: PathBuf,
    /// Its private key (PEM). Default `/etc/gpufeed/tls/host-key.pem`.
    pub key: PathBuf,
    /// Spool directory, one subdirectory per guest; events survive agent restarts there.
    /// Empty string: memory-only spool. Default `/var/lib/gpufeed/spool`.
    pub spool_dir: PathBuf,
    /// Events kept in memory per guest (the whole spool when memory-only, else a cache of the
    /// newest). Default 65536.
    pub memory_events: usize,
    /// ... and at most this many bytes of them (encoded) per guest; the oldest go first (to
    /// disk, or lost without a spool directory). Default 16 MiB: a few guests and the agent fit
    /// the unit's `MemoryMax=128M` even with every event at the 64 KiB frame limit.
    pub memory_bytes: usize,
    /// Disk limit per guest in bytes; beyond it the oldest segment is dropped. Default 256 MiB.
    pub disk_max_bytes: u64,
    /// Segment file size in bytes (the unit dropped when the disk limit is hit). Default 4 MiB.
    pub segment_bytes: u64,
    /// First reconnect delay in ms (doubles up to `reconnect_max_ms`, with jitter). Default 200.
    pub reconnect_min_ms: u64,
    /// Largest reconnect delay in ms. Default 30000.
    pub reconnect_max_ms: u64,
    /// Handshake timeout in ms. Default 10000.
    pub connect_timeout_ms: u64,
    /// QUIC idle timeout in ms (the connection is declared dead after this silence). Default
    /// 5000: with events outstanding QUIC's retransmission backoff grows, so a guest that
    /// restarted may not see a packet (and answer with a stateless reset) for longer than this;
    /// the idle timeout bounds how long the host waits for one.
    pub idle_timeout_ms: u64,
    /// QUIC keep-alive interval in ms. Default 1000 (an idle connection to a restarted guest
    /// is reset within a second).
    pub keep_alive_ms: u64,
    /// Largest write to the event stream in bytes. Default 65536.
    pub batch_bytes: usize,
    /// After an idle wait, let events gather for this many microseconds before sending, so
    /// that a burst leaves as a few packets instead of one per event (0: send at once).
    /// Default 500.
    pub coalesce_us: u64,
    /// How often the host's series for a guest are looked at and, when changed, sent to it
    /// (guests that take host state). They are also looked at right after events go out (at
    /// most every 20 ms), so the series that an event changed reach the guest with it; the
    /// periodic look carries what moves without events (host load, byte counters). Default
    /// 2000: a look gathers the host's whole registry, the largest part of an idle agent's
    /// CPU time (see docs/benchmarks.md).
    pub state_interval_ms: u64,
    /// Guests to stream to. Default none (streaming off).
    pub guests: Vec<GuestEndpoint>,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            ca: "/etc/gpufeed/tls/ca.pem".into(),
            cert: "/etc/gpufeed/tls/host.pem".into(),
            key: "/etc/gpufeed/tls/host-key.pem".into(),
            spool_dir: "/var/lib/gpufeed/spool".into(),
            memory_events: 65536,
            memory_bytes: 16 << 20,
            disk_max_bytes: 256 << 20,
            segment_bytes: 4 << 20,
            reconnect_min_ms: 200,
            reconnect_max_ms: 30_000,
            connect_timeout_ms: 10_000,
            idle_timeout_ms: 5_000,
            keep_alive_ms: 1_000,
            batch_bytes: 64 * 1024,
            coalesce_us: 500,
            state_interval_ms: 2000,
            guests: Vec::new(),
        }
    }
}

impl StreamConfig {
    /// What [`start`] refuses, without starting anything (`--check-config`): guest names that
    /// are empty, duplicated or no directory name; certificate files that are missing or do
    /// not parse; a client certificate that does not name `host_id` (every guest would refuse
    /// the connection). The files are read again at every connection attempt, so renewed
    /// certificates are picked up.
    pub fn check(&self, host_id: &str) -> Result<(), StreamError> {
        for (i, g) in self.guests.iter().enumerate() {
            let label = g.label();
            if label.is_empty()
                || label.contains(['/', '\0'])
                || label == "."
                || label == ".."
                || self.guests[..i].iter().any(|x| x.label() == label)
            {
                return Err(StreamError::Config(format!(
                    "guest name {label:?} is empty, duplicated or not usable as a directory name"
                )));
            }
        }
        if self.guests.is_empty() {
            return Ok(());
        }
        let read = crate::tls::read;
        let (ca, cert, key) = (read(&self.ca)?, read(&self.cert)?, read(&self.key)?);
        crate::tls::client_config(&ca, &cert, &key)?;
        let names_host = crate::tls::parse_certs(&cert, "client certificate")?
            .first()
            .is_some_and(|c| crate::tls::identity_of(c, &[host_id.to_owned()]).is_some());
        if !names_host {
            return Err(StreamError::Config(format!(
                "the client certificate {} does not name this host's id {host_id:?} (host_id); \
                 every guest would refuse it",
                self.cert.display()
            )));
        }
        Ok(())
    }
}

/// One guest (VM) to stream to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestEndpoint {
    /// `HOST:PORT` of the guest's `--quic-listen` (required).
    pub endpoint: String,
    /// Name for the spool subdirectory and the `guest` label. Default: `endpoint`.
    #[serde(default)]
    pub name: String,
    /// Name checked against the guest's server certificate. Default: the host part of
    /// `endpoint`.
    #[serde(default)]
    pub server_name: String,
    /// VMIDs served by this guest. Empty together with `devices`: every event.
    #[serde(default)]
    pub vmids: Vec<u32>,
    /// PCI devices (BDF) passed through to this guest.
    #[serde(default)]
    pub devices: Vec<String>,
}

impl GuestEndpoint {
    pub fn label(&self) -> &str {
        if self.name.is_empty() {
            &self.endpoint
        } else {
            &self.name
        }
    }

    /// `server_name`, or the host part of `endpoint` (brackets of an IPv6 literal removed).
    pub fn server_name(&self) -> String {
        if !self.server_name.is_empty() {
            return self.server_name.clone();
        }
        let host = match self.endpoint.rsplit_once(':') {
            Some((h, _)) => h,
            None => &self.endpoint,
        };
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Spool(#[from] spool::SpoolError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("stream config: {0}")]
    Config(String),
    #[error("stream certificates: {0}")]
    Tls(#[from] crate::tls::TlsError),
}

struct Metrics {
    connected: IntGaugeVec,
    spooled: IntCounterVec,
    sent: IntCounterVec,
    dropped: IntCounterVec,
    spool_events: IntGaugeVec,
    spool_disk: IntGaugeVec,
    acked: IntGaugeVec,
    connects: IntCounterVec,
    lagged: IntCounter,
}

impl Metrics {
    fn new(r: &Registry) -> Result<Self, prometheus::Error> {
        let g = |n: &str, h: &str| IntGaugeVec::new(Opts::new(n, h), &["guest"]);
        let c = |n: &str, h: &str| IntCounterVec::new(Opts::new(n, h), &["guest"]);
        let m = Metrics {
            connected: g(
                "gpufeed_host_stream_connected",
                "1 while the stream to the guest is established",
            )?,
            spooled: c(
                "gpufeed_host_stream_events_spooled_total",
                "Events put into the guest's spool",
            )?,
            sent: c(
                "gpufeed_host_stream_events_sent_total",
                "Event frames written to the guest (retransmissions included)",
            )?,
            dropped: c(
                "gpufeed_host_stream_events_dropped_total",
                "Events the full spool dropped (oldest first) before the guest had them",
            )?,
            spool_events: g(
                "gpufeed_host_stream_spool_events",
                "Events in the spool not yet acknowledged",
            )?,
            spool_disk: g(
                "gpufeed_host_stream_spool_disk_bytes",
                "Bytes of spool segment files",
            )?,
            acked: g(
                "gpufeed_host_stream_acked_seq",
                "Highest sequence number the guest acknowledged",
            )?,
            connects: IntCounterVec::new(
                Opts::new(
                    "gpufeed_host_stream_connects_total",
                    "Connection attempts by result (ok, error, rejected)",
                ),
                &["guest", "result"],
            )?,
            lagged: IntCounter::new(
                "gpufeed_host_stream_bus_lagged_total",
                "Events the stream missed because it fell behind the agent's event bus",
            )?,
        };
        r.register(Box::new(m.connected.clone()))?;
        r.register(Box::new(m.spooled.clone()))?;
        r.register(Box::new(m.sent.clone()))?;
        r.register(Box::new(m.dropped.clone()))?;
        r.register(Box::new(m.spool_events.clone()))?;
        r.register(Box::new(m.spool_disk.clone()))?;
        r.register(Box::new(m.acked.clone()))?;
        r.register(Box::new(m.connects.clone()))?;
        r.register(Box::new(m.lagged.clone()))?;
        Ok(m)
    }
}

/// Per-guest metric handles.
struct GuestMetrics {
    connected: IntGauge,
    spooled: IntCounter,
    sent: IntCounter,
    dropped: IntCounter,
    spool_events: IntGauge,
    spool_disk: IntGauge,
    acked: IntGauge,
    connects_ok: IntCounter,
    connects_err: IntCounter,
    connects_rejected: IntCounter,
}

/// State shared between the router and a guest's connection task.
pub(crate) struct Guest {
    /// Position in [`StreamConfig::guests`] (what a [`StateSource`] is asked about).
    index: usize,
    cfg: GuestEndpoint,
    spool: Mutex<Spool>,
    notify: Notify,
    m: GuestMetrics,
    /// "spool full" warnings (one per batch otherwise, while the spool overflows).
    full_log: crate::ratelog::RateLimitedLog,
    /// "reported spool loss" warnings (one per loss report otherwise).
    loss_log: crate::ratelog::RateLimitedLog,
}

impl Guest {
    /// The spool. A panic elsewhere while it was held does not stop the stream: the spool's
    /// state is consistent between its method calls, so the poison is ignored.
    fn spool(&self) -> std::sync::MutexGuard<'_, Spool> {
        self.spool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Brings the metrics up to date with the spool; every drop, whatever its cause, reaches
    /// `gpufeed_host_stream_events_dropped_total` here (call after every change).
    fn update_gauges(&self, s: &mut Spool) {
        self.m.dropped.inc_by(s.take_dropped());
        self.m.spool_events.set(s.pending() as i64);
        self.m.spool_disk.set(s.disk_bytes() as i64);
        if let Some(a) = s.acked() {
            self.m.acked.set(a as i64);
        }
    }
}

/// Settings shared by the connection tasks.
pub(crate) struct Common {
    host_id: String,
    cfg: StreamConfig,
    clock: Arc<dyn ReferenceClock>,
    state: Option<StateSource>,
}

/// The host's series for guest `index` (its position in [`StreamConfig::guests`]) at the given
/// reference time; sent to guests that take host state.
pub type StateSource = Arc<dyn Fn(usize, i64) -> crate::hoststate::HostState + Send + Sync>;

/// The running stream. Dropping it leaves the tasks running; call [`shutdown`](Self::shutdown)
/// on exit so that the spools' state is on disk.
pub struct StreamHandle {
    spools: Spools,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    lagged: IntCounter,
}

/// Where events go in: every guest's spool, and the clock to stamp them with. Cheap to clone,
/// so that a router task can hold one.
#[derive(Clone)]
pub struct Spools {
    guests: Arc<[Arc<Guest>]>,
    clock: Arc<dyn ReferenceClock>,
}

/// Spool state of one guest, for tests and status output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolStatus {
    pub guest: String,
    pub boot_id: u64,
    pub next_seq: u64,
    pub acked: Option<u64>,
    pub pending: u64,
    pub dropped_total: u64,
}

/// Starts a connection task per guest of `cfg`, as `host_id` (which must be the identity in the
/// client certificate); clock replies carry `clock`'s time (production:
/// [`crate::clock::SystemClock`]), and `state`, where given, is the host's series for each
/// guest, sent as host state. Must be called inside a tokio runtime. Events are given through
/// [`StreamHandle::spools`].
pub fn start(
    cfg: StreamConfig,
    host_id: String,
    registry: &Registry,
    clock: Arc<dyn ReferenceClock>,
    state: Option<StateSource>,
) -> Result<StreamHandle, StreamError> {
    let metrics = Metrics::new(registry)?;
    let limits = SpoolLimits {
        memory_events: cfg.memory_events,
        memory_bytes: cfg.memory_bytes,
        disk_max_bytes: cfg.disk_max_bytes,
        segment_bytes: cfg.segment_bytes,
    };
    cfg.check(&host_id)?;
    let mut guests = Vec::new();
    for g in &cfg.guests {
        let label = g.label().to_owned();
        let spool = if cfg.spool_dir.as_os_str().is_empty() {
            Spool::memory(limits)
        } else {
            Spool::open(&cfg.spool_dir.join(&label), limits)?
        };
        let l = [label.as_str()];
        let m = GuestMetrics {
            connected: metrics.connected.with_label_values(&l),
            spooled: metrics.spooled.with_label_values(&l),
            sent: metrics.sent.with_label_values(&l),
            dropped: metrics.dropped.with_label_values(&l),
            spool_events: metrics.spool_events.with_label_values(&l),
            spool_disk: metrics.spool_disk.with_label_values(&l),
            acked: metrics.acked.with_label_values(&l),
            connects_ok: metrics.connects.with_label_values(&[&label, "ok"]),
            connects_err: metrics.connects.with_label_values(&[&label, "error"]),
            connects_rejected: metrics.connects.with_label_values(&[&label, "rejected"]),
        };
        tracing::info!(
            guest = %label,
            endpoint = %g.endpoint,
            boot_id = spool.boot_id(),
            next_seq = spool.next_seq(),
            pending = spool.pending(),
            "host stream: spool ready"
        );
        let guest = Arc::new(Guest {
            index: guests.len(),
            cfg: g.clone(),
            spool: Mutex::new(spool),
            notify: Notify::new(),
            m,
            full_log: crate::ratelog::RateLimitedLog::new(Duration::from_secs(10)),
            loss_log: crate::ratelog::RateLimitedLog::new(Duration::from_secs(10)),
        });
        guest.update_gauges(&mut guest.spool());
        guests.push(guest);
    }
    let (stop, _) = watch::channel(false);
    let common = Arc::new(Common {
        host_id,
        cfg,
        clock: clock.clone(),
        state,
    });
    let tasks = guests
        .iter()
        .map(|g| tokio::spawn(conn::run(g.clone(), common.clone(), stop.subscribe())))
        .collect();
    Ok(StreamHandle {
        spools: Spools {
            guests: guests.into(),
            clock,
        },
        stop,
        tasks,
        lagged: metrics.lagged,
    })
}

/// An event ready for a spool: host realtime ns (as reported), host monotonic ns, kind,
/// postcard payload.
pub type RawEvent = (i64, u64, u16, Vec<u8>);

fn push_encoded(g: &Guest, evs: &[Arc<EncodedEvent>]) {
    let mut s = g.spool();
    let mut dropped = 0;
    for e in evs {
        match s.push(e.clone()) {
            Ok((_, d)) => dropped += d,
            Err(e) => {
                tracing::error!(guest = %g.cfg.label(), error = %e, "event cannot be framed; skipped");
            }
        }
    }
    // Logged when writing starts failing and when it works again, not at every batch.
    let was_failing = s.disk_failing();
    match s.flush(Duration::from_secs(1)) {
        Ok(d) => {
            dropped += d;
            if was_failing && !s.disk_failing() {
                tracing::info!(guest = %g.cfg.label(), "spool writes work again");
            }
        }
        Err(e) if !was_failing => {
            tracing::error!(guest = %g.cfg.label(), error = %e, pending = s.pending(), "spool write failed; events wait in memory");
        }
        Err(e) => tracing::debug!(guest = %g.cfg.label(), error = %e, "spool write still failing"),
    }
    if dropped > 0 {
        if let Some(unlogged) = g.full_log.note("spool_full", std::time::Instant::now()) {
            tracing::warn!(guest = %g.cfg.label(), dropped, total = s.dropped_total(), unlogged, "spool full: dropped the oldest events");
        }
    }
    g.m.spooled.inc_by(evs.len() as u64);
    g.update_gauges(&mut s);
    drop(s);
    g.notify.notify_one();
}

impl Spools {
    /// Spools events for the guest at `guest_index` (the order of `StreamConfig::guests`).
    /// One [`EncodedEvent`] may go to any number of guests.
    pub fn push_encoded(&self, guest_index: usize, events: &[Arc<EncodedEvent>]) {
        push_encoded(&self.guests[guest_index], events);
    }

    /// Spools raw `(kind, payload)` events for the guest at `guest_index` (tests,
    /// benchmarks). `host_realtime_ns` is used as given.
    pub fn push_raw(&self, guest_index: usize, events: Vec<RawEvent>) {
        let encoded: Vec<_> = events
            .iter()
            .filter_map(|(rt, mono, kind, payload)| {
                EncodedEvent::new(*rt, *mono, *kind, payload)
                    .map_err(|e| tracing::error!(kind, error = %e, "cannot frame event; skipped"))
                    .ok()
                    .map(Arc::new)
            })
            .collect();
        push_encoded(&self.guests[guest_index], &encoded);
    }

    /// Number of guests (valid indices of [`push_encoded`](Self::push_encoded)).
    pub fn guest_count(&self) -> usize {
        self.guests.len()
    }

    /// The reference clock events are to be stamped with.
    pub fn clock(&self) -> &dyn ReferenceClock {
        &*self.clock
    }
}

/// How long a spool may stay locked before the stream counts as wedged (its operations take
/// microseconds; a disk write milliseconds).
const SPOOL_LOCK_PATIENCE: Duration = Duration::from_millis(200);

/// A task's progress: the monotonic time (ns) it last went round its loop. A task that may
/// wait long for work beats on a timer too, so a stale beat means it is stuck.
#[derive(Debug, Default)]
pub struct Beat(std::sync::atomic::AtomicU64);

impl Beat {
    pub fn now(&self) {
        self.0.store(
            crate::clock::monotonic_ns(),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    /// Time since the last beat.
    pub fn age(&self) -> Duration {
        let last = self.0.load(std::sync::atomic::Ordering::Relaxed);
        Duration::from_nanos(crate::clock::monotonic_ns().saturating_sub(last))
    }
}

/// Whether the stream still works, for a watchdog: its tasks run, its spools are not held
/// (a task stuck with a spool locked stops every guest's events), and the tasks with a
/// [`Beat`] went round their loops recently. Cheap to clone.
#[derive(Clone)]
pub struct Liveness {
    tasks: Vec<(String, tokio::task::AbortHandle, Option<Arc<Beat>>)>,
    guests: Arc<[Arc<Guest>]>,
    stopping: watch::Receiver<bool>,
}

impl Liveness {
    /// Watches another task too (the caller's bus reader, say), stale after `Beat::age`
    /// exceeds the `max_age` given to [`check`](Self::check).
    pub fn with_task(
        mut self,
        name: impl Into<String>,
        task: tokio::task::AbortHandle,
        beat: Arc<Beat>,
    ) -> Self {
        self.tasks.push((name.into(), task, Some(beat)));
        self
    }

    /// `Err` with what is stuck; `Ok` while shutting down.
    pub fn check(&self, max_age: Duration) -> Result<(), String> {
        if *self.stopping.borrow() {
            return Ok(());
        }
        for (name, task, beat) in &self.tasks {
            if task.is_finished() {
                return Err(format!("{name} ended"));
            }
            if let Some(age) = beat.as_ref().map(|b| b.age()).filter(|a| *a > max_age) {
                return Err(format!("{name} made no progress for {age:.1?}"));
            }
        }
        for g in self.guests.iter() {
            let t0 = std::time::Instant::now();
            loop {
                match g.spool.try_lock() {
                    Ok(_) | Err(std::sync::TryLockError::Poisoned(_)) => break,
                    Err(std::sync::TryLockError::WouldBlock) => {
                        if t0.elapsed() > SPOOL_LOCK_PATIENCE {
                            return Err(format!(
                                "the spool of guest {} stayed locked for {SPOOL_LOCK_PATIENCE:?}",
                                g.cfg.label()
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
        Ok(())
    }
}

impl StreamHandle {
    /// The stream's [`Liveness`] (its connection tasks and spools).
    pub fn liveness(&self) -> Liveness {
        Liveness {
            tasks: self
                .tasks
                .iter()
                .zip(self.spools.guests.iter())
                .map(|(t, g)| {
                    (
                        format!("the connection task of guest {}", g.cfg.label()),
                        t.abort_handle(),
                        None,
                    )
                })
                .collect(),
            guests: self.spools.guests.clone(),
            stopping: self.stop.subscribe(),
        }
    }

    /// Where events go in.
    pub fn spools(&self) -> &Spools {
        &self.spools
    }

    /// `gpufeed_host_stream_bus_lagged_total`: events the caller's bus subscriber missed.
    pub fn bus_lagged(&self) -> &IntCounter {
        &self.lagged
    }

    pub fn status(&self) -> Vec<SpoolStatus> {
        self.spools
            .guests
            .iter()
            .map(|g| {
                let s = g.spool();
                SpoolStatus {
                    guest: g.cfg.label().to_owned(),
                    boot_id: s.boot_id(),
                    next_seq: s.next_seq(),
                    acked: s.acked(),
                    pending: s.pending(),
                    dropped_total: s.dropped_total(),
                }
            })
            .collect()
    }

    /// Stops the tasks (closing connections) and writes every spool's state to disk.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        for g in self.spools.guests.iter() {
            let mut s = g.spool();
            // The ledger is written even where the frames cannot be: a restart finds the
            // events that only memory held missing and reports them as lost.
            if let Err(e) = s.flush(Duration::ZERO) {
                let unwritten = s.unwritten();
                tracing::error!(guest = %g.cfg.label(), error = %e, unwritten, "spool flush at shutdown failed: the events only in memory are lost with this process, and reported to the guest as lost at the next start");
            }
            g.update_gauges(&mut s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream to a guest that is not there, with real certificates.
    fn stream(dir: &std::path::Path) -> StreamHandle {
        let dep = crate::tls::Deployment::generate("127.0.0.1", &["pve1".into()]).unwrap();
        dep.write_guest_dir(dir).unwrap();
        dep.write_host_files(dir).unwrap();
        let cfg = StreamConfig {
            ca: dir.join(crate::tls::CA_FILE),
            cert: dir.join(crate::tls::host_cert_file("pve1")),
            key: dir.join(crate::tls::host_key_file("pve1")),
            spool_dir: PathBuf::new(),
            guests: vec![GuestEndpoint {
                endpoint: "127.0.0.1:9".into(),
                name: "g".into(),
                server_name: String::new(),
                vmids: vec![],
                devices: vec![],
            }],
            ..StreamConfig::default()
        };
        let clock = Arc::new(crate::clock::SystemClock);
        start(cfg, "pve1".into(), &Registry::new(), clock, None).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn liveness_sees_a_wedged_spool_a_stale_beat_and_an_ended_task() {
        let dir = tempfile::tempdir().unwrap();
        let h = stream(dir.path());
        let max_age = Duration::from_secs(1);
        let beat = Arc::new(Beat::default());
        beat.now();
        let reader = tokio::spawn(std::future::pending::<()>());
        let l = h
            .liveness()
            .with_task("the reader", reader.abort_handle(), beat.clone());
        assert_eq!(l.check(max_age), Ok(()));

        // A task wedged while holding a spool.
        let guest = h.spools.guests[0].clone();
        let (held, release) = (
            std::sync::mpsc::channel::<()>(),
            std::sync::mpsc::channel::<()>(),
        );
        let holder = std::thread::spawn(move || {
            let _spool = guest.spool();
            held.0.send(()).unwrap();
            let _ = release.1.recv();
        });
        held.1.recv().unwrap();
        let e = l.check(max_age).unwrap_err();
        assert!(e.contains("spool of guest g"), "{e}");
        release.0.send(()).unwrap();
        holder.join().unwrap();
        assert_eq!(l.check(max_age), Ok(()));

        // A loop that stopped going round.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let e = l.check(max_age).unwrap_err();
        assert!(e.contains("the reader made no progress"), "{e}");
        beat.now();
        assert_eq!(l.check(max_age), Ok(()));

        // A task that ended (a panic, say).
        reader.abort();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(l.check(max_age), Err("the reader ended".into()));
        h.shutdown().await;
    }
}
