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
//!   sequence, host time) goes to the join ([`Delivery::Unknown`]): the guest lists it, never
//!   drops it silently.
//! * Recent events are kept in a bounded ring ([`Hub::recent`]), optionally journaled
//!   ([`HubConfig::journal`]), and handed in order to the one join that takes them
//!   ([`Hub::intake`]): a bounded queue that pushes back on the hosts' streams rather than
//!   dropping (see [`intake`]).
//!
//! Metrics: `gpufeed_stream_connected{host}`, `gpufeed_stream_events_received_total{host}`,
//! `gpufeed_stream_events_duplicate_total{host}`, `gpufeed_stream_events_lost_total{host}`,
//! `gpufeed_stream_lag_seconds{host}`, `gpufeed_stream_frames_rejected_total{host,reason}`,
//! `gpufeed_clock_offset_seconds{host}` (host minus guest), `gpufeed_clock_round_trip_seconds{host}`,
//! and where a KVM PTP clock exists `gpufeed_clock_kvm_ptp_offset_seconds` (hypervisor minus
//! guest, the cross-check).
//!
//! The protocol's decisions are sans-IO, all of them [`GuestStream`]'s (in `core`): every
//! connection's state machine ([`crate::proto::GuestConnection`]) and frame decoders, the one
//! de-duplication table, what a read of the event stream amounts to (journal, then
//! de-duplication table and recent ring, or nothing at all: [`batch`]), clock filters and the
//! PTP cross-check's warnings. The rest moves bytes and applies their outcome: `server` starts the endpoint ([`serve`],
//! [`Hub`]) and reloads the TLS files; `shared` holds the state the tasks share; `accept` takes
//! a connection from admission to an authenticated host, and `conn` drives it from the `Hello`
//! on. [`HubConfig`] is in `config`, the series in `metrics`, [`ReceivedEvent`] and
//! [`UnknownEvent`] in `event`, [`HubError`] and the close codes in `error`, this guest's VM
//! identity (its SMBIOS system UUID) in `vm`.
//!
//! The modules import one way: `event`, `error`, `config`, `metrics`, `vm` and `host_state` are the
//! bottom; `recent` and `intake` above them, `batch` above `recent`, `journal` and `core` above
//! `batch`; `shared` above those, then `conn`, `accept` (which runs `conn`) and `server` (which spawns
//! `accept`) on top. A module takes a sibling by its own path (`super::shared::Inner`); this file
//! only declares them and re-exports.

mod accept;
pub use crate::admission;
pub mod batch;
mod config;
mod conn;
pub mod core;
mod error;
mod event;
pub mod host_state;
pub mod intake;
pub mod journal;
mod metrics;
pub mod recent;
mod server;
mod shared;
pub mod vm;

pub use config::HubConfig;
pub use core::{ConnId, ControlEvent, End, EventsRead, GuestStream, PtpDisagreement};
pub use error::{HubError, CLOSE_PROTOCOL, CLOSE_REFUSED, CLOSE_UNAVAILABLE, UNVERIFIED};
pub use event::{ReceivedEvent, UnknownEvent};
pub use intake::Delivery;
pub use server::{serve, Hub};
