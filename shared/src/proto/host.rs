//! The host end of one connection as a sans-IO state machine: `Hello` out, the `Welcome`
//! deadline, the resume point, acknowledgements, clock replies. Time comes in as arguments
//! (`now_mono_ns` is `CLOCK_MONOTONIC`; `now_realtime_ns` is the host's reference clock as
//! reported on the wire); the host's QUIC driver moves the messages and applies acks to the
//! spool.

use std::collections::VecDeque;

use super::{caps, ClientAction, ClientSession, Message, ProtocolError};
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
        }
    }

    /// Capabilities announced by the guest (0 before the `Welcome`).
    pub fn peer_capabilities(&self) -> u64 {
        self.session.peer_capabilities()
    }

    /// When the `Welcome` must have arrived (monotonic ns); `None` once it has.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.welcome_deadline_ns
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
        if conn.poll_timeout().is_some() || conn.peer_capabilities() & caps::HOST_STATE == 0 {
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
}
