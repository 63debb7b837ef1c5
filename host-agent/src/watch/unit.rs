//! What a watcher is to the agent: a [`Unit`] (its name and how its events read for a person)
//! and the [`Watcher`] its registry line builds from its own configuration section.
//!
//! The agent builds every unit when it is created (building registers the unit's series, so
//! that `/metrics` lists them whether or not the watcher runs), then starts those the
//! configuration asks for in the order of the registry ([`Watcher::start`]) and reports each
//! [`Outcome`]. A running watcher gets its section (it was built with it), its inbox and the
//! agent's shared parts ([`Context`]): nothing else of the agent or of other units.

use super::context::Context;
pub use super::poke::{Inbox, Poke, Pokes};
use gpufeed_shared::event::HostEvent;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// One watcher, as the registry names it.
pub struct Unit {
    /// Its name in `gpufeed_host_watcher_enabled{watcher=}`, `WatcherDisabled` and the logs;
    /// also the address other watchers poke it by ([`Context::poke`]).
    pub name: &'static str,
    /// One line for a person (the `watch` command) for the event kinds this unit emits;
    /// `None` for the others.
    pub describe: fn(&HostEvent) -> Option<String>,
}

/// A built watcher, holding its section and series until it starts.
pub trait Watcher: Send {
    /// Take the baseline (no events for what was already there), spawn its loops. Resolves
    /// once it runs or is known not to.
    fn start(self: Box<Self>, cx: Cx) -> Starting;
}

/// The series a built watcher that is not asked for holds: registered, never set.
pub struct NotAsked;

impl Watcher for NotAsked {
    fn start(self: Box<Self>, _: Cx) -> Starting {
        Box::pin(async { Outcome::Skipped })
    }
}

/// ` vm <id>` when the event has a VM, for the units' descriptions.
pub fn vm_suffix(v: Option<u32>) -> String {
    v.map(|v| format!(" vm {v}")).unwrap_or_default()
}

pub type Starting = Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// What a watcher gets when it starts.
pub struct Cx {
    /// The agent's shared parts.
    pub ctx: Arc<Context>,
    /// Pokes addressed to this watcher by others ([`Context::poke`]).
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
