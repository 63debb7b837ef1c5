//! What one read of the event stream amounts to, decided without I/O: the batch the core
//! staged ([`crate::proto::Staged`]) is written to the journal, and only once the journal has
//! it committed to the de-duplication table and the recent ring. A batch the journal refuses is
//! not accepted at all: nothing of it is delivered or counted and the table stays as it was,
//! so that the host, which keeps what was not acknowledged, sends the same events again on
//! its next connection and they are taken then. The driver applies the [`Outcome`] (metrics,
//! broadcast, log lines) and ends the connection when it says so.

use std::fmt;

use crate::proto::{Dedup, EventFrame, GuestConnection, Staged, Undecoded};

use super::event::{ReceivedEvent, UnknownEvent};
use super::recent::{self, Recent};

/// Where accepted events and losses are written before they count ([`super::journal`]): every
/// number a batch accounts is in one of its records (an event, decoded or not, a loss report
/// or a gap), so that the log explains every number it moves past.
pub trait EventLog {
    /// A decoded event; `possible_duplicate`: its sequence space is in doubt there (see
    /// [`Dedup`]).
    fn add_event(&mut self, e: &ReceivedEvent, possible_duplicate: bool);
    /// An event accounted without a decoded form (see [`Undecoded`]).
    fn add_undecoded(
        &mut self,
        host: &str,
        boot: u64,
        frame: &EventFrame,
        why: Undecoded,
        possible_duplicate: bool,
    );
    /// A loss report: the range `first..=last` the host reported, `lost` of it newly lost.
    fn add_loss(&mut self, host: &str, boot: u64, first: u64, last: u64, lost: u64);
    /// Events `first..=last` neither received nor reported lost: counted as lost.
    fn add_gap(&mut self, host: &str, boot: u64, first: u64, last: u64);
    /// The sequence space's events below `below` are possible duplicates (see [`Dedup`]).
    fn add_doubt(&mut self, host: &str, boot: u64, below: u64);
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
    /// An event of a kind this guest knows whose payload does not decode as that kind.
    BadPayload {
        seq: u64,
        kind: u16,
        payload_len: usize,
        boot: u64,
    },
    /// `count` events (and losses) of a sequence space in doubt were accounted below its
    /// doubt: they may have been accounted before (see [`Dedup`]).
    PossibleDuplicates { count: u64, below: u64, boot: u64 },
}

impl Note {
    pub fn kind(&self) -> &'static str {
        match self {
            Note::Gap { .. } => "gap",
            Note::SpoolLoss { .. } => "spool_loss",
            Note::BadPayload { .. } => "bad_payload",
            Note::PossibleDuplicates { .. } => "possible_duplicate",
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
            Note::BadPayload { seq, kind, payload_len, boot } => write!(
                f,
                "event {seq} (boot {boot}) of known kind {kind} has a payload of {payload_len} bytes that does not decode as that kind; counted as corrupt (bad_payload) and journaled as such"
            ),
            Note::PossibleDuplicates { count, below, boot } => write!(
                f,
                "{count} events of boot {boot} below {below} may have been accounted before: this guest forgot that sequence space or never knew it and cannot tell which; delivered and counted as possible duplicates"
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
    /// Accepted events of known kinds whose payload does not decode (each also in `notes`).
    pub bad_payload: u64,
    /// Retransmissions dropped.
    pub duplicates: u64,
    /// Events (delivered, or counted lost) that may have been accounted before: their
    /// sequence space is in doubt (see [`Dedup`]).
    pub possible_duplicates: u64,
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
    let possible_duplicates = staged.possible_duplicates();
    let mut sizes = Vec::with_capacity(staged.deliveries.len());
    // Decoded events, with their possible-duplicate mark; the others' records.
    let mut marks = Vec::with_capacity(staged.deliveries.len());
    let mut undecoded = Vec::new();
    for d in staged.deliveries.drain(..) {
        let f = d.frame;
        let event = match d.event {
            Ok(e) => e,
            Err(why) => {
                match why {
                    Undecoded::UnknownKind => out.unknown.push(UnknownEvent {
                        host: at.host.to_owned(),
                        kind: f.kind,
                        payload_len: f.payload.len(),
                        seq: f.seq,
                        host_realtime_ns: f.host_realtime_ns,
                        clock_offset_ns: at.clock_offset_ns,
                    }),
                    Undecoded::BadPayload => {
                        out.bad_payload += 1;
                        out.notes.push(Note::BadPayload {
                            seq: f.seq,
                            kind: f.kind,
                            payload_len: f.payload.len(),
                            boot: at.boot,
                        });
                    }
                }
                undecoded.push((f, why, d.possible_duplicate));
                continue;
            }
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
        marks.push(d.possible_duplicate);
        out.delivered.push(e);
    }
    if let Some(log) = log.as_deref_mut() {
        for (l, n) in &staged.losses {
            log.add_loss(at.host, at.boot, l.first_seq, l.last_seq, *n);
        }
        for &(seq, missing) in &staged.gaps {
            log.add_gap(at.host, at.boot, seq - missing, seq - 1);
        }
        for (f, why, dup) in &undecoded {
            log.add_undecoded(at.host, at.boot, f, *why, *dup);
        }
        for (e, dup) in out.delivered.iter().zip(&marks) {
            log.add_event(e, *dup);
        }
        // After the records that put the space in the table (a restart replays them in order).
        if let Some(below) = staged.doubt_below {
            log.add_doubt(at.host, at.boot, below);
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
    out.possible_duplicates = possible_duplicates;
    if out.possible_duplicates > 0 {
        out.notes.push(Note::PossibleDuplicates {
            count: out.possible_duplicates,
            below: staged
                .doubt_below
                .or(dedup.doubt_below(at.host, at.boot))
                .unwrap_or(0),
            boot: at.boot,
        });
    }
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
    use crate::proto::{ClientSession, EventFrame, GuestTiming, Message, SpoolLoss};

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
        fn add_event(&mut self, e: &ReceivedEvent, dup: bool) {
            let dup = if dup { " possible duplicate" } else { "" };
            self.pending.push(format!("event {}{dup}", e.seq));
        }
        fn add_undecoded(
            &mut self,
            _host: &str,
            _boot: u64,
            f: &EventFrame,
            why: Undecoded,
            _dup: bool,
        ) {
            self.pending.push(format!(
                "undecoded {} kind {} {}",
                f.seq,
                f.kind,
                why.reason()
            ));
        }
        fn add_loss(&mut self, _host: &str, _boot: u64, first: u64, last: u64, lost: u64) {
            self.pending.push(format!("loss {first}..={last} {lost}"));
        }
        fn add_gap(&mut self, _host: &str, _boot: u64, first: u64, last: u64) {
            self.pending.push(format!("gap {first}..={last}"));
        }
        fn add_doubt(&mut self, _host: &str, _boot: u64, below: u64) {
            self.pending.push(format!("doubt below {below}"));
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

    /// An event of a kind no build knows yet (a newer host's).
    fn unknown(seq: u64) -> Message {
        Message::Event(EventFrame {
            seq,
            host_realtime_ns: 1_000,
            host_monotonic_ns: 0,
            kind: 999,
            payload: vec![1, 2, 3],
        })
    }

    /// An event of a known kind whose payload is no such event.
    fn corrupt(seq: u64) -> Message {
        let ev = HostEvent::KmsgLost { count: seq };
        Message::Event(EventFrame {
            seq,
            host_realtime_ns: 1_000,
            host_monotonic_ns: 0,
            kind: ev.kind(),
            // A varint that never ends.
            payload: vec![0x89, 0xff, 0xff],
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
        let batch = || vec![known(0), known(1), loss(2, 3), known(4), unknown(5)];
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
        // Losses and gaps first, then the events, all in one write, and the table moved after
        // it: every number up to the watermark is in a record.
        assert_eq!(
            guest.log.written,
            ["loss 1..=2 2", "gap 3..=4", "event 0", "event 5"]
        );
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
        let o = guest.connection_sends(vec![unknown(0), known(1)]);
        let u = &o.unknown[..];
        assert_eq!(u.len(), 1);
        assert_eq!(
            (u[0].host.as_str(), u[0].kind, u[0].payload_len, u[0].seq),
            (HOST, 999, 3, 0)
        );
        assert_eq!(u[0].clock_offset_ns, Some(1_500));
        assert_eq!(o.bad_payload, 0);
        // An unknown event has no decoded form, but it is journaled as one and moves the
        // watermark: it is not asked for again, and the journal explains its number.
        assert_eq!(
            guest.log.written,
            ["undecoded 0 kind 999 unknown_kind", "event 1"]
        );
        assert_eq!(guest.watermark(), Some(1));
        let e = &o.delivered[0];
        assert_eq!((e.boot_id, e.received_realtime_ns), (BOOT, 5_000));
        assert_eq!(e.event, HostEvent::KmsgLost { count: 1 });
        // Received at 5000 guest time, sent at 1000 host time, host 1500 ahead.
        assert_eq!(o.lag_ns, Some(5_500));
        assert!(o.refused.is_empty());
    }

    #[test]
    fn a_corrupt_event_of_a_known_kind_is_no_unknown_kind() {
        let mut guest = Guest::new(true);
        let o = guest.connection_sends(vec![known(0), corrupt(1), unknown(2), known(3)]);
        assert_eq!(seqs(&o), vec![0, 3]);
        // Counted as corrupt, not listed as a kind this guest does not know ...
        assert_eq!(o.bad_payload, 1);
        assert_eq!(o.unknown.iter().map(|u| u.seq).collect::<Vec<_>>(), [2]);
        assert_eq!(
            o.notes,
            [Note::BadPayload {
                seq: 1,
                kind: HostEvent::KmsgLost { count: 0 }.kind(),
                payload_len: 3,
                boot: BOOT
            }]
        );
        assert!(o.notes[0].to_string().contains("bad_payload"));
        // ... and journaled as such: every number up to the watermark has its record.
        assert_eq!(
            guest.log.written,
            [
                "undecoded 1 kind 10 bad_payload",
                "undecoded 2 kind 999 unknown_kind",
                "event 0",
                "event 3"
            ]
        );
        assert_eq!(guest.watermark(), Some(3));
        // A payload that decodes as another kind than its frame says is corrupt too.
        let mut m = known(4);
        if let Message::Event(f) = &mut m {
            f.kind = HostEvent::WatcherDisabled {
                watcher: String::new(),
                reason: String::new(),
            }
            .kind();
        }
        let o = guest.connection_sends(vec![m]);
        assert_eq!((o.bad_payload, o.unknown.len()), (1, 0));
    }

    #[test]
    fn a_space_in_doubt_is_delivered_marked_and_counted_below_its_first_horizon() {
        let mut guest = Guest::new(true);
        guest.dedup = Dedup::with_boots_per_host(1);
        // The table held another space of this host and had to forget one: it cannot tell
        // whether BOOT is new or forgotten.
        guest.dedup.seed(HOST, 1, 10);
        guest.dedup.seed(HOST, 2, 10);
        assert!(guest.dedup.cannot_tell(HOST, BOOT));
        let horizon = |below| Message::Horizon(crate::proto::Horizon { below });
        let o = guest.connection_sends(vec![horizon(3), known(0), loss(1, 1)]);
        assert_eq!(seqs(&o), vec![0]);
        // One event and one loss below the horizon the host had when it connected.
        assert_eq!((o.possible_duplicates, o.lost), (2, 1));
        assert_eq!(
            guest.log.written,
            [
                "loss 1..=1 1",
                "event 0 possible duplicate",
                "doubt below 3"
            ]
        );
        assert_eq!(guest.dedup.doubt_below(HOST, BOOT), Some(3));
        assert_eq!(
            o.notes.last(),
            Some(&Note::PossibleDuplicates {
                count: 2,
                below: 3,
                boot: BOOT
            })
        );
        // The next connection of that space resumes with the doubt it recorded: what it sends
        // below it is still in doubt, what the host numbered after is not.
        guest.log.written.clear();
        let o = guest.connection_sends(vec![horizon(9), known(2), known(3)]);
        assert_eq!((seqs(&o), o.possible_duplicates), (vec![2, 3], 1));
        assert_eq!(guest.log.written, ["event 2 possible duplicate", "event 3"]);
        // A space it holds is never in doubt.
        let mut certain = Guest::new(true);
        let o = certain.connection_sends(vec![horizon(3), known(0)]);
        assert_eq!(o.possible_duplicates, 0);
        assert_eq!(certain.log.written, ["event 0"]);
    }
}
