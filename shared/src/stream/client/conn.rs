//! One guest's connection task: connect (mutual TLS, ALPN `gpufeed/1`), then drive a
//! [`HostConnection`]: its messages out on the control stream, the guest's in, the spool from
//! the resume point out on the event stream, acks into the spool. On any failure reconnect when
//! the reconnect policy ([`Reconnect`], sans-IO) says: after an exponential backoff with
//! jitter, or soon after a lost connection or a refusal.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::guest::{Common, Guest};
use crate::clock::monotonic_ns;
use crate::proto::reconnect::{Attempt, Reconnect, FAST_RECONNECT_MAX};
use crate::proto::{
    encode, FrameDecoder, HostConnection, HostOutput, Message, StatePacing, CLOSE_VM_UNBOUND,
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
    #[error("handshake with {0} timed out")]
    HandshakeTimeout(SocketAddr),
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
    Protocol(#[from] crate::proto::ProtocolError),
    #[error(transparent)]
    Spool(#[from] super::spool::SpoolError),
    #[error("guest rejected this host: {0}")]
    Rejected(String),
    #[error("not streaming to this guest: {0}")]
    Unbound(String),
    #[error("guest closed the control stream")]
    ControlClosed,
    #[error("unexpected {0:?} from the connection state")]
    Unexpected(HostOutput),
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

/// Application close codes.
pub const CLOSE_SHUTDOWN: u32 = 0;
pub const CLOSE_PROTOCOL: u32 = 1;

/// The RTT assumed before a measurement: the guest is a VM of this host (sub-millisecond), so
/// quinn's 333 ms default would space the first Initial retransmissions a second and more
/// apart.
const INITIAL_RTT: Duration = Duration::from_millis(100);

pub(crate) async fn run(g: Arc<Guest>, c: Arc<Common>, mut stop: watch::Receiver<bool>) {
    let label = g.cfg.label().to_owned();
    // every decision of this loop (how long to wait, how long an attempt may take) is the
    // policy's; this moves between attempts and logs
    let mut policy = Reconnect::new(
        Duration::from_millis(c.cfg.reconnect_min_ms),
        Duration::from_millis(c.cfg.reconnect_max_ms),
        Duration::from_millis(c.cfg.connect_timeout_ms),
    );
    let mut last_error = String::new();
    // A guest whose journal cannot be written closes every connection at once: one line per
    // reconnect would be several a second.
    let lost_log = crate::ratelog::RateLimitedLog::new(Duration::from_secs(10));
    loop {
        if *stop.borrow() {
            return;
        }
        let connect_timeout = policy.connect_timeout(monotonic_ns());
        let mut stop2 = stop.clone();
        let res = tokio::select! {
            r = connect_and_stream(&g, &c, connect_timeout, &mut stop2) => r,
            _ = stop.changed() => return,
        };
        g.m.connected.set(0);
        let how = match res {
            Ok(Outcome::Stopped) => return,
            Ok(Outcome::Streamed(e)) => {
                if let Some(unlogged) = lost_log.note("lost", std::time::Instant::now()) {
                    tracing::warn!(guest = %label, error = %e, unlogged, "host stream: connection to guest lost; reconnecting");
                }
                last_error.clear();
                Attempt::Lost
            }
            Err(e) if e.refused() => {
                if let Some(unlogged) = lost_log.note("refused", std::time::Instant::now()) {
                    tracing::warn!(guest = %label, endpoint = %g.cfg.endpoint, error = %e, unlogged, "host stream: guest refused the connection (busy); retrying within {FAST_RECONNECT_MAX:?}");
                }
                Attempt::Refused
            }
            Err(e) => {
                let msg = e.to_string();
                if msg != last_error {
                    tracing::warn!(guest = %label, endpoint = %g.cfg.endpoint, error = %msg, "host stream: cannot connect to guest");
                    last_error = msg;
                } else {
                    tracing::debug!(guest = %label, error = %msg, "host stream: still cannot connect");
                }
                Attempt::Failed
            }
        };
        let delay = policy.ended(how, monotonic_ns());
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.changed() => return,
        }
    }
}

enum Outcome {
    Stopped,
    /// The handshake succeeded and the connection later ended with this error.
    Streamed(ConnError),
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

async fn connect_and_stream(
    g: &Guest,
    c: &Common,
    connect_timeout: Duration,
    stop: &mut watch::Receiver<bool>,
) -> Result<Outcome, ConnError> {
    // Certificates are read at every attempt, so renewed files are picked up on reconnect.
    let cfg = client_config(c)?;
    let addr = resolve(&g.cfg.endpoint).await?;
    let bind: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let endpoint = quinn::Endpoint::client(bind).map_err(ConnError::Bind)?;
    let server_name = g.cfg.server_name();
    let connecting = endpoint.connect_with(cfg, addr, &server_name)?;
    let conn = match tokio::time::timeout(connect_timeout, connecting).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            g.m.connects_err.inc();
            return Err(ConnError::Handshake {
                addr,
                server_name,
                source: e,
            });
        }
        Err(_) => {
            g.m.connects_err.inc();
            return Err(ConnError::HandshakeTimeout(addr));
        }
    };
    let res = stream(g, c, &conn, stop).await;
    let (code, why): (u32, &[u8]) = match &res {
        Ok(Outcome::Stopped) => (CLOSE_SHUTDOWN, b"shutdown"),
        // the guest logs and counts the reason (kept well inside one packet)
        Err(ConnError::Unbound(reason)) => (CLOSE_VM_UNBOUND, cut(reason.as_bytes(), 200)),
        _ => (CLOSE_PROTOCOL, b"error"),
    };
    conn.close(code.into(), why);
    // Give the close frame a moment to leave; never block shutdown for long.
    let _ = tokio::time::timeout(Duration::from_millis(200), endpoint.wait_idle()).await;
    res
}

/// At most `max` bytes of `b`, cut at a UTF-8 boundary.
fn cut(b: &[u8], max: usize) -> &[u8] {
    let mut n = b.len().min(max);
    while n > 0 && std::str::from_utf8(&b[..n]).is_err() {
        n -= 1;
    }
    &b[..n]
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

/// Writes every message the connection has for the control stream.
async fn transmit(
    conn: &mut HostConnection,
    send: &mut quinn::SendStream,
    buf: &mut Vec<u8>,
) -> Result<(), ConnError> {
    buf.clear();
    while let Some(m) = conn.poll_transmit() {
        encode(&m, buf)?;
    }
    if !buf.is_empty() {
        send.write_all(buf).await?;
    }
    Ok(())
}

async fn stream(
    g: &Guest,
    c: &Common,
    conn: &quinn::Connection,
    stop: &mut watch::Receiver<bool>,
) -> Result<Outcome, ConnError> {
    let label = g.cfg.label();
    let boot_id = g.spool().boot_id();
    let mut session = HostConnection::new(
        c.host_id.clone(),
        boot_id,
        c.cfg.connect_timeout_ms.saturating_mul(1_000_000),
        monotonic_ns(),
    );
    if c.state.is_some() {
        // The state interval bounds how often the whole registry is gathered; the looks after
        // events at most every EVENT_STATE_GAP (a flood of events is not a snapshot per batch).
        let interval = Duration::from_millis(c.cfg.state_interval_ms.max(100));
        session = session.with_state_pacing(StatePacing {
            interval_ns: interval.as_nanos() as u64,
            after_events_gap_ns: EVENT_STATE_GAP.min(interval).as_nanos() as u64,
        });
    }
    let (mut ctl_send, mut ctl_recv) = conn.open_bi().await?;
    let mut buf = Vec::new();
    transmit(&mut session, &mut ctl_send, &mut buf).await?;
    let mut dec = FrameDecoder::default();
    let resume_from = loop {
        let msg =
            match tokio::time::timeout(until(&session), read_msg(&mut ctl_recv, &mut dec)).await {
                Ok(m) => m?,
                Err(_) => {
                    session.handle_timeout(monotonic_ns())?;
                    continue;
                }
            };
        match session.handle_control(msg, monotonic_ns(), c.clock.now_ns())? {
            Some(HostOutput::Start { resume_from }) => break resume_from,
            Some(HostOutput::Rejected(reason)) => {
                g.m.connects_rejected.inc();
                return Err(ConnError::Rejected(reason));
            }
            Some(other) => return Err(ConnError::Unexpected(other)),
            None => continue,
        }
    };
    // Which VM the guest runs in decides what it gets; a guest the host cannot bind to one of
    // its VMs gets nothing (rather than everything), and is told why.
    if let Some(bind) = &c.binder {
        if let Err(reason) = bind(g.index, session.peer_vm_uuid()) {
            g.m.connects_unbound.inc();
            return Err(ConnError::Unbound(reason));
        }
    }
    g.m.connects_ok.inc();
    g.m.connected.set(1);
    let cursor = {
        let mut s = g.spool();
        let cur = s.start_cursor(resume_from);
        g.update_gauges(&mut s);
        cur?
    };
    session.start(cursor, monotonic_ns());
    tracing::info!(guest = %label, boot_id, ?resume_from, cursor, "host stream: connected");
    let mut ev = conn.open_uni().await?;

    // Both halves drive the one connection state; neither holds it across an await (a mutex
    // only because the task's future must be Send; it is never contended).
    let session = std::sync::Mutex::new(session);
    let session = || {
        session
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    // The sender wakes the control half when it planned a look at the host state.
    let replan = tokio::sync::Notify::new();
    let control = async {
        let mut out = Vec::new();
        loop {
            let wait = until(&session());
            // read_msg is cancel-safe: its only await is read_chunk, which consumes nothing
            // when dropped.
            let msg = tokio::select! {
                m = read_msg(&mut ctl_recv, &mut dec) => m?,
                _ = tokio::time::sleep(wait) => {
                    let look = session().poll_state(monotonic_ns());
                    if let (true, Some(source)) = (look, c.state.as_ref()) {
                        let state = source(g.index, c.clock.now_ns());
                        // Bound first: the borrow must end before the write's await.
                        let offered = session().offer_state(state);
                        if let Some(m) = offered {
                            out.clear();
                            encode(&m, &mut out)?;
                            ctl_send.write_all(&out).await?;
                        }
                    }
                    continue;
                }
                _ = replan.notified() => continue,
            };
            let output = session().handle_control(msg, monotonic_ns(), c.clock.now_ns())?;
            match output {
                Some(HostOutput::Acked(up_to)) => {
                    let mut s = g.spool();
                    s.ack(up_to)?;
                    g.update_gauges(&mut s);
                }
                None => {
                    out.clear();
                    while let Some(m) = session().poll_transmit() {
                        encode(&m, &mut out)?;
                    }
                    if !out.is_empty() {
                        ctl_send.write_all(&out).await?;
                    }
                }
                Some(other) => return Err(ConnError::Unexpected(other)),
            }
        }
        #[allow(unreachable_code)]
        Ok::<(), ConnError>(())
    };
    let sender = async {
        let mut bytes = Vec::new();
        loop {
            let cursor = session().cursor().unwrap_or_default();
            let b = {
                let mut s = g.spool();
                s.read_batch(cursor, c.cfg.batch_bytes)?
            };
            if b.bytes.is_empty() {
                g.notify.notified().await;
                if c.cfg.coalesce_us > 0 {
                    tokio::time::sleep(Duration::from_micros(c.cfg.coalesce_us)).await;
                }
                continue;
            }
            bytes.clear();
            if let Some(h) = session().horizon_for(b.horizon) {
                encode(&h, &mut bytes)?;
            }
            bytes.extend_from_slice(&b.bytes);
            ev.write_all(&bytes).await?;
            if let Some(l) = &b.loss {
                if let Some(unlogged) = g.loss_log.note("reported", std::time::Instant::now()) {
                    tracing::warn!(guest = %label, dropped = l.dropped, first = l.first_seq, last = l.last_seq, unlogged, "host stream: reported spool loss to guest");
                }
            }
            g.m.sent.inc_by(b.events);
            session().sent(b.next_cursor, b.events, monotonic_ns());
            replan.notify_one();
        }
        #[allow(unreachable_code)]
        Ok::<(), ConnError>(())
    };
    tokio::select! {
        r = control => Ok(Outcome::Streamed(r.err().unwrap_or(ConnError::ControlClosed))),
        r = sender => Ok(Outcome::Streamed(r.err().unwrap_or(ConnError::ControlClosed))),
        _ = stop.changed() => Ok(Outcome::Stopped),
    }
}

/// How long until the connection has something due (an hour when nothing is).
fn until(session: &HostConnection) -> Duration {
    session
        .poll_timeout()
        .map_or(Duration::from_secs(3600), |d| {
            Duration::from_nanos(d.saturating_sub(monotonic_ns()))
        })
}

/// Closest spacing of the host-state looks that follow events.
const EVENT_STATE_GAP: Duration = Duration::from_millis(20);
