//! State machines of both ends, and the guest's de-duplication table.

use std::collections::HashMap;

use super::ledger::MAX_SEQ;
use super::message::{
    caps, Ack, ClockProbe, ClockReply, EventFrame, Hello, Message, Reject, SpoolLoss, Welcome,
    WelcomeVm, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use crate::clock::ClockSample;

/// A peer broke the protocol; the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("unexpected {got} message while {state}")]
    Unexpected {
        got: &'static str,
        state: &'static str,
    },
    #[error("sequence went backwards on the event stream: {seq} after {prev}")]
    SeqBackwards { seq: u64, prev: u64 },
    #[error("no {waiting_for} within {after_ms} ms")]
    Timeout {
        waiting_for: &'static str,
        after_ms: u64,
    },
}

impl ProtocolError {
    /// Label value for `gpufeed_stream_frames_rejected_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            ProtocolError::Unexpected { .. } => "unexpected_message",
            ProtocolError::SeqBackwards { .. } => "seq_backwards",
            ProtocolError::Timeout { .. } => "timeout",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Host side

/// What the host must do after a control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientAction {
    /// Handshake done: open the event stream and send from `resume_from` (`None`: from the
    /// oldest event still spooled). Everything below `resume_from` counts as acknowledged.
    Start { resume_from: Option<u64> },
    /// The guest refused the connection.
    Rejected(String),
    /// Events up to this sequence number may leave the spool.
    Acked(u64),
    /// Send this message on the control stream (a clock reply).
    Send(Message),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientState {
    AwaitWelcome,
    Streaming,
    Closed,
}

/// Host end of a connection's control stream.
#[derive(Debug)]
pub struct ClientSession {
    hello: Hello,
    state: ClientState,
    peer_caps: u64,
    /// The SMBIOS system UUID the guest named in a [`WelcomeVm`].
    peer_vm: Option<String>,
}

impl ClientSession {
    pub fn new(host_id: impl Into<String>, boot_id: u64) -> Self {
        ClientSession {
            hello: Hello {
                protocol_version: PROTOCOL_VERSION,
                host_id: host_id.into(),
                boot_id,
                capabilities: caps::ALL,
            },
            state: ClientState::AwaitWelcome,
            peer_caps: 0,
            peer_vm: None,
        }
    }

    /// The first message to send.
    pub fn hello(&self) -> Message {
        Message::Hello(self.hello.clone())
    }

    /// Capabilities announced by the guest.
    pub fn peer_capabilities(&self) -> u64 {
        self.peer_caps
    }

    /// The SMBIOS system UUID of the guest's VM, where its answer named one (a guest older than
    /// [`caps::VM_IDENTITY`], or one that cannot read its UUID, names none).
    pub fn peer_vm_uuid(&self) -> Option<&str> {
        self.peer_vm.as_deref()
    }

    /// Handles a message read from the control stream. `now_realtime_ns` is the host's
    /// reference clock at receipt (used for clock replies).
    pub fn handle(
        &mut self,
        msg: Message,
        now_realtime_ns: i64,
    ) -> Result<ClientAction, ProtocolError> {
        match (self.state, msg) {
            (ClientState::AwaitWelcome, Message::Welcome(w)) => {
                self.state = ClientState::Streaming;
                self.peer_caps = w.capabilities;
                Ok(ClientAction::Start {
                    resume_from: w.resume_from,
                })
            }
            (
                ClientState::AwaitWelcome,
                Message::WelcomeVm(WelcomeVm {
                    welcome,
                    smbios_uuid,
                }),
            ) if self.hello.capabilities & caps::VM_IDENTITY != 0 => {
                self.state = ClientState::Streaming;
                self.peer_caps = welcome.capabilities;
                self.peer_vm = Some(smbios_uuid);
                Ok(ClientAction::Start {
                    resume_from: welcome.resume_from,
                })
            }
            (ClientState::AwaitWelcome, Message::Reject(Reject { reason })) => {
                self.state = ClientState::Closed;
                Ok(ClientAction::Rejected(reason))
            }
            (ClientState::Streaming, Message::Ack(Ack { up_to })) => Ok(ClientAction::Acked(up_to)),
            (ClientState::Streaming, Message::ClockProbe(ClockProbe { id, t1 })) => {
                Ok(ClientAction::Send(Message::ClockReply(ClockReply {
                    id,
                    t1,
                    t2: now_realtime_ns,
                    t3: now_realtime_ns,
                })))
            }
            (state, m) => {
                self.state = ClientState::Closed;
                Err(ProtocolError::Unexpected {
                    got: m.name(),
                    state: match state {
                        ClientState::AwaitWelcome => "awaiting welcome",
                        ClientState::Streaming => "streaming",
                        ClientState::Closed => "closed",
                    },
                })
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Guest side

/// De-duplication by `(host, boot, seq)`: per sequence space, the highest sequence number that
/// was delivered or accounted as lost (the watermark). Events arrive in order on one stream, so
/// anything at or below the watermark is a duplicate of a retransmission.
///
/// A host starts a new sequence space (`boot`) when its spool state is lost; an old one comes
/// back only with an old copy of its spool (a rollback, a restored snapshot). The table keeps
/// the watermarks of the [`Dedup::BOOTS_PER_HOST`] most recently used spaces of each host, so
/// that a host that keeps changing its boot id (a crash loop with a memory-only spool, a buggy
/// or hostile host) cannot grow it without bound; it counts the spaces it had to forget. A
/// space it does not hold, from a host that had spaces forgotten, may be a forgotten one: the
/// guest cannot tell. Such a space is *in doubt* below the first number the host had not
/// handed out yet when it connected (its first [`super::Horizon`]; everything, without one):
/// events below it are delivered, since they may be new, but each is counted as a possible
/// duplicate ([`GuestConnection`](super::GuestConnection) decides, the journal records it).
#[derive(Debug, Clone)]
pub struct Dedup {
    hosts: HashMap<String, HostMarks>,
    /// A logical clock for "last use".
    uses: u64,
    boots_per_host: usize,
}

/// One host's sequence spaces.
#[derive(Debug, Default, Clone)]
struct HostMarks {
    boots: HashMap<u64, Mark>,
    /// Spaces dropped from the table (least recently used first) to keep it bounded.
    forgotten: u64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Mark {
    watermark: u64,
    used: u64,
    /// Numbers below this are possible duplicates (0: none); see [`Dedup`].
    doubt_below: u64,
}

impl Default for Dedup {
    fn default() -> Self {
        Self::with_boots_per_host(Self::BOOTS_PER_HOST)
    }
}

/// What to do with an event frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventVerdict {
    /// New: deliver it. `gap` events between the previous watermark and this one were neither
    /// received nor reported lost (counted as lost).
    Deliver { gap: u64 },
    /// Seen before: drop it.
    Duplicate,
}

impl Dedup {
    /// Sequence spaces kept per host: about 40 bytes each in memory and one journal line each
    /// after a compaction. A host reaches it only after that many losses of its spool state.
    pub const BOOTS_PER_HOST: usize = 256;

    pub fn new() -> Self {
        Self::default()
    }

    /// A table that keeps `n` (at least 1) sequence spaces per host.
    pub fn with_boots_per_host(n: usize) -> Self {
        Dedup {
            hosts: HashMap::new(),
            uses: 0,
            boots_per_host: n.max(1),
        }
    }

    /// Highest accounted sequence number of `(host, boot)`.
    pub fn watermark(&self, host: &str, boot: u64) -> Option<u64> {
        self.get(host, boot).map(|m| m.watermark)
    }

    fn get(&self, host: &str, boot: u64) -> Option<&Mark> {
        self.hosts.get(host)?.boots.get(&boot)
    }

    /// How many sequence spaces of `host` the table had to forget.
    pub fn forgotten(&self, host: &str) -> u64 {
        self.hosts.get(host).map_or(0, |h| h.forgotten)
    }

    /// Whether the guest cannot tell a new sequence space from a forgotten one: `(host, boot)`
    /// is not in the table and `host` had spaces forgotten.
    pub fn cannot_tell(&self, host: &str, boot: u64) -> bool {
        self.get(host, boot).is_none() && self.forgotten(host) > 0
    }

    /// Below which number events of `(host, boot)` are possible duplicates (`None`: none are).
    pub fn doubt_below(&self, host: &str, boot: u64) -> Option<u64> {
        self.get(host, boot)
            .map(|m| m.doubt_below)
            .filter(|&d| d > 0)
    }

    /// The mark of `(host, boot)` for an update, created at `init` if new (then the host's
    /// least recently used spaces beyond the bound are forgotten, and counted).
    fn mark(&mut self, host: &str, boot: u64, init: u64) -> &mut Mark {
        self.uses += 1;
        let uses = self.uses;
        let bound = self.boots_per_host;
        let h = self.hosts.entry(host.to_owned()).or_default();
        if !h.boots.contains_key(&boot) {
            while h.boots.len() >= bound {
                let Some(oldest) = h.boots.iter().min_by_key(|(_, m)| m.used).map(|(b, _)| *b)
                else {
                    break;
                };
                h.boots.remove(&oldest);
                h.forgotten += 1;
            }
        }
        let m = h.boots.entry(boot).or_insert(Mark {
            watermark: init,
            used: 0,
            doubt_below: 0,
        });
        m.used = uses;
        m
    }

    /// Seeds a watermark (from persisted state, or a committed batch); never lowers one. A
    /// number at or beyond [`MAX_SEQ`] is no watermark and is ignored (returns false).
    pub fn seed(&mut self, host: &str, boot: u64, up_to: u64) -> bool {
        if up_to >= MAX_SEQ {
            return false;
        }
        let m = self.mark(host, boot, up_to);
        m.watermark = m.watermark.max(up_to);
        true
    }

    /// Records that events of `(host, boot)` below `below` are possible duplicates (from
    /// persisted state, or a committed batch); only for a space the table holds, never
    /// lowered. Returns false for a number that cannot be one (beyond [`MAX_SEQ`]).
    pub fn seed_doubt(&mut self, host: &str, boot: u64, below: u64) -> bool {
        if below > MAX_SEQ {
            return false;
        }
        if let Some(m) = self
            .hosts
            .get_mut(host)
            .and_then(|h| h.boots.get_mut(&boot))
        {
            m.doubt_below = m.doubt_below.max(below);
        }
        true
    }

    /// Seeds the count of `host`'s forgotten spaces (from persisted state); never lowers it.
    pub fn seed_forgotten(&mut self, host: &str, n: u64) {
        if n > 0 {
            let h = self.hosts.entry(host.to_owned()).or_default();
            h.forgotten = h.forgotten.max(n);
        }
    }

    /// The `Welcome.resume_from` for `(host, boot)`.
    pub fn resume_from(&self, host: &str, boot: u64) -> Option<u64> {
        self.watermark(host, boot).map(|w| w.saturating_add(1))
    }

    /// What an event numbered `seq` is against watermark `w` (`None`: nothing accounted yet),
    /// and the watermark after it.
    pub fn verdict(w: Option<u64>, seq: u64) -> (EventVerdict, u64) {
        match w {
            None => (EventVerdict::Deliver { gap: 0 }, seq),
            Some(w) if seq <= w => (EventVerdict::Duplicate, w),
            Some(w) => (EventVerdict::Deliver { gap: seq - w - 1 }, seq),
        }
    }

    /// How many events of a spool loss report were not accounted before against watermark
    /// `w`, and the watermark after it.
    pub fn loss_verdict(w: Option<u64>, loss: &SpoolLoss) -> (u64, Option<u64>) {
        if loss.last_seq < loss.first_seq {
            return (0, w);
        }
        let span = loss.last_seq - loss.first_seq + 1;
        match w {
            None => (loss.dropped.min(span), Some(loss.last_seq)),
            Some(w) if loss.last_seq <= w => (0, Some(w)),
            Some(w) => {
                let fresh = loss.last_seq - loss.first_seq.max(w + 1) + 1;
                // `dropped` may be less than the span if acknowledged events sat in between.
                (fresh.min(loss.dropped).min(span), Some(loss.last_seq))
            }
        }
    }

    /// Accounts an event.
    pub fn on_event(&mut self, host: &str, boot: u64, seq: u64) -> EventVerdict {
        let (v, w) = Self::verdict(self.watermark(host, boot), seq);
        self.seed(host, boot, w);
        v
    }

    /// Accounts a spool loss report; returns how many of the dropped events were not already
    /// accounted (received, or reported lost before).
    pub fn on_loss(&mut self, host: &str, boot: u64, loss: &SpoolLoss) -> u64 {
        let (n, w) = Self::loss_verdict(self.watermark(host, boot), loss);
        if let Some(w) = w {
            self.seed(host, boot, w);
        }
        n
    }

    /// All watermarks, for persistence.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64, u64)> {
        self.hosts.iter().flat_map(|(h, hm)| {
            hm.boots
                .iter()
                .map(move |(b, m)| (h.as_str(), *b, m.watermark))
        })
    }

    /// Every host with forgotten spaces, and how many, for persistence.
    pub fn forgotten_iter(&self) -> impl Iterator<Item = (&str, u64)> {
        self.hosts
            .iter()
            .filter(|(_, h)| h.forgotten > 0)
            .map(|(h, hm)| (h.as_str(), hm.forgotten))
    }
}

/// What the guest must do after a control message.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerAction {
    /// Send `Welcome`; the connection streams `(host, boot)` from now on.
    Welcome(Message),
    /// Send this `Reject`, then close.
    Reject(Message, String),
    /// A clock probe came back.
    Clock(ClockSample),
    /// A reply to a probe we no longer wait for (late or duplicated): ignore.
    Ignore,
    /// The host's series for this guest, replacing the previous ones.
    HostState(crate::hoststate::HostState),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ServerState {
    AwaitHello,
    Streaming { boot_id: u64 },
    Closed,
}

/// Guest end of one connection. `host` is the identity proven by the client certificate.
#[derive(Debug)]
pub struct ServerSession {
    host: String,
    state: ServerState,
    next_probe: u32,
    outstanding: Vec<(u32, i64)>,
    last_seq: Option<u64>,
    /// The host's last [`super::Horizon`] on this connection.
    horizon: Option<u64>,
    /// This guest's SMBIOS system UUID, named in a [`WelcomeVm`] to hosts that take it.
    vm_uuid: Option<String>,
}

impl ServerSession {
    pub fn new(verified_host: impl Into<String>) -> Self {
        ServerSession {
            host: verified_host.into(),
            state: ServerState::AwaitHello,
            next_probe: 0,
            outstanding: Vec::new(),
            last_seq: None,
            horizon: None,
            vm_uuid: None,
        }
    }

    /// Names this guest's VM (its SMBIOS system UUID) to hosts that announce
    /// [`caps::VM_IDENTITY`].
    pub fn with_vm_uuid(mut self, uuid: Option<String>) -> Self {
        self.vm_uuid = uuid;
        self
    }

    pub fn host(&self) -> &str {
        &self.host
    }

    /// The boot id once the handshake is done.
    pub fn boot_id(&self) -> Option<u64> {
        match self.state {
            ServerState::Streaming { boot_id } => Some(boot_id),
            _ => None,
        }
    }

    /// Handles a control stream message.
    pub fn handle_control(
        &mut self,
        msg: Message,
        dedup: &Dedup,
        now_realtime_ns: i64,
    ) -> Result<ServerAction, ProtocolError> {
        match (&self.state, msg) {
            (ServerState::AwaitHello, Message::Hello(h)) => {
                let refuse =
                    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&h.protocol_version) {
                        Some(format!(
                        "protocol version {} not in {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}",
                        h.protocol_version
                    ))
                    } else if h.host_id != self.host {
                        Some(format!(
                            "host id {:?} does not match the certificate identity {:?}",
                            h.host_id, self.host
                        ))
                    } else {
                        None
                    };
                if let Some(reason) = refuse {
                    self.state = ServerState::Closed;
                    return Ok(ServerAction::Reject(
                        Message::Reject(Reject {
                            reason: reason.clone(),
                        }),
                        reason,
                    ));
                }
                self.state = ServerState::Streaming { boot_id: h.boot_id };
                let welcome = Welcome {
                    protocol_version: PROTOCOL_VERSION,
                    resume_from: dedup.resume_from(&self.host, h.boot_id),
                    capabilities: caps::ALL,
                };
                // Only a host that announced the bit decodes the longer answer.
                Ok(ServerAction::Welcome(
                    match (&self.vm_uuid, h.capabilities & caps::VM_IDENTITY != 0) {
                        (Some(uuid), true) => Message::WelcomeVm(WelcomeVm {
                            welcome,
                            smbios_uuid: uuid.clone(),
                        }),
                        _ => Message::Welcome(welcome),
                    },
                ))
            }
            (ServerState::Streaming { .. }, Message::ClockReply(r)) => {
                match self
                    .outstanding
                    .iter()
                    .position(|(id, t1)| *id == r.id && *t1 == r.t1)
                {
                    Some(i) => {
                        self.outstanding.swap_remove(i);
                        Ok(ServerAction::Clock(ClockSample::from_timestamps(
                            r.t1,
                            r.t2,
                            r.t3,
                            now_realtime_ns,
                        )))
                    }
                    None => Ok(ServerAction::Ignore),
                }
            }
            (ServerState::Streaming { .. }, Message::HostState(st)) => {
                Ok(ServerAction::HostState(st))
            }
            (state, m) => {
                let state = match state {
                    ServerState::AwaitHello => "awaiting hello",
                    ServerState::Streaming { .. } => "streaming",
                    ServerState::Closed => "closed",
                };
                self.state = ServerState::Closed;
                Err(ProtocolError::Unexpected {
                    got: m.name(),
                    state,
                })
            }
        }
    }

    /// A new clock probe to send on the control stream. At most 8 stay outstanding.
    pub fn clock_probe(&mut self, now_realtime_ns: i64) -> Message {
        let id = self.next_probe;
        self.next_probe = self.next_probe.wrapping_add(1);
        if self.outstanding.len() >= 8 {
            self.outstanding.remove(0);
        }
        self.outstanding.push((id, now_realtime_ns));
        Message::ClockProbe(ClockProbe {
            id,
            t1: now_realtime_ns,
        })
    }

    /// Checks a message of the event stream; only events, loss reports and horizons are
    /// allowed there, numbers in increasing order. A number that cannot be right (at or
    /// beyond [`MAX_SEQ`], or beyond the host's own [`super::Horizon`]) is refused alone:
    /// [`StreamCheck::Refuse`], the stream goes on. A number going backwards is a protocol
    /// error.
    pub fn check_event_stream(&mut self, msg: &Message) -> Result<StreamCheck, ProtocolError> {
        if !matches!(self.state, ServerState::Streaming { .. }) {
            return Err(ProtocolError::Unexpected {
                got: msg.name(),
                state: "before the handshake",
            });
        }
        let (lo, hi) = match msg {
            Message::Event(EventFrame { seq, .. }) => (*seq, *seq),
            Message::SpoolLoss(l) => (l.first_seq, l.last_seq),
            Message::Horizon(h) => {
                if h.below > MAX_SEQ || self.horizon.is_some_and(|p| h.below < p) {
                    return Ok(StreamCheck::Refuse("horizon_invalid"));
                }
                self.horizon = Some(h.below);
                return Ok(StreamCheck::Accept);
            }
            m => {
                return Err(ProtocolError::Unexpected {
                    got: m.name(),
                    state: "on the event stream",
                })
            }
        };
        if hi >= MAX_SEQ || lo > hi {
            return Ok(StreamCheck::Refuse("seq_out_of_range"));
        }
        if self.horizon.is_some_and(|h| hi >= h) {
            return Ok(StreamCheck::Refuse("seq_beyond_horizon"));
        }
        if let Some(prev) = self.last_seq {
            if lo <= prev {
                return Err(ProtocolError::SeqBackwards { seq: lo, prev });
            }
        }
        self.last_seq = Some(hi);
        Ok(StreamCheck::Accept)
    }
}

/// What [`ServerSession::check_event_stream`] makes of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamCheck {
    /// In order and in range: account it.
    Accept,
    /// Refused alone, for this reason (a `gpufeed_stream_frames_rejected_total` reason).
    Refuse(&'static str),
}

/// When the guest acknowledges: after `every_events` new events or `interval_ns`, whichever
/// comes first, and only when the watermark moved.
#[derive(Debug, Clone)]
pub struct AckPolicy {
    every_events: u64,
    interval_ns: u64,
    pending: u64,
    last_sent_ns: u64,
    acked: Option<u64>,
}

impl AckPolicy {
    pub fn new(every_events: u64, interval_ns: u64) -> Self {
        AckPolicy {
            every_events: every_events.max(1),
            interval_ns,
            pending: 0,
            last_sent_ns: 0,
            acked: None,
        }
    }

    /// `n` more events were accounted.
    pub fn on_progress(&mut self, n: u64) {
        self.pending += n;
    }

    /// An ack to send now, given the current watermark and a monotonic `now_ns`.
    pub fn poll(&mut self, watermark: Option<u64>, now_ns: u64) -> Option<Ack> {
        let w = watermark?;
        if self.acked.is_some_and(|a| a >= w) {
            return None;
        }
        if self.pending >= self.every_events
            || now_ns.saturating_sub(self.last_sent_ns) >= self.interval_ns
        {
            self.pending = 0;
            self.last_sent_ns = now_ns;
            self.acked = Some(w);
            return Some(Ack { up_to: w });
        }
        None
    }

    /// When [`poll`](Self::poll) gives the next ack (monotonic ns; at or before now when one is
    /// due already); `None` while the watermark has not moved past the last ack.
    pub fn poll_timeout(&self, watermark: Option<u64>) -> Option<u64> {
        let w = watermark?;
        if self.acked.is_some_and(|a| a >= w) {
            return None;
        }
        Some(if self.pending >= self.every_events {
            self.last_sent_ns
        } else {
            self.last_sent_ns.saturating_add(self.interval_ns)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{encode_to_vec, FrameDecoder};
    use super::*;

    /// Carries messages through the real codec, like the transport would.
    fn wire(m: Message) -> Message {
        let mut d = FrameDecoder::default();
        d.push(&encode_to_vec(&m).unwrap());
        d.next_frame().unwrap().unwrap()
    }

    use super::super::test_event as event;

    #[test]
    fn dedup_keeps_the_newest_boots_of_each_host() {
        let mut d = Dedup::with_boots_per_host(4);
        for boot in 0..10u64 {
            d.on_event("pve1", boot, 5);
            d.on_event("pve2", 100 + boot, 5);
            // The current space stays in use while the newer ones come.
            assert_eq!(d.on_event("pve1", boot, 5), EventVerdict::Duplicate);
        }
        fn boots(d: &Dedup, h: &str) -> Vec<u64> {
            let mut b: Vec<u64> = d.iter().filter(|e| e.0 == h).map(|e| e.1).collect();
            b.sort_unstable();
            b
        }
        assert_eq!(boots(&d, "pve1"), vec![6, 7, 8, 9]);
        assert_eq!(boots(&d, "pve2"), vec![106, 107, 108, 109]);
        assert_eq!((d.forgotten("pve1"), d.forgotten("pve2")), (6, 6));
        // A space in use is kept even when older ones were created after it.
        d.on_event("pve1", 6, 6);
        d.on_event("pve1", 42, 0);
        assert_eq!(boots(&d, "pve1"), vec![6, 8, 9, 42]);
        assert_eq!(d.watermark("pve1", 6), Some(6));
        assert_eq!(d.forgotten("pve1"), 7);
        // A forgotten space and a new one look alike: the guest cannot tell them apart, and
        // says so; a space it holds it can.
        assert!(d.cannot_tell("pve1", 7) && d.cannot_tell("pve1", 1234));
        assert!(!d.cannot_tell("pve1", 6));
        assert!(!Dedup::new().cannot_tell("pve1", 7));
    }

    #[test]
    fn the_default_table_holds_far_more_boots_than_a_spool_shows() {
        let mut d = Dedup::new();
        for boot in 0..Dedup::BOOTS_PER_HOST as u64 {
            d.on_event("pve1", boot, 4);
        }
        assert_eq!(d.forgotten("pve1"), 0);
        // Every one of them still knows its events.
        for boot in 0..Dedup::BOOTS_PER_HOST as u64 {
            assert_eq!(d.on_event("pve1", boot, 4), EventVerdict::Duplicate);
        }
        assert_eq!(d.resume_from("pve1", 0), Some(5));
        // One more forgets the least recently used, and counts it.
        d.on_event("pve1", 1 << 40, 0);
        assert_eq!(d.forgotten("pve1"), 1);
        assert_eq!(d.iter().count(), Dedup::BOOTS_PER_HOST);
        // Doubts belong to spaces the table holds, and never go down.
        assert!(d.seed_doubt("pve1", 1 << 40, 9));
        assert!(d.seed_doubt("pve1", 1 << 40, 3));
        assert_eq!(d.doubt_below("pve1", 1 << 40), Some(9));
        assert_eq!(d.doubt_below("pve1", 1), None);
        assert!(!d.seed_doubt("pve1", 1 << 40, u64::MAX));
    }

    /// The messages as a build before [`caps::VM_IDENTITY`] knew them (same order, so the
    /// same postcard tags): what an older peer decodes.
    #[derive(Debug, serde::Serialize, serde::Deserialize)]
    enum OldMessage {
        Hello(Hello),
        Welcome(Welcome),
        Reject(Reject),
        Event(EventFrame),
        SpoolLoss(SpoolLoss),
        Ack(Ack),
        ClockProbe(ClockProbe),
        ClockReply(ClockReply),
        HostState(crate::hoststate::HostState),
        Horizon(super::super::Horizon),
    }

    /// What the older build's codec does with a frame body: postcard, nothing left over.
    fn old_decode(m: &Message) -> Result<OldMessage, String> {
        let body = postcard::to_allocvec(m).unwrap();
        match postcard::take_from_bytes::<OldMessage>(&body) {
            Ok((m, [])) => Ok(m),
            Ok((_, rest)) => Err(format!("{} trailing bytes", rest.len())),
            Err(e) => Err(e.to_string()),
        }
    }

    const UUID: &str = "9a8b7c6d-0101-4000-8000-000000000101";
    /// Every bit an older build announced.
    const OLD_CAPS: u64 = caps::ALL & !caps::VM_IDENTITY;

    #[test]
    fn a_guest_names_its_vm_to_a_host_that_takes_it() {
        let mut host = ClientSession::new("pve1", 7);
        let mut guest = ServerSession::new("pve1").with_vm_uuid(Some(UUID.into()));
        let ServerAction::Welcome(w) = guest
            .handle_control(wire(host.hello()), &Dedup::new(), 0)
            .unwrap()
        else {
            panic!("no welcome")
        };
        assert!(matches!(&w, Message::WelcomeVm(v) if v.smbios_uuid == UUID));
        assert_eq!(
            host.handle(wire(w), 0).unwrap(),
            ClientAction::Start { resume_from: None }
        );
        assert_eq!(host.peer_vm_uuid(), Some(UUID));
        assert_eq!(host.peer_capabilities(), caps::ALL);
        // a guest that cannot read its UUID answers as before
        let mut host = ClientSession::new("pve1", 7);
        let mut guest = ServerSession::new("pve1").with_vm_uuid(None);
        let ServerAction::Welcome(w) = guest
            .handle_control(host.hello(), &Dedup::new(), 0)
            .unwrap()
        else {
            panic!("no welcome")
        };
        assert!(matches!(w, Message::Welcome(_)));
        host.handle(w, 0).unwrap();
        assert_eq!(host.peer_vm_uuid(), None);
    }

    #[test]
    fn an_older_host_gets_a_welcome_it_decodes() {
        // the older host's Hello, as it encodes it, decoded by this guest
        let old_hello = OldMessage::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            host_id: "pve1".into(),
            boot_id: 7,
            capabilities: OLD_CAPS,
        });
        let hello: Message = postcard::from_bytes(&postcard::to_allocvec(&old_hello).unwrap())
            .expect("this build decodes an older Hello");
        let mut guest = ServerSession::new("pve1").with_vm_uuid(Some(UUID.into()));
        let ServerAction::Welcome(w) = guest.handle_control(hello, &Dedup::new(), 0).unwrap()
        else {
            panic!("no welcome")
        };
        // no VM named: the older host would not decode it
        assert!(
            matches!(old_decode(&w), Ok(OldMessage::Welcome(_))),
            "{w:?}"
        );
        // which it would not: the new message is a tag the older build does not have
        let vm = Message::WelcomeVm(WelcomeVm {
            welcome: Welcome {
                protocol_version: PROTOCOL_VERSION,
                resume_from: None,
                capabilities: caps::ALL,
            },
            smbios_uuid: UUID.into(),
        });
        assert!(old_decode(&vm).is_err());
    }

    #[test]
    fn an_older_guest_welcome_starts_the_stream_without_a_vm() {
        let old = OldMessage::Welcome(Welcome {
            protocol_version: PROTOCOL_VERSION,
            resume_from: Some(3),
            capabilities: OLD_CAPS,
        });
        let mut d = FrameDecoder::default();
        let body = postcard::to_allocvec(&old).unwrap();
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend(&body);
        d.push(&frame);
        let w = d.next_frame().unwrap().expect("a frame");
        let mut host = ClientSession::new("pve1", 7);
        assert_eq!(
            host.handle(w, 0).unwrap(),
            ClientAction::Start {
                resume_from: Some(3)
            }
        );
        assert_eq!(host.peer_vm_uuid(), None);
        assert_eq!(host.peer_capabilities(), OLD_CAPS);
        // the tags before the new one still mean what they meant
        let old_horizon = OldMessage::Horizon(super::super::Horizon { below: 9 });
        assert_eq!(
            postcard::from_bytes::<Message>(&postcard::to_allocvec(&old_horizon).unwrap()).unwrap(),
            Message::Horizon(super::super::Horizon { below: 9 })
        );
    }

    #[test]
    fn a_vm_named_to_a_host_that_did_not_ask_is_a_protocol_error() {
        let mut host = ClientSession::new("pve1", 7);
        host.hello.capabilities = OLD_CAPS;
        let w = Message::WelcomeVm(WelcomeVm {
            welcome: Welcome {
                protocol_version: PROTOCOL_VERSION,
                resume_from: None,
                capabilities: caps::ALL,
            },
            smbios_uuid: UUID.into(),
        });
        assert_eq!(
            host.handle(w, 0).unwrap_err().reason(),
            "unexpected_message"
        );
    }

    #[test]
    fn handshake_resume_and_ack_in_memory() {
        let mut dedup = Dedup::new();
        let mut host = ClientSession::new("pve1", 77);
        let mut guest = ServerSession::new("pve1");
        let ServerAction::Welcome(w) = guest.handle_control(wire(host.hello()), &dedup, 0).unwrap()
        else {
            panic!("no welcome")
        };
        assert_eq!(
            host.handle(wire(w), 0).unwrap(),
            ClientAction::Start { resume_from: None }
        );
        assert_eq!(host.peer_capabilities(), caps::ALL);
        let mut acks = AckPolicy::new(3, u64::MAX);
        for seq in 0..5 {
            let m = wire(event(seq));
            guest.check_event_stream(&m).unwrap();
            assert_eq!(
                dedup.on_event("pve1", 77, seq),
                EventVerdict::Deliver { gap: 0 }
            );
            acks.on_progress(1);
            if let Some(a) = acks.poll(dedup.watermark("pve1", 77), 0) {
                assert_eq!(
                    host.handle(wire(Message::Ack(a)), 0).unwrap(),
                    ClientAction::Acked(2)
                );
            }
        }
        // Reconnect: the guest asks to resume after what it has.
        let mut guest2 = ServerSession::new("pve1");
        let mut host2 = ClientSession::new("pve1", 77);
        let ServerAction::Welcome(w) = guest2.handle_control(host2.hello(), &dedup, 0).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            host2.handle(w, 0).unwrap(),
            ClientAction::Start {
                resume_from: Some(5)
            }
        );
        // Host re-sends 3 and 4 (not acked): duplicates.
        assert_eq!(dedup.on_event("pve1", 77, 3), EventVerdict::Duplicate);
        assert_eq!(dedup.on_event("pve1", 77, 4), EventVerdict::Duplicate);
        assert_eq!(
            dedup.on_event("pve1", 77, 5),
            EventVerdict::Deliver { gap: 0 }
        );
        // Another boot is another sequence space.
        assert_eq!(
            dedup.on_event("pve1", 78, 0),
            EventVerdict::Deliver { gap: 0 }
        );
        assert_eq!(
            dedup.on_event("pve1", 77, 9),
            EventVerdict::Deliver { gap: 3 }
        );
    }

    #[test]
    fn reject_identity_and_version() {
        let dedup = Dedup::new();
        let mut guest = ServerSession::new("pve1");
        let host = ClientSession::new("pve2", 1);
        let ServerAction::Reject(m, reason) =
            guest.handle_control(host.hello(), &dedup, 0).unwrap()
        else {
            panic!()
        };
        assert!(reason.contains("pve2"), "{reason}");
        let mut h = ClientSession::new("pve2", 1);
        assert!(matches!(h.handle(m, 0).unwrap(), ClientAction::Rejected(_)));

        let mut guest = ServerSession::new("pve1");
        let mut hello = ClientSession::new("pve1", 1).hello();
        if let Message::Hello(h) = &mut hello {
            h.protocol_version = 99;
        }
        assert!(matches!(
            guest.handle_control(hello, &dedup, 0).unwrap(),
            ServerAction::Reject(_, r) if r.contains("99")
        ));
    }

    #[test]
    fn unexpected_messages_are_errors() {
        let dedup = Dedup::new();
        let mut guest = ServerSession::new("pve1");
        assert_eq!(
            guest.check_event_stream(&event(1)).unwrap_err().reason(),
            "unexpected_message"
        );
        let e = guest
            .handle_control(Message::Ack(Ack { up_to: 1 }), &dedup, 0)
            .unwrap_err();
        assert_eq!(e.reason(), "unexpected_message");
        let mut host = ClientSession::new("pve1", 1);
        assert!(host.handle(Message::Ack(Ack { up_to: 1 }), 0).is_err());

        let mut guest = ServerSession::new("pve1");
        guest
            .handle_control(ClientSession::new("pve1", 1).hello(), &dedup, 0)
            .unwrap();
        guest.check_event_stream(&event(5)).unwrap();
        assert_eq!(
            guest.check_event_stream(&event(5)).unwrap_err().reason(),
            "seq_backwards"
        );
        assert!(guest
            .check_event_stream(&Message::Ack(Ack { up_to: 1 }))
            .is_err());
    }

    #[test]
    fn loss_accounting_is_idempotent() {
        let mut d = Dedup::new();
        let loss = SpoolLoss {
            dropped: 10,
            first_seq: 0,
            last_seq: 9,
        };
        assert_eq!(d.on_loss("h", 1, &loss), 10);
        // Reported again after a reconnect: nothing new.
        assert_eq!(d.on_loss("h", 1, &loss), 0);
        assert_eq!(d.on_event("h", 1, 10), EventVerdict::Deliver { gap: 0 });
        // Partially received range.
        assert_eq!(d.on_event("h", 1, 11), EventVerdict::Deliver { gap: 0 });
        let loss = SpoolLoss {
            dropped: 5,
            first_seq: 11,
            last_seq: 15,
        };
        assert_eq!(d.on_loss("h", 1, &loss), 4);
        assert_eq!(d.resume_from("h", 1), Some(16));
    }

    #[test]
    fn clock_probe_roundtrip() {
        let dedup = Dedup::new();
        let mut guest = ServerSession::new("pve1");
        let mut host = ClientSession::new("pve1", 1);
        let ServerAction::Welcome(w) = guest.handle_control(host.hello(), &dedup, 0).unwrap()
        else {
            panic!()
        };
        host.handle(w, 0).unwrap();
        // Host clock is 1 s ahead; 100 µs each way.
        let probe = guest.clock_probe(1_000_000);
        let ClientAction::Send(reply) = host
            .handle(wire(probe), 1_000_000 + 100_000 + 1_000_000_000)
            .unwrap()
        else {
            panic!()
        };
        let ServerAction::Clock(s) = guest
            .handle_control(wire(reply.clone()), &dedup, 1_200_000)
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(s.offset_ns, 1_000_000_000);
        assert_eq!(s.rtt_ns, 200_000);
        // The same reply again is ignored.
        assert_eq!(
            guest.handle_control(reply, &dedup, 1_300_000).unwrap(),
            ServerAction::Ignore
        );
    }

    #[test]
    fn ack_policy_time_and_count() {
        let mut p = AckPolicy::new(100, 1_000);
        assert_eq!(p.poll(None, 5_000), None);
        p.on_progress(1);
        assert_eq!(p.poll(Some(0), 5_000), Some(Ack { up_to: 0 }));
        p.on_progress(1);
        assert_eq!(p.poll(Some(1), 5_500), None);
        assert_eq!(p.poll(Some(1), 6_000), Some(Ack { up_to: 1 }));
        p.on_progress(100);
        assert_eq!(p.poll(Some(101), 6_001), Some(Ack { up_to: 101 }));
        assert_eq!(p.poll(Some(101), 9_000), None);
    }
}
