//! The guest end of one connection as a sans-IO state machine: the `Hello` deadline, the
//! handshake, de-duplication of the event stream, journal before acknowledgement, when to
//! acknowledge and when to probe the host's clock.
//!
//! Events are accepted in two steps: [`GuestConnection::handle_event`] accounts what a read
//! of the event stream brought into a [`Staged`] batch without touching the de-duplication
//! table; the batch is journaled (the hub's `stream::hub::batch`), and only
//! [`GuestConnection::commit`] moves the watermark (and so what an ack can carry). A batch the
//! journal refused is never committed: the connection closes and the host sends the events
//! again. Time comes in as arguments (`now_mono_ns` is `CLOCK_MONOTONIC`, `now_realtime_ns`
//! the guest's `CLOCK_REALTIME`) and [`GuestConnection::poll_timeout`] says when to come
//! back; messages come in decoded and go out as [`Message`]s; the hub's QUIC driver only
//! moves them.

use super::ledger::MAX_SEQ;
use super::message::{EventFrame, Message, SpoolLoss};
use super::session::{
    AckPolicy, Dedup, EventVerdict, ProtocolError, ServerAction, ServerSession, StreamCheck,
};
use crate::event::HostEvent;

/// Timing of the guest end. [`GuestTiming::default`] is what the hub ships with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestTiming {
    /// From the connection's start until the `Hello` must have arrived.
    pub hello_timeout_ns: u64,
    /// Acknowledge after this many accounted events ...
    pub ack_every: u64,
    /// ... or at least this often while the watermark moves.
    pub ack_interval_ns: u64,
    /// Quick clock probes right after the handshake, so that an offset estimate exists at once.
    pub probe_burst: u32,
    /// Gap between the probes of the burst.
    pub probe_burst_gap_ns: u64,
    /// Gap between probes after the burst.
    pub probe_interval_ns: u64,
}

impl Default for GuestTiming {
    fn default() -> Self {
        GuestTiming {
            hello_timeout_ns: 10_000_000_000,
            ack_every: 4096,
            ack_interval_ns: 20_000_000,
            probe_burst: 8,
            probe_burst_gap_ns: 10_000_000,
            probe_interval_ns: 2_000_000_000,
        }
    }
}

/// An event a batch delivers.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    pub frame: EventFrame,
    /// The decoded event, or why there is none: a kind this build does not know (a newer
    /// host's) is delivered (listed, counted) undecoded; a known kind whose payload does not
    /// decode as it is corrupt (counted, journaled as such). Neither is dropped silently, and
    /// both are accounted (never asked for again).
    pub event: Result<HostEvent, Undecoded>,
    /// The event's sequence space is in doubt and the number below the doubt: it may have
    /// been delivered before (see [`Dedup`]). Delivered anyway, counted.
    pub possible_duplicate: bool,
}

/// Why an event was not decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undecoded {
    /// A kind this build does not know (`reason="unknown_kind"`).
    UnknownKind,
    /// A kind this build knows, with a payload that does not decode as it
    /// (`reason="bad_payload"`).
    BadPayload,
}

impl Undecoded {
    /// What a frame of `kind` with `payload` holds.
    pub fn decode(kind: u16, payload: &[u8]) -> Result<HostEvent, Undecoded> {
        if !HostEvent::is_known_kind(kind) {
            return Err(Undecoded::UnknownKind);
        }
        postcard::from_bytes::<HostEvent>(payload)
            .ok()
            .filter(|e| e.kind() == kind)
            .ok_or(Undecoded::BadPayload)
    }

    /// The `gpufeed_stream_frames_rejected_total` reason.
    pub fn reason(self) -> &'static str {
        match self {
            Undecoded::UnknownKind => "unknown_kind",
            Undecoded::BadPayload => "bad_payload",
        }
    }
}

/// What one or more messages of the event stream amount to, not yet accepted (see the module
/// docs).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Staged {
    /// The watermark after this batch (`None`: unchanged).
    watermark: Option<u64>,
    /// Accounted messages (for the ack policy).
    progress: u64,
    /// New events, in order.
    pub deliveries: Vec<Delivery>,
    /// The host's loss reports, with how many of each were newly lost.
    pub losses: Vec<(SpoolLoss, u64)>,
    /// Gaps without a loss report: `(seq after the gap, events missing)`, counted as lost.
    pub gaps: Vec<(u64, u64)>,
    /// Retransmissions dropped.
    pub duplicates: u64,
    /// Messages refused alone (a number out of range): their reasons.
    pub refused: Vec<&'static str>,
    /// The sequence space's doubt, where this batch is the first to record it (see [`Dedup`]):
    /// events below it are possible duplicates.
    pub doubt_below: Option<u64>,
    /// Events newly counted lost by this batch's loss reports that lie in the doubt: the host
    /// may have reported them before (counted as lost, and as possible duplicates).
    pub doubtful_losses: u64,
}

impl Staged {
    /// Events this batch counts as lost (reported by the host or missing without a report).
    pub fn lost(&self) -> u64 {
        self.losses.iter().map(|(_, n)| n).sum::<u64>() + self.gaps.iter().map(|g| g.1).sum::<u64>()
    }

    /// Events and losses of this batch that may have been accounted before (see [`Dedup`]).
    pub fn possible_duplicates(&self) -> u64 {
        self.deliveries
            .iter()
            .filter(|d| d.possible_duplicate)
            .count() as u64
            + self.doubtful_losses
    }
}

/// Guest end of one connection. `host` is the identity proven by the client certificate.
#[derive(Debug)]
pub struct GuestConnection {
    session: ServerSession,
    timing: GuestTiming,
    acks: AckPolicy,
    hello_deadline_ns: u64,
    boot: Option<u64>,
    /// The guest could not tell this connection's sequence space from a forgotten one at the
    /// handshake: its doubt is recorded with the first message of the event stream.
    in_doubt: bool,
    /// Where that doubt ends, once the event stream said.
    doubt_below: Option<u64>,
    probes_sent: u32,
    next_probe_ns: u64,
}

impl GuestConnection {
    /// A connection that started (was accepted) at `now_mono_ns`.
    pub fn new(verified_host: impl Into<String>, timing: GuestTiming, now_mono_ns: u64) -> Self {
        GuestConnection {
            session: ServerSession::new(verified_host),
            acks: AckPolicy::new(timing.ack_every, timing.ack_interval_ns),
            hello_deadline_ns: now_mono_ns.saturating_add(timing.hello_timeout_ns),
            timing,
            boot: None,
            in_doubt: false,
            doubt_below: None,
            probes_sent: 0,
            next_probe_ns: 0,
        }
    }

    /// Names this guest's VM by its SMBIOS system UUID to hosts that take it (see
    /// [`super::caps::VM_IDENTITY`]).
    pub fn with_vm_uuid(mut self, uuid: Option<String>) -> Self {
        self.session = self.session.with_vm_uuid(uuid);
        self
    }

    pub fn host(&self) -> &str {
        self.session.host()
    }

    /// The host's sequence space, once the handshake is done.
    pub fn boot_id(&self) -> Option<u64> {
        self.boot
    }

    /// The next moment something is due (monotonic ns): before the handshake its deadline,
    /// after it the next ack (only while the watermark in `dedup` is ahead of the last one) or
    /// clock probe, whichever comes first. A driver that sleeps until then and calls
    /// [`handle_timeout`](Self::handle_timeout) and [`poll_transmit`](Self::poll_transmit)
    /// misses nothing, and an idle connection wakes only for its probes.
    pub fn poll_timeout(&self, dedup: &Dedup) -> Option<u64> {
        let Some(boot) = self.boot else {
            return Some(self.hello_deadline_ns);
        };
        let ack = self
            .acks
            .poll_timeout(dedup.watermark(self.session.host(), boot));
        Some(ack.map_or(self.next_probe_ns, |a| a.min(self.next_probe_ns)))
    }

    /// Checks the `Hello` deadline.
    pub fn handle_timeout(&mut self, now_mono_ns: u64) -> Result<(), ProtocolError> {
        match self.boot.is_none().then_some(self.hello_deadline_ns) {
            Some(d) if now_mono_ns >= d => Err(ProtocolError::Timeout {
                waiting_for: "Hello",
                after_ms: self.timing.hello_timeout_ns / 1_000_000,
            }),
            _ => Ok(()),
        }
    }

    /// Handles a message of the control stream. A `Welcome` answer starts the stream: the
    /// first clock probe is due at once.
    pub fn handle_control(
        &mut self,
        msg: Message,
        dedup: &Dedup,
        now_mono_ns: u64,
        now_realtime_ns: i64,
    ) -> Result<ServerAction, ProtocolError> {
        if self.boot.is_none() {
            self.handle_timeout(now_mono_ns)?;
        }
        let action = self.session.handle_control(msg, dedup, now_realtime_ns)?;
        if let ServerAction::Welcome(_) = action {
            self.boot = self.session.boot_id();
            self.in_doubt = self
                .boot
                .is_some_and(|b| dedup.cannot_tell(self.session.host(), b));
            self.next_probe_ns = now_mono_ns;
        }
        Ok(action)
    }

    /// Accounts one message of the event stream into `staged`, against `dedup` as it was when
    /// the batch started plus what the batch accounted so far (nothing is applied to `dedup`
    /// before [`commit`](Self::commit)).
    pub fn handle_event(
        &mut self,
        msg: Message,
        staged: &mut Staged,
        dedup: &Dedup,
    ) -> Result<(), ProtocolError> {
        if let StreamCheck::Refuse(reason) = self.session.check_event_stream(&msg)? {
            staged.refused.push(reason);
            return Ok(());
        }
        // check_event_stream refuses messages before the handshake.
        let boot = self.boot.unwrap_or_default();
        // A space in doubt: what the host had handed out before it connected may have been
        // delivered under a forgotten entry. Its first horizon says where that ends; a message
        // before any horizon (a host that sends none) leaves all of the space in doubt.
        if self.in_doubt && self.doubt_below.is_none() {
            self.doubt_below = Some(match &msg {
                Message::Horizon(h) => h.below,
                _ => MAX_SEQ,
            });
        }
        let host = self.session.host();
        let w = staged.watermark.or_else(|| dedup.watermark(host, boot));
        if dedup.doubt_below(host, boot).is_none() {
            staged.doubt_below = self.doubt_below;
        }
        let doubt = staged
            .doubt_below
            .or_else(|| dedup.doubt_below(host, boot))
            .unwrap_or(0);
        match msg {
            Message::Event(frame) => match Dedup::verdict(w, frame.seq) {
                (EventVerdict::Duplicate, _) => staged.duplicates += 1,
                (EventVerdict::Deliver { gap }, w) => {
                    if gap > 0 {
                        staged.gaps.push((frame.seq, gap));
                    }
                    staged.watermark = Some(w);
                    let event = Undecoded::decode(frame.kind, &frame.payload);
                    let possible_duplicate = frame.seq < doubt;
                    staged.deliveries.push(Delivery {
                        frame,
                        event,
                        possible_duplicate,
                    });
                }
            },
            Message::SpoolLoss(loss) => {
                let (newly_lost, w) = Dedup::loss_verdict(w, &loss);
                if newly_lost > 0 && loss.first_seq < doubt {
                    let in_doubt = doubt.min(loss.last_seq + 1) - loss.first_seq;
                    staged.doubtful_losses += newly_lost.min(in_doubt);
                }
                staged.watermark = w.or(staged.watermark);
                staged.losses.push((loss, newly_lost));
            }
            // A horizon moves nothing.
            Message::Horizon(_) => return Ok(()),
            // Refused by check_event_stream.
            m => {
                return Err(ProtocolError::Unexpected {
                    got: m.name(),
                    state: "on the event stream",
                })
            }
        }
        staged.progress += 1;
        Ok(())
    }

    /// The batch is journaled (or there is no journal): it is accepted, and acknowledgements
    /// may carry it from now on.
    pub fn commit(&mut self, staged: &Staged, dedup: &mut Dedup) {
        if let (Some(w), Some(boot)) = (staged.watermark, self.boot) {
            dedup.seed(self.session.host(), boot, w);
            if let Some(d) = staged.doubt_below {
                dedup.seed_doubt(self.session.host(), boot, d);
            }
        }
        self.acks.on_progress(staged.progress);
    }

    /// The next message to send on the control stream now (an ack, then a clock probe); call
    /// until `None`.
    pub fn poll_transmit(
        &mut self,
        dedup: &Dedup,
        now_mono_ns: u64,
        now_realtime_ns: i64,
    ) -> Option<Message> {
        let boot = self.boot?;
        if let Some(a) = self
            .acks
            .poll(dedup.watermark(self.session.host(), boot), now_mono_ns)
        {
            return Some(Message::Ack(a));
        }
        if now_mono_ns >= self.next_probe_ns {
            self.probes_sent = self.probes_sent.saturating_add(1);
            let gap = if self.probes_sent < self.timing.probe_burst {
                self.timing.probe_burst_gap_ns
            } else {
                self.timing.probe_interval_ns
            };
            self.next_probe_ns = now_mono_ns.saturating_add(gap);
            return Some(self.session.clock_probe(now_realtime_ns));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::super::{caps, Ack, ClientSession, Welcome, PROTOCOL_VERSION};
    use super::*;

    const MS: u64 = 1_000_000;

    fn timing() -> GuestTiming {
        GuestTiming {
            hello_timeout_ns: 100 * MS,
            ack_every: 3,
            ack_interval_ns: 20 * MS,
            probe_burst: 3,
            probe_burst_gap_ns: 10 * MS,
            probe_interval_ns: 1_000 * MS,
        }
    }

    use super::super::test_event as ev;

    fn connected(dedup: &Dedup, boot: u64, now: u64) -> GuestConnection {
        let mut g = GuestConnection::new("pve1", timing(), now);
        let a = g
            .handle_control(ClientSession::new("pve1", boot).hello(), dedup, now, 0)
            .unwrap();
        assert!(matches!(a, ServerAction::Welcome(_)));
        g
    }

    #[test]
    fn hello_deadline() {
        let dedup = Dedup::new();
        let mut g = GuestConnection::new("pve1", timing(), 1_000 * MS);
        assert_eq!(g.poll_timeout(&dedup), Some(1_100 * MS));
        g.handle_timeout(1_099 * MS).unwrap();
        let e = g.handle_timeout(1_100 * MS).unwrap_err();
        assert_eq!(e.reason(), "timeout");
        assert!(e.to_string().contains("Hello"), "{e}");
        // A Hello after the deadline is refused as a timeout too.
        let hello = ClientSession::new("pve1", 1).hello();
        assert_eq!(
            g.handle_control(hello, &dedup, 1_200 * MS, 0)
                .unwrap_err()
                .reason(),
            "timeout"
        );
        // In time: no deadline afterwards, and nothing to send before the handshake.
        let mut g = GuestConnection::new("pve1", timing(), 0);
        assert_eq!(g.poll_transmit(&dedup, 0, 0), None);
        g.handle_control(ClientSession::new("pve1", 1).hello(), &dedup, 99 * MS, 0)
            .unwrap();
        assert_eq!(g.poll_timeout(&dedup), Some(99 * MS), "the first probe");
        g.handle_timeout(u64::MAX).unwrap();
        assert_eq!(g.boot_id(), Some(1));
    }

    #[test]
    fn welcome_carries_the_resume_point() {
        let mut dedup = Dedup::new();
        dedup.seed("pve1", 7, 41);
        let mut g = GuestConnection::new("pve1", timing(), 0);
        let a = g
            .handle_control(ClientSession::new("pve1", 7).hello(), &dedup, 0, 0)
            .unwrap();
        assert_eq!(
            a,
            ServerAction::Welcome(Message::Welcome(Welcome {
                protocol_version: PROTOCOL_VERSION,
                resume_from: Some(42),
                capabilities: caps::ALL,
            }))
        );
    }

    /// Stages `msgs` as one batch and commits it.
    fn feed(g: &mut GuestConnection, msgs: Vec<Message>, dedup: &mut Dedup) -> Staged {
        let mut st = Staged::default();
        for m in msgs {
            g.handle_event(m, &mut st, dedup).unwrap();
        }
        g.commit(&st, dedup);
        st
    }

    fn seqs(st: &Staged) -> Vec<u64> {
        st.deliveries.iter().map(|d| d.frame.seq).collect()
    }

    #[test]
    fn dedup_gap_and_loss_accounting() {
        let mut dedup = Dedup::new();
        let mut g = connected(&dedup, 9, 0);
        let loss = SpoolLoss {
            dropped: 3,
            first_seq: 4,
            last_seq: 6,
        };
        let st = feed(
            &mut g,
            vec![ev(0), ev(3), Message::SpoolLoss(loss.clone())],
            &mut dedup,
        );
        assert_eq!(seqs(&st), vec![0, 3]);
        assert_eq!(st.gaps, vec![(3, 2)]);
        assert_eq!(st.losses, vec![(loss, 3)]);
        assert_eq!(st.lost(), 5);
        // The test's payloads are empty, no event of their (known) kind: delivered undecoded,
        // as corrupt.
        assert_eq!(st.deliveries[0].event, Err(Undecoded::BadPayload));
        // Sequence must go forward on one stream.
        let mut st = Staged::default();
        assert_eq!(
            g.handle_event(ev(6), &mut st, &dedup).unwrap_err().reason(),
            "seq_backwards"
        );
        // A second connection of the same sequence space re-sends: duplicates.
        let mut g2 = connected(&dedup, 9, 0);
        let st = feed(&mut g2, vec![ev(3), ev(7)], &mut dedup);
        assert_eq!((st.duplicates, seqs(&st)), (1, vec![7]));
        assert_eq!(dedup.watermark("pve1", 9), Some(7));
        // Control messages do not belong on the event stream.
        assert_eq!(
            g2.handle_event(Message::Ack(Ack { up_to: 1 }), &mut st.clone(), &dedup)
                .unwrap_err()
                .reason(),
            "unexpected_message"
        );
    }

    #[test]
    fn nothing_is_accepted_before_the_commit() {
        let mut dedup = Dedup::new();
        let mut g = connected(&dedup, 9, 0);
        let mut st = Staged::default();
        for s in 0..5 {
            g.handle_event(ev(s), &mut st, &dedup).unwrap();
        }
        // Within the batch the staged watermark counts: a repeat is a duplicate.
        g.handle_event(ev(4), &mut st, &dedup).unwrap_err();
        assert_eq!(seqs(&st), vec![0, 1, 2, 3, 4]);
        // The journal refused it: no watermark, no ack.
        assert_eq!(dedup.watermark("pve1", 9), None);
        assert!(!matches!(
            g.poll_transmit(&dedup, 100 * MS, 0),
            Some(Message::Ack(_))
        ));
        // A new connection gets the events again, and they count once.
        let mut g2 = connected(&dedup, 9, 0);
        let st = feed(&mut g2, (0..5).map(ev).collect(), &mut dedup);
        assert_eq!((seqs(&st).len(), st.duplicates), (5, 0));
        assert_eq!(dedup.resume_from("pve1", 9), Some(5));
    }

    #[test]
    fn numbers_out_of_range_cost_only_themselves() {
        let mut dedup = Dedup::new();
        let mut g = connected(&dedup, 9, 0);
        let horizon = |below| Message::Horizon(super::super::Horizon { below });
        let st = feed(
            &mut g,
            vec![
                ev(0),
                // damaged: beyond anything a sequence space holds
                ev(1 << 63),
                ev(1),
                horizon(10),
                ev(2),
                // beyond what the host says it handed out
                ev(50),
                ev(3),
                // a horizon may not go back
                horizon(5),
                ev(9),
                horizon(20),
                ev(15),
            ],
            &mut dedup,
        );
        assert_eq!(seqs(&st), vec![0, 1, 2, 3, 9, 15]);
        assert_eq!(
            st.refused,
            vec!["seq_out_of_range", "seq_beyond_horizon", "horizon_invalid"]
        );
        assert_eq!(st.gaps, vec![(9, 5), (15, 5)]);
        let loss = |first_seq, last_seq| {
            Message::SpoolLoss(SpoolLoss {
                dropped: 1,
                first_seq,
                last_seq,
            })
        };
        let st = feed(&mut g, vec![loss(16, 1 << 62), loss(30, 16)], &mut dedup);
        assert_eq!(st.lost(), 0);
        assert_eq!(st.refused, vec!["seq_out_of_range", "seq_out_of_range"]);
        assert_eq!(dedup.watermark("pve1", 9), Some(15));
    }

    #[test]
    fn events_before_the_handshake_are_refused() {
        let dedup = Dedup::new();
        let mut g = GuestConnection::new("pve1", timing(), 0);
        assert_eq!(
            g.handle_event(ev(0), &mut Staged::default(), &dedup)
                .unwrap_err()
                .reason(),
            "unexpected_message"
        );
        assert_eq!(dedup.watermark("pve1", 0), None);
    }

    /// What the guest sends at `now`, by name.
    fn sent_at(g: &mut GuestConnection, dedup: &Dedup, now: u64) -> Vec<&'static str> {
        std::iter::from_fn(|| g.poll_transmit(dedup, now, 0))
            .map(|m| m.name())
            .collect()
    }

    #[test]
    fn poll_timeout_is_the_next_ack_or_probe() {
        let mut dedup = Dedup::new();
        let mut g = connected(&dedup, 1, 0);
        // The first probe is due at once; with nothing accepted there is no ack to wait for.
        assert_eq!(g.poll_timeout(&dedup), Some(0));
        assert_eq!(sent_at(&mut g, &dedup, 0), ["clock_probe"]);
        assert_eq!(g.poll_timeout(&dedup), Some(10 * MS));
        // One event: its ack waits for the interval, the burst's next probe comes first.
        feed(&mut g, vec![ev(0)], &mut dedup);
        assert_eq!(g.poll_timeout(&dedup), Some(10 * MS));
        assert_eq!(sent_at(&mut g, &dedup, 10 * MS), ["clock_probe"]);
        assert_eq!(g.poll_timeout(&dedup), Some(20 * MS));
        assert_eq!(sent_at(&mut g, &dedup, 20 * MS), ["ack", "clock_probe"]);
        // Idle: only the next probe, at the interval after the burst.
        assert_eq!(g.poll_timeout(&dedup), Some(1_020 * MS));
        // A batch of `ack_every` events: the ack is due already.
        feed(&mut g, (1..4).map(ev).collect(), &mut dedup);
        let due = g.poll_timeout(&dedup).unwrap();
        assert!(due <= 30 * MS, "{due}");
        assert_eq!(
            g.poll_transmit(&dedup, 30 * MS, 0),
            Some(Message::Ack(Ack { up_to: 3 }))
        );
        assert_eq!(g.poll_timeout(&dedup), Some(1_020 * MS));
        // Nothing is sent before the time it names.
        assert!(sent_at(&mut g, &dedup, 1_020 * MS - 1).is_empty());
        assert_eq!(sent_at(&mut g, &dedup, 1_020 * MS), ["clock_probe"]);
    }

    #[test]
    fn acks_by_count_and_time_then_probes_burst_and_interval() {
        let mut dedup = Dedup::new();
        let mut g = connected(&dedup, 1, 0);
        // Right after the handshake: nothing to ack, the first probe is due.
        assert!(matches!(
            g.poll_transmit(&dedup, 0, 500),
            Some(Message::ClockProbe(p)) if p.t1 == 500
        ));
        assert_eq!(g.poll_transmit(&dedup, 0, 500), None);
        // Three events: an ack by count (the interval has not passed since the last ack).
        feed(&mut g, (0..3).map(ev).collect(), &mut dedup);
        assert_eq!(
            g.poll_transmit(&dedup, 5 * MS, 0),
            Some(Message::Ack(Ack { up_to: 2 }))
        );
        // One more: acknowledged only once the interval has passed.
        feed(&mut g, vec![ev(3)], &mut dedup);
        assert_eq!(g.poll_transmit(&dedup, 9 * MS, 0), None);
        assert_eq!(
            g.poll_transmit(&dedup, 25 * MS, 0),
            Some(Message::Ack(Ack { up_to: 3 }))
        );
        // The burst: probes 2 and 3 are 10 ms apart (the first went out at 0) ...
        assert!(matches!(
            g.poll_transmit(&dedup, 25 * MS, 0),
            Some(Message::ClockProbe(_))
        ));
        assert_eq!(g.poll_transmit(&dedup, 34 * MS, 0), None);
        assert!(matches!(
            g.poll_transmit(&dedup, 35 * MS, 0),
            Some(Message::ClockProbe(_))
        ));
        // ... then the interval.
        assert_eq!(g.poll_transmit(&dedup, 1_034 * MS, 0), None);
        assert!(matches!(
            g.poll_transmit(&dedup, 1_035 * MS, 0),
            Some(Message::ClockProbe(_))
        ));
        // No new events: no new ack, only the probe that is due.
        assert!(matches!(
            g.poll_transmit(&dedup, 5_000 * MS, 0),
            Some(Message::ClockProbe(p)) if p.id == 4
        ));
        assert_eq!(g.poll_transmit(&dedup, 5_000 * MS, 0), None);
    }
}
