//! What a watcher is to the agent: a [`Unit`] in [`super::UNITS`] that registers its series,
//! starts from its configuration section and says how its events read for a person.
//!
//! The agent builds every unit when it is created ([`Unit::new`] registers the unit's series,
//! so that `/metrics` lists them whether or not the watcher runs), then starts them in the
//! order of [`super::UNITS`] ([`Watcher::start`]) and reports each [`Outcome`].

use crate::agent::Agent;
use crate::heartbeat::Beat;
use gpufeed_shared::event::{AerDetail, HostEvent, Source};
use prometheus::Registry;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One watcher in the registry.
pub struct Unit {
    /// Its name in `gpufeed_host_watcher_enabled{watcher=}`, `WatcherDisabled` and the logs;
    /// also the address other watchers poke it by ([`Agent::poke`]).
    pub name: &'static str,
    /// Register the unit's series in the agent's registry and return the watcher to start.
    pub new: fn(&Registry) -> Box<dyn Watcher>,
    /// One line for a person (the `watch` command) for the event kinds this unit emits;
    /// `None` for the others.
    pub describe: fn(&HostEvent) -> Option<String>,
}

/// A built watcher, holding its series until it starts.
pub trait Watcher: Send {
    /// Read its configuration section from `cx.agent.cfg`, take the baseline (no events for
    /// what was already there), spawn its loops. Resolves once it runs or is known not to.
    fn start(self: Box<Self>, cx: Cx) -> Starting;
}

pub type Starting = Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// What a watcher gets when it starts.
pub struct Cx {
    pub agent: Arc<Agent>,
    /// Pokes addressed to this watcher by others ([`Agent::poke`]).
    pub inbox: Inbox,
    /// Set when the agent stops: for watchers that run on their own thread (tokio tasks are
    /// aborted instead).
    pub stop: Arc<AtomicBool>,
}

/// How a start went.
pub enum Outcome {
    /// The configuration does not ask for it: no series, no event, no log line.
    Skipped,
    /// Running; the tasks are aborted when the agent stops. `gpufeed_host_watcher_enabled` 1.
    On(Vec<JoinHandle<()>>),
    /// Asked for but cannot run (missing subsystem, permission): one warning,
    /// `gpufeed_host_watcher_enabled` 0 and a `WatcherDisabled` event with the reason.
    Off(String),
    /// An optional source that is not there, which polling covers: the unit logged why;
    /// `gpufeed_host_watcher_enabled` 0, no event.
    Absent,
}

/// A request from one watcher to another to look now rather than at its next tick.
#[derive(Debug, Clone)]
pub enum Poke {
    /// Poll everything now.
    Tick,
    /// Something happened at this port (empty: anywhere), seen through this source.
    Port(String, Source),
    /// The `ras:aer_event` tracepoint reported this error.
    Aer(AerDetail),
}

/// The pokes addressed to one loop, with its name (for its heartbeat).
pub struct Inbox {
    pub name: &'static str,
    pub rx: mpsc::Receiver<Poke>,
}

/// A poller's wake-ups: its timer's ticks merged with the pokes sent to it. Once every sender
/// is gone only the timer is left (a closed channel must not be polled again: it is always
/// ready, and the loop would spin). Asking for the next wake-up is the loop's heartbeat: a
/// poller stuck in its poll stops asking, and the watchdog notices.
pub struct Pokes {
    timer: crate::ticks::Ticks,
    rx: mpsc::Receiver<Poke>,
    open: bool,
    beat: Arc<Beat>,
}

impl Pokes {
    /// `timer` past its immediate first tick (the caller polled once already).
    pub fn new(timer: crate::ticks::Ticks, rx: mpsc::Receiver<Poke>, beat: Arc<Beat>) -> Pokes {
        Pokes {
            timer,
            rx,
            open: true,
            beat,
        }
    }

    pub async fn next(&mut self) -> Poke {
        self.beat.now();
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
