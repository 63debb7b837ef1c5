//! The host → guest event stream over QUIC with mutual TLS, both ends: [`client`] (the host
//! agent: spools and one connection task per guest) and [`hub`] (the guest agent: the QUIC
//! server that receives, de-duplicates, acknowledges and keeps the events).
//!
//! Everything the protocol decides (handshake, deadlines, acks, clock probes,
//! de-duplication) is in the sans-IO [`crate::proto`] ([`crate::proto::HostConnection`],
//! [`crate::proto::GuestConnection`]); these modules are the tokio/quinn drivers around it:
//! sockets, timers, files and metrics.
//!
//! Behind the `stream` feature, so that users of the wire format alone do not pull in quinn
//! and tokio.

#[cfg(feature = "samples")]
pub mod by_hand;
pub mod client;
pub mod hub;
