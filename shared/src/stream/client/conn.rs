//! One guest's connection task, the driver of a [`HostStream`]: it reads the clock, performs
//! what the core asks ([`Action`]: dial with mutual TLS and ALPN `gpufeed/1`, read the spool,
//! release what the guest acknowledged, look at the host state, close), writes what the core
//! has for the control stream and the batches it read on the event stream, and feeds back
//! what happened; then it sleeps until the core's deadline, a message, the end of a write or
//! new events in the spool. When to (re)connect, how long an attempt may take, where the spool
//! starts, how much is read and when, all are the core's.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::guest::{Common, Guest};
use crate::clock::monotonic_ns;
use crate::proto::reconnect::FAST_RECONNECT_MAX;
use crate::proto::{
    encode, Action, BatchRead, Ended, FrameDecoder, HostStream, HostStreamConfig, Message,
};
use crate::tls;

/// Why a connection attempt or an established connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("TLS config unusable for QUIC: {0}")]
    QuicTls(#[from] quinn::crypto::rustls::NoInitialCipherSuite),
    #[error("idle timeout out of range: {0}")]
    IdleTimeout(#[from] quinn::VarIntBoundsExceeded),
    #[error("resolving {endpoint}: {source}")]
    Resolve {
        endpoint: String,
        source: std::io::Error,
    },
    #[error("{0} resolves to no address")]
    NoAddress(String),
    #[error("binding UDP socket: {0}")]
    Bind(std::io::Error),
    #[error("connecting: {0}")]
    Connect(#[from] quinn::ConnectError),
    #[error("handshake with {addr} ({server_name}): {source}")]
    Handshake {
        addr: SocketAddr,
        server_name: String,
        source: quinn::ConnectionError,
    },
    #[error(transparent)]
    Connection(#[from] quinn::ConnectionError),
    #[error(transparent)]
    Read(#[from] quinn::ReadError),
    #[error(transparent)]
    Write(#[from] quinn::WriteError),
    #[error(transparent)]
    Decode(#[from] crate::proto::DecodeError),
    #[error(transparent)]
    Encode(#[from] crate::proto::EncodeError),
    #[error(transparent)]
    Spool(#[from] super::spool::SpoolError),
    #[error("guest closed the control stream")]
    ControlClosed,
}

impl ConnError {
    /// The guest refused the connection before its handshake (it is busy).
    pub fn refused(&self) -> bool {
        matches!(
            self,
            ConnError::Handshake {
                source: quinn::ConnectionError::ConnectionClosed(c),
                ..
            } if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED
        )
    }
}

/// The RTT assumed before a measurement: the guest is a VM of this host (sub-millisecond), so
/// quinn's 333 ms default would space the first Initial retransmissions a second and more
/// apart.
const INITIAL_RTT: Duration = Duration::from_millis(100);

/// How long the driver sleeps when the core names no deadline (it is waiting for the driver).
const IDLE: Duration = Duration::from_secs(3600);

type Dialing = Pin<Box<dyn Future<Output = Result<Transport, ConnError>> + Send>>;
type Writing =
    Pin<Box<dyn Future<Output = (quinn::SendStream, Vec<u8>, Result<(), ConnError>)> + Send>>;

/// An established transport.
struct Transport {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
}

/// What the driver holds of one attempt.
#[derive(Default)]
struct Io {
    dialing: Option<Dialing>,
    transport: Option<Transport>,
    ctl_send: Option<quinn::SendStream>,
    ctl_recv: Option<quinn::RecvStream>,
    ctl_dec: FrameDecoder,
    /// The event stream while no batch is being written on it ...
    events: Option<quinn::SendStream>,
    /// ... and the write under way (it hands the stream back).
    writing: Option<Writing>,
}

/// Awaits `f` where there is one; never otherwise.
async fn maybe<F: Future + Unpin>(f: &mut Option<F>) -> F::Output {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

pub(crate) async fn run(g: Arc<Guest>, c: Arc<Common>, mut stop: watch::Receiver<bool>) {
    let mut core = HostStream::new(
        HostStreamConfig {
            host_id: c.host_id.clone(),
            reconnect_min: Duration::from_millis(c.cfg.reconnect_min_ms),
            reconnect_max: Duration::from_millis(c.cfg.reconnect_max_ms),
            connect_timeout: Duration::from_millis(c.cfg.connect_timeout_ms),
            batch_bytes: c.cfg.batch_bytes,
            coalesce: Duration::from_micros(c.cfg.coalesce_us),
            state_interval: c
                .state
                .is_some()
                .then(|| Duration::from_millis(c.cfg.state_interval_ms)),
        },
        monotonic_ns(),
    );
    let mut io = Io::default();
    let mut log = EndLog::default();
    let mut out = Vec::new();
    let mut spare = Vec::new();
    // One timer for the loop, moved only when the core's deadline moves (not one per round:
    // a busy stream goes round once per batch).
    let sleep = tokio::time::sleep(IDLE);
    tokio::pin!(sleep);
    let mut armed: Option<Option<u64>> = None;
    loop {
        if *stop.borrow() {
            core.handle_stop();
        }
        core.handle_timeout(monotonic_ns());
        while let Some(a) = core.poll() {
            if perform(a, &g, &c, &mut core, &mut io, &mut log, &mut spare).await {
                return;
            }
        }
        // What the core has for the control stream.
        if let Some(send) = &mut io.ctl_send {
            out.clear();
            let mut res = Ok(());
            while let Some(m) = core.poll_transmit() {
                if let Err(e) = encode(&m, &mut out) {
                    res = Err(ConnError::from(e));
                    break;
                }
            }
            if res.is_ok() && !out.is_empty() {
                res = send.write_all(&out).await.map_err(ConnError::from);
            }
            if let Err(e) = res {
                core.handle_lost(e.to_string(), false);
                continue;
            }
        }
        let due = core.poll_timeout();
        if armed != Some(due) {
            let wait = due.map_or(IDLE, |d| {
                Duration::from_nanos(d.saturating_sub(monotonic_ns()))
            });
            sleep.as_mut().reset(tokio::time::Instant::now() + wait);
            armed = Some(due);
        }
        let waiting = core.waiting_for_events();
        let Io {
            dialing,
            ctl_recv,
            ctl_dec,
            writing,
            ..
        } = &mut io;
        tokio::select! {
            _ = stop.changed() => core.handle_stop(),
            r = maybe(dialing) => {
                io.dialing = None;
                match r {
                    Ok(t) => connected(&g, &mut core, &mut io, t).await,
                    Err(e) => {
                        if matches!(e, ConnError::Handshake { .. }) {
                            g.m.connects_err.inc();
                        }
                        core.handle_lost(e.to_string(), e.refused());
                    }
                }
            }
            // read_msg is cancel-safe: its only await is read_chunk, which consumes nothing
            // when dropped.
            r = async { match ctl_recv { Some(r) => read_msg(r, ctl_dec).await, None => std::future::pending().await } } => {
                match r {
                    Ok(m) => core.handle_control(m, monotonic_ns(), c.clock.now_ns()),
                    Err(e) => core.handle_lost(e.to_string(), false),
                }
            }
            r = maybe(writing) => {
                io.writing = None;
                let (ev, bytes, r) = r;
                spare = bytes;
                match r {
                    Ok(()) => {
                        io.events = Some(ev);
                        core.handle_written(monotonic_ns());
                    }
                    Err(e) => core.handle_lost(e.to_string(), false),
                }
            }
            _ = g.notify.notified(), if waiting => core.handle_spooled(monotonic_ns()),
            _ = &mut sleep => armed = None,
        }
    }
}

/// The transport is up: the control stream opens and the core's Hello goes out on the next
/// round.
async fn connected(g: &Guest, core: &mut HostStream, io: &mut Io, t: Transport) {
    match t.conn.open_bi().await {
        Ok((send, recv)) => {
            io.ctl_send = Some(send);
            io.ctl_recv = Some(recv);
            io.ctl_dec = FrameDecoder::default();
            io.transport = Some(t);
            let boot_id = g.spool().boot_id();
            core.handle_connected(boot_id, monotonic_ns());
        }
        Err(e) => {
            io.transport = Some(t);
            core.handle_lost(e.to_string(), false);
        }
    }
}

/// Performs one action of the core; `true`: the driver stops.
async fn perform(
    a: Action,
    g: &Arc<Guest>,
    c: &Arc<Common>,
    core: &mut HostStream,
    io: &mut Io,
    log: &mut EndLog,
    spare: &mut Vec<u8>,
) -> bool {
    let label = g.cfg.label();
    match a {
        Action::Dial => io.dialing = Some(Box::pin(dial(g.clone(), c.clone()))),
        Action::Bind { vm_uuid } => {
            let bound = match &c.binder {
                Some(bind) => bind(g.index, vm_uuid.as_deref()),
                None => Ok(()),
            };
            core.handle_bound(bound);
        }
        Action::StartSpool { resume_from } => {
            g.m.connects_ok.inc();
            g.m.connected.set(1);
            let cursor = {
                let mut s = g.spool();
                let cur = s.start_cursor(resume_from);
                g.update_gauges(&mut s);
                cur
            };
            let opened = match (cursor, &io.transport) {
                (Ok(cur), Some(t)) => t
                    .conn
                    .open_uni()
                    .await
                    .map(|ev| (cur, ev))
                    .map_err(ConnError::from),
                (Err(e), _) => Err(e.into()),
                (Ok(_), None) => Err(ConnError::ControlClosed),
            };
            match opened {
                Ok((cursor, ev)) => {
                    tracing::info!(guest = %label, boot_id = g.spool().boot_id(), ?resume_from, cursor, "host stream: connected");
                    io.events = Some(ev);
                    core.handle_started(cursor, monotonic_ns());
                }
                Err(e) => core.handle_lost(e.to_string(), false),
            }
        }
        Action::ReadSpool { cursor, max_bytes } => {
            let read = g.spool().read_batch(cursor, max_bytes);
            let b = match read {
                Ok(b) => b,
                Err(e) => {
                    core.handle_lost(e.to_string(), false);
                    return false;
                }
            };
            let horizon = core.handle_batch(BatchRead {
                events: b.events,
                empty: b.bytes.is_empty(),
                next_cursor: b.next_cursor,
                horizon: b.horizon,
            });
            if b.bytes.is_empty() {
                return false;
            }
            let mut bytes = std::mem::take(spare);
            bytes.clear();
            if let Some(h) = horizon {
                if let Err(e) = encode(&h, &mut bytes) {
                    core.handle_lost(e.to_string(), false);
                    return false;
                }
            }
            bytes.extend_from_slice(&b.bytes);
            if let Some(l) = &b.loss {
                if let Some(unlogged) = g.loss_log.note("reported", std::time::Instant::now()) {
                    tracing::warn!(guest = %label, dropped = l.dropped, first = l.first_seq, last = l.last_seq, unlogged, "host stream: reported spool loss to guest");
                }
            }
            g.m.sent.inc_by(b.events);
            let Some(mut ev) = io.events.take() else {
                core.handle_lost("no event stream".into(), false);
                return false;
            };
            io.writing = Some(Box::pin(async move {
                let r = ev.write_all(&bytes).await.map_err(ConnError::from);
                (ev, bytes, r)
            }));
        }
        Action::AckSpool(up_to) => {
            let mut s = g.spool();
            let r = s.ack(up_to);
            g.update_gauges(&mut s);
            drop(s);
            if let Err(e) = r {
                core.handle_lost(e.to_string(), false);
            }
        }
        Action::LookAtState => {
            if let Some(source) = &c.state {
                core.offer_state(source(g.index, c.clock.now_ns()));
            }
        }
        Action::Close {
            code,
            reason,
            ended,
        } => {
            g.m.connected.set(0);
            log.ended(g, &ended);
            *io = close(std::mem::take(io), code, &reason).await;
            if ended == Ended::Stopped {
                return true;
            }
            core.handle_closed(monotonic_ns());
        }
    }
    false
}

/// Ends an attempt: abandons the dial, closes the connection with the core's code, and gives
/// the close frame a moment to leave (never blocking shutdown for long).
async fn close(io: Io, code: u32, reason: &[u8]) -> Io {
    drop(io.dialing);
    if let Some(t) = io.transport {
        t.conn.close(code.into(), reason);
        let _ = tokio::time::timeout(Duration::from_millis(200), t.endpoint.wait_idle()).await;
    }
    Io::default()
}

/// How attempts ended, in the log: lost connections and refusals rate-limited (a guest whose
/// journal cannot be written closes every connection at once), the same failure once.
struct EndLog {
    rate: crate::ratelog::RateLimitedLog,
    last_error: String,
}

impl Default for EndLog {
    fn default() -> Self {
        EndLog {
            rate: crate::ratelog::RateLimitedLog::new(Duration::from_secs(10)),
            last_error: String::new(),
        }
    }
}

impl EndLog {
    fn ended(&mut self, g: &Guest, ended: &Ended) {
        let label = g.cfg.label();
        let now = std::time::Instant::now();
        let msg = match ended {
            Ended::Stopped => return,
            Ended::Lost(e) => {
                if let Some(unlogged) = self.rate.note("lost", now) {
                    tracing::warn!(guest = %label, error = %e, unlogged, "host stream: connection to guest lost; reconnecting");
                }
                self.last_error.clear();
                return;
            }
            Ended::Refused(e) => {
                if let Some(unlogged) = self.rate.note("refused", now) {
                    tracing::warn!(guest = %label, endpoint = %g.cfg.endpoint, error = %e, unlogged, "host stream: guest refused the connection (busy); retrying within {FAST_RECONNECT_MAX:?}");
                }
                return;
            }
            Ended::HandshakeTimeout(t) => {
                g.m.connects_err.inc();
                format!("handshake with {} timed out after {t:?}", g.cfg.endpoint)
            }
            Ended::Rejected(r) => {
                g.m.connects_rejected.inc();
                format!("guest rejected this host: {r}")
            }
            Ended::Unbound(r) => {
                g.m.connects_unbound.inc();
                format!("not streaming to this guest: {r}")
            }
            Ended::Failed(e) => e.clone(),
        };
        if msg != self.last_error {
            tracing::warn!(guest = %label, endpoint = %g.cfg.endpoint, error = %msg, "host stream: cannot connect to guest");
            self.last_error = msg;
        } else {
            tracing::debug!(guest = %label, error = %msg, "host stream: still cannot connect");
        }
    }
}

fn client_config(c: &Common) -> Result<quinn::ClientConfig, ConnError> {
    let rustls_cfg = tls::client_config(
        &tls::read(&c.cfg.ca)?,
        &tls::read(&c.cfg.cert)?,
        &tls::read(&c.cfg.key)?,
    )?;
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_cfg)?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(quic));
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(
        Duration::from_millis(c.cfg.idle_timeout_ms.max(1)).try_into()?,
    ));
    t.keep_alive_interval(Some(Duration::from_millis(c.cfg.keep_alive_ms.max(1))));
    t.initial_rtt(INITIAL_RTT);
    cfg.transport_config(Arc::new(t));
    Ok(cfg)
}

async fn resolve(endpoint: &str) -> Result<SocketAddr, ConnError> {
    tokio::net::lookup_host(endpoint)
        .await
        .map_err(|source| ConnError::Resolve {
            endpoint: endpoint.to_owned(),
            source,
        })?
        .next()
        .ok_or_else(|| ConnError::NoAddress(endpoint.to_owned()))
}

/// One attempt's transport: resolve, bind, QUIC and TLS handshake (the core times it out by
/// dropping it).
async fn dial(g: Arc<Guest>, c: Arc<Common>) -> Result<Transport, ConnError> {
    // Certificates are read at every attempt, so renewed files are picked up on reconnect.
    let cfg = client_config(&c)?;
    let addr = resolve(&g.cfg.endpoint).await?;
    let bind: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let endpoint = quinn::Endpoint::client(bind).map_err(ConnError::Bind)?;
    let server_name = g.cfg.server_name();
    let conn = endpoint
        .connect_with(cfg, addr, &server_name)?
        .await
        .map_err(|source| ConnError::Handshake {
            addr,
            server_name,
            source,
        })?;
    Ok(Transport { endpoint, conn })
}

/// Reads the next message of a control stream.
async fn read_msg(
    recv: &mut quinn::RecvStream,
    dec: &mut FrameDecoder,
) -> Result<Message, ConnError> {
    loop {
        if let Some(m) = dec.next_frame()? {
            return Ok(m);
        }
        match recv.read_chunk(64 * 1024, true).await? {
            Some(ch) => dec.push(&ch.bytes),
            None => {
                dec.finish()?;
                return Err(ConnError::ControlClosed);
            }
        }
    }
}
