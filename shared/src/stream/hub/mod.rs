//! The hub: QUIC server (`--quic-listen ADDR:PORT`, `--tls-dir DIR`) that host agents stream
//! their events to.
//!
//! * Accepts only clients whose certificate chains to the deployment CA and names a host listed
//!   in `DIR/allowed-hosts` (see `crate::tls`), with ALPN `gpufeed/1`. The files are
//!   re-read when they change (checked every `tls_reload_interval`).
//! * Per connection: `Hello` → `Welcome{resume_from}`, then events in sequence order on a
//!   unidirectional stream; de-duplication by `(host, boot, seq)`; acks and clock probes on the
//!   control stream.
//! * Before a connection gets any state, [`admission`] decides: a QUIC Retry (address
//!   validation), a refusal (too many handshakes, or connections from one address), or a
//!   handshake that must finish within `handshake_timeout`; the handshake places are shared
//!   fairly among addresses (a newcomer evicts the oldest handshake of the address holding
//!   most), and addresses of hosts that authenticated before have places of their own.
//! * Every rejection (TLS failure, wrong ALPN, unlisted host, refused `Hello`, garbage /
//!   oversize / truncated frames, protocol violations, the limits above) increments
//!   `gpufeed_stream_frames_rejected_total{host,reason}` (`host="unverified"` before the peer
//!   is authenticated) and logs a `warn` line; for unauthenticated peers, who can repeat them
//!   at will, at most one line per reason every 10 s, with the count of those not logged.
//!   An event this guest cannot decode (a kind from a newer host agent) is counted with
//!   `reason="unknown_kind"`, and what its frame says (host, kind number, payload size,
//!   sequence, host time) goes to the join ([`Delivery::Unknown`]): the guest lists it, never
//!   drops it silently.
//! * Recent events are kept in a bounded ring ([`Hub::recent`]), optionally journaled
//!   ([`HubConfig::journal`]), and handed in order to the one join that takes them
//!   ([`Hub::intake`]): a bounded queue that pushes back on the hosts' streams rather than
//!   dropping (see [`intake`]).
//!
//! Metrics: `gpufeed_stream_connected{host}`, `gpufeed_stream_events_received_total{host}`,
//! `gpufeed_stream_events_duplicate_total{host}`, `gpufeed_stream_events_lost_total{host}`,
//! `gpufeed_stream_lag_seconds{host}`, `gpufeed_stream_frames_rejected_total{host,reason}`,
//! `gpufeed_clock_offset_seconds{host}` (host minus guest), `gpufeed_clock_round_trip_seconds{host}`,
//! and where a KVM PTP clock exists `gpufeed_clock_kvm_ptp_offset_seconds` (hypervisor minus
//! guest, the cross-check).
//!
//! The protocol's decisions are sans-IO: the connection's state machine is
//! [`crate::proto::GuestConnection`], and what a read of the event stream amounts to
//! (journal, then de-duplication table and recent ring, or nothing at all) is [`batch`]'s.
//! The rest moves bytes and applies their outcome: this module starts the endpoint, holds the
//! shared state and reloads the TLS files; `accept` takes a connection from admission to an
//! authenticated host, and `conn` drives it from the `Hello` on. [`HubConfig`] is in `config`,
//! the series in `metrics`.

mod accept;
pub use crate::admission;
pub mod batch;
mod config;
mod conn;
pub mod host_state;
pub mod intake;
pub mod journal;
mod metrics;
pub mod recent;

pub use config::HubConfig;
pub use intake::Delivery;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::clock::{ClockFilter, KvmPtp};
use crate::event::HostEvent;
use crate::proto::Dedup;
use crate::tls::{self, FileStamps, GuestTlsDir};
use metrics::Metrics;
use prometheus::Registry;
use serde::Serialize;
use tokio::sync::mpsc;

/// A host event as received by the hub.
#[derive(Debug, Clone, Serialize)]
pub struct ReceivedEvent {
    /// Host identity (from its certificate).
    pub host: String,
    pub boot_id: u64,
    pub seq: u64,
    pub kind: u16,
    /// Host realtime when the event was emitted (host clock), ns.
    pub host_realtime_ns: i64,
    pub host_monotonic_ns: u64,
    /// Guest realtime when the hub received it, ns.
    pub received_realtime_ns: i64,
    /// Host minus guest clock offset estimated at receipt, ns (None before the first probe).
    pub clock_offset_ns: Option<i64>,
    pub event: HostEvent,
}

/// An event whose payload this guest could not decode as its frame's kind (a kind from a newer
/// host agent): what the frame says about it.
#[derive(Debug, Clone, Serialize)]
pub struct UnknownEvent {
    pub host: String,
    /// The frame's kind number.
    pub kind: u16,
    /// Size of the undecoded payload in bytes.
    pub payload_len: usize,
    pub seq: u64,
    /// When the host emitted it (host clock), and the offset estimated at receipt, as in
    /// [`ReceivedEvent`].
    pub host_realtime_ns: i64,
    pub clock_offset_ns: Option<i64>,
}

impl ReceivedEvent {
    /// When the event happened, in guest realtime (host time minus the estimated offset).
    pub fn guest_realtime_ns(&self) -> i64 {
        self.host_realtime_ns - self.clock_offset_ns.unwrap_or(0)
    }
}

/// Why the hub could not start (or could not reload its TLS files).
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("loading TLS files from {dir}: {source}")]
    Tls { dir: PathBuf, source: tls::TlsError },
    #[error("TLS config unusable for QUIC: {0}")]
    QuicTls(#[from] quinn::crypto::rustls::NoInitialCipherSuite),
    #[error("idle timeout out of range: {0}")]
    IdleTimeout(#[from] quinn::VarIntBoundsExceeded),
    #[error("binding QUIC on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("opening event journal {path}: {source}")]
    Journal {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// Label used for peers that did not authenticate.
pub const UNVERIFIED: &str = "unverified";
/// Application close code for protocol errors.
pub const CLOSE_PROTOCOL: u32 = 1;
/// Application close code for a refused peer.
pub const CLOSE_REFUSED: u32 = 2;
/// Application close code when the guest cannot take events now (its journal cannot be
/// written): the host keeps them and reconnects.
pub const CLOSE_UNAVAILABLE: u32 = 3;

struct State {
    dedup: Dedup,
    recent: recent::Recent,
    journal: Option<journal::Journal>,
    clocks: HashMap<String, ClockFilter>,
}

struct Inner {
    cfg: HubConfig,
    state: Mutex<State>,
    metrics: Metrics,
    allowed: RwLock<Vec<String>>,
    /// Where accepted events go to the join.
    intake: intake::Intake,
    endpoint: quinn::Endpoint,
    ptp: Option<Mutex<KvmPtp>>,
    ptp_warned: Mutex<HashMap<String, Instant>>,
    /// The hosts' own series, exported in this guest's scrape.
    host_states: Arc<host_state::HostStates>,
    admission: admission::Admission,
    /// Authenticated connections by `stable_id`, with their host: closed when the host leaves
    /// `allowed-hosts`.
    live: Mutex<HashMap<usize, (String, quinn::Connection)>>,
    /// Rejections of unauthenticated peers, which anyone reaching the port can repeat.
    unverified_log: crate::ratelog::RateLimitedLog,
    /// Repeating warnings about authenticated hosts' streams, per host and kind.
    host_log: crate::ratelog::RateLimitedLog<(String, &'static str)>,
}

/// The running hub. Cheap to clone.
#[derive(Clone)]
pub struct Hub {
    inner: Arc<Inner>,
}

fn quinn_server_config(
    tls_cfg: rustls::ServerConfig,
    cfg: &HubConfig,
) -> Result<quinn::ServerConfig, HubError> {
    let quic = quinn::crypto::rustls::QuicServerConfig::try_from(tls_cfg)?;
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(quic));
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(cfg.idle_timeout.try_into()?));
    t.max_concurrent_uni_streams(4u32.into());
    t.max_concurrent_bidi_streams(4u32.into());
    t.stream_receive_window((4u32 << 20).into());
    t.receive_window((8u32 << 20).into());
    sc.transport_config(Arc::new(t));
    // Datagrams buffered for connections not yet accepted or refused: the accept loop decides
    // at once, so little is needed (quinn's defaults allow 100 MB).
    sc.max_incoming((cfg.max_handshakes + cfg.known_reserve).max(1) * 4);
    sc.incoming_buffer_size(64 << 10);
    sc.incoming_buffer_size_total(1 << 20);
    Ok(sc)
}

/// Starts the hub: loads the TLS files, binds `cfg.listen`, registers the metrics on
/// `registry` and spawns the accept and reload tasks. Must run inside a tokio runtime.
pub async fn serve(cfg: HubConfig, registry: &Registry) -> Result<Hub, HubError> {
    let dir = GuestTlsDir::new(&cfg.tls_dir);
    let (tls_cfg, allowed) = dir.load().map_err(|source| HubError::Tls {
        dir: cfg.tls_dir.clone(),
        source,
    })?;
    // Stateless-reset key derived from the guest's private key: a restarted guest (same key)
    // answers packets of its predecessor's connections with a valid stateless reset, so hosts
    // notice at once instead of after the idle timeout. The connection IDs are keyed from it
    // too: quinn drops packets whose ID its generator does not validate, and its default key
    // is random per process, so a restarted guest would drop them instead of resetting.
    let key_pem =
        tls::read(&cfg.tls_dir.join(tls::GUEST_KEY_FILE)).map_err(|source| HubError::Tls {
            dir: cfg.tls_dir.clone(),
            source,
        })?;
    let seed = ring::digest::digest(
        &ring::digest::SHA256,
        &[b"gpufeed stateless reset\0".as_slice(), &key_pem].concat(),
    );
    let mut ep_cfg = quinn::EndpointConfig::new(Arc::new(ring::hmac::Key::new(
        ring::hmac::HMAC_SHA256,
        seed.as_ref(),
    )));
    let cid_key = ring::digest::digest(
        &ring::digest::SHA256,
        &[b"gpufeed connection ids\0".as_slice(), &key_pem].concat(),
    );
    let cid_key = u64::from_le_bytes(cid_key.as_ref()[..8].try_into().unwrap_or_default());
    ep_cfg.cid_generator(move || {
        Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key))
    });
    let socket = std::net::UdpSocket::bind(cfg.listen).map_err(|source| HubError::Bind {
        addr: cfg.listen,
        source,
    })?;
    let endpoint = quinn::Endpoint::new(
        ep_cfg,
        Some(quinn_server_config(tls_cfg, &cfg)?),
        socket,
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(|source| HubError::Bind {
        addr: cfg.listen,
        source,
    })?;
    let metrics = Metrics::new(registry)?;
    let mut dedup = Dedup::new();
    let journal = match &cfg.journal {
        Some(p) => Some(
            journal::Journal::open(p, cfg.journal_max_bytes, &mut dedup).map_err(|source| {
                HubError::Journal {
                    path: p.clone(),
                    source,
                }
            })?,
        ),
        None => None,
    };
    if let Some(j) = &journal {
        metrics.journal_damaged.inc_by(j.damaged_records());
    }
    let ptp = match KvmPtp::open(&cfg.sysfs_root) {
        Ok(Some(p)) => match p.offset_ns() {
            Ok(off) => {
                tracing::info!(device = %p.path().display(), offset_ns = off, "KVM virtual PTP clock found: clock offsets are cross-checked against it");
                registry.register(Box::new(metrics.ptp.clone()))?;
                metrics.ptp.set(off as f64 / 1e9);
                Some(Mutex::new(p))
            }
            Err(e) => {
                tracing::warn!(device = %p.path().display(), error = %e, "KVM virtual PTP clock present but unreadable (host clocksource not TSC?): no cross-check");
                None
            }
        },
        Ok(None) => {
            tracing::info!("no KVM virtual PTP clock: clock offsets come from probes only");
            None
        }
        Err(e) => {
            tracing::info!(error = %e, "cannot open the KVM virtual PTP clock (needs access to /dev/ptpN): offsets are not cross-checked");
            None
        }
    };
    let listen = endpoint.local_addr().map_err(|source| HubError::Bind {
        addr: cfg.listen,
        source,
    })?;
    tracing::info!(listen = %listen, allowed = ?allowed, "hub listening");
    let host_states = Arc::new(host_state::HostStates::default());
    registry.register(Box::new(host_state::HostStatesCollector(
        host_states.clone(),
    )))?;
    let inner = Arc::new(Inner {
        state: Mutex::new(State {
            dedup,
            recent: recent::Recent::new(cfg.recent_capacity, cfg.recent_max_bytes),
            journal,
            clocks: HashMap::new(),
        }),
        metrics,
        allowed: RwLock::new(allowed),
        intake: intake::Intake::new(registry)?,
        endpoint,
        ptp,
        ptp_warned: Mutex::new(HashMap::new()),
        host_states,
        admission: admission::Admission::new(admission::Limits {
            max_pending: cfg.max_handshakes,
            max_per_address: cfg.max_per_address,
            retry_above: cfg.retry_above,
            known_reserve: cfg.known_reserve,
        }),
        unverified_log: crate::ratelog::RateLimitedLog::new(UNVERIFIED_LOG_INTERVAL),
        host_log: crate::ratelog::RateLimitedLog::new(UNVERIFIED_LOG_INTERVAL),
        live: Mutex::new(HashMap::new()),
        cfg,
    });
    tokio::spawn(accept::accept_loop(inner.clone()));
    tokio::spawn(reload_loop(inner.clone(), dir));
    Ok(Hub { inner })
}

impl Hub {
    /// The last host state received from `host` (kept after its stream stopped).
    pub fn host_state(&self, host: &str) -> Option<crate::hoststate::HostState> {
        self.inner.host_states.get(host)
    }

    /// Every allowed host and whether its stream is connected now.
    pub fn hosts(&self) -> Vec<(String, bool)> {
        let allowed = self
            .inner
            .allowed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        allowed
            .into_iter()
            .map(|h| {
                let up = self.inner.metrics.connected.with_label_values(&[&h]).get() > 0;
                (h, up)
            })
            .collect()
    }

    /// The most recent events, oldest first.
    pub fn recent(&self) -> Vec<ReceivedEvent> {
        let st = self.inner.state.lock().expect("hub state");
        st.recent.iter().cloned().collect()
    }

    /// Every event accepted from now on, in the order accepted, events of unknown kinds among
    /// them: for the one join (the first caller; `None` after). The hub waits for the receiver
    /// when [`intake::CAPACITY`] events are queued, so that nothing accepted is dropped on the
    /// way; a receiver that is dropped is counted for what it did not take.
    pub fn intake(&self) -> Option<mpsc::Receiver<Delivery>> {
        self.inner.intake.take(intake::CAPACITY)
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner
            .endpoint
            .local_addr()
            .unwrap_or(self.inner.cfg.listen)
    }

    /// Current clock offset estimate for `host` (host minus guest), ns.
    pub fn clock_offset_ns(&self, host: &str) -> Option<i64> {
        let st = self.inner.state.lock().expect("hub state");
        st.clocks.get(host)?.estimate().map(|e| e.offset_ns)
    }

    /// Closes all connections and the endpoint.
    pub async fn shutdown(&self) {
        self.inner.endpoint.close(0u32.into(), b"shutdown");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.endpoint.wait_idle()).await;
    }
}

/// At most one log line per this interval and reason for rejected unauthenticated peers.
const UNVERIFIED_LOG_INTERVAL: Duration = Duration::from_secs(10);

impl Inner {
    /// Counts a rejection and logs it; rejections of unauthenticated peers are logged
    /// rate-limited (anyone who reaches the port can repeat them).
    fn reject(
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
    fn drop_unlisted(&self, allowed: &[String]) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        for (host, conn) in live.values() {
            if !allowed.contains(host) {
                tracing::warn!(host = %host, remote = %conn.remote_address(), "hub: host removed from allowed-hosts: closing its connection");
                conn.close(CLOSE_REFUSED.into(), b"host no longer allowed");
            }
        }
    }

    /// Logs the rate-limited rejections not logged yet.
    fn log_unlogged_rejections(&self) {
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

async fn reload_loop(inner: Arc<Inner>, dir: GuestTlsDir) {
    let mut stamps = FileStamps::new(dir.paths());
    let mut tick = tokio::time::interval(inner.cfg.tls_reload_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        inner.log_unlogged_rejections();
        if !stamps.changed() {
            continue;
        }
        match dir
            .load()
            .map_err(|source| HubError::Tls {
                dir: dir.dir.clone(),
                source,
            })
            .and_then(|(c, a)| Ok((quinn_server_config(c, &inner.cfg)?, a)))
        {
            Ok((sc, allowed)) => {
                inner.endpoint.set_server_config(Some(sc));
                tracing::info!(dir = %dir.dir.display(), allowed = ?allowed, "hub: TLS files changed: reloaded");
                inner.drop_unlisted(&allowed);
                *inner.allowed.write().expect("allowed") = allowed;
            }
            Err(e) => {
                tracing::warn!(dir = %dir.dir.display(), error = %e, "hub: TLS files changed but cannot be loaded; keeping the previous ones");
            }
        }
    }
}
