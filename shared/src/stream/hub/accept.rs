//! From an incoming connection to an authenticated host: admission (before the connection
//! has any state), the TLS handshake within its time, ALPN and the allowed host; then the
//! connection's driver ([`super::conn`]) runs, and how it ended is counted and closes the
//! connection with its code.

use std::sync::Arc;

use rustls::pki_types::CertificateDer;

use super::conn::Conn;
use super::core::End;
use super::error::{CLOSE_PROTOCOL, CLOSE_REFUSED, CLOSE_UNAVAILABLE, UNVERIFIED};
use super::shared::Inner;
use crate::admission;
use crate::proto::ALPN;
use crate::tls;

/// Decides for every incoming connection before it gets any state (see [`admission`]).
pub(super) async fn accept_loop(inner: Arc<Inner>) {
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
    let mut c = Conn::new(&inner, &host, remote);
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
        Err(End::Unbound(why)) => {
            inner
                .metrics
                .unbound
                .with_label_values(&[host.as_str()])
                .inc();
            if let Some(unlogged) = inner
                .host_log
                .note((host.clone(), "unbound"), std::time::Instant::now())
            {
                tracing::warn!(host = %host, %remote, vm_uuid = ?inner.vm_uuid, unlogged, "hub: the host refused to stream to this guest: {why}");
            }
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
