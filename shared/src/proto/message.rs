//! The messages of the protocol and its constants: the version, ALPN, the frame size limit
//! and the capability bits ([`caps`]). Every other part of [`crate::proto`] builds on these.

use serde::{Deserialize, Serialize};

/// Protocol version spoken by this build. A guest accepts hosts in
/// `MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION`.
pub const PROTOCOL_VERSION: u16 = 1;
/// Oldest protocol version this build still accepts.
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// ALPN identifier negotiated by TLS on every connection.
pub const ALPN: &[u8] = b"gpufeed/1";
/// Hard cap on the body of one frame (the length prefix excluded). Larger frames are never
/// sent and a peer announcing one is disconnected.
pub const MAX_FRAME_LEN: usize = 64 * 1024;

/// The QUIC application close code with which a host ends a connection to a guest it will not
/// stream to because the guest's VM identity does not bind it to one of the host's VMs (no VM
/// of the host has its UUID, or another guest holds that VM). The close reason says which.
/// The hub's own codes (1 to 3) are below it.
pub const CLOSE_VM_UNBOUND: u32 = 4;

/// Capability bits exchanged in [`Hello`] / [`Welcome`].
pub mod caps {
    /// The peer answers / sends clock probes on the control stream.
    pub const CLOCK_PROBE: u64 = 1 << 0;
    /// The host reports spool losses with [`super::SpoolLoss`].
    pub const SPOOL_LOSS: u64 = 1 << 1;
    /// The guest takes [`super::Message::HostState`] on the control stream (a host sends it
    /// only to guests that announce this bit, so older guests never see the message).
    pub const HOST_STATE: u64 = 1 << 2;
    /// The guest takes [`super::Message::Horizon`] on the event stream: the host says below
    /// which number everything it sends lies, so that a damaged or hostile number is refused
    /// alone instead of counted as a gap.
    pub const SEQ_HORIZON: u64 = 1 << 3;
    /// Host: it takes [`super::Message::WelcomeVm`] instead of `Welcome` (a guest answers so
    /// only to a `Hello` with this bit: an older host would not decode it). Guest: it names
    /// its VM that way when it can read its SMBIOS system UUID.
    pub const VM_IDENTITY: u64 = 1 << 4;
    /// Everything this build implements.
    pub const ALL: u64 = CLOCK_PROBE | SPOOL_LOSS | HOST_STATE | SEQ_HORIZON | VM_IDENTITY;
}

/// Every message of the protocol. Which stream may carry which variant is checked by the
/// state machines ([`ClientSession`](super::ClientSession),
/// [`ServerSession`](super::ServerSession)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    Hello(Hello),
    Welcome(Welcome),
    Reject(Reject),
    Event(EventFrame),
    SpoolLoss(SpoolLoss),
    Ack(Ack),
    ClockProbe(ClockProbe),
    ClockReply(ClockReply),
    /// Host → guest on the control stream, after `Welcome`: the host's own series that concern
    /// this guest, replacing the previous state whole (see [`crate::hoststate`]).
    HostState(crate::hoststate::HostState),
    /// Host → guest on the event stream, to guests that announce [`caps::SEQ_HORIZON`]:
    /// every number handed out so far is below `below` (appended last: the variants before
    /// keep their postcard tags).
    Horizon(Horizon),
    /// Guest → host instead of `Welcome`, only where the host's `Hello` announced
    /// [`caps::VM_IDENTITY`]: the `Welcome` and the VM the guest runs in, so that the host
    /// routes it that VM's events (appended last, like `Horizon`).
    WelcomeVm(WelcomeVm),
}

impl Message {
    /// Short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Welcome(_) => "welcome",
            Message::Reject(_) => "reject",
            Message::Event(_) => "event",
            Message::SpoolLoss(_) => "spool_loss",
            Message::Ack(_) => "ack",
            Message::ClockProbe(_) => "clock_probe",
            Message::ClockReply(_) => "clock_reply",
            Message::HostState(_) => "host_state",
            Message::Horizon(_) => "horizon",
            Message::WelcomeVm(_) => "welcome_vm",
        }
    }
}

/// First message of a connection, host → guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol_version: u16,
    /// Host identity; must equal the identity proven by the client certificate.
    pub host_id: String,
    /// Sequence space of this host (see the module docs).
    pub boot_id: u64,
    /// [`caps`] bits.
    pub capabilities: u64,
}

/// Guest → host: the host may stream. `resume_from` is the first sequence number the guest
/// still needs for `(host, boot)`; `None` when the guest has no record of this sequence space
/// (then the host sends everything it still holds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub protocol_version: u16,
    pub resume_from: Option<u64>,
    pub capabilities: u64,
}

/// Guest → host: a [`Welcome`] that names the guest's VM by its SMBIOS system UUID (what
/// `/sys/class/dmi/id/product_uuid` reads in the guest; the `smbios1: uuid=` of the VM's
/// configuration on a Proxmox host). The host checks it against its VMs; it never trusts it
/// beyond choosing which events to send (the certificate still says which guest this is).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WelcomeVm {
    pub welcome: Welcome,
    pub smbios_uuid: String,
}

/// Guest → host: the connection is refused; the guest closes it after sending this.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reject {
    pub reason: String,
}

/// One host event. `payload` is the postcard encoding of the event of kind `kind`; a receiver
/// that does not know `kind` skips the frame and counts it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventFrame {
    pub seq: u64,
    /// Host `CLOCK_REALTIME`, ns since the Unix epoch.
    pub host_realtime_ns: i64,
    /// Host `CLOCK_MONOTONIC`, ns.
    pub host_monotonic_ns: u64,
    pub kind: u16,
    #[serde(with = "bytes")]
    pub payload: Vec<u8>,
}

/// Host → guest on the event stream: the spool dropped `dropped` events, all within
/// `first_seq..=last_seq`, before the guest could receive them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpoolLoss {
    pub dropped: u64,
    pub first_seq: u64,
    pub last_seq: u64,
}

/// Host → guest: the host has handed out only numbers below `below` (never decreasing on one
/// connection). An event or loss report at or beyond it is refused by the guest, alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Horizon {
    pub below: u64,
}

/// Guest → host: every sequence number `<= up_to` of the current `(host, boot)` is either
/// delivered or known lost; the host may forget them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    pub up_to: u64,
}

/// Guest → host: `t1` = guest `CLOCK_REALTIME` when sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockProbe {
    pub id: u32,
    pub t1: i64,
}

/// Host → guest: `t2`/`t3` = host realtime when the probe was received / the reply was sent.
/// The guest adds `t4` (its realtime at receipt); see [`crate::clock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockReply {
    pub id: u32,
    pub t1: i64,
    pub t2: i64,
    pub t3: i64,
}

/// `Vec<u8>` as serde bytes: the same postcard wire format as a sequence of `u8` (varint length,
/// then the bytes), but copied in one go instead of element by element.
mod bytes {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(a.size_hint().unwrap_or(0).min(4096));
                while let Some(b) = a.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_byte_buf(V)
    }
}

/// An empty event frame with this sequence number (the state-machine tests' unit of traffic).
#[cfg(test)]
pub(crate) fn test_event(seq: u64) -> Message {
    Message::Event(EventFrame {
        seq,
        host_realtime_ns: 0,
        host_monotonic_ns: 0,
        kind: 1,
        payload: vec![],
    })
}
