//! The guest end of the stream, sans-IO: every connection's [`GuestConnection`] with its frame
//! decoders, the one de-duplication table they share ([`Dedup`], owned here and nowhere else),
//! the acceptance of what a read of the event stream brought ([`batch::accept`]), the hosts'
//! clock filters and the policy on a KVM PTP clock that disagrees with them.
//!
//! One [`GuestStream`] serves the whole hub, as quinn-proto's `Endpoint` holds its
//! connections: a connection is a [`ConnId`], and the driver (the hub's `conn` task, one per
//! connection; the simulation) hands in the bytes it read, the clock readings and the time of
//! its reads, and gets back what to write, what to apply (metrics, log lines, the join) and
//! how the connection ends ([`End`]). Hello decoding, the Hello deadline, a stream cut inside
//! a frame and garbage frames are all decided here; the driver only moves bytes.

use std::collections::{HashMap, VecDeque};

use super::batch::{self, EventLog, Receipt};
use super::recent::Recent;
use crate::clock::{ClockEstimate, ClockFilter};
use crate::hoststate::HostState;
use crate::proto::{
    DecodeError, Dedup, FrameDecoder, GuestConnection, GuestTiming, Message, ProtocolError,
    ServerAction, Staged,
};

/// A KVM PTP clock that disagrees with the probes by more than this is worth a warning.
pub const PTP_DISAGREEMENT_NS: i64 = 1_000_000;
/// At most one such warning per host this often.
pub const PTP_WARN_INTERVAL_NS: u64 = 60_000_000_000;

/// Why a connection ended abnormally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The peer misbehaved: counted, logged, closed.
    Rejected(&'static str, String),
    /// Transport ended (peer gone, timeout).
    Lost(String),
    /// The host will not stream to this guest: it cannot bind the guest's VM identity to one
    /// of its VMs (the host's reason). Counted and logged; the host tries again later.
    Unbound(String),
    /// This guest could not take the events (its journal write failed; logged there): they
    /// were neither delivered nor acknowledged, and closing makes the host send them again.
    Unavailable,
}

impl From<DecodeError> for End {
    fn from(e: DecodeError) -> Self {
        End::Rejected(e.reason(), e.to_string())
    }
}
impl From<ProtocolError> for End {
    fn from(e: ProtocolError) -> Self {
        End::Rejected(e.reason(), e.to_string())
    }
}

/// A connection of a [`GuestStream`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnId(u64);

/// What a read of the control stream amounts to.
#[derive(Debug, Clone, PartialEq)]
pub enum ControlEvent {
    /// The handshake is done: the host streams sequence space `boot` from `resume_from`.
    Connected { boot: u64, resume_from: Option<u64> },
    /// The host's series for this guest.
    HostState(HostState),
    /// A clock probe came back: the host's filtered offset estimate now.
    Clock(ClockEstimate),
    /// Send what [`GuestStream::poll_transmit`] has, finish the control stream, then end the
    /// connection so (a refused Hello: the host reads the `Reject` first).
    Finish(End),
}

/// What a read of the event stream amounts to.
#[derive(Debug, Default)]
pub struct EventsRead {
    /// The accepted batch (metrics, notes, the join).
    pub outcome: batch::Outcome,
    /// Frames skipped alone (garbage, oversize): the stream goes on.
    pub skipped: Vec<DecodeError>,
    /// The connection must end (what was accepted before is in `outcome`).
    pub end: Option<End>,
}

/// A KVM PTP clock that disagrees with a host's probes (logged at most once per interval).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtpDisagreement {
    pub probe_offset_ns: i64,
    pub kvm_ptp_offset_ns: i64,
    pub diff_ns: i64,
}

#[derive(Debug)]
struct Conn {
    host: String,
    core: GuestConnection,
    ctl: FrameDecoder,
    events: FrameDecoder,
    outbox: VecDeque<Message>,
}

/// The guest end of the stream (see the module docs). Times: `now` is monotonic ns,
/// `now_realtime_ns` the guest's `CLOCK_REALTIME`.
#[derive(Debug)]
pub struct GuestStream {
    timing: GuestTiming,
    vm_uuid: Option<String>,
    dedup: Dedup,
    clocks: HashMap<String, ClockFilter>,
    ptp_warned: HashMap<String, u64>,
    conns: HashMap<ConnId, Conn>,
    next_id: u64,
}

impl GuestStream {
    /// A stream over `dedup` (as a journal seeded it); `vm_uuid` is named to hosts that take
    /// it.
    pub fn new(timing: GuestTiming, vm_uuid: Option<String>, dedup: Dedup) -> Self {
        GuestStream {
            timing,
            vm_uuid,
            dedup,
            clocks: HashMap::new(),
            ptp_warned: HashMap::new(),
            conns: HashMap::new(),
            next_id: 0,
        }
    }

    /// The de-duplication table (read only: the stream alone changes it).
    pub fn dedup(&self) -> &Dedup {
        &self.dedup
    }

    /// The current clock offset estimate of `host` (host minus guest), ns.
    pub fn clock_offset_ns(&self, host: &str) -> Option<i64> {
        self.clocks.get(host)?.estimate().map(|e| e.offset_ns)
    }

    /// A connection from `host` (authenticated) was accepted at `now`: the Hello is due
    /// within the timing's deadline.
    pub fn accept(&mut self, host: &str, now: u64) -> ConnId {
        let id = ConnId(self.next_id);
        self.next_id += 1;
        let core = GuestConnection::new(host, self.timing, now).with_vm_uuid(self.vm_uuid.clone());
        self.conns.insert(
            id,
            Conn {
                host: host.to_owned(),
                core,
                ctl: FrameDecoder::default(),
                events: FrameDecoder::default(),
                outbox: VecDeque::new(),
            },
        );
        id
    }

    /// The connection is gone.
    pub fn remove(&mut self, id: ConnId) {
        self.conns.remove(&id);
    }

    /// Whether the connection's handshake is done (its event stream is taken).
    pub fn streaming(&self, id: ConnId) -> bool {
        self.conns
            .get(&id)
            .is_some_and(|c| c.core.boot_id().is_some())
    }

    /// The next moment something is due on the connection (the Hello deadline, an ack, a
    /// clock probe).
    pub fn poll_timeout(&self, id: ConnId) -> Option<u64> {
        self.conns.get(&id)?.core.poll_timeout(&self.dedup)
    }

    /// Checks the Hello deadline at `now`.
    pub fn handle_timeout(&mut self, id: ConnId, now: u64) -> Result<(), End> {
        let Some(c) = self.conns.get_mut(&id) else {
            return Ok(());
        };
        Ok(c.core.handle_timeout(now)?)
    }

    /// The next message for the connection's control stream; call until `None`.
    pub fn poll_transmit(&mut self, id: ConnId, now: u64, now_realtime_ns: i64) -> Option<Message> {
        let c = self.conns.get_mut(&id)?;
        c.outbox
            .pop_front()
            .or_else(|| c.core.poll_transmit(&self.dedup, now, now_realtime_ns))
    }

    /// Bytes read from the control stream.
    pub fn handle_control(
        &mut self,
        id: ConnId,
        bytes: &[u8],
        now: u64,
        now_realtime_ns: i64,
    ) -> Result<Vec<ControlEvent>, End> {
        let Some(c) = self.conns.get_mut(&id) else {
            return Ok(Vec::new());
        };
        c.ctl.push(bytes);
        let mut out = Vec::new();
        while let Some(msg) = c.ctl.next_frame()? {
            match c
                .core
                .handle_control(msg, &self.dedup, now, now_realtime_ns)?
            {
                ServerAction::Welcome(w) => {
                    let resume_from = match &w {
                        Message::Welcome(w) => w.resume_from,
                        Message::WelcomeVm(w) => w.welcome.resume_from,
                        _ => None,
                    };
                    c.outbox.push_back(w);
                    let boot = c.core.boot_id().unwrap_or_default();
                    out.push(ControlEvent::Connected { boot, resume_from });
                }
                ServerAction::Reject(m, reason) => {
                    c.outbox.push_back(m);
                    out.push(ControlEvent::Finish(End::Rejected("hello_refused", reason)));
                    return Ok(out);
                }
                ServerAction::Clock(sample) => {
                    let f = self.clocks.entry(c.host.clone()).or_default();
                    f.add(sample);
                    if let Some(est) = f.estimate() {
                        out.push(ControlEvent::Clock(est));
                    }
                }
                ServerAction::HostState(s) => out.push(ControlEvent::HostState(s)),
                ServerAction::Ignore => {}
            }
        }
        Ok(out)
    }

    /// The host finished the control stream: before the Hello a truncated stream, inside a
    /// frame a cut one; otherwise the connection closes normally.
    pub fn handle_control_finished(&mut self, id: ConnId) -> Result<(), End> {
        let Some(c) = self.conns.get(&id) else {
            return Ok(());
        };
        c.ctl.finish()?;
        if c.core.boot_id().is_none() {
            return Err(End::Rejected(
                "truncated",
                "control stream ended before Hello".into(),
            ));
        }
        Ok(())
    }

    /// Bytes read from the event stream at `now_realtime_ns`: every complete frame is
    /// accounted, and the batch accepted through `log` (journaled before it counts) into
    /// `recent`.
    pub fn handle_events<L: EventLog + ?Sized>(
        &mut self,
        id: ConnId,
        bytes: &[u8],
        now_realtime_ns: i64,
        log: Option<&mut L>,
        recent: &mut Recent,
    ) -> EventsRead {
        let mut read = EventsRead::default();
        let Some(c) = self.conns.get_mut(&id) else {
            return read;
        };
        c.events.push(bytes);
        let mut staged = Staged::default();
        loop {
            let msg = match c.events.next_frame() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) if !e.is_fatal() => {
                    read.skipped.push(e);
                    continue;
                }
                Err(e) => {
                    read.end = Some(e.into());
                    break;
                }
            };
            if let Err(e) = c.core.handle_event(msg, &mut staged, &self.dedup) {
                read.end = Some(e.into());
                break;
            }
        }
        let at = Receipt {
            host: &c.host,
            boot: c.core.boot_id().unwrap_or_default(),
            realtime_ns: now_realtime_ns,
            clock_offset_ns: self
                .clocks
                .get(&c.host)
                .and_then(|f| f.estimate())
                .map(|e| e.offset_ns),
        };
        read.outcome = batch::accept(&mut c.core, staged, at, &mut self.dedup, log, recent);
        if read.outcome.unavailable.is_some() {
            read.end = Some(End::Unavailable);
        }
        read
    }

    /// The event stream broke with `error` (a transport error): inside a frame a truncated
    /// stream, otherwise the transport's end.
    pub fn handle_events_broken(&self, id: ConnId, error: End) -> End {
        let buffered = self.conns.get(&id).map_or(0, |c| c.events.buffered());
        match error {
            End::Lost(e) if buffered > 0 => End::Rejected(
                "truncated",
                format!("event stream broke inside a frame ({buffered} bytes buffered): {e}"),
            ),
            e => e,
        }
    }

    /// The host finished the event stream: the connection closes normally unless a frame
    /// was cut.
    pub fn handle_events_finished(&self, id: ConnId) -> Result<(), End> {
        match self.conns.get(&id) {
            Some(c) => Ok(c.events.finish()?),
            None => Ok(()),
        }
    }

    /// The KVM PTP clock read `kvm_ptp_offset_ns` (hypervisor minus guest) after a probe of
    /// the connection's host at `now`: a disagreement beyond [`PTP_DISAGREEMENT_NS`] (is this
    /// host the VM's hypervisor?) is reported at most once per [`PTP_WARN_INTERVAL_NS`] and
    /// host.
    pub fn handle_ptp(
        &mut self,
        id: ConnId,
        kvm_ptp_offset_ns: i64,
        now: u64,
    ) -> Option<PtpDisagreement> {
        let host = &self.conns.get(&id)?.host;
        let est = self.clocks.get(host)?.estimate()?;
        let diff_ns = est.offset_ns - kvm_ptp_offset_ns;
        if diff_ns.abs() <= PTP_DISAGREEMENT_NS {
            return None;
        }
        let due = self
            .ptp_warned
            .get(host)
            .is_none_or(|t| now.saturating_sub(*t) > PTP_WARN_INTERVAL_NS);
        if !due {
            return None;
        }
        self.ptp_warned.insert(host.clone(), now);
        Some(PtpDisagreement {
            probe_offset_ns: est.offset_ns,
            kvm_ptp_offset_ns,
            diff_ns,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ClockSample;
    use crate::proto::{encode, ClientSession, ClockReply, MAX_FRAME_LEN};

    const MS: u64 = 1_000_000;

    fn bytes(m: &Message) -> Vec<u8> {
        let mut b = Vec::new();
        encode(m, &mut b).unwrap();
        b
    }

    fn stream() -> GuestStream {
        GuestStream::new(GuestTiming::default(), None, Dedup::new())
    }

    /// The Hello arrives in pieces; a control stream that ends before it is truncated, and a
    /// Hello after the deadline is a timeout.
    #[test]
    fn hello_in_pieces_truncated_and_late() {
        let mut s = stream();
        let id = s.accept("pve1", 0);
        let hello = bytes(&ClientSession::new("pve1", 7).hello());
        let (a, b) = hello.split_at(3);
        assert_eq!(s.handle_control(id, a, 1, 0), Ok(vec![]));
        assert!(!s.streaming(id));
        let ev = s.handle_control(id, b, 2, 0).unwrap();
        assert_eq!(
            ev,
            vec![ControlEvent::Connected {
                boot: 7,
                resume_from: None
            }]
        );
        assert!(matches!(
            s.poll_transmit(id, 2, 0),
            Some(Message::Welcome(_))
        ));
        assert!(s.streaming(id));
        assert_eq!(s.handle_control_finished(id), Ok(()));

        let id = s.accept("pve1", 0);
        s.handle_control(id, a, 1, 0).unwrap();
        let Err(End::Rejected(reason, _)) = s.handle_control_finished(id) else {
            panic!()
        };
        assert_eq!(reason, "truncated");
        let id = s.accept("pve1", 0);
        let Err(End::Rejected(reason, detail)) = s.handle_control_finished(id) else {
            panic!()
        };
        assert_eq!(
            (reason, detail.as_str()),
            ("truncated", "control stream ended before Hello")
        );

        let id = s.accept("pve1", 0);
        assert_eq!(s.poll_timeout(id), Some(10_000 * MS));
        let Err(End::Rejected(reason, _)) = s.handle_timeout(id, 10_000 * MS) else {
            panic!()
        };
        assert_eq!(reason, "timeout");
        // A Hello from another identity is refused: the Reject goes out first.
        let id = s.accept("pve2", 0);
        let ev = s.handle_control(id, &hello, 1, 0).unwrap();
        assert!(matches!(
            &ev[..],
            [ControlEvent::Finish(End::Rejected("hello_refused", _))]
        ));
        assert!(matches!(
            s.poll_transmit(id, 1, 0),
            Some(Message::Reject(_))
        ));
    }

    /// Events are accepted into the one table; a retransmission on another connection is a
    /// duplicate; an oversize frame is skipped alone; a stream cut inside a frame is
    /// truncated.
    #[test]
    fn events_dedup_across_connections_garbage_and_cuts() {
        let mut s = stream();
        let mut recent = Recent::new(100, 1 << 20);
        let none: Option<&mut dyn EventLog> = None;
        let a = s.accept("pve1", 0);
        s.handle_control(a, &bytes(&ClientSession::new("pve1", 7).hello()), 0, 0)
            .unwrap();
        let frames: Vec<u8> = (0..3)
            .flat_map(|i| bytes(&crate::proto::test_event(i)))
            .collect();
        let r = s.handle_events(a, &frames, 0, none, &mut recent);
        assert_eq!((r.outcome.bad_payload, r.end), (3, None));
        assert_eq!(s.dedup().watermark("pve1", 7), Some(2));
        let b = s.accept("pve1", 0);
        let ev = s
            .handle_control(b, &bytes(&ClientSession::new("pve1", 7).hello()), 0, 0)
            .unwrap();
        assert_eq!(
            ev,
            vec![ControlEvent::Connected {
                boot: 7,
                resume_from: Some(3)
            }]
        );
        let none: Option<&mut dyn EventLog> = None;
        let r = s.handle_events(
            b,
            &bytes(&crate::proto::test_event(2)),
            0,
            none,
            &mut recent,
        );
        assert_eq!(r.outcome.duplicates, 1);
        // An oversize frame (a header announcing more than the limit) is fatal.
        let mut big = ((MAX_FRAME_LEN + 1) as u32).to_le_bytes().to_vec();
        big.extend_from_slice(&[0; 8]);
        let none: Option<&mut dyn EventLog> = None;
        let r = s.handle_events(b, &big, 0, none, &mut recent);
        assert!(matches!(r.end, Some(End::Rejected(_, _))), "{:?}", r.end);
        // Cut inside a frame.
        let c = s.accept("pve1", 0);
        s.handle_control(c, &bytes(&ClientSession::new("pve1", 7).hello()), 0, 0)
            .unwrap();
        let f = bytes(&crate::proto::test_event(3));
        let none: Option<&mut dyn EventLog> = None;
        s.handle_events(c, &f[..4], 0, none, &mut recent);
        let End::Rejected(reason, _) = s.handle_events_broken(c, End::Lost("reset".into())) else {
            panic!()
        };
        assert_eq!(reason, "truncated");
        assert!(s.handle_events_finished(c).is_err());
        assert_eq!(
            s.handle_events_broken(a, End::Lost("reset".into())),
            End::Lost("reset".into())
        );
    }

    /// Clock replies feed the host's filter; a PTP clock that disagrees is reported once a
    /// minute per host, one that agrees never.
    #[test]
    fn clock_estimates_and_the_ptp_policy() {
        let mut s = stream();
        let id = s.accept("pve1", 0);
        s.handle_control(id, &bytes(&ClientSession::new("pve1", 7).hello()), 0, 0)
            .unwrap();
        assert!(matches!(
            s.poll_transmit(id, 0, 1_000),
            Some(Message::Welcome(_))
        ));
        let Some(Message::ClockProbe(p)) = s.poll_transmit(id, 0, 1_000) else {
            panic!("no probe")
        };
        let reply = ClockReply {
            id: p.id,
            t1: p.t1,
            t2: 6_000,
            t3: 6_000,
        };
        let ev = s
            .handle_control(id, &bytes(&Message::ClockReply(reply)), 0, 2_000)
            .unwrap();
        let sample = ClockSample::from_timestamps(1_000, 6_000, 6_000, 2_000);
        let [ControlEvent::Clock(est)] = &ev[..] else {
            panic!("{ev:?}")
        };
        assert_eq!(est.offset_ns, sample.offset_ns);
        assert_eq!(s.clock_offset_ns("pve1"), Some(sample.offset_ns));
        assert_eq!(s.handle_ptp(id, sample.offset_ns + 999_999, 0), None);
        let far = sample.offset_ns - 2_000_000;
        assert_eq!(
            s.handle_ptp(id, far, MS).map(|d| d.diff_ns),
            Some(2_000_000)
        );
        assert_eq!(s.handle_ptp(id, far, 59_000 * MS), None);
        assert!(s.handle_ptp(id, far, 62_000 * MS).is_some());
    }
}
