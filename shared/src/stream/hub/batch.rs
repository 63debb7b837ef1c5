//! What one read of the event stream amounts to, decided without I/O: the batch the core
//! staged ([`crate::proto::Staged`]) is written to the journal, and only once the journal has
//! it committed to the de-duplication table and the recent ring. A batch the journal refuses is
//! not accepted at all: nothing of it is delivered or counted and the table stays as it was,
//! so that the host, which keeps what was not acknowledged, sends the same events again on
//! its next connection and they are taken then. The driver applies the [`Outcome`] (metrics,
//! broadcast, log lines) and ends the connection when it says so.

use std::fmt;

use crate::proto::{Dedup, GuestConnection, Staged};

use super::recent::{self, Recent};
use super::{ReceivedEvent, UnknownEvent};

/// Where accepted events and losses are written before they count ([`super::journal`]).
pub trait EventLog {
    fn add_event(&mut self, e: &ReceivedEvent);
    /// A loss report: the range `first..=last` the host reported, `lost` of it newly lost.
    fn add_loss(&mut self, host: &str, boot: u64, first: u64, last: u64, lost: u64);
    /// Writes what was added since the last commit: all of it, or (on an error) none.
    fn commit(&mut self) -> std::io::Result<()>;
    /// The committed batch is in `dedup` now.
    fn committed(&mut self, dedup: &Dedup);
}

/// Where a batch comes from and when it arrived.
#[derive(Debug, Clone, Copy)]
pub struct Receipt<'a> {
    /// The host's identity (from its certificate).
    pub host: &'a str,
    pub boot: u64,
    /// Guest realtime at receipt, ns.
    pub realtime_ns: i64,
    /// Host minus guest clock offset estimated at receipt, ns.
    pub clock_offset_ns: Option<i64>,
}

/// A warning about the host's stream that the driver logs (rate-limited per [`Note::kind`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// `missing` events before `seq` that no loss report accounts for: counted as lost.
    Gap { seq: u64, missing: u64, boot: u64 },
    /// The host's spool dropped `first..=last` (`reported` events); `newly_lost` of them were
    /// not accounted before.
    SpoolLoss {
        first: u64,
        last: u64,
        reported: u64,
        newly_lost: u64,
        boot: u64,
    },
}

impl Note {
    pub fn kind(&self) -> &'static str {
        match self {
            Note::Gap { .. } => "gap",
            Note::SpoolLoss { .. } => "spool_loss",
        }
    }
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Note::Gap { seq, missing, boot } => write!(
                f,
                "sequence gap of {missing} before {seq} without a loss report (boot {boot}); counted as lost"
            ),
            Note::SpoolLoss {
                first,
                last,
                reported,
                newly_lost,
                boot,
            } => write!(
                f,
                "host spool dropped events {first}..={last} (reported {reported}, newly lost {newly_lost}, boot {boot})"
            ),
        }
    }
}

/// The journal refused a batch: nothing of it was accepted.
#[derive(Debug)]
pub struct Refused {
    pub error: std::io::Error,
    /// Decoded events the batch held.
    pub events: usize,
}

/// What a batch amounts to.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Accepted events, in order (already in the recent ring): to hand on.
    pub delivered: Vec<ReceivedEvent>,
    /// Accepted events of kinds this guest cannot decode: to list.
    pub unknown: Vec<UnknownEvent>,
    /// Retransmissions dropped.
    pub duplicates: u64,
    /// Events newly counted as lost (reported by the host, or missing without a report).
    pub lost: u64,
    /// Emission to receipt of the latest delivered event, ns, never negative (it is only
    /// within the offset estimate's error).
    pub lag_ns: Option<i64>,
    pub notes: Vec<Note>,
    /// Messages refused alone (numbers out of range): their reasons. The stream goes on.
    pub refused: Vec<&'static str>,
    /// Set when the journal refused the batch: everything else is empty, and the connection
    /// must end so that the host sends the events again.
    pub unavailable: Option<Refused>,
}

/// Accepts `staged`, accounted by `core` against `dedup`: journals it in `log` (where there is
/// one), then commits it to `dedup` and keeps its events in `recent`.
pub fn accept<L: EventLog + ?Sized>(
    core: &mut GuestConnection,
    mut staged: Staged,
    at: Receipt<'_>,
    dedup: &mut Dedup,
    mut log: Option<&mut L>,
    recent: &mut Recent,
) -> Outcome {
    let mut out = Outcome::default();
    let mut sizes = Vec::with_capacity(staged.deliveries.len());
    for d in staged.deliveries.drain(..) {
        let f = d.frame;
        let Some(event) = d.event else {
            out.unknown.push(UnknownEvent {
                host: at.host.to_owned(),
                kind: f.kind,
                payload_len: f.payload.len(),
                seq: f.seq,
                host_realtime_ns: f.host_realtime_ns,
                clock_offset_ns: at.clock_offset_ns,
            });
            continue;
        };
        let e = ReceivedEvent {
            host: at.host.to_owned(),
            boot_id: at.boot,
            seq: f.seq,
            kind: f.kind,
            host_realtime_ns: f.host_realtime_ns,
            host_monotonic_ns: f.host_monotonic_ns,
            received_realtime_ns: at.realtime_ns,
            clock_offset_ns: at.clock_offset_ns,
            event,
        };
        sizes.push(recent::estimate(&e, f.payload.len()));
        out.delivered.push(e);
    }
    if let Some(log) = log.as_deref_mut() {
        for (l, n) in &staged.losses {
            log.add_loss(at.host, at.boot, l.first_seq, l.last_seq, *n);
        }
        for e in &out.delivered {
            log.add_event(e);
        }
        if let Err(error) = log.commit() {
            // Not committed, so no ack can carry it.
            return Outcome {
                unavailable: Some(Refused {
                    error,
                    events: out.delivered.len(),
                }),
                ..Outcome::default()
            };
        }
    }
    core.commit(&staged, dedup);
    if let Some(log) = log {
        log.committed(dedup);
    }
    for (e, size) in out.delivered.iter().zip(sizes) {
        recent.push(e.clone(), size);
    }
    out.notes
        .extend(staged.gaps.iter().map(|&(seq, missing)| Note::Gap {
            seq,
            missing,
            boot: at.boot,
        }));
    out.notes
        .extend(staged.losses.iter().map(|(l, n)| Note::SpoolLoss {
            first: l.first_seq,
            last: l.last_seq,
            reported: l.dropped,
            newly_lost: *n,
            boot: at.boot,
        }));
    out.lag_ns = out
        .delivered
        .last()
        .map(|e| (at.realtime_ns + e.clock_offset_ns.unwrap_or(0) - e.host_realtime_ns).max(0));
    out.duplicates = staged.duplicates;
    out.lost = staged.lost();
    out.refused = staged.refused;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::HostEvent;
    use crate::proto::{test_event, ClientSession, EventFrame, GuestTiming, Message, SpoolLoss};

    /// A journal that keeps its lines in memory and fails while `fail` is set.
    #[derive(Default)]
    struct Log {
        fail: bool,
        pending: Vec<String>,
        written: Vec<String>,
        /// The watermark each commit left in the table, as `committed` saw it.
        committed: Vec<Option<u64>>,
    }

    impl EventLog for Log {
        fn add_event(&mut self, e: &ReceivedEvent) {
            self.pending.push(format!("event {}", e.seq));
        }
        fn add_loss(&mut self, _host: &str, _boot: u64, first: u64, last: u64, lost: u64) {
            self.pending.push(format!("loss {first}..={last} {lost}"));
        }
        fn commit(&mut self) -> std::io::Result<()> {
            if self.fail {
                self.pending.clear();
                return Err(std::io::Error::other("disk full"));
            }
            self.written.append(&mut self.pending);
            Ok(())
        }
        fn committed(&mut self, dedup: &Dedup) {
            self.committed.push(dedup.watermark(HOST, BOOT));
        }
    }

    const HOST: &str = "pve1";
    const BOOT: u64 = 7;

    /// An event this build decodes.
    fn known(seq: u64) -> Message {
        let ev = HostEvent::KmsgLost { count: seq };
        Message::Event(EventFrame {
            seq,
            host_realtime_ns: 1_000,
            host_monotonic_ns: 0,
            kind: ev.kind(),
            payload: postcard::to_allocvec(&ev).unwrap(),
        })
    }

    fn loss(first_seq: u64, last_seq: u64) -> Message {
        Message::SpoolLoss(SpoolLoss {
            dropped: last_seq - first_seq + 1,
            first_seq,
            last_seq,
        })
    }

    /// The guest's side of a host's connections: each [`Self::connection_sends`] is a new
    /// connection that sends its messages in one read.
    struct Guest {
        dedup: Dedup,
        recent: Recent,
        log: Log,
        journaled: bool,
        conn: Option<GuestConnection>,
    }

    impl Guest {
        fn new(journaled: bool) -> Self {
            Guest {
                dedup: Dedup::new(),
                recent: Recent::new(16, 1 << 20),
                log: Log::default(),
                journaled,
                conn: None,
            }
        }

        fn connection_sends(&mut self, msgs: Vec<Message>) -> Outcome {
            let mut g = GuestConnection::new(HOST, GuestTiming::default(), 0);
            g.handle_control(ClientSession::new(HOST, BOOT).hello(), &self.dedup, 0, 0)
                .unwrap();
            let mut staged = Staged::default();
            for m in msgs {
                g.handle_event(m, &mut staged, &self.dedup).unwrap();
            }
            let at = Receipt {
                host: HOST,
                boot: BOOT,
                realtime_ns: 5_000,
                clock_offset_ns: Some(1_500),
            };
            let log = self.journaled.then_some(&mut self.log);
            let o = accept(&mut g, staged, at, &mut self.dedup, log, &mut self.recent);
            self.conn = Some(g);
            o
        }

        fn watermark(&self) -> Option<u64> {
            self.dedup.watermark(HOST, BOOT)
        }

        fn recent(&self) -> Vec<u64> {
            self.recent.iter().map(|e| e.seq).collect()
        }
    }

    fn seqs(o: &Outcome) -> Vec<u64> {
        o.delivered.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn a_refused_journal_write_accepts_nothing_and_the_retry_takes_it_all() {
        let mut guest = Guest::new(true);
        guest.log.fail = true;
        let batch = || vec![known(0), known(1), loss(2, 3), known(4), test_event(5)];
        let o = guest.connection_sends(batch());
        let refused = o.unavailable.as_ref().expect("refused");
        assert_eq!(refused.events, 3);
        assert!(o.delivered.is_empty() && o.unknown.is_empty() && o.notes.is_empty());
        assert_eq!((o.duplicates, o.lost, o.lag_ns), (0, 0, None));
        assert_eq!((guest.watermark(), guest.recent()), (None, vec![]));
        assert!(guest.log.written.is_empty() && guest.log.committed.is_empty());
        // Nothing was committed, so there is nothing to acknowledge.
        let g = guest.conn.as_mut().unwrap();
        assert!(!matches!(
            g.poll_transmit(&guest.dedup, 1 << 40, 0),
            Some(Message::Ack(_))
        ));
        // The host sends the same frames again on its next connection, and they count once.
        guest.log.fail = false;
        let o = guest.connection_sends(batch());
        assert!(o.unavailable.is_none());
        assert_eq!((seqs(&o), o.duplicates, o.lost), (vec![0, 1, 4], 0, 2));
        assert_eq!(o.unknown.len(), 1);
        assert_eq!(
            (guest.watermark(), guest.recent()),
            (Some(5), vec![0, 1, 4])
        );
    }

    #[test]
    fn losses_are_journaled_before_the_commit() {
        let mut guest = Guest::new(true);
        let o = guest.connection_sends(vec![known(0), loss(1, 2), known(5)]);
        // Losses first, then the events, all in one write, and the table moved after it.
        assert_eq!(guest.log.written, ["loss 1..=2 2", "event 0", "event 5"]);
        assert_eq!(guest.log.committed, [Some(5)]);
        // 1..=2 reported, 3..=4 missing without a report.
        assert_eq!(o.lost, 4);
        assert_eq!(
            o.notes,
            [
                Note::Gap {
                    seq: 5,
                    missing: 2,
                    boot: BOOT
                },
                Note::SpoolLoss {
                    first: 1,
                    last: 2,
                    reported: 2,
                    newly_lost: 2,
                    boot: BOOT
                },
            ]
        );
        assert_eq!(o.notes[0].kind(), "gap");
        assert_eq!(
            o.notes[1].to_string(),
            "host spool dropped events 1..=2 (reported 2, newly lost 2, boot 7)"
        );
        // A journal write that fails leaves a loss unaccounted too.
        guest.log.fail = true;
        let o = guest.connection_sends(vec![loss(6, 9)]);
        assert!(o.unavailable.is_some());
        assert_eq!((o.lost, guest.watermark()), (0, Some(5)));
    }

    #[test]
    fn duplicates_are_counted_and_not_delivered() {
        let mut guest = Guest::new(false);
        let o = guest.connection_sends((0..3).map(known).collect());
        assert_eq!((seqs(&o), o.duplicates), (vec![0, 1, 2], 0));
        // A reconnect resends from before the watermark.
        let o = guest.connection_sends((1..5).map(known).collect());
        assert_eq!((seqs(&o), o.duplicates, o.lost), (vec![3, 4], 2, 0));
        assert_eq!(guest.recent(), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn unknown_kinds_are_passed_on_and_delivered_events_carry_the_receipt() {
        let mut guest = Guest::new(true);
        let o = guest.connection_sends(vec![test_event(0), known(1)]);
        let u = &o.unknown[..];
        assert_eq!(u.len(), 1);
        assert_eq!(
            (u[0].host.as_str(), u[0].kind, u[0].payload_len, u[0].seq),
            (HOST, 1, 0, 0)
        );
        assert_eq!(u[0].clock_offset_ns, Some(1_500));
        // An unknown event has no decoded form to journal, but it moves the watermark: it is
        // not asked for again.
        assert_eq!(guest.log.written, ["event 1"]);
        assert_eq!(guest.watermark(), Some(1));
        let e = &o.delivered[0];
        assert_eq!((e.boot_id, e.received_realtime_ns), (BOOT, 5_000));
        assert_eq!(e.event, HostEvent::KmsgLost { count: 1 });
        // Received at 5000 guest time, sent at 1000 host time, host 1500 ahead.
        assert_eq!(o.lag_ns, Some(5_500));
        assert!(o.refused.is_empty());
    }
}
