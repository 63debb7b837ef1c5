//! The agents' HTTP listeners (`/metrics` and the rest), bounded: both listen where many can
//! reach them (the guest on the node address, open to every pod; the host on the Proxmox
//! host), and `axum::serve` has no limits.
//!
//! * A client has [`HEADER_READ_TIMEOUT`] to send a request's headers (every request of a
//!   kept-alive connection; a long response such as an event stream is not cut).
//! * At most [`HttpLimits::max_connections`] connections are open at once and
//!   [`HttpLimits::max_per_address`] from one IP address; the places are shared fairly
//!   ([`crate::admission`]): when all are taken, a connection from an address that holds
//!   fewer than the address holding the most closes that address's oldest connection, so
//!   no set of addresses can lock out one more (a kubelet, a Prometheus). Beyond the
//!   per-address cap a new connection is closed at once.
//! * Refusals and evictions are logged at most once per 10 s per reason, with the count not
//!   logged.

use std::time::{Duration, Instant};

use crate::admission::{Admission, Decision, Limits};
use crate::ratelog::RateLimitedLog;

/// How long a client may take to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Connection caps of one listener.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub max_per_address: usize,
}

impl Default for HttpLimits {
    /// 512 in all and 64 per address: each connection costs some 10 KiB of buffers and one
    /// file descriptor, so the caps bound the server's memory and stay well inside the units'
    /// file limits.
    fn default() -> Self {
        HttpLimits {
            max_connections: 512,
            max_per_address: 64,
        }
    }
}

/// Accept-queue length of the agents' listeners (the kernel caps it at `net.core.somaxconn`,
/// 4096 by default). Rust's and tokio's `bind` ask for 128: a flood of a few hundred clients
/// reconnecting as the server closes them fills that, the kernel then drops new SYNs
/// (`ListenOverflows`), and a scrape's connect waits for its SYN's retransmit, 1 s later: a
/// scrape with a 1 s timeout failed that way about once in 60 under 8 × 64 idle connections.
pub const LISTEN_BACKLOG: u32 = 4096;

/// A TCP listener on `addr` with [`LISTEN_BACKLOG`] (address reuse on, as tokio's `bind`).
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves `app` on `listener` within `limits` until the process ends; `name` goes into the
/// log lines.
pub async fn serve_bounded(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    name: &'static str,
) -> std::io::Result<()> {
    // Every connection is pending for its whole life (never `established`): any may be
    // closed for a newcomer from an address that holds fewer.
    let admission = Admission::new(Limits {
        max_pending: limits.max_connections,
        max_per_address: limits.max_per_address,
        retry_above: usize::MAX,
        known_reserve: 0,
    });
    let log = RateLimitedLog::new(Duration::from_secs(10));
    let mut evictions_logged = 0;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors or a connection reset before accept: not fatal.
                if let Some(unlogged) = log.note("accept", Instant::now()) {
                    tracing::warn!(server = name, error = %e, unlogged, "HTTP server: accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let ticket = match admission.decide(peer.ip(), true) {
            Decision::Accept(t) => t,
            Decision::Refuse(reason) => {
                if let Some(unlogged) = log.note(reason, Instant::now()) {
                    tracing::warn!(server = name, %peer, reason, unlogged, "HTTP server: too many connections (limits: {} in all, {} per address); closed", limits.max_connections, limits.max_per_address);
                }
                continue;
            }
            Decision::Retry => continue,
        };
        let evictions = admission.evictions();
        if evictions > evictions_logged {
            if let Some(unlogged) = log.note("evicted", Instant::now()) {
                tracing::warn!(server = name, %peer, evictions, unlogged, "HTTP server: all connection places taken; closed the oldest connection of the address holding most");
            }
            evictions_logged = evictions;
        }
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            tokio::select! {
                r = conn => {
                    if let Err(e) = r {
                        tracing::debug!(server = name, %peer, error = %e, "HTTP server: connection ended");
                    }
                }
                _ = ticket.evicted() => {
                    tracing::debug!(server = name, %peer, "HTTP server: connection closed for a newcomer");
                }
            }
            drop(ticket);
        });
    }
}
