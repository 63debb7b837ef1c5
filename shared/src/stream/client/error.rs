//! Why the host's stream could not start ([`StreamError`]).

use super::spool;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Spool(#[from] spool::SpoolError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("stream config: {0}")]
    Config(String),
    #[error("stream certificates: {0}")]
    Tls(#[from] crate::tls::TlsError),
}
