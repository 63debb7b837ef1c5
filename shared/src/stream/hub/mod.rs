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
//!   sequence, host time) goes to [`Hub::subscribe_unknown`]: the guest lists it, never drops it
//!   silently.
//! * Recent events are kept in a bounded ring ([`Hub::recent`]) and broadcast
//!   ([`Hub::subscribe`]); optionally journaled ([`HubConfig::journal`]).
//!
//! Metrics: `gpufeed_stream_connected{host}`, `gpufeed_stream_events_received_total{host}`,
//! `gpufeed_stream_events_duplicate_total{host}`, `gpufeed_stream_events_lost_total{host}`,
//! `gpufeed_stream_lag_seconds{host}`, `gpufeed_stream_frames_rejected_total{host,reason}`,
//! `gpufeed_clock_offset_seconds{host}` (host minus guest), `gpufeed_clock_round_trip_seconds{host}`,
//! and where a KVM PTP clock exists `gpufeed_clock_kvm_ptp_offset_seconds` (hypervisor minus
//! guest, the cross-check).

pub use crate::admission;
pub mod host_state;
pub mod journal;
pub mod recent;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::clock::{self, ClockFilter, KvmPtp};
use crate::event::HostEvent;
use crate::proto::{
    encode, DecodeError, Dedup, FrameDecoder, GuestConnection, GuestTiming, Message, ServerAction,
    Staged, ALPN,
};
use crate::tls::{self, FileStamps, GuestTlsDir};
use prometheus::{Gauge, GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use rustls::pki_types::CertificateDer;
use serde::Serialize;
use tokio::sync::broadcast;

/// Settings of the hub. [`HubConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// UDP address to listen on.
    pub listen: SocketAddr,
    /// Directory with `ca.pem`, `guest.pem`, `guest-key.pem`, `allowed-hosts`.
    pub tls_dir: PathBuf,
    /// Events kept for [`Hub::recent`]. Default 4096.
    pub recent_capacity: usize,
    /// ... and at most about this many bytes of them (twice the encoded payload per event, an
    /// estimate of the decoded size). Default 8 MiB, within the DaemonSet's 256 MiB limit even
    /// with every event at the frame limit.
    pub recent_max_bytes: usize,
    /// Append accepted events to this JSON-lines file and seed de-duplication from it at start.
    /// Default none.
    pub journal: Option<PathBuf>,
    /// When the journal grows past this, it is compacted to one watermark line per
    /// `(host, boot)`. Default 64 MiB.
    pub journal_max_bytes: u64,
    /// How often the TLS files are checked for changes. Default 5 s.
    pub tls_reload_interval: Duration,
    /// Acknowledge at least this often while events arrive. Default 20 ms.
    pub ack_interval: Duration,
    /// ... or after this many events. Default 4096.
    pub ack_every: u64,
    /// Clock probe interval after the initial burst. Default 2 s.
    pub clock_probe_interval: Duration,
    /// QUIC idle timeout. Default 15 s.
    pub idle_timeout: Duration,
    /// Where to look for `class/ptp` (KVM PTP cross-check). Default `/sys`.
    pub sysfs_root: PathBuf,
    /// Connections in their TLS handshake at once; more are refused (`reason="busy"`).
    /// Default 64.
    pub max_handshakes: usize,
    /// Connections (in a handshake or established) from one IP address; more are refused
    /// (`reason="per_address"`). Default 8.
    pub max_per_address: usize,
    /// With this many handshakes in flight, a peer must first validate its address with a
    /// QUIC Retry (a stateless round trip). Default 0: always.
    pub retry_above: usize,
    /// A TLS handshake not done by then is dropped (`reason="handshake_timeout"`). Default 3 s,
    /// well below the idle timeout.
    pub handshake_timeout: Duration,
    /// Handshake places for addresses from which an allowed host authenticated before (no
    /// Retry, never evicted by strangers). Default 16.
    pub known_reserve: usize,
}

impl HubConfig {
    /// The protocol timing of a connection.
    fn timing(&self) -> GuestTiming {
        GuestTiming {
            ack_every: self.ack_every,
            ack_interval_ns: self.ack_interval.as_nanos() as u64,
            probe_interval_ns: self.clock_probe_interval.as_nanos() as u64,
            ..GuestTiming::default()
        }
    }

    pub fn new(listen: SocketAddr, tls_dir: impl Into<PathBuf>) -> Self {
        HubConfig {
            listen,
            tls_dir: tls_dir.into(),
            recent_capacity: 4096,
            recent_max_bytes: 8 << 20,
            journal: None,
            journal_max_bytes: 64 << 20,
            tls_reload_interval: Duration::from_secs(5),
            ack_interval: Duration::from_millis(20),
            ack_every: 4096,
            clock_probe_interval: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(15),
            sysfs_root: "/sys".into(),
            max_handshakes: 64,
            max_per_address: 8,
            retry_above: 0,
            handshake_timeout: Duration::from_secs(3),
            known_reserve: 16,
        }
    }
}

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

struct Metrics {
    connected: IntGaugeVec,
    received: IntCounterVec,
    duplicate: IntCounterVec,
    lost: IntCounterVec,
    lag: GaugeVec,
    rejected: IntCounterVec,
    offset: GaugeVec,
    rtt: GaugeVec,
    ptp: Gauge,
}

impl Metrics {
    fn new(r: &Registry) -> Result<Self, prometheus::Error> {
        let h = &["host"];
        let m = Metrics {
            connected: IntGaugeVec::new(
                Opts::new(
                    "gpufeed_stream_connected",
                    "Established streams from the host",
                ),
                h,
            )?,
            received: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_events_received_total",
                    "Host events received (after de-duplication)",
                ),
                h,
            )?,
            duplicate: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_events_duplicate_total",
                    "Retransmitted host events dropped by de-duplication",
                ),
                h,
            )?,
            lost: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_events_lost_total",
                    "Host events lost before reaching the guest (as reported by the host's spool)",
                ),
                h,
            )?,
            lag: GaugeVec::new(
                Opts::new(
                    "gpufeed_stream_lag_seconds",
                    "Time from emission on the host to receipt by the hub, of the latest event",
                ),
                h,
            )?,
            rejected: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_frames_rejected_total",
                    "Rejected connections, frames and skipped events, by reason",
                ),
                &["host", "reason"],
            )?,
            offset: GaugeVec::new(
                Opts::new(
                    "gpufeed_clock_offset_seconds",
                    "Host realtime minus guest realtime, estimated from clock probes",
                ),
                h,
            )?,
            rtt: GaugeVec::new(
                Opts::new(
                    "gpufeed_clock_round_trip_seconds",
                    "Round trip of the clock probes used for the offset estimate",
                ),
                h,
            )?,
            ptp: Gauge::new(
                "gpufeed_clock_kvm_ptp_offset_seconds",
                "Hypervisor realtime (KVM virtual PTP) minus guest realtime",
            )?,
        };
        r.register(Box::new(m.connected.clone()))?;
        r.register(Box::new(m.received.clone()))?;
        r.register(Box::new(m.duplicate.clone()))?;
        r.register(Box::new(m.lost.clone()))?;
        r.register(Box::new(m.lag.clone()))?;
        r.register(Box::new(m.rejected.clone()))?;
        r.register(Box::new(m.offset.clone()))?;
        r.register(Box::new(m.rtt.clone()))?;
        Ok(m)
    }
}

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
    tx: broadcast::Sender<ReceivedEvent>,
    unknown_tx: broadcast::Sender<UnknownEvent>,
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
        tx: broadcast::channel(4096).0,
        unknown_tx: broadcast::channel(256).0,
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
    tokio::spawn(accept_loop(inner.clone()));
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

    /// Every event received from now on (a receiver that lags loses events).
    pub fn subscribe(&self) -> broadcast::Receiver<ReceivedEvent> {
        self.inner.tx.subscribe()
    }

    /// Every event of a kind this guest cannot decode received from now on.
    pub fn subscribe_unknown(&self) -> broadcast::Receiver<UnknownEvent> {
        self.inner.unknown_tx.subscribe()
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

/// Decides for every incoming connection before it gets any state (see [`admission`]).
async fn accept_loop(inner: Arc<Inner>) {
    while let Some(incoming) = inner.endpoint.accept().await {
        let remote = incoming.remote_address();
        let validated = incoming.remote_address_validated();
        match inner.admission.decide(remote.ip(), validated) {
            admission::Decision::Retry if incoming.may_retry() => {
                // Stateless: nothing is kept until the peer echoes the token.
                let _ = incoming.retry();
            }
            admission::Decision::Retry => incoming.ignore(),
            admission::Decision::Refuse(reason) => {
                incoming.refuse();
                inner.reject(
                    UNVERIFIED,
                    reason,
                    remote,
                    &format_args!(
                        "too many connections (limits: {} handshakes, {} per address)",
                        inner.cfg.max_handshakes, inner.cfg.max_per_address
                    ),
                );
            }
            admission::Decision::Accept(ticket) => {
                tokio::spawn(handle_incoming(inner.clone(), incoming, ticket));
            }
        }
    }
}

async fn handle_incoming(
    inner: Arc<Inner>,
    incoming: quinn::Incoming,
    mut ticket: admission::Ticket,
) {
    let remote = incoming.remote_address();
    // Dropping the handshake (at the timeout, or evicted for a newcomer) closes the connection
    // and frees its state.
    let handshake = tokio::select! {
        r = tokio::time::timeout(inner.cfg.handshake_timeout, incoming) => r,
        _ = ticket.evicted() => {
            inner.reject(
                UNVERIFIED,
                "evicted",
                remote,
                &format_args!("handshake evicted: its address held the most of the {} handshake places and another address wanted one", inner.cfg.max_handshakes),
            );
            return;
        }
    };
    let conn = match handshake {
        Err(_) => {
            inner.reject(
                UNVERIFIED,
                "handshake_timeout",
                remote,
                &format_args!(
                    "TLS handshake not done within {:?}",
                    inner.cfg.handshake_timeout
                ),
            );
            return;
        }
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            let reason = tls::classify_handshake_error(&e.to_string());
            inner.reject(
                UNVERIFIED,
                reason,
                remote,
                &format_args!("TLS handshake failed: {e}"),
            );
            return;
        }
    };
    let alpn = conn
        .handshake_data()
        .and_then(|h| h.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|h| h.protocol);
    if alpn.as_deref() != Some(ALPN) {
        inner.reject(
            UNVERIFIED,
            "alpn",
            remote,
            &format_args!(
                "ALPN {:?} instead of {:?}",
                alpn.as_deref().map(String::from_utf8_lossy),
                String::from_utf8_lossy(ALPN)
            ),
        );
        conn.close(CLOSE_REFUSED.into(), b"alpn");
        return;
    }
    let host = {
        let allowed = inner.allowed.read().expect("allowed");
        conn.peer_identity()
            .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok())
            .and_then(|certs| {
                certs
                    .first()
                    .and_then(|c| tls::identity_of(c, &allowed).map(str::to_owned))
            })
    };
    let Some(host) = host else {
        // The verifier already checks this; the allow list may have changed since.
        inner.reject(UNVERIFIED, "unlisted_host", remote, &tls::UNLISTED_HOST);
        conn.close(CLOSE_REFUSED.into(), b"unlisted host");
        return;
    };
    // Authenticated: it no longer counts against the handshake limit (its address's place
    // is kept while it lives), and its address gets the reserved places from now on.
    ticket.established();
    inner.admission.remember(remote.ip());
    let _live = LiveEntry::new(&inner, &host, &conn);
    let connected = inner.metrics.connected.with_label_values(&[&host]);
    let mut c = Conn {
        inner: &inner,
        host: &host,
        remote,
        core: GuestConnection::new(host.clone(), inner.cfg.timing(), clock::monotonic_ns()),
        handshake_done: false,
    };
    let res = c.run(&conn, &connected).await;
    if c.handshake_done {
        connected.dec();
    }
    match res {
        Ok(()) => tracing::info!(host = %host, %remote, "hub: stream closed"),
        Err(End::Rejected(reason, detail)) => {
            inner.reject(&host, reason, remote, &detail);
            conn.close(CLOSE_PROTOCOL.into(), reason.as_bytes());
        }
        Err(End::Lost(e)) => {
            tracing::info!(host = %host, %remote, "hub: connection ended: {e}")
        }
        Err(End::Unavailable) => {
            conn.close(CLOSE_UNAVAILABLE.into(), b"journal unavailable");
        }
    }
}

/// A connection's entry in [`Inner::live`], removed when dropped.
struct LiveEntry<'a> {
    inner: &'a Inner,
    id: usize,
}

impl<'a> LiveEntry<'a> {
    fn new(inner: &'a Inner, host: &str, conn: &quinn::Connection) -> Self {
        let id = conn.stable_id();
        inner
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (host.to_owned(), conn.clone()));
        LiveEntry { inner, id }
    }
}

impl Drop for LiveEntry<'_> {
    fn drop(&mut self) {
        self.inner
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

/// Why a connection ended abnormally.
enum End {
    /// The peer misbehaved: counted, logged, closed.
    Rejected(&'static str, String),
    /// Transport ended (peer gone, timeout).
    Lost(String),
    /// This guest could not take the events (its journal write failed; logged there): they
    /// were neither delivered nor acknowledged, and closing makes the host send them again.
    Unavailable,
}

impl From<quinn::ReadError> for End {
    fn from(e: quinn::ReadError) -> Self {
        End::Lost(e.to_string())
    }
}
impl From<quinn::WriteError> for End {
    fn from(e: quinn::WriteError) -> Self {
        End::Lost(e.to_string())
    }
}
impl From<quinn::ConnectionError> for End {
    fn from(e: quinn::ConnectionError) -> Self {
        End::Lost(e.to_string())
    }
}
impl From<DecodeError> for End {
    fn from(e: DecodeError) -> Self {
        End::Rejected(e.reason(), e.to_string())
    }
}
impl From<crate::proto::ProtocolError> for End {
    fn from(e: crate::proto::ProtocolError) -> Self {
        End::Rejected(e.reason(), e.to_string())
    }
}

struct Conn<'a> {
    inner: &'a Inner,
    host: &'a str,
    remote: SocketAddr,
    core: GuestConnection,
    handshake_done: bool,
}

async fn read_opt(
    s: &mut Option<quinn::RecvStream>,
) -> Result<Option<quinn::Chunk>, quinn::ReadError> {
    match s {
        Some(s) => s.read_chunk(256 * 1024, true).await,
        None => std::future::pending().await,
    }
}

impl Conn<'_> {
    async fn write(send: &mut quinn::SendStream, m: &Message) -> Result<(), End> {
        let mut buf = Vec::with_capacity(64);
        encode(m, &mut buf).map_err(|e| End::Lost(e.to_string()))?;
        send.write_all(&buf).await?;
        Ok(())
    }

    /// The `Hello` deadline as a tokio instant.
    fn hello_by(&self) -> tokio::time::Instant {
        let left = self
            .core
            .poll_timeout()
            .map_or(0, |d| d.saturating_sub(clock::monotonic_ns()));
        tokio::time::Instant::now() + Duration::from_nanos(left)
    }

    /// The deadline passed: the core words the error.
    fn timed_out(&mut self) -> End {
        let due = self.core.poll_timeout().unwrap_or(0);
        match self.core.handle_timeout(clock::monotonic_ns().max(due)) {
            Err(e) => e.into(),
            Ok(()) => End::Rejected("timeout", "handshake timed out".into()),
        }
    }

    async fn run(
        &mut self,
        conn: &quinn::Connection,
        connected: &prometheus::IntGauge,
    ) -> Result<(), End> {
        let inner = self.inner;
        let hello_by = self.hello_by();
        let (mut ctl_send, mut ctl_recv) =
            match tokio::time::timeout_at(hello_by, conn.accept_bi()).await {
                Ok(r) => r?,
                Err(_) => return Err(self.timed_out()),
            };
        let mut ctl_dec = FrameDecoder::default();
        let hello = loop {
            if let Some(m) = ctl_dec.next_frame()? {
                break m;
            }
            let chunk =
                match tokio::time::timeout_at(hello_by, ctl_recv.read_chunk(64 * 1024, true)).await
                {
                    Ok(r) => r?,
                    Err(_) => return Err(self.timed_out()),
                };
            match chunk {
                Some(c) => ctl_dec.push(&c.bytes),
                None => {
                    ctl_dec.finish()?;
                    return Err(End::Rejected(
                        "truncated",
                        "control stream ended before Hello".into(),
                    ));
                }
            }
        };
        let action = {
            let st = inner.state.lock().expect("hub state");
            self.core.handle_control(
                hello,
                &st.dedup,
                clock::monotonic_ns(),
                clock::realtime_ns(),
            )?
        };
        let (boot, resume_from) = match (action, self.core.boot_id()) {
            (ServerAction::Welcome(w), Some(boot)) => {
                Self::write(&mut ctl_send, &w).await?;
                let resume = match &w {
                    Message::Welcome(w) => w.resume_from,
                    _ => None,
                };
                (boot, resume)
            }
            (ServerAction::Reject(m, reason), _) => {
                let _ = Self::write(&mut ctl_send, &m).await;
                let _ = ctl_send.finish();
                // Let the Reject reach the host before the close.
                let _ = tokio::time::timeout(Duration::from_millis(200), ctl_send.stopped()).await;
                return Err(End::Rejected("hello_refused", reason));
            }
            _ => return Err(End::Rejected("unexpected_message", "no Hello".into())),
        };
        self.handshake_done = true;
        connected.inc();
        tracing::info!(host = self.host, remote = %self.remote, boot, ?resume_from, "hub: host connected");
        let m = &inner.metrics;
        let host_l = [self.host];
        let (received, duplicate, lost, lag, offset_g, rtt_g) = (
            m.received.with_label_values(&host_l),
            m.duplicate.with_label_values(&host_l),
            m.lost.with_label_values(&host_l),
            m.lag.with_label_values(&host_l),
            m.offset.with_label_values(&host_l),
            m.rtt.with_label_values(&host_l),
        );
        let mut ev_recv: Option<quinn::RecvStream> = None;
        let mut ev_dec = FrameDecoder::default();
        let mut tick = tokio::time::interval(inner.cfg.ack_interval.min(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut delivered = Vec::new();
        let mut out = Vec::new();
        loop {
            tokio::select! {
                s = conn.accept_uni(), if ev_recv.is_none() => {
                    ev_recv = Some(s?);
                }
                r = read_opt(&mut ev_recv) => {
                    let chunk = match r {
                        Ok(c) => c,
                        Err(e) => {
                            if ev_dec.buffered() > 0 {
                                return Err(End::Rejected("truncated", format!(
                                    "event stream broke inside a frame ({} bytes buffered): {e}",
                                    ev_dec.buffered()
                                )));
                            }
                            return Err(e.into());
                        }
                    };
                    let Some(chunk) = chunk else {
                        ev_dec.finish()?;
                        return Ok(());
                    };
                    ev_dec.push(&chunk.bytes);
                    self.process(&mut ev_dec, boot, &mut delivered, &received, &duplicate, &lost, &lag)?;
                }
                r = ctl_recv.read_chunk(64 * 1024, true) => {
                    let Some(chunk) = r? else {
                        ctl_dec.finish()?;
                        return Ok(());
                    };
                    ctl_dec.push(&chunk.bytes);
                    while let Some(msg) = ctl_dec.next_frame()? {
                        let action = {
                            let st = inner.state.lock().expect("hub state");
                            self.core.handle_control(msg, &st.dedup, clock::monotonic_ns(), clock::realtime_ns())?
                        };
                        match action {
                            ServerAction::Clock(sample) => self.clock_sample(sample, &offset_g, &rtt_g),
                            ServerAction::HostState(state) => {
                                inner.host_states.update(self.host, state, Instant::now());
                            }
                            _ => {}
                        }
                    }
                }
                _ = tick.tick() => {
                    out.clear();
                    {
                        let st = inner.state.lock().expect("hub state");
                        while let Some(m) = self.core.poll_transmit(&st.dedup, clock::monotonic_ns(), clock::realtime_ns()) {
                            encode(&m, &mut out).map_err(|e| End::Lost(e.to_string()))?;
                        }
                    }
                    if !out.is_empty() {
                        ctl_send.write_all(&out).await?;
                    }
                }
            }
        }
    }

    /// Decodes every complete frame of the event stream, has the core account them, journals
    /// what it staged and commits it (or, where the journal refuses it, ends the connection
    /// without committing), then hands the events on.
    #[allow(clippy::too_many_arguments)]
    fn process(
        &mut self,
        dec: &mut FrameDecoder,
        boot: u64,
        delivered: &mut Vec<ReceivedEvent>,
        received: &prometheus::IntCounter,
        duplicate: &prometheus::IntCounter,
        lost: &prometheus::IntCounter,
        lag: &prometheus::Gauge,
    ) -> Result<(), End> {
        let inner = self.inner;
        let now = clock::realtime_ns();
        let mut garbage = Vec::new();
        let mut fatal = None;
        let mut staged = Staged::default();
        let mut unknown = Vec::new();
        delivered.clear();
        {
            let mut st = inner.state.lock().expect("hub state");
            let st = &mut *st;
            loop {
                let msg = match dec.next_frame() {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) if !e.is_fatal() => {
                        garbage.push(e);
                        continue;
                    }
                    Err(e) => {
                        fatal = Some(End::from(e));
                        break;
                    }
                };
                if let Err(e) = self.core.handle_event(msg, &mut staged, &st.dedup) {
                    fatal = Some(e.into());
                    break;
                }
            }
            let offset = st
                .clocks
                .get(self.host)
                .and_then(|c| c.estimate())
                .map(|e| e.offset_ns);
            let mut sizes = Vec::with_capacity(staged.deliveries.len());
            for d in staged.deliveries.drain(..) {
                let f = d.frame;
                let Some(event) = d.event else {
                    unknown.push(UnknownEvent {
                        host: self.host.to_owned(),
                        kind: f.kind,
                        payload_len: f.payload.len(),
                        seq: f.seq,
                        host_realtime_ns: f.host_realtime_ns,
                        clock_offset_ns: offset,
                    });
                    continue;
                };
                let e = ReceivedEvent {
                    host: self.host.to_owned(),
                    boot_id: boot,
                    seq: f.seq,
                    kind: f.kind,
                    host_realtime_ns: f.host_realtime_ns,
                    host_monotonic_ns: f.host_monotonic_ns,
                    received_realtime_ns: now,
                    clock_offset_ns: offset,
                    event,
                };
                sizes.push(recent::estimate(&e, f.payload.len()));
                delivered.push(e);
            }
            if let Some(j) = &mut st.journal {
                for (l, n) in &staged.losses {
                    j.add_loss(self.host, boot, l.first_seq, l.last_seq, *n);
                }
                for e in delivered.iter() {
                    j.add_event(e);
                }
                if let Err(e) = j.commit() {
                    // Not in the journal, so not accepted: the batch is not committed (no ack
                    // can carry it), nothing of it is delivered, and the connection closes so
                    // that the host sends it again once the journal can be written.
                    if let Some(unlogged) = j.note_failure(Instant::now()) {
                        tracing::error!(path = %j.path().display(), error = %e, host = self.host, events = delivered.len(), unlogged, "hub: event journal write failed; the host keeps the events and sends them again");
                    }
                    delivered.clear();
                    return Err(End::Unavailable);
                }
            }
            self.core.commit(&staged, &mut st.dedup);
            if let Some(j) = &mut st.journal {
                j.compact_if_due(&st.dedup);
            }
            for (e, size) in delivered.iter().zip(sizes) {
                st.recent.push(e.clone(), size);
            }
        }
        for (seq, gap) in &staged.gaps {
            self.note(
                "gap",
                &format_args!("sequence gap of {gap} before {seq} without a loss report (boot {boot}); counted as lost"),
            );
        }
        for (l, n) in &staged.losses {
            self.note(
                "spool_loss",
                &format_args!(
                    "host spool dropped events {}..={} (reported {}, newly lost {n}, boot {boot})",
                    l.first_seq, l.last_seq, l.dropped
                ),
            );
        }
        if let Some(last) = delivered.last() {
            let off = last.clock_offset_ns.unwrap_or(0);
            // Negative only within the offset estimate's error: report 0 then.
            lag.set((now + off - last.host_realtime_ns).max(0) as f64 / 1e9);
        }
        received.inc_by(delivered.len() as u64);
        duplicate.inc_by(staged.duplicates);
        lost.inc_by(staged.lost());
        if !unknown.is_empty() {
            tracing::debug!(
                host = self.host,
                unknown = unknown.len(),
                "hub: events of a kind this guest does not know; passed on undecoded"
            );
            inner
                .metrics
                .rejected
                .with_label_values(&[self.host, "unknown_kind"])
                .inc_by(unknown.len() as u64);
            if inner.unknown_tx.receiver_count() > 0 {
                for e in unknown {
                    let _ = inner.unknown_tx.send(e);
                }
            }
        }
        for reason in &staged.refused {
            inner.reject(
                self.host,
                reason,
                self.remote,
                &format_args!(
                    "refused a message numbered out of range ({reason}); the stream goes on"
                ),
            );
        }
        for g in garbage {
            inner.reject(
                self.host,
                g.reason(),
                self.remote,
                &format_args!("skipped a frame: {g}"),
            );
        }
        if inner.tx.receiver_count() > 0 {
            for e in delivered.drain(..) {
                let _ = inner.tx.send(e);
            }
        }
        match fatal {
            Some(f) => Err(f),
            None => Ok(()),
        }
    }

    /// A warning about this host's stream that repeats (gaps, losses): rate-limited per kind.
    fn note(&self, kind: &'static str, detail: &dyn std::fmt::Display) {
        let key = (self.host.to_owned(), kind);
        if let Some(unlogged) = self.inner.host_log.note(key, Instant::now()) {
            tracing::warn!(host = self.host, kind, unlogged, "hub: {detail}");
        }
    }

    fn clock_sample(
        &self,
        s: clock::ClockSample,
        offset_g: &prometheus::Gauge,
        rtt_g: &prometheus::Gauge,
    ) {
        let est = {
            let mut st = self.inner.state.lock().expect("hub state");
            let f = st.clocks.entry(self.host.to_owned()).or_default();
            f.add(s);
            f.estimate()
        };
        let Some(est) = est else { return };
        offset_g.set(est.offset_ns as f64 / 1e9);
        rtt_g.set(est.rtt_ns as f64 / 1e9);
        let Some(ptp) = &self.inner.ptp else { return };
        let Ok(p) = ptp.lock().expect("ptp").offset_ns() else {
            return;
        };
        self.inner.metrics.ptp.set(p as f64 / 1e9);
        let diff = est.offset_ns - p;
        if diff.abs() > 1_000_000 {
            let mut warned = self.inner.ptp_warned.lock().expect("ptp warned");
            let due = warned
                .get(self.host)
                .is_none_or(|t| t.elapsed() > Duration::from_secs(60));
            if due {
                warned.insert(self.host.to_owned(), Instant::now());
                tracing::warn!(host = self.host, probe_offset_ns = est.offset_ns, kvm_ptp_offset_ns = p, diff_ns = diff, "hub: clock offset from probes disagrees with the KVM PTP clock by more than 1 ms (is this host the VM's hypervisor?)");
            }
        }
    }
}
