//! What a guest's connection task shares with the router ([`Guest`]: its spool, metrics and
//! wake-up) and with the other tasks ([`Common`]: this host's identity, the configuration, the
//! clock and the host-state source).

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::config::{GuestEndpoint, StreamConfig};
use super::metrics::GuestMetrics;
use super::spool::Spool;
use crate::clock::ReferenceClock;

/// State shared between the router and a guest's connection task.
pub(crate) struct Guest {
    /// Position in [`StreamConfig::guests`] (what a [`StateSource`] is asked about).
    pub(super) index: usize,
    pub(super) cfg: GuestEndpoint,
    pub(super) spool: Mutex<Spool>,
    pub(super) notify: Notify,
    pub(super) m: GuestMetrics,
    /// "spool full" warnings (one per batch otherwise, while the spool overflows).
    pub(super) full_log: crate::ratelog::RateLimitedLog,
    /// "reported spool loss" warnings (one per loss report otherwise).
    pub(super) loss_log: crate::ratelog::RateLimitedLog,
}

impl Guest {
    /// The spool. A panic elsewhere while it was held does not stop the stream: the spool's
    /// state is consistent between its method calls, so the poison is ignored.
    pub(super) fn spool(&self) -> std::sync::MutexGuard<'_, Spool> {
        self.spool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Brings the metrics up to date with the spool; every drop, whatever its cause, reaches
    /// `gpufeed_host_stream_events_dropped_total` here (call after every change).
    pub(super) fn update_gauges(&self, s: &mut Spool) {
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
    pub(super) host_id: String,
    pub(super) cfg: StreamConfig,
    pub(super) clock: Arc<dyn ReferenceClock>,
    pub(super) state: Option<StateSource>,
    pub(super) binder: Option<Binder>,
}

/// The host's series for guest `index` (its position in [`StreamConfig::guests`]) at the given
/// reference time; sent to guests that take host state.
pub type StateSource = Arc<dyn Fn(usize, i64) -> crate::hoststate::HostState + Send + Sync>;

/// Decides, at each handshake, whether guest `index` (its position in
/// [`StreamConfig::guests`]) may be streamed to, given the SMBIOS system UUID its answer named
/// (`None`: it named none). `Err` carries the reason: the host then closes the connection
/// with [`crate::proto::CLOSE_VM_UNBOUND`] and that reason, and tries again later.
pub type Binder = Arc<dyn Fn(usize, Option<&str>) -> Result<(), String> + Send + Sync>;
