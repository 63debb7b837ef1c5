//! The hub's settings ([`HubConfig`]) and the protocol timing they give each connection.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::proto::GuestTiming;

/// Settings of the hub. [`HubConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// UDP address to listen on.
    pub listen: SocketAddr,
    /// Directory with `ca.pem`, `guest.pem`, `guest-key.pem`, `allowed-hosts`.
    pub tls_dir: PathBuf,
    /// Events kept for [`Hub::recent`](super::Hub::recent). Default 4096.
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
    pub(super) fn timing(&self) -> GuestTiming {
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
