//! What a running watcher may use besides its own section and series: the roots it reads, the
//! event bus it emits on, the topology and recent kernel log it reads, the timers' common phase,
//! the heartbeats the watchdog checks, the other units' inboxes to poke, and whether AER
//! records come from the tracepoint. The agent builds one [`Context`] and hands every unit a
//! reference to it; no unit sees the agent or another unit's configuration.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use gpufeed_shared::event::HostEvent;
use tokio::sync::mpsc;

use super::poke::{Inbox, Poke, Pokes};
use super::recent::RecentKmsg;
use super::topology::TopoCell;
use crate::events::EventBus;
use crate::heartbeat::{Beat, Heartbeats};
use crate::roots::Roots;

/// Address of the discovery loop for [`Context::poke`] (a uevent asks it to rescan).
pub const DISCOVERY: &str = "discovery";

/// See the module docs.
pub struct Context {
    pub roots: Roots,
    pub bus: Arc<EventBus>,
    pub recent: Arc<RecentKmsg>,
    pub topo: Arc<TopoCell>,
    /// The periodic loops' progress, for the watchdog.
    pub heartbeats: Heartbeats,
    /// `ras:aer_event` records are being read (the tracepoints watcher set it up): the aer
    /// watcher then holds what its poll finds first for the record to join.
    pub aer_records: AtomicBool,
    /// Common phase of the pollers' timers: intervals that divide each other fire in the same
    /// wake-up (pcie, aer and vm each second, thunderbolt every other, host every fifth).
    phase: crate::ticks::Phase,
    /// Poke senders by unit name (and [`DISCOVERY`]).
    pokes: HashMap<&'static str, mpsc::Sender<Poke>>,
}

impl Context {
    pub fn new(
        roots: Roots,
        bus: Arc<EventBus>,
        pokes: HashMap<&'static str, mpsc::Sender<Poke>>,
    ) -> Context {
        Context {
            roots,
            bus,
            recent: Arc::new(RecentKmsg::default()),
            topo: Arc::new(TopoCell::default()),
            heartbeats: Heartbeats::default(),
            aer_records: AtomicBool::new(false),
            phase: crate::ticks::Phase::now(),
            pokes,
        }
    }

    /// A poller's timer: first tick at once, then on the agent's common phase (see
    /// [`crate::ticks`]). A late tick is skipped rather than shifting the phase.
    pub fn ticker(&self, period_ms: u64) -> crate::ticks::Ticks {
        crate::ticks::Ticks::new(self.phase, Duration::from_millis(period_ms.max(1)))
    }

    /// A poller's wake-ups: its timer (past its immediate first tick: the caller polled once
    /// already) merged with its inbox; each wake-up it asks for is its heartbeat.
    pub async fn pokes(&self, period_ms: u64, inbox: Inbox) -> Pokes {
        let mut timer = self.ticker(period_ms);
        timer.tick().await;
        let beat = self.heartbeat(inbox.name, period_ms);
        Pokes::new(timer, inbox.rx, beat)
    }

    /// The heartbeat of a loop that comes round every `period_ms` (see [`Heartbeats`]).
    pub fn heartbeat(&self, name: &'static str, period_ms: u64) -> Arc<Beat> {
        self.heartbeats
            .register(name, Duration::from_millis(period_ms.max(1)))
    }

    /// Ask the unit named `to` (or [`DISCOVERY`]) to look now. Never blocks: a full inbox
    /// already holds a poke that will make it look.
    pub fn poke(&self, to: &str, p: Poke) {
        if let Some(tx) = self.pokes.get(to) {
            let _ = tx.try_send(p);
        }
    }

    /// Emit events in order.
    pub fn emit_all(&self, evs: impl IntoIterator<Item = HostEvent>) {
        for ev in evs {
            self.bus.emit(ev);
        }
    }
}
