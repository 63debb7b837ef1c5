//! How one watcher asks another to look now ([`Poke`]), and a poller's wake-ups: its timer
//! merged with the pokes sent to it ([`Pokes`]).

use crate::heartbeat::Beat;
use gpufeed_shared::event::{AerDetail, Source};
use std::sync::Arc;
use tokio::sync::mpsc;

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
