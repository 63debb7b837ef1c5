//! The host end of the stream to one guest, sans-IO, across connections: when to dial and how
//! long an attempt may take ([`Reconnect`]), the connection itself ([`HostConnection`]), where
//! the spool starts and what it reads next, which acknowledgement releases what, when the
//! host's series are looked at, and the pacing of the event stream (a drained spool waits for
//! new events, then lets them gather for `coalesce`).
//!
//! The driver (the client's `conn` task; the simulation) reads the clock, calls
//! [`HostStream::handle_timeout`] and performs each [`Action`] from [`HostStream::poll`]:
//! dialing, spool reads and acks (the spool is file IO and stays the driver's), closing; it
//! sends what [`HostStream::poll_transmit`] gives on the control stream and feeds back what
//! happened (`handle_*`). Then it sleeps until [`HostStream::poll_timeout`], a message, the
//! end of a write, or new events. It decides nothing itself, as quinn-proto's `Connection`
//! does for quinn.

use std::collections::VecDeque;
use std::time::Duration;

use super::host::{HostConnection, HostOutput, StatePacing};
use super::message::{Message, CLOSE_VM_UNBOUND};
use super::reconnect::{Attempt, Reconnect};
use crate::hoststate::HostState;

/// Application close codes of the host.
pub const CLOSE_SHUTDOWN: u32 = 0;
pub const CLOSE_PROTOCOL: u32 = 1;

/// Closest spacing of the host-state looks that follow events (a flood of events is not a
/// snapshot per batch).
pub const EVENT_STATE_GAP: Duration = Duration::from_millis(20);

/// What a [`HostStream`] is set up with.
#[derive(Debug, Clone)]
pub struct HostStreamConfig {
    /// This host's identity (the one in its client certificate).
    pub host_id: String,
    /// Backoff range between failed attempts.
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// How long an attempt (the transport handshake), and then the `Welcome`, may take.
    pub connect_timeout: Duration,
    /// About how many bytes one spool read returns.
    pub batch_bytes: usize,
    /// How long new events gather after a drained spool is woken (`ZERO`: none).
    pub coalesce: Duration,
    /// Looks at the host's series this often (and after events); `None`: no host state.
    pub state_interval: Option<Duration>,
}

/// Why an attempt or a connection ended (the driver logs and counts it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// The stream was established (the spool started) and the connection ended later.
    Lost(String),
    /// The guest refused before the handshake (busy).
    Refused(String),
    /// The transport handshake took longer than the attempt may.
    HandshakeTimeout(Duration),
    /// The guest refused this host (its `Reject`).
    Rejected(String),
    /// The driver's binder would not stream to the guest's VM: the reason.
    Unbound(String),
    /// Anything else before the stream was established.
    Failed(String),
    /// The driver stops.
    Stopped,
}

impl Ended {
    fn attempt(&self) -> Attempt {
        match self {
            Ended::Lost(_) | Ended::Stopped => Attempt::Lost,
            Ended::Refused(_) => Attempt::Refused,
            _ => Attempt::Failed,
        }
    }
}

/// What the driver is to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start an attempt: resolve, connect, handshake; report
    /// [`handle_connected`](HostStream::handle_connected) or
    /// [`handle_lost`](HostStream::handle_lost). The core times it out (a [`Action::Close`]).
    Dial,
    /// The guest answered: may it be streamed to, given its VM identity? Report
    /// [`handle_bound`](HostStream::handle_bound).
    Bind { vm_uuid: Option<String> },
    /// The stream is established: count it, open the event stream, have the spool resume at
    /// `resume_from` and report the cursor ([`handle_started`](HostStream::handle_started)).
    StartSpool { resume_from: Option<u64> },
    /// Read about `max_bytes` of the spool from `cursor`; report
    /// [`handle_batch`](HostStream::handle_batch).
    ReadSpool { cursor: u64, max_bytes: usize },
    /// The guest has every event up to this number: release them from the spool.
    AckSpool(u64),
    /// Look at the host's series for this guest; hand them to
    /// [`offer_state`](HostStream::offer_state).
    LookAtState,
    /// End this attempt: close the connection (if any) with `code` and `reason`, abandon a
    /// dial, then report [`handle_closed`](HostStream::handle_closed).
    Close {
        code: u32,
        reason: Vec<u8>,
        ended: Ended,
    },
}

/// A spool read, as the core needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchRead {
    /// Event frames in it (0 with only a loss report).
    pub events: u64,
    /// Whether it holds anything at all.
    pub empty: bool,
    pub next_cursor: u64,
    /// Every number in it is below this.
    pub horizon: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    /// A spool read is due.
    Due,
    /// One was asked for.
    Reading,
    /// The batch is being written.
    Writing { next_cursor: u64, events: u64 },
    /// The spool had nothing: waiting for new events.
    Drained,
    /// New events came: they gather until then.
    Coalescing { until: u64 },
}

#[derive(Debug)]
enum Phase {
    /// Between attempts: the next one at `dial_at`.
    Idle {
        dial_at: u64,
    },
    /// An attempt runs until `deadline`.
    Dialing {
        deadline: u64,
        timeout: Duration,
    },
    /// Transport up; the handshake, the binding and the spool's start.
    Connected {
        conn: Box<HostConnection>,
        resume_from: Option<Option<u64>>,
        /// Acknowledgements that came before the spool resumed.
        held_ack: Option<u64>,
    },
    /// Events flow.
    Streaming {
        conn: Box<HostConnection>,
        read: Read,
    },
    /// A close was asked for: waiting for the driver to report it done.
    Closing(Attempt),
    Stopped,
}

/// The host end of the stream to one guest (see the module docs). Times are monotonic ns.
#[derive(Debug)]
pub struct HostStream {
    cfg: HostStreamConfig,
    pacing: Option<StatePacing>,
    policy: Reconnect,
    phase: Phase,
    actions: VecDeque<Action>,
    /// Host-state messages to send (the connection's own go first).
    outbox: VecDeque<Message>,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// At most `max` bytes of `b`, cut at a UTF-8 boundary.
fn cut(b: &[u8], max: usize) -> &[u8] {
    let mut n = b.len().min(max);
    while n > 0 && std::str::from_utf8(&b[..n]).is_err() {
        n -= 1;
    }
    &b[..n]
}

impl HostStream {
    /// A stream whose first attempt is due at once.
    pub fn new(cfg: HostStreamConfig, now: u64) -> Self {
        let pacing = cfg.state_interval.map(|i| {
            let interval = i.max(Duration::from_millis(100));
            StatePacing {
                interval_ns: ns(interval),
                after_events_gap_ns: ns(EVENT_STATE_GAP.min(interval)),
            }
        });
        HostStream {
            policy: Reconnect::new(cfg.reconnect_min, cfg.reconnect_max, cfg.connect_timeout),
            cfg,
            pacing,
            phase: Phase::Idle { dial_at: now },
            actions: VecDeque::new(),
            outbox: VecDeque::new(),
        }
    }

    /// The next thing for the driver to do; call until `None`.
    pub fn poll(&mut self) -> Option<Action> {
        if let Some(a) = self.actions.pop_front() {
            return Some(a);
        }
        if let Phase::Streaming { conn, read } = &mut self.phase {
            if *read == Read::Due {
                *read = Read::Reading;
                return Some(Action::ReadSpool {
                    cursor: conn.cursor().unwrap_or_default(),
                    max_bytes: self.cfg.batch_bytes,
                });
            }
        }
        None
    }

    /// The next message for the control stream; call until `None`.
    pub fn poll_transmit(&mut self) -> Option<Message> {
        match &mut self.phase {
            Phase::Connected { conn, .. } | Phase::Streaming { conn, .. } => {
                conn.poll_transmit().or_else(|| self.outbox.pop_front())
            }
            _ => None,
        }
    }

    /// The next moment something is due: an attempt, its deadline, the `Welcome` deadline, a
    /// look at the host state, the end of a coalescing wait. `None`: nothing until the
    /// driver reports something.
    pub fn poll_timeout(&self) -> Option<u64> {
        match &self.phase {
            Phase::Idle { dial_at } => Some(*dial_at),
            Phase::Dialing { deadline, .. } => Some(*deadline),
            Phase::Connected { conn, .. } => conn.poll_timeout(),
            Phase::Streaming { conn, read } => {
                let gather = match read {
                    Read::Coalescing { until } => Some(*until),
                    _ => None,
                };
                [conn.poll_timeout(), gather].into_iter().flatten().min()
            }
            Phase::Closing(_) | Phase::Stopped => None,
        }
    }

    /// Does what is due at `now`.
    pub fn handle_timeout(&mut self, now: u64) {
        match &mut self.phase {
            Phase::Idle { dial_at } if now >= *dial_at => {
                let timeout = self.policy.connect_timeout(now);
                self.phase = Phase::Dialing {
                    deadline: now.saturating_add(ns(timeout)),
                    timeout,
                };
                self.actions.push_back(Action::Dial);
            }
            Phase::Dialing { deadline, timeout } if now >= *deadline => {
                let t = *timeout;
                self.end(Ended::HandshakeTimeout(t), CLOSE_PROTOCOL, b"error");
            }
            Phase::Connected { conn, .. } => {
                if let Err(e) = conn.handle_timeout(now) {
                    self.end(Ended::Failed(e.to_string()), CLOSE_PROTOCOL, b"error");
                }
            }
            Phase::Streaming { conn, read } => {
                if let Read::Coalescing { until } = read {
                    if now >= *until {
                        *read = Read::Due;
                    }
                }
                if conn.poll_state(now) {
                    self.actions.push_back(Action::LookAtState);
                }
            }
            _ => {}
        }
    }

    /// The transport is up (the TLS handshake done) at `now`; the spool's sequence space is
    /// `boot_id`. The `Hello` is the first message to send.
    pub fn handle_connected(&mut self, boot_id: u64, now: u64) {
        if !matches!(self.phase, Phase::Dialing { .. }) {
            return;
        }
        let mut conn = HostConnection::new(
            self.cfg.host_id.clone(),
            boot_id,
            ns(self.cfg.connect_timeout),
            now,
        );
        if let Some(p) = self.pacing {
            conn = conn.with_state_pacing(p);
        }
        self.outbox.clear();
        self.phase = Phase::Connected {
            conn: Box::new(conn),
            resume_from: None,
            held_ack: None,
        };
    }

    /// The attempt or the connection failed in the driver (no route, a TLS failure, the
    /// connection lost, a spool error): `refused` where the guest refused before any state.
    pub fn handle_lost(&mut self, error: String, refused: bool) {
        let ended = match &self.phase {
            Phase::Streaming { .. } => Ended::Lost(error),
            Phase::Dialing { .. } if refused => Ended::Refused(error),
            Phase::Dialing { .. } | Phase::Connected { .. } => Ended::Failed(error),
            _ => return,
        };
        self.end(ended, CLOSE_PROTOCOL, b"error");
    }

    /// A message of the control stream.
    pub fn handle_control(&mut self, msg: Message, now: u64, now_realtime_ns: i64) {
        let (Phase::Connected { conn, .. } | Phase::Streaming { conn, .. }) = &mut self.phase
        else {
            return;
        };
        match conn.handle_control(msg, now, now_realtime_ns) {
            Err(e) => {
                let e = e.to_string();
                self.handle_lost(e, false);
            }
            Ok(Some(HostOutput::Start { resume_from })) => {
                if let Phase::Connected {
                    conn,
                    resume_from: r,
                    ..
                } = &mut self.phase
                {
                    *r = Some(resume_from);
                    let vm_uuid = conn.peer_vm_uuid().map(str::to_owned);
                    self.actions.push_back(Action::Bind { vm_uuid });
                }
            }
            Ok(Some(HostOutput::Rejected(reason))) => {
                self.end(Ended::Rejected(reason), CLOSE_PROTOCOL, b"error")
            }
            Ok(Some(HostOutput::Acked(up_to))) => match &mut self.phase {
                // Not before the spool resumed: what the resume counts as collided must not
                // be released as acknowledged first (an ack may follow the Welcome at once).
                Phase::Connected { held_ack, .. } => {
                    *held_ack = Some(held_ack.map_or(up_to, |a: u64| a.max(up_to)))
                }
                _ => self.actions.push_back(Action::AckSpool(up_to)),
            },
            Ok(None) => {}
        }
    }

    /// The binder's answer to [`Action::Bind`]: a guest the host cannot bind to one of its
    /// VMs gets nothing (rather than everything), and is told why.
    pub fn handle_bound(&mut self, bound: Result<(), String>) {
        let Phase::Connected {
            resume_from: Some(resume_from),
            ..
        } = &self.phase
        else {
            return;
        };
        let resume_from = *resume_from;
        match bound {
            Ok(()) => self.actions.push_back(Action::StartSpool { resume_from }),
            Err(reason) => {
                let why = cut(reason.as_bytes(), 200).to_vec();
                self.end(Ended::Unbound(reason), CLOSE_VM_UNBOUND, &why);
            }
        }
    }

    /// The spool resumed at `cursor` ([`Action::StartSpool`]): events flow from there.
    pub fn handle_started(&mut self, cursor: u64, now: u64) {
        let Phase::Connected { .. } = self.phase else {
            return;
        };
        let Phase::Connected {
            mut conn, held_ack, ..
        } = std::mem::replace(&mut self.phase, Phase::Stopped)
        else {
            unreachable!()
        };
        conn.start(cursor, now);
        if let Some(a) = held_ack {
            self.actions.push_back(Action::AckSpool(a));
        }
        self.phase = Phase::Streaming {
            conn,
            read: Read::Due,
        };
    }

    /// What the read of [`Action::ReadSpool`] brought. A batch with something in it is to be
    /// written on the event stream, after the returned horizon message where there is one;
    /// report [`handle_written`](Self::handle_written) when it is.
    pub fn handle_batch(&mut self, b: BatchRead) -> Option<Message> {
        let Phase::Streaming { conn, read } = &mut self.phase else {
            return None;
        };
        if b.empty {
            *read = Read::Drained;
            return None;
        }
        *read = Read::Writing {
            next_cursor: b.next_cursor,
            events: b.events,
        };
        conn.horizon_for(b.horizon)
    }

    /// The batch is written: the stream goes on after it.
    pub fn handle_written(&mut self, now: u64) {
        if let Phase::Streaming { conn, read } = &mut self.phase {
            if let Read::Writing {
                next_cursor,
                events,
            } = *read
            {
                conn.sent(next_cursor, events, now);
                *read = Read::Due;
            }
        }
    }

    /// Whether a drained spool waits for new events ([`handle_spooled`](Self::handle_spooled)
    /// is wanted).
    pub fn waiting_for_events(&self) -> bool {
        matches!(
            self.phase,
            Phase::Streaming {
                read: Read::Drained,
                ..
            }
        )
    }

    /// New events are in the spool.
    pub fn handle_spooled(&mut self, now: u64) {
        if let Phase::Streaming { read, .. } = &mut self.phase {
            if *read == Read::Drained {
                *read = if self.cfg.coalesce.is_zero() {
                    Read::Due
                } else {
                    Read::Coalescing {
                        until: now.saturating_add(ns(self.cfg.coalesce)),
                    }
                };
            }
        }
    }

    /// The host state [`Action::LookAtState`] asked for: sent where the guest takes it and it
    /// changed.
    pub fn offer_state(&mut self, state: HostState) {
        if let Phase::Streaming { conn, .. } = &mut self.phase {
            if let Some(m) = conn.offer_state(state) {
                self.outbox.push_back(m);
            }
        }
    }

    /// The driver stops: close the connection as a shutdown.
    pub fn handle_stop(&mut self) {
        if !matches!(self.phase, Phase::Stopped) {
            // (in place of a close asked for and not done yet)
            self.actions.retain(|a| !matches!(a, Action::Close { .. }));
            self.end(Ended::Stopped, CLOSE_SHUTDOWN, b"shutdown");
        }
        self.phase = Phase::Stopped;
    }

    /// The close of [`Action::Close`] is done at `now`: the next attempt is planned. Returns
    /// the wait until it.
    pub fn handle_closed(&mut self, now: u64) -> Option<Duration> {
        let Phase::Closing(how) = self.phase else {
            return None;
        };
        let delay = self.policy.ended(how, now);
        self.phase = Phase::Idle {
            dial_at: now.saturating_add(ns(delay)),
        };
        Some(delay)
    }

    /// Whether events flow (the handshake done, the spool started).
    pub fn streaming(&self) -> bool {
        matches!(self.phase, Phase::Streaming { .. })
    }

    /// Whether an attempt or a connection is under way (between [`Action::Dial`] and
    /// [`Action::Close`]).
    pub fn connecting_or_connected(&self) -> bool {
        matches!(
            self.phase,
            Phase::Dialing { .. } | Phase::Connected { .. } | Phase::Streaming { .. }
        )
    }

    fn end(&mut self, ended: Ended, code: u32, reason: &[u8]) {
        self.phase = Phase::Closing(ended.attempt());
        self.outbox.clear();
        self.actions.retain(|a| matches!(a, Action::AckSpool(_)));
        self.actions.push_back(Action::Close {
            code,
            reason: reason.to_vec(),
            ended,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::reconnect::{FAST_CONNECT_TIMEOUT, FAST_RECONNECT_MAX};
    use super::super::{Ack, Dedup, GuestConnection, GuestTiming, ServerAction};
    use super::*;

    const MS: u64 = 1_000_000;

    fn cfg() -> HostStreamConfig {
        HostStreamConfig {
            host_id: "pve1".into(),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            batch_bytes: 1000,
            coalesce: Duration::from_micros(500),
            state_interval: None,
        }
    }

    fn drain(s: &mut HostStream) -> Vec<Action> {
        std::iter::from_fn(|| s.poll()).collect()
    }

    /// Connects `s` at `now` through a guest core, up to the spool's start.
    fn handshake(s: &mut HostStream, now: u64) -> Vec<Action> {
        s.handle_connected(5, now);
        let hello = s.poll_transmit().unwrap();
        let mut g = GuestConnection::new("pve1", GuestTiming::default(), now);
        let ServerAction::Welcome(w) = g.handle_control(hello, &Dedup::new(), now, 0).unwrap()
        else {
            panic!("no welcome")
        };
        s.handle_control(w, now, 0);
        drain(s)
    }

    /// The attempt's deadline is the core's: a dial that hangs is abandoned, and the next is
    /// planned by the backoff.
    #[test]
    fn a_hanging_dial_is_abandoned_at_the_connect_timeout() {
        let mut s = HostStream::new(cfg(), 0);
        assert_eq!(s.poll_timeout(), Some(0));
        s.handle_timeout(0);
        assert_eq!(drain(&mut s), vec![Action::Dial]);
        assert_eq!(s.poll_timeout(), Some(5_000 * MS));
        s.handle_timeout(4_999 * MS);
        assert_eq!(drain(&mut s), vec![]);
        s.handle_timeout(5_000 * MS);
        let [Action::Close { ended, .. }] = &drain(&mut s)[..] else {
            panic!()
        };
        assert_eq!(*ended, Ended::HandshakeTimeout(Duration::from_secs(5)));
        let wait = s.handle_closed(5_000 * MS).unwrap();
        assert!(wait >= Duration::from_millis(50) && wait <= Duration::from_millis(100));
        assert_eq!(s.poll_timeout(), Some(5_000 * MS + ns(wait)));
    }

    /// The whole way: Hello, binding, the spool's start, reads paced by the spool's state,
    /// acks to the spool; then the connection is lost and the next attempt comes soon and
    /// short.
    #[test]
    fn handshake_bind_start_read_ack_and_a_fast_reconnect() {
        let mut s = HostStream::new(cfg(), 0);
        s.handle_timeout(0);
        assert_eq!(drain(&mut s), vec![Action::Dial]);
        assert_eq!(handshake(&mut s, MS), vec![Action::Bind { vm_uuid: None }]);
        // An ack right behind the Welcome waits for the spool's resume.
        s.handle_control(Message::Ack(Ack { up_to: 39 }), MS, 0);
        s.handle_bound(Ok(()));
        assert_eq!(
            drain(&mut s),
            vec![Action::StartSpool { resume_from: None }]
        );
        assert!(!s.streaming());
        s.handle_started(40, 2 * MS);
        assert!(s.streaming());
        assert_eq!(
            drain(&mut s),
            vec![
                Action::AckSpool(39),
                Action::ReadSpool {
                    cursor: 40,
                    max_bytes: 1000
                }
            ]
        );
        // One read at a time.
        assert_eq!(drain(&mut s), vec![]);
        let h = s.handle_batch(BatchRead {
            events: 3,
            empty: false,
            next_cursor: 43,
            horizon: 43,
        });
        assert!(matches!(h, Some(Message::Horizon(x)) if x.below == 43));
        assert_eq!(drain(&mut s), vec![], "no read while the batch is written");
        s.handle_written(3 * MS);
        assert_eq!(
            drain(&mut s),
            vec![Action::ReadSpool {
                cursor: 43,
                max_bytes: 1000
            }]
        );
        let empty = BatchRead {
            events: 0,
            empty: true,
            next_cursor: 43,
            horizon: 43,
        };
        assert_eq!(s.handle_batch(empty), None);
        assert!(s.waiting_for_events());
        assert_eq!(s.poll_timeout(), None);
        // New events gather for the coalescing time before the next read.
        s.handle_spooled(10 * MS);
        assert_eq!(s.poll_timeout(), Some(10 * MS + 500_000));
        s.handle_timeout(10 * MS + 499_999);
        assert_eq!(drain(&mut s), vec![]);
        s.handle_timeout(10 * MS + 500_000);
        assert_eq!(drain(&mut s).len(), 1);
        s.handle_control(Message::Ack(Ack { up_to: 42 }), 11 * MS, 0);
        assert_eq!(drain(&mut s), vec![Action::AckSpool(42)]);
        // Lost: the next attempt within the fast window, and short.
        s.handle_lost("connection reset".into(), false);
        let [Action::Close { code, ended, .. }] = &drain(&mut s)[..] else {
            panic!()
        };
        assert_eq!(
            (code, ended),
            (&CLOSE_PROTOCOL, &Ended::Lost("connection reset".into()))
        );
        let wait = s.handle_closed(20 * MS).unwrap();
        assert!(wait <= FAST_RECONNECT_MAX);
        s.handle_timeout(20 * MS + ns(wait));
        assert_eq!(drain(&mut s), vec![Action::Dial]);
        assert_eq!(
            s.poll_timeout(),
            Some(20 * MS + ns(wait) + ns(FAST_CONNECT_TIMEOUT))
        );
    }

    /// A guest whose VM the binder refuses is closed with the VM-unbound code and the reason;
    /// a refusal (busy) keeps the attempts close; a silent guest runs into the Welcome
    /// deadline.
    #[test]
    fn unbound_refused_and_a_silent_guest() {
        let mut s = HostStream::new(cfg(), 0);
        s.handle_timeout(0);
        drain(&mut s);
        handshake(&mut s, 0);
        s.handle_bound(Err("no VM with that UUID".into()));
        let [Action::Close {
            code,
            reason,
            ended,
        }] = &drain(&mut s)[..]
        else {
            panic!()
        };
        assert_eq!(*code, super::super::CLOSE_VM_UNBOUND);
        assert_eq!(reason, b"no VM with that UUID");
        assert_eq!(*ended, Ended::Unbound("no VM with that UUID".into()));
        // Failed attempts grow the wait; a refusal caps it.
        let mut now = 0;
        for _ in 0..8 {
            now += ns(s.handle_closed(now).unwrap());
            s.handle_timeout(now);
            drain(&mut s);
            s.handle_lost("no route".into(), false);
            drain(&mut s);
        }
        assert!(s.handle_closed(now).unwrap() >= Duration::from_secs(5));
        now += 10_000 * MS;
        s.handle_timeout(now);
        drain(&mut s);
        s.handle_lost("refused".into(), true);
        let [Action::Close { ended, .. }] = &drain(&mut s)[..] else {
            panic!()
        };
        assert_eq!(*ended, Ended::Refused("refused".into()));
        let wait = s.handle_closed(now).unwrap();
        assert!(wait <= FAST_RECONNECT_MAX);
        // The guest never answers the Hello: the Welcome deadline ends the attempt.
        now += ns(wait);
        s.handle_timeout(now);
        drain(&mut s);
        s.handle_connected(5, now);
        assert!(matches!(s.poll_transmit(), Some(Message::Hello(_))));
        assert_eq!(s.poll_timeout(), Some(now + 5_000 * MS));
        s.handle_timeout(now + 5_000 * MS);
        let [Action::Close { ended, .. }] = &drain(&mut s)[..] else {
            panic!()
        };
        assert_eq!(*ended, Ended::Failed("no Welcome within 5000 ms".into()));
        // A stop closes as a shutdown, and nothing follows.
        s.handle_closed(now);
        s.handle_stop();
        let [Action::Close { code, ended, .. }] = &drain(&mut s)[..] else {
            panic!()
        };
        assert_eq!((*code, ended), (CLOSE_SHUTDOWN, &Ended::Stopped));
        assert_eq!(s.poll_timeout(), None);
    }
}
