//! What the hub hands on: an event it received ([`ReceivedEvent`]), and what a frame says about
//! an event of a kind this guest cannot decode ([`UnknownEvent`]).

use serde::Serialize;

use crate::event::HostEvent;

/// A host event as received by the hub.
#[derive(Debug, Clone, Serialize)]
pub struct ReceivedEvent {
    /// Host identity (from its certificate).
    pub host: String,
    pub boot_id: u64,
    pub seq: u64,
    pub kind: u16,
    /// Host realtime when the event was emitted (host clock), ns.
    pub host_realtime_ns: i64,
    pub host_monotonic_ns: u64,
    /// Guest realtime when the hub received it, ns.
    pub received_realtime_ns: i64,
    /// Host minus guest clock offset estimated at receipt, ns (None before the first probe).
    pub clock_offset_ns: Option<i64>,
    pub event: HostEvent,
}

/// An event whose payload this guest could not decode as its frame's kind (a kind from a newer
/// host agent): what the frame says about it.
#[derive(Debug, Clone, Serialize)]
pub struct UnknownEvent {
    pub host: String,
    /// The frame's kind number.
    pub kind: u16,
    /// Size of the undecoded payload in bytes.
    pub payload_len: usize,
    pub seq: u64,
    /// When the host emitted it (host clock), and the offset estimated at receipt, as in
    /// [`ReceivedEvent`].
    pub host_realtime_ns: i64,
    pub clock_offset_ns: Option<i64>,
}

impl ReceivedEvent {
    /// When the event happened, in guest realtime (host time minus the estimated offset).
    pub fn guest_realtime_ns(&self) -> i64 {
        self.host_realtime_ns - self.clock_offset_ns.unwrap_or(0)
    }
}

/// A received event numbered `seq`, for the hub's tests.
#[cfg(test)]
pub(super) fn sample(seq: u64) -> ReceivedEvent {
    ReceivedEvent {
        host: "pve1".into(),
        boot_id: 1,
        seq,
        kind: HostEvent::KmsgLost { count: seq }.kind(),
        host_realtime_ns: 0,
        host_monotonic_ns: 0,
        received_realtime_ns: 0,
        clock_offset_ns: None,
        event: HostEvent::KmsgLost { count: seq },
    }
}
