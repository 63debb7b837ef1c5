//! How the hub fails and refuses: why it could not start ([`HubError`]), the application close
//! codes a connection ends with, and the label of peers that did not authenticate.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::tls;

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
