//! The one way accepted events leave the hub for the guest's join: a bounded queue in the
//! order the hub accepted them, events of unknown kinds among them.
//!
//! The queue pushes back instead of dropping. A connection whose events the join has not taken
//! yet waits before it reads more of its stream, so a burst (a host's spool replayed after a
//! guest restart, a flapping link) waits in QUIC's flow control and, beyond it, in the host's
//! spool, which was made to hold it; the events are journaled and acknowledged as before. The
//! only loss left is a join that is gone (its task ended): what the hub could not hand over is
//! counted in `gpufeed_join_events_dropped_total{reason}` and logged once per interval with the
//! count.
//!
//! Until someone takes the queue ([`super::Hub::intake`]) nothing is queued: a hub that nobody
//! joins (the host agent's tests, the stream benchmark) keeps its events in the recent ring and
//! the journal only.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, Opts, Registry};
use tokio::sync::mpsc;

use super::event::{ReceivedEvent, UnknownEvent};
use crate::ratelog::RateLimitedLog;

/// Events the queue holds before the hub waits for the join.
pub const CAPACITY: usize = 4096;

/// The series counting what could not be handed to the join.
pub const DROPPED: &str = "gpufeed_join_events_dropped_total";

/// Why an accepted event did not reach the join.
pub const JOIN_STOPPED: &str = "join_stopped";

/// One accepted event, as the join takes it.
// Nearly every delivery is an `Event`: boxing it would cost an allocation per event to shrink
// the rare `Unknown`.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Delivery {
    /// An event this guest decodes.
    Event(ReceivedEvent),
    /// An event of a kind this guest cannot decode: what its frame says.
    Unknown(UnknownEvent),
}

impl Delivery {
    /// The event's sequence number in its host's stream.
    pub fn seq(&self) -> u64 {
        match self {
            Delivery::Event(e) => e.seq,
            Delivery::Unknown(u) => u.seq,
        }
    }
}

pub(super) struct Intake {
    tx: Mutex<Option<mpsc::Sender<Delivery>>>,
    dropped: IntCounterVec,
    log: RateLimitedLog,
}

impl Intake {
    pub(super) fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let dropped = IntCounterVec::new(
            Opts::new(
                DROPPED,
                "Accepted host events the join could not take (they are in the journal), by reason",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(dropped.clone()))?;
        Ok(Intake {
            tx: Mutex::new(None),
            dropped,
            log: RateLimitedLog::new(Duration::from_secs(10)),
        })
    }

    /// The queue's receiving end, for the first caller; `None` after.
    pub(super) fn take(&self, capacity: usize) -> Option<mpsc::Receiver<Delivery>> {
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        if tx.is_some() {
            return None;
        }
        let (s, r) = mpsc::channel(capacity.max(1));
        *tx = Some(s);
        Some(r)
    }

    fn sender(&self) -> Option<mpsc::Sender<Delivery>> {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Hands `items` to the join in order, waiting while its queue is full.
    pub(super) async fn deliver(&self, items: Vec<Delivery>) {
        if items.is_empty() {
            return;
        }
        let Some(tx) = self.sender() else { return };
        let total = items.len();
        for (i, d) in items.into_iter().enumerate() {
            if tx.send(d).await.is_err() {
                self.stopped((total - i) as u64);
                return;
            }
        }
    }

    /// The join is gone: the `n` events it did not take are counted (each later batch too).
    fn stopped(&self, n: u64) {
        self.dropped.with_label_values(&[JOIN_STOPPED]).inc_by(n);
        if let Some(unlogged) = self.log.note(JOIN_STOPPED, Instant::now()) {
            tracing::warn!(
                events = n,
                unlogged,
                "hub: the join has stopped; accepted events are journaled but not joined"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64) -> Delivery {
        Delivery::Event(super::super::event::sample(seq))
    }

    fn dropped(i: &Intake) -> u64 {
        i.dropped.with_label_values(&[JOIN_STOPPED]).get()
    }

    /// A burst larger than the queue waits for the join instead of being dropped, and reaches
    /// it whole and in order.
    #[tokio::test]
    async fn a_burst_beyond_the_queue_waits_for_the_join() {
        let intake = std::sync::Arc::new(Intake::new(&Registry::new()).unwrap());
        let mut rx = intake.take(16).unwrap();
        assert!(intake.take(16).is_none(), "one join takes the queue");
        let sending = {
            let intake = intake.clone();
            tokio::spawn(async move { intake.deliver((0..1000).map(event).collect()).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !sending.is_finished(),
            "the hub waits while the queue is full"
        );
        let mut seen = Vec::new();
        while seen.len() < 1000 {
            seen.push(rx.recv().await.unwrap().seq());
        }
        sending.await.unwrap();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
        assert_eq!(dropped(&intake), 0);
    }

    /// Nobody joins: nothing is queued and nothing counted; a join that stopped: what it did
    /// not take is counted.
    #[tokio::test]
    async fn without_a_join_nothing_waits_and_a_stopped_join_is_counted() {
        let intake = Intake::new(&Registry::new()).unwrap();
        intake.deliver((0..10_000).map(event).collect()).await;
        assert_eq!(dropped(&intake), 0);
        let rx = intake.take(4).unwrap();
        drop(rx);
        intake.deliver((0..7).map(event).collect()).await;
        assert_eq!(dropped(&intake), 7);
    }
}
