//! The running stream: [`start`] opens every guest's spool and spawns its connection task;
//! [`StreamHandle`] stops them, [`Spools`] takes events in, [`Liveness`] says whether the
//! stream still moves.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{IntCounter, Registry};
use tokio::sync::{watch, Notify};

use super::config::StreamConfig;
use super::conn;
use super::error::StreamError;
use super::guest::{Binder, Common, Guest, StateSource};
use super::metrics::{GuestMetrics, Metrics};
use super::spool::{Spool, SpoolLimits};
use crate::clock::ReferenceClock;
use crate::proto::EncodedEvent;

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
/// guest, sent as host state; `binder`, where given, decides at each handshake whether the
/// guest may be streamed to (see [`Binder`]). Must be called inside a tokio runtime. Events are given through
/// [`StreamHandle::spools`].
pub fn start(
    cfg: StreamConfig,
    host_id: String,
    registry: &Registry,
    clock: Arc<dyn ReferenceClock>,
    state: Option<StateSource>,
    binder: Option<Binder>,
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
            connects_unbound: metrics.connects.with_label_values(&[&label, "unbound"]),
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
        binder,
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

fn push_encoded(g: &Guest, evs: &[EncodedEvent]) {
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
    pub fn push_encoded(&self, guest_index: usize, events: &[EncodedEvent]) {
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
            })
            .collect();
        push_encoded(&self.guests[guest_index], &encoded);
    }

    /// Gives up the events held for the guest at `guest_index` (its VM left this host: they
    /// are its new host's to tell); returns how many.
    pub fn give_up(&self, guest_index: usize) -> u64 {
        let g = &self.guests[guest_index];
        let mut s = g.spool();
        let n = s.give_up_pending().unwrap_or_else(|e| {
            tracing::warn!(guest = %g.cfg.label(), error = %e, "spool: the given-up events' watermark not written; they stay on disk until the next acknowledgement");
            0
        });
        g.update_gauges(&mut s);
        n
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
    use std::path::PathBuf;

    use super::super::config::GuestEndpoint;
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
        start(cfg, "pve1".into(), &Registry::new(), clock, None, None).unwrap()
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
