//! The host → guest event stream over QUIC with mutual TLS, both ends: [`client`] (the host
//! agent: spools and one connection task per guest) and [`hub`] (the guest agent: the QUIC
//! server that receives, de-duplicates, acknowledges and keeps the events).
//!
//! Everything the stream decides (reconnects, handshake, deadlines, the spool's cursor and
//! pacing, acks, clock probes, de-duplication, batch acceptance) is in two sans-IO cores,
//! [`crate::proto::HostStream`] and [`hub::GuestStream`]; the rest of these modules are the
//! tokio/quinn drivers around them: sockets, the clock, files and metrics.
//!
//! Behind the `stream` feature, so that users of the wire format alone do not pull in quinn
//! and tokio.

#[cfg(feature = "samples")]
pub mod by_hand;
pub mod client;
pub mod hub;
