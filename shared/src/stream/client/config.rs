//! The `[stream]` section of the host configuration ([`StreamConfig`]), one guest to stream to
//! ([`GuestEndpoint`]), and what [`StreamConfig::check`] refuses before anything starts.

use std::path::PathBuf;

use serde::Deserialize;

use super::error::StreamError;

/// `[stream]` section of the host configuration. Every key is optional.
///
/// ```toml
/// [stream]
/// ca = "/etc/gpufeed/tls/ca.pem"
/// cert = "/etc/gpufeed/tls/host.pem"
/// key = "/etc/gpufeed/tls/host-key.pem"
/// spool_dir = "/var/lib/gpufeed/spool"
///
/// [[stream.guests]]
/// name = "talos-gpu"
/// endpoint = "10.0.0.20:7845"
/// vmids = [100]
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamConfig {
    /// Deployment CA certificate (PEM); the only trusted root. Default
    /// `/etc/gpufeed/tls/ca.pem`.
    pub ca: PathBuf,
    /// This host's client certificate (PEM). Default `/etc/gpufeed/tls/host.pem`.
    pub cert: PathBuf,
    /// Its private key (PEM). Default `/etc/gpufeed/tls/host-key.pem`.
    pub key: PathBuf,
    /// Spool directory, one subdirectory per guest; events survive agent restarts there.
    /// Empty string: memory-only spool. Default `/var/lib/gpufeed/spool`.
    pub spool_dir: PathBuf,
    /// Events kept in memory per guest (the whole spool when memory-only, else a cache of the
    /// newest). Default 65536.
    pub memory_events: usize,
    /// ... and at most this many bytes of them (encoded) per guest; the oldest go first (to
    /// disk, or lost without a spool directory). Default 16 MiB: a few guests and the agent fit
    /// the unit's `MemoryMax=128M` even with every event at the 64 KiB frame limit.
    pub memory_bytes: usize,
    /// Disk limit per guest in bytes; beyond it the oldest segment is dropped. Default 256 MiB.
    pub disk_max_bytes: u64,
    /// Segment file size in bytes (the unit dropped when the disk limit is hit). Default 4 MiB.
    pub segment_bytes: u64,
    /// First reconnect delay in ms (doubles up to `reconnect_max_ms`, with jitter). Default 200.
    pub reconnect_min_ms: u64,
    /// Largest reconnect delay in ms. Default 30000.
    pub reconnect_max_ms: u64,
    /// Handshake timeout in ms. Default 10000.
    pub connect_timeout_ms: u64,
    /// QUIC idle timeout in ms (the connection is declared dead after this silence). Default
    /// 5000: with events outstanding QUIC's retransmission backoff grows, so a guest that
    /// restarted may not see a packet (and answer with a stateless reset) for longer than this;
    /// the idle timeout bounds how long the host waits for one.
    pub idle_timeout_ms: u64,
    /// QUIC keep-alive interval in ms. Default 1000 (an idle connection to a restarted guest
    /// is reset within a second).
    pub keep_alive_ms: u64,
    /// Largest write to the event stream in bytes. Default 65536.
    pub batch_bytes: usize,
    /// After an idle wait, let events gather for this many microseconds before sending, so
    /// that a burst leaves as a few packets instead of one per event (0: send at once).
    /// Default 500.
    pub coalesce_us: u64,
    /// How often the host's series for a guest are looked at and, when changed, sent to it
    /// (guests that take host state). They are also looked at right after events go out (at
    /// most every 20 ms), so the series that an event changed reach the guest with it; the
    /// periodic look carries what moves without events (host load, byte counters). Default
    /// 2000: a look gathers the host's whole registry, the largest part of an idle agent's
    /// CPU time (see docs/benchmarks.md).
    pub state_interval_ms: u64,
    /// Guests to stream to. Default none (streaming off).
    pub guests: Vec<GuestEndpoint>,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            ca: "/etc/gpufeed/tls/ca.pem".into(),
            cert: "/etc/gpufeed/tls/host.pem".into(),
            key: "/etc/gpufeed/tls/host-key.pem".into(),
            spool_dir: "/var/lib/gpufeed/spool".into(),
            memory_events: 65536,
            memory_bytes: 16 << 20,
            disk_max_bytes: 256 << 20,
            segment_bytes: 4 << 20,
            reconnect_min_ms: 200,
            reconnect_max_ms: 30_000,
            connect_timeout_ms: 10_000,
            idle_timeout_ms: 5_000,
            keep_alive_ms: 1_000,
            batch_bytes: 64 * 1024,
            coalesce_us: 500,
            state_interval_ms: 2000,
            guests: Vec::new(),
        }
    }
}

impl StreamConfig {
    /// What [`start`](super::start) refuses, without starting anything (`--check-config`):
    /// guest names that are empty, duplicated or no directory name; certificate files that are
    /// missing or do not parse; a client certificate that does not name `host_id` (every guest
    /// would refuse the connection). The files are read again at every connection attempt, so
    /// renewed certificates are picked up.
    pub fn check(&self, host_id: &str) -> Result<(), StreamError> {
        for (i, g) in self.guests.iter().enumerate() {
            let label = g.label();
            if label.is_empty()
                || label.contains(['/', '\0'])
                || label == "."
                || label == ".."
                || self.guests[..i].iter().any(|x| x.label() == label)
            {
                return Err(StreamError::Config(format!(
                    "guest name {label:?} is empty, duplicated or not usable as a directory name"
                )));
            }
        }
        if self.guests.is_empty() {
            return Ok(());
        }
        let read = crate::tls::read;
        let (ca, cert, key) = (read(&self.ca)?, read(&self.cert)?, read(&self.key)?);
        crate::tls::client_config(&ca, &cert, &key)?;
        let names_host = crate::tls::parse_certs(&cert, "client certificate")?
            .first()
            .is_some_and(|c| crate::tls::identity_of(c, &[host_id.to_owned()]).is_some());
        if !names_host {
            return Err(StreamError::Config(format!(
                "the client certificate {} does not name this host's id {host_id:?} (host_id); \
                 every guest would refuse it",
                self.cert.display()
            )));
        }
        Ok(())
    }
}

/// One guest (VM) to stream to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestEndpoint {
    /// `HOST:PORT` of the guest's `--quic-listen` (required).
    pub endpoint: String,
    /// Name for the spool subdirectory and the `guest` label. Default: `endpoint`.
    #[serde(default)]
    pub name: String,
    /// Name checked against the guest's server certificate. Default: the host part of
    /// `endpoint`.
    #[serde(default)]
    pub server_name: String,
    /// VMIDs served by this guest. Empty together with `devices`: on a Proxmox host the guest
    /// gets the events of the VM whose SMBIOS UUID it names at its handshake; elsewhere, or
    /// where it names none, every event. Either list set: routed by them (an override).
    #[serde(default)]
    pub vmids: Vec<u32>,
    /// PCI devices (BDF) passed through to this guest.
    #[serde(default)]
    pub devices: Vec<String>,
}

impl GuestEndpoint {
    pub fn label(&self) -> &str {
        if self.name.is_empty() {
            &self.endpoint
        } else {
            &self.name
        }
    }

    /// `server_name`, or the host part of `endpoint` (brackets of an IPv6 literal removed).
    pub fn server_name(&self) -> String {
        if !self.server_name.is_empty() {
            return self.server_name.clone();
        }
        let host = match self.endpoint.rsplit_once(':') {
            Some((h, _)) => h,
            None => &self.endpoint,
        };
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned()
    }
}
