//! The agent's single event channel.
//!
//! [`EventBus::new`] is the one place where the channel is created; every watcher emits
//! through [`EventBus::emit`], which stamps the event with the host's `CLOCK_REALTIME` and
//! `CLOCK_MONOTONIC`. Consumers (the `watch` command, the metrics, the host→guest stream)
//! call [`EventBus::subscribe`] and get every event emitted after that call as a
//! [`Stamped`]. The channel is a `tokio::sync::broadcast`: a consumer that falls more than
//! `capacity` events behind gets `RecvError::Lagged(n)` and must count those `n` as lost.

use gpufeed_shared::event::{HostEvent, Stamped};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::broadcast;

#[derive(Debug)]
pub struct EventBus {
    tx: broadcast::Sender<Stamped>,
    emitted: AtomicU64,
}

impl EventBus {
    /// Create the bus. `capacity` bounds how far a subscriber may lag.
    pub fn new(capacity: usize) -> Arc<EventBus> {
        let (tx, _) = broadcast::channel(capacity.max(16));
        Arc::new(EventBus {
            tx,
            emitted: AtomicU64::new(0),
        })
    }

    /// Stamp and publish an event. Never blocks; returns the stamped copy.
    pub fn emit(&self, event: HostEvent) -> Stamped {
        let st = stamp(event);
        tracing::debug!(kind = st.event.kind_name(), "event {:?}", st.event);
        self.emitted.fetch_add(1, Ordering::Relaxed);
        // No subscriber is not an error: the host-local metrics still count.
        let _ = self.tx.send(st.clone());
        st
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Stamped> {
        self.tx.subscribe()
    }

    /// Number of events emitted since start.
    pub fn emitted(&self) -> u64 {
        self.emitted.load(Ordering::Relaxed)
    }
}

/// Stamp an event with the current realtime and monotonic clocks.
pub fn stamp(event: HostEvent) -> Stamped {
    Stamped {
        realtime_ns: realtime_ns(),
        monotonic_ns: monotonic_ns(),
        event,
    }
}

pub fn realtime_ns() -> i64 {
    match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
