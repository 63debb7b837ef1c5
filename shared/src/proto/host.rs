//! The host end of one connection as a sans-IO state machine: `Hello` out, the `Welcome`
//! deadline, the resume point and the event stream's cursor, horizons, acknowledgements,
//! clock replies, and when the host's series are looked at (host-state pacing): every state
//! interval, and right after events went out (at most once per gap), so the series an event
//! changed follow it. [`HostConnection::poll_timeout`] is the next moment anything is due. Time comes in as arguments
//! (`now_mono_ns` is `CLOCK_MONOTONIC`; `now_realtime_ns` is the host's reference clock as
//! reported on the wire); the host's QUIC driver moves the messages and applies acks to the
//! spool.

use std::collections::VecDeque;

use super::message::{caps, Horizon, Message};
use super::session::{ClientAction, ClientSession, ProtocolError};
use crate::hoststate::HostState;

/// What the connection tells its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostOutput {
    /// Handshake done: open the event stream and send from `resume_from` (`None`: from the
    /// oldest event still spooled). Everything below `resume_from` counts as acknowledged.
    Start { resume_from: Option<u64> },
    /// The guest refused this host.
    Rejected(String),
    /// The guest has every event up to this sequence number.
    Acked(u64),
}

/// Host end of one connection.
#[derive(Debug)]
pub struct HostConnection {
    session: ClientSession,
    welcome_deadline_ns: Option<u64>,
    welcome_timeout_ms: u64,
    outbox: VecDeque<Message>,
    /// The next event to send, once streaming.
    cursor: Option<u64>,
    /// The last horizon sent on the event stream.
    horizon_sent: u64,
    pacing: Option<StatePacing>,
    /// When the next periodic look at the host state is due.
    state_due_ns: Option<u64>,
    /// When the look that follows events is due (`None`: no events since the last look).
    after_events_ns: Option<u64>,
    last_look_ns: Option<u64>,
    states: StateSender,
}

/// When a connection looks at the host's series for its guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatePacing {
    /// A look this often ...
    pub interval_ns: u64,
    /// ... and one after events went out, at most this soon after the previous look.
    pub after_events_gap_ns: u64,
}

impl HostConnection {
    /// A connection whose transport came up at `now_mono_ns`; the guest has `welcome_timeout_ns`
    /// to answer the `Hello`, which is the first message [`poll_transmit`](Self::poll_transmit)
    /// gives.
    pub fn new(
        host_id: impl Into<String>,
        boot_id: u64,
        welcome_timeout_ns: u64,
        now_mono_ns: u64,
    ) -> Self {
        let session = ClientSession::new(host_id, boot_id);
        let outbox = VecDeque::from([session.hello()]);
        HostConnection {
            session,
            welcome_deadline_ns: Some(now_mono_ns.saturating_add(welcome_timeout_ns)),
            welcome_timeout_ms: welcome_timeout_ns / 1_000_000,
            outbox,
            cursor: None,
            horizon_sent: 0,
            pacing: None,
            state_due_ns: None,
            after_events_ns: None,
            last_look_ns: None,
            states: StateSender::default(),
        }
    }

    /// Looks at the host's series with this pacing (a host with state to send).
    pub fn with_state_pacing(mut self, pacing: StatePacing) -> Self {
        self.pacing = Some(pacing);
        self
    }

    /// Whether the handshake is done.
    pub fn streaming(&self) -> bool {
        self.cursor.is_some()
    }

    /// The handshake is done and the spool resumed at `cursor` (see
    /// [`crate::proto::Ledger::resume`]): the event stream starts there, and the first look at
    /// the host state is due at once.
    pub fn start(&mut self, cursor: u64, now_mono_ns: u64) {
        self.cursor = Some(cursor);
        if self.pacing.is_some() {
            self.state_due_ns = Some(now_mono_ns);
        }
    }

    /// Where the event stream goes on.
    pub fn cursor(&self) -> Option<u64> {
        self.cursor
    }

    /// A batch read from the spool is about to go out, all its numbers below `horizon`: the
    /// horizon message to send before it, where the guest takes them and it moved.
    pub fn horizon_for(&mut self, horizon: u64) -> Option<Message> {
        if self.session.peer_capabilities() & caps::SEQ_HORIZON == 0 || horizon <= self.horizon_sent
        {
            return None;
        }
        self.horizon_sent = horizon;
        Some(Message::Horizon(Horizon { below: horizon }))
    }

    /// A batch went out; the stream goes on at `next_cursor`. With `events` in it, a look at
    /// the host state follows (at most one per gap).
    pub fn sent(&mut self, next_cursor: u64, events: u64, now_mono_ns: u64) {
        self.cursor = Some(next_cursor);
        if let (Some(p), true, None) = (self.pacing, events > 0, self.after_events_ns) {
            let earliest = self
                .last_look_ns
                .map_or(now_mono_ns, |l| l.saturating_add(p.after_events_gap_ns));
            self.after_events_ns = Some(earliest.max(now_mono_ns));
        }
    }

    /// Whether the host state is to be looked at now; if so, the next looks are planned from
    /// here.
    pub fn poll_state(&mut self, now_mono_ns: u64) -> bool {
        let Some(p) = self.pacing else { return false };
        let due = [self.state_due_ns, self.after_events_ns]
            .into_iter()
            .flatten()
            .any(|d| now_mono_ns >= d);
        if due {
            self.last_look_ns = Some(now_mono_ns);
            self.after_events_ns = None;
            self.state_due_ns = Some(now_mono_ns.saturating_add(p.interval_ns));
        }
        due
    }

    /// The message for the host state just looked at, if the guest takes it and it changed.
    pub fn offer_state(&mut self, state: HostState) -> Option<Message> {
        let mut states = std::mem::take(&mut self.states);
        let m = states.offer(self, state);
        self.states = states;
        m
    }

    /// The SMBIOS system UUID of the guest's VM, where its `WelcomeVm` named one.
    pub fn peer_vm_uuid(&self) -> Option<&str> {
        self.session.peer_vm_uuid()
    }

    /// Capabilities announced by the guest (0 before the `Welcome`).
    pub fn peer_capabilities(&self) -> u64 {
        self.session.peer_capabilities()
    }

    /// The next moment something is due (monotonic ns): the `Welcome` deadline, then the
    /// looks at the host state; `None`: nothing until a message comes.
    pub fn poll_timeout(&self) -> Option<u64> {
        [
            self.welcome_deadline_ns,
            self.state_due_ns,
            self.after_events_ns,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Checks the `Welcome` deadline.
    pub fn handle_timeout(&mut self, now_mono_ns: u64) -> Result<(), ProtocolError> {
        match self.welcome_deadline_ns {
            Some(d) if now_mono_ns >= d => Err(ProtocolError::Timeout {
                waiting_for: "Welcome",
                after_ms: self.welcome_timeout_ms,
            }),
            _ => Ok(()),
        }
    }

    /// Handles a message of the control stream. Clock probes are answered through
    /// [`poll_transmit`](Self::poll_transmit) and give no output.
    pub fn handle_control(
        &mut self,
        msg: Message,
        now_mono_ns: u64,
        now_realtime_ns: i64,
    ) -> Result<Option<HostOutput>, ProtocolError> {
        self.handle_timeout(now_mono_ns)?;
        Ok(match self.session.handle(msg, now_realtime_ns)? {
            ClientAction::Start { resume_from } => {
                self.welcome_deadline_ns = None;
                Some(HostOutput::Start { resume_from })
            }
            ClientAction::Rejected(reason) => {
                self.welcome_deadline_ns = None;
                Some(HostOutput::Rejected(reason))
            }
            ClientAction::Acked(up_to) => Some(HostOutput::Acked(up_to)),
            ClientAction::Send(m) => {
                self.outbox.push_back(m);
                None
            }
        })
    }

    /// The next message for the control stream; call until `None`.
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.outbox.pop_front()
    }
}

/// Decides which host states go out: only to a guest that takes them, only after the
/// handshake, and only when the series differ from the last state sent on this connection
/// (a new connection starts with a full state, since the guest may be a new process).
#[derive(Debug, Default)]
pub struct StateSender {
    last: Option<HostState>,
}

impl StateSender {
    /// The message to send for `state`, if any.
    pub fn offer(&mut self, conn: &HostConnection, state: HostState) -> Option<Message> {
        if conn.welcome_deadline_ns.is_some() || conn.peer_capabilities() & caps::HOST_STATE == 0 {
            return None;
        }
        if self.last.as_ref().is_some_and(|l| l.same_series(&state)) {
            return None;
        }
        self.last = Some(state.clone());
        Some(Message::HostState(state))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        caps, Ack, ClockProbe, ClockReply, Dedup, GuestConnection, GuestTiming, Reject,
        ServerAction,
    };
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn hello_first_then_start_acks_and_clock_replies() {
        let mut h = HostConnection::new("pve1", 5, 100 * MS, 0);
        let hello = h.poll_transmit().unwrap();
        assert!(matches!(&hello, Message::Hello(x) if x.host_id == "pve1" && x.boot_id == 5));
        assert_eq!(h.poll_transmit(), None);
        // The guest's side, driven in memory.
        let mut dedup = Dedup::new();
        dedup.seed("pve1", 5, 9);
        let mut g = GuestConnection::new("pve1", GuestTiming::default(), 0);
        let ServerAction::Welcome(w) = g.handle_control(hello, &dedup, 0, 0).unwrap() else {
            panic!("no welcome")
        };
        assert_eq!(
            h.handle_control(w, 50 * MS, 0).unwrap(),
            Some(HostOutput::Start {
                resume_from: Some(10)
            })
        );
        assert_eq!(h.peer_capabilities(), caps::ALL);
        assert_eq!(h.poll_timeout(), None);
        // After the handshake the deadline no longer applies.
        h.handle_timeout(u64::MAX).unwrap();
        assert_eq!(
            h.handle_control(Message::Ack(Ack { up_to: 12 }), u64::MAX, 0)
                .unwrap(),
            Some(HostOutput::Acked(12))
        );
        // A probe is answered with the host's reference time at receipt.
        let probe = Message::ClockProbe(ClockProbe { id: 3, t1: 77 });
        assert_eq!(h.handle_control(probe, 0, 1_000).unwrap(), None);
        assert_eq!(
            h.poll_transmit(),
            Some(Message::ClockReply(ClockReply {
                id: 3,
                t1: 77,
                t2: 1_000,
                t3: 1_000
            }))
        );
        assert_eq!(h.poll_transmit(), None);
    }

    #[test]
    fn welcome_deadline_and_reject() {
        let mut h = HostConnection::new("pve1", 5, 100 * MS, 10 * MS);
        assert_eq!(h.poll_timeout(), Some(110 * MS));
        h.handle_timeout(109 * MS).unwrap();
        let e = h.handle_timeout(110 * MS).unwrap_err();
        assert_eq!(e.to_string(), "no Welcome within 100 ms");
        assert_eq!(e.reason(), "timeout");

        let mut h = HostConnection::new("pve1", 5, 100 * MS, 0);
        let reject = Message::Reject(Reject {
            reason: "unknown host".into(),
        });
        assert_eq!(
            h.handle_control(reject, 1, 0).unwrap(),
            Some(HostOutput::Rejected("unknown host".into()))
        );
        // Nothing is valid after a refusal.
        assert!(h
            .handle_control(Message::Ack(Ack { up_to: 1 }), 2, 0)
            .is_err());
    }

    #[test]
    fn acks_before_the_handshake_are_protocol_errors() {
        let mut h = HostConnection::new("pve1", 5, 100 * MS, 0);
        assert_eq!(
            h.handle_control(Message::Ack(Ack { up_to: 1 }), 0, 0)
                .unwrap_err()
                .reason(),
            "unexpected_message"
        );
    }

    #[test]
    fn host_state_goes_out_after_the_handshake_when_changed() {
        use crate::hoststate::{StateFamily, StateKind, StateSeries};
        let state = |v: f64, t: i64| HostState {
            taken_realtime_ns: t,
            families: vec![StateFamily {
                name: "gpufeed_host_pcie_link_width".into(),
                help: "w".into(),
                kind: StateKind::Gauge,
                series: vec![StateSeries {
                    labels: vec![("bdf".into(), "0000:0a:00.0".into())],
                    value: v,
                }],
            }],
            truncated_series: 0,
        };
        let mut h = HostConnection::new("pve1", 5, 100 * MS, 0);
        let mut out = StateSender::default();
        assert_eq!(out.offer(&h, state(4.0, 1)), None, "not before the Welcome");
        let hello = h.poll_transmit().unwrap();
        let mut g = GuestConnection::new("pve1", GuestTiming::default(), 0);
        let ServerAction::Welcome(w) = g.handle_control(hello, &Dedup::new(), 0, 0).unwrap() else {
            panic!("no welcome")
        };
        h.handle_control(w, 1, 0).unwrap();
        let m = out
            .offer(&h, state(4.0, 2))
            .expect("first state after the handshake");
        // the guest takes it while streaming
        assert_eq!(
            g.handle_control(m, &Dedup::new(), 2, 0).unwrap(),
            ServerAction::HostState(state(4.0, 2))
        );
        assert_eq!(
            out.offer(&h, state(4.0, 3)),
            None,
            "unchanged series are not resent"
        );
        assert!(
            matches!(out.offer(&h, state(1.0, 4)), Some(Message::HostState(s)) if s.taken_realtime_ns == 4)
        );

        // a guest that does not announce the capability never gets one
        let mut h = HostConnection::new("pve1", 5, 100 * MS, 0);
        let _ = h.poll_transmit();
        let old_welcome = Message::Welcome(super::super::Welcome {
            protocol_version: super::super::PROTOCOL_VERSION,
            resume_from: None,
            capabilities: caps::CLOCK_PROBE | caps::SPOOL_LOSS,
        });
        h.handle_control(old_welcome, 1, 0).unwrap();
        assert_eq!(StateSender::default().offer(&h, state(4.0, 5)), None);
    }

    #[test]
    fn cursor_horizons_and_state_pacing() {
        let pacing = StatePacing {
            interval_ns: 2_000 * MS,
            after_events_gap_ns: 20 * MS,
        };
        let mut h = HostConnection::new("pve1", 5, 100 * MS, 0).with_state_pacing(pacing);
        let hello = h.poll_transmit().unwrap();
        let mut g = GuestConnection::new("pve1", GuestTiming::default(), 0);
        let ServerAction::Welcome(w) = g.handle_control(hello, &Dedup::new(), 0, 0).unwrap() else {
            panic!("no welcome")
        };
        h.handle_control(w, MS, 0).unwrap();
        assert!(!h.poll_state(MS), "no state before the stream starts");
        h.start(40, 10 * MS);
        assert_eq!(h.cursor(), Some(40));
        // The first look is due at once, then every interval.
        assert_eq!(h.poll_timeout(), Some(10 * MS));
        assert!(h.poll_state(10 * MS));
        assert_eq!(h.poll_timeout(), Some(2_010 * MS));
        assert!(!h.poll_state(500 * MS));
        // Events went out: a look follows, at most one per gap after the previous look.
        h.sent(50, 10, 15 * MS);
        assert_eq!((h.cursor(), h.poll_timeout()), (Some(50), Some(30 * MS)));
        h.sent(60, 10, 16 * MS);
        assert_eq!(h.poll_timeout(), Some(30 * MS), "one look for both");
        assert!(!h.poll_state(29 * MS));
        assert!(h.poll_state(30 * MS));
        assert_eq!(h.poll_timeout(), Some(2_030 * MS));
        // A batch without events (a loss report) asks for no look.
        h.sent(70, 0, 40 * MS);
        assert_eq!(h.poll_timeout(), Some(2_030 * MS));
        // Horizons: only when they move, and only to guests that take them.
        assert_eq!(
            h.horizon_for(70),
            Some(Message::Horizon(Horizon { below: 70 }))
        );
        assert_eq!(h.horizon_for(70), None);
        assert_eq!(h.horizon_for(60), None);
        let mut old = HostConnection::new("pve1", 5, 100 * MS, 0);
        let _ = old.poll_transmit();
        old.handle_control(
            Message::Welcome(super::super::Welcome {
                protocol_version: super::super::PROTOCOL_VERSION,
                resume_from: None,
                capabilities: caps::CLOCK_PROBE,
            }),
            1,
            0,
        )
        .unwrap();
        assert_eq!(old.horizon_for(70), None);
        assert_eq!(old.poll_timeout(), None, "no pacing: nothing is due");
    }
}
