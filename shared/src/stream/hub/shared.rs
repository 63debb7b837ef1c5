//! The state the hub's tasks share ([`Inner`]: configuration, metrics, allowed hosts, the
//! endpoint, live connections; [`State`] behind its lock: the stream's sans-IO core with its
//! de-duplication table and clock filters, the recent ring, the journal), and what they do with it: count and log rejections, close the
//! connections of hosts no longer allowed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::config::HubConfig;
use super::core::GuestStream;
use super::error::{CLOSE_REFUSED, UNVERIFIED};
use super::metrics::Metrics;
use super::{host_state, intake, journal, recent};
use crate::admission;
use crate::clock::KvmPtp;

pub(super) struct State {
    /// Every decision about the hosts' streams (the de-duplication table is its own).
    pub(super) stream: GuestStream,
    pub(super) recent: recent::Recent,
    pub(super) journal: Option<journal::Journal>,
}

pub(super) struct Inner {
    pub(super) cfg: HubConfig,
    pub(super) state: Mutex<State>,
    pub(super) metrics: Metrics,
    pub(super) allowed: RwLock<Vec<String>>,
    /// Where accepted events go to the join.
    pub(super) intake: intake::Intake,
    pub(super) endpoint: quinn::Endpoint,
    pub(super) ptp: Option<Mutex<KvmPtp>>,
    /// The hosts' own series, exported in this guest's scrape.
    pub(super) host_states: Arc<host_state::HostStates>,
    pub(super) admission: admission::Admission,
    /// This guest's SMBIOS system UUID (see [`super::vm`]), named to hosts that take it.
    pub(super) vm_uuid: Option<String>,
    /// Authenticated connections by `stable_id`, with their host: closed when the host leaves
    /// `allowed-hosts`.
    pub(super) live: Mutex<HashMap<usize, (String, quinn::Connection)>>,
    /// Rejections of unauthenticated peers, which anyone reaching the port can repeat.
    pub(super) unverified_log: crate::ratelog::RateLimitedLog,
    /// Repeating warnings about authenticated hosts' streams, per host and kind.
    pub(super) host_log: crate::ratelog::RateLimitedLog<(String, &'static str)>,
}

/// At most one log line per this interval and reason for rejected unauthenticated peers.
pub(super) const UNVERIFIED_LOG_INTERVAL: Duration = Duration::from_secs(10);

impl Inner {
    /// Counts a rejection and logs it; rejections of unauthenticated peers are logged
    /// rate-limited (anyone who reaches the port can repeat them).
    pub(super) fn reject(
        &self,
        host: &str,
        reason: &'static str,
        remote: SocketAddr,
        detail: &dyn std::fmt::Display,
    ) {
        self.metrics
            .rejected
            .with_label_values(&[host, reason])
            .inc();
        if host != UNVERIFIED {
            // An authenticated host can repeat them too (a stream of garbage frames).
            if let Some(unlogged) = self
                .host_log
                .note((host.to_owned(), reason), Instant::now())
            {
                tracing::warn!(host, %remote, reason, unlogged, "hub: rejected: {detail}");
            }
            return;
        }
        if let Some(unlogged) = self.unverified_log.note(reason, Instant::now()) {
            tracing::warn!(host, %remote, reason, unlogged, "hub: rejected: {detail}");
        }
    }

    /// Closes the live connections of hosts not in `allowed` (removed from `allowed-hosts`):
    /// the certificate check only runs at the handshake.
    pub(super) fn drop_unlisted(&self, allowed: &[String]) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        for (host, conn) in live.values() {
            if !allowed.contains(host) {
                tracing::warn!(host = %host, remote = %conn.remote_address(), "hub: host removed from allowed-hosts: closing its connection");
                conn.close(CLOSE_REFUSED.into(), b"host no longer allowed");
            }
        }
    }

    /// Logs the rate-limited rejections not logged yet.
    pub(super) fn log_unlogged_rejections(&self) {
        for (reason, unlogged) in self.unverified_log.due(Instant::now()) {
            tracing::warn!(
                host = UNVERIFIED,
                reason,
                unlogged,
                "hub: rejected {unlogged} more unauthenticated connections in the last {}s",
                UNVERIFIED_LOG_INTERVAL.as_secs()
            );
        }
    }
}
