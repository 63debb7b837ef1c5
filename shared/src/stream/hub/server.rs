//! Starting the hub ([`serve`]: TLS files, endpoint, journal, metrics, the accept and reload
//! tasks), the handle on it ([`Hub`]), and the reload of the TLS files when they change.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use prometheus::Registry;
use tokio::sync::mpsc;

use super::accept;
use super::config::HubConfig;
use super::core::GuestStream;
use super::error::HubError;
use super::event::ReceivedEvent;
use super::intake::{self, Delivery};
use super::metrics::Metrics;
use super::shared::{Inner, State, UNVERIFIED_LOG_INTERVAL};
use super::{host_state, journal, recent, vm};
use crate::admission;
use crate::clock::KvmPtp;
use crate::proto::Dedup;
use crate::tls::{self, FileStamps, GuestTlsDir};

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
    let vm_uuid = vm::read(&cfg.sysfs_root);
    let inner = Arc::new(Inner {
        state: Mutex::new(State {
            stream: GuestStream::new(cfg.timing(), vm_uuid.clone(), dedup),
            recent: recent::Recent::new(cfg.recent_capacity, cfg.recent_max_bytes),
            journal,
        }),
        metrics,
        allowed: RwLock::new(allowed),
        intake: intake::Intake::new(registry)?,
        endpoint,
        ptp,
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
        vm_uuid,
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
        st.stream.clock_offset_ns(host)
    }

    /// Closes all connections and the endpoint.
    pub async fn shutdown(&self) {
        self.inner.endpoint.close(0u32.into(), b"shutdown");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.endpoint.wait_idle()).await;
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
