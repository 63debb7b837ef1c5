//! Host end of the event stream: one bounded [`spool::Spool`] and one QUIC connection task per
//! guest.
//!
//! The host agent routes every event to the guests it concerns, encodes it once
//! ([`EncodedEvent`](crate::proto::EncodedEvent)) and hands it to [`Spools::push_encoded`]; each
//! guest's spool keeps it until that guest acknowledges it, and that guest's task ([`conn`])
//! streams it: connect with mutual TLS (ALPN `gpufeed/1`), `Hello` → `Welcome`, resume from the
//! guest's `resume_from`, send frames in sequence order, drop what the guest acknowledges,
//! reconnect with exponential backoff and jitter. Every decision of it (when to dial, how long an
//! attempt may take, where the spool resumes, what is read when, which ack releases what) is
//! [`crate::proto::HostStream`]'s; the task reads the clock, moves bytes and does the spool's IO.
//!
//! Metrics (all with label `guest`): `gpufeed_host_stream_connected`,
//! `gpufeed_host_stream_events_spooled_total`, `gpufeed_host_stream_events_sent_total`,
//! `gpufeed_host_stream_events_dropped_total`, `gpufeed_host_stream_spool_events`,
//! `gpufeed_host_stream_spool_disk_bytes`, `gpufeed_host_stream_acked_seq`,
//! `gpufeed_host_stream_connects_total{result}` (`ok`, `error`, `rejected` by the guest, `unbound`: the
//! host's [`Binder`] refused the guest's VM identity); and `gpufeed_host_stream_bus_lagged_total`
//! (counted by the agent's bus subscriber, see [`StreamHandle::bus_lagged`]).
//!
//! Layout, importing one way: `meta`, then `spool`, and `metrics` at the bottom; `error`
//! ([`StreamError`]) above `spool`, `config` ([`StreamConfig`], [`GuestEndpoint`]) above `error`;
//! `guest` (what a connection task shares with the router and the other tasks); `conn`; `handle`
//! ([`start`], [`StreamHandle`], [`Spools`], [`Liveness`]) on top. A module takes a sibling by its
//! own path (`super::guest::Guest`); this file only declares them and re-exports.

mod config;
pub mod conn;
mod error;
mod guest;
mod handle;
pub mod meta;
mod metrics;
pub mod spool;

pub use config::{GuestEndpoint, StreamConfig};
pub use error::StreamError;
pub use guest::{Binder, StateSource};
pub use handle::{start, Beat, Liveness, RawEvent, SpoolStatus, Spools, StreamHandle};
