//! The host → guest wire protocol, sans-IO: message types, the length-prefixed postcard frame
//! codec and the state machines of both ends. Nothing here touches a socket, so every piece is
//! unit-testable in memory; `gpufeed-host`'s stream client and `gpufeed-guest`'s hub drive them
//! over QUIC.
//!
//! Two layers: [`ClientSession`] / [`ServerSession`] check which message may come when;
//! [`HostConnection`] / [`GuestConnection`] add what a connection does over time (deadlines,
//! acknowledgements, clock probes, de-duplication), with every clock reading passed in;
//! `HostStream` adds what the host does across connections (reconnects, the spool's cursor,
//! pacing), and the hub's `GuestStream` what the guest does across them, so that the QUIC
//! drivers in [`crate::stream`] only move bytes.
//!
//! # Streams of a connection
//! * **Control** (bidirectional, opened by the host): host sends [`Hello`], guest answers
//!   [`Welcome`] or [`Reject`]; to a host that announces [`caps::VM_IDENTITY`] a guest that
//!   knows its SMBIOS system UUID answers [`WelcomeVm`] instead (the `Welcome` and the UUID),
//!   by which the host binds it to one of its VMs; a host that will not stream to the guest
//!   closes the connection with [`CLOSE_VM_UNBOUND`] and the reason. Afterwards the guest sends [`Ack`]s and [`ClockProbe`]s, the host
//!   answers probes with [`ClockReply`].
//!   Where the guest announced [`caps::HOST_STATE`] the host also sends [`Message::HostState`]
//!   when its series for this guest changed, looked at once per state interval and right
//!   after events went out on the event stream (so the series an event changed follow it).
//! * **Events** (unidirectional host → guest, opened after `Welcome`): [`EventFrame`]s in sequence
//!   order, with [`SpoolLoss`] records in between where the host's spool had to drop events.
//!
//! # Delivery
//! At-least-once with de-duplication by `(host id, boot id, seq)` on the guest ([`Dedup`]).
//! `boot_id` names the host's sequence space (a fresh random id whenever the host's spool starts
//! without state), so `seq` is unique per `(host, boot)` and strictly increasing on the wire.
//!
//! # Layout
//! The modules import one way: `message` (the messages, the version and size constants,
//! [`caps`]) is the bottom; `codec` and `ledger` above it, then `fit` and `session`, then
//! `host` and `guest`; `reconnect` (when the host tries again) stands alone; `host_stream`
//! (the host's end across connections, `HostStream`) on top of `host` and `reconnect`. A
//! module takes a sibling by its own path (`super::message::Message`); this file only declares
//! them and re-exports.

mod codec;
mod fit;
mod guest;
mod host;
// the host's end across connections (its reconnect policy's jitter needs the stream feature)
#[cfg(feature = "stream")]
mod host_stream;
pub mod ledger;
mod message;
// the host's stream client's policy (its jitter comes from the stream feature's generator)
#[cfg(feature = "stream")]
pub mod reconnect;
mod session;

pub use codec::{
    decode_one, encode, encode_to_vec, DecodeError, EncodeError, EncodedEvent, FrameDecoder,
    HEADER_LEN,
};
pub use fit::{encode_event, KMSG_CONTEXT_MAX_BYTES};
pub use guest::{Delivery, GuestConnection, GuestTiming, Staged, Undecoded};
pub use host::{HostConnection, HostOutput, StatePacing, StateSender};
#[cfg(feature = "stream")]
pub use host_stream::{
    Action, BatchRead, Ended, HostStream, HostStreamConfig, CLOSE_PROTOCOL, CLOSE_SHUTDOWN,
    EVENT_STATE_GAP,
};
pub use ledger::{Ledger, SeqError, MAX_SEQ};
pub use message::{
    caps, Ack, ClockProbe, ClockReply, EventFrame, Hello, Horizon, Message, Reject, SpoolLoss,
    Welcome, WelcomeVm, ALPN, CLOSE_VM_UNBOUND, MAX_FRAME_LEN, MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
};
#[cfg(feature = "stream")]
pub use reconnect::{Attempt, Reconnect};
pub use session::{
    AckPolicy, ClientAction, ClientSession, Dedup, EventVerdict, ProtocolError, ServerAction,
    ServerSession, StreamCheck,
};

// The state-machine tests' empty event frame, for the children's tests as
// `super::super::test_event`.
#[cfg(test)]
pub(crate) use message::test_event;
