//! The host's sequence space for one guest, sans-IO: which numbers were handed out, which the
//! guest acknowledged, which were dropped (and must be reported), where a connection resumes
//! and what it sends next. The spool (`stream::client::spool`) keeps the frames and writes
//! this state to disk; every decision about numbers is made here, so that it is unit-tested
//! without files and shared by the spool and the in-memory simulation of a connection.
//!
//! Every number that enters from outside (the persisted state, a guest's `resume_from`, its
//! acks) is checked against [`MAX_SEQ`] and against what this ledger handed out: nothing wraps,
//! and a guest cannot make the host skip past [`MAX_SEQ`].

use super::message::SpoolLoss;

/// Sequence numbers are below this everywhere (on the wire, on disk, in journals). At a million
/// events a second a sequence space lasts 146,000 years; a number at or above it is damage or
/// a hostile peer, never a count, and is refused where it enters.
pub const MAX_SEQ: u64 = 1 << 62;

/// Loss ranges kept at most (they are persisted in a fixed-size record). Beyond, the two
/// closest ranges are merged: the events between them are dropped too (and counted), so the
/// ranges stay true.
pub const MAX_LOSS_RANGES: usize = 64;

/// Why a number from outside was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeqError {
    #[error("sequence number {0} is not below the limit {MAX_SEQ}")]
    OutOfRange(u64),
    #[error("persisted spool state is inconsistent: {0}")]
    Inconsistent(String),
}

/// What a (re)connected stream does first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// The first sequence number to send (after what the guest has).
    pub cursor: u64,
    /// The guest had numbers beyond `next_seq` (a rolled-back spool): `next_seq` moved from
    /// `.0` to `.1`, and `.2` events spooled since the rollback carry numbers the guest already
    /// has: they are lost (counted here, never reported: the guest has other events under
    /// those numbers).
    pub jumped: Option<(u64, u64, u64)>,
}

/// What to send next from a cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// A loss report; the cursor continues after it.
    Loss(SpoolLoss),
    /// The events `from..stop` (those that are still held; the spool sends what it has).
    Events { from: u64, stop: u64 },
    /// Nothing yet.
    Idle,
}

/// The sequence space of one guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    boot_id: u64,
    next_seq: u64,
    acked: Option<u64>,
    /// Dropped ranges not yet acknowledged: sorted, disjoint, not adjacent, above `acked`.
    losses: Vec<(u64, u64)>,
    dropped_total: u64,
    /// Of `dropped_total`: numbers the guest already had after a rollback (never reported).
    collided_total: u64,
    /// `next_seq` when the spool was opened, while no guest has resumed since (persisted, so
    /// that it survives further restarts): numbers from here on were handed out after the
    /// last contact with the guest. A rollback of the disk can only happen while no process
    /// runs, so if the guest has numbers at or beyond it, exactly those numbers were handed
    /// out again ([`Ledger::resume`]); the numbers below it are the events the guest has.
    unconfirmed_from: Option<u64>,
}

impl Ledger {
    /// A fresh sequence space.
    pub fn new(boot_id: u64) -> Self {
        Ledger {
            boot_id,
            next_seq: 0,
            acked: None,
            losses: Vec::new(),
            dropped_total: 0,
            collided_total: 0,
            unconfirmed_from: None,
        }
    }

    /// The spool was opened (a start, or a restart on a disk that may have been rolled back):
    /// the numbers handed out from now until a guest resumes are unconfirmed. Kept when
    /// already set (a restart before any guest resumed).
    pub fn opened(&mut self) {
        self.unconfirmed_from.get_or_insert(self.next_seq);
    }

    /// See [`Ledger::opened`].
    pub fn unconfirmed_from(&self) -> Option<u64> {
        self.unconfirmed_from
    }

    pub fn boot_id(&self) -> u64 {
        self.boot_id
    }
    /// The number the next event gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }
    pub fn acked(&self) -> Option<u64> {
        self.acked
    }
    /// Lowest number not acknowledged.
    pub fn low(&self) -> u64 {
        self.acked.map_or(0, |a| a + 1)
    }
    pub fn losses(&self) -> &[(u64, u64)] {
        &self.losses
    }
    /// Events dropped in this sequence space (reported ones and collisions).
    pub fn dropped_total(&self) -> u64 {
        self.dropped_total
    }
    /// Of them, numbers that collided with the guest's after a rollback.
    pub fn collided_total(&self) -> u64 {
        self.collided_total
    }
    /// Handed out, neither acknowledged nor dropped.
    pub fn pending(&self) -> u64 {
        let lost: u64 = self.losses.iter().map(|(f, l)| l - f + 1).sum();
        self.next_seq - self.low() - lost
    }
    /// Whether `seq` was dropped (inside a loss range).
    pub fn is_lost(&self, seq: u64) -> bool {
        let i = self.losses.partition_point(|(_, l)| *l < seq);
        self.losses.get(i).is_some_and(|(f, _)| *f <= seq)
    }

    /// Hands out the next number; `None` when the space is used up (at [`MAX_SEQ`]; the spool
    /// then starts a new one).
    pub fn assign(&mut self) -> Option<u64> {
        if self.next_seq >= MAX_SEQ {
            return None;
        }
        self.next_seq += 1;
        Some(self.next_seq - 1)
    }

    /// The guest has everything up to `up_to` (clamped to what was handed out). Returns whether
    /// the watermark moved.
    pub fn ack(&mut self, up_to: u64) -> bool {
        let Some(last) = self.next_seq.checked_sub(1) else {
            return false;
        };
        let up_to = up_to.min(last);
        if self.acked.is_some_and(|a| a >= up_to) {
            return false;
        }
        self.acked = Some(up_to);
        self.losses.retain(|(_, l)| *l > up_to);
        if let Some(first) = self.losses.first_mut() {
            first.0 = first.0.max(up_to + 1);
        }
        true
    }

    /// Records `first..=last` as dropped (the part above the watermark and not dropped
    /// before); returns how many were newly dropped. Beyond [`MAX_LOSS_RANGES`] the closest
    /// ranges are merged, and the events between them count as dropped too.
    pub fn record_loss(&mut self, first: u64, last: u64) -> u64 {
        let first = first.max(self.low());
        let last = last.min(self.next_seq.saturating_sub(1));
        if first > last || self.next_seq == 0 {
            return 0;
        }
        let fresh = uncovered(&self.losses, first, last);
        let mut n: u64 = fresh.iter().map(|(f, l)| l - f + 1).sum();
        self.losses.extend(fresh);
        self.losses.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.losses.len());
        for &(f, l) in &self.losses {
            match merged.last_mut() {
                Some((_, pl)) if pl.saturating_add(1) >= f => *pl = (*pl).max(l),
                _ => merged.push((f, l)),
            }
        }
        while merged.len() > MAX_LOSS_RANGES {
            // The pair with the fewest kept events between them.
            let i = (0..merged.len() - 1)
                .min_by_key(|&i| merged[i + 1].0 - merged[i].1)
                .unwrap_or(0);
            n += merged[i + 1].0 - merged[i].1 - 1;
            merged[i].1 = merged[i + 1].1;
            merged.remove(i + 1);
        }
        self.losses = merged;
        self.dropped_total += n;
        n
    }

    /// Where a (re)connected stream starts, given the guest's `resume_from` (which also
    /// acknowledges everything below it). A `resume_from` beyond the numbers handed out before
    /// the spool was last opened ([`Ledger::opened`]) means the spool was rolled back (a power
    /// loss, a restored snapshot): the numbers handed out since the opening that the guest
    /// already has are collisions (the guest has other events under them), counted as
    /// dropped; the numbers below are the guest's own events, acknowledged. Numbers are never
    /// used twice: `next_seq` moves past the guest's.
    pub fn resume(&mut self, resume_from: Option<u64>) -> Result<Resume, SeqError> {
        let mut jumped = None;
        let unconfirmed = self.unconfirmed_from.take();
        if let Some(r) = resume_from {
            if r >= MAX_SEQ {
                self.unconfirmed_from = unconfirmed;
                return Err(SeqError::OutOfRange(r));
            }
            let from = self.next_seq;
            // Without an opening since the last contact the guest cannot be ahead; if it is
            // anyway, every pending number counts as collided (the old, cautious rule).
            let start = match unconfirmed {
                Some(u) => Some(u),
                None if r > from => Some(self.low()),
                None => None,
            };
            if let Some(u) = start.filter(|&u| r > u) {
                let (lo, hi) = (u.max(self.low()), r.min(from));
                let newly = self.record_loss(lo, hi.saturating_sub(1));
                // After an opening every number in the range collided, also one dropped
                // before (no report of it can have gone out: no guest resumed since). Without
                // one, a dropped number may have been reported: only the new ones count here.
                let collided = match unconfirmed {
                    Some(_) => hi.saturating_sub(lo),
                    None => newly,
                };
                self.collided_total += collided;
                self.next_seq = from.max(r);
                jumped = Some((from, r, collided));
            }
            if r > 0 {
                self.ack(r - 1);
            }
        }
        Ok(Resume {
            cursor: self.low(),
            jumped,
        })
    }

    /// What to send from `cursor` on: a loss report when the cursor is inside a dropped
    /// range, else the events up to the next dropped range.
    pub fn next(&self, cursor: u64) -> Next {
        let cursor = cursor.max(self.low());
        let next_loss = self.losses.iter().find(|(_, l)| *l >= cursor).copied();
        if let Some((_, l)) = next_loss.filter(|(f, _)| *f <= cursor) {
            return Next::Loss(SpoolLoss {
                dropped: l - cursor + 1,
                first_seq: cursor,
                last_seq: l,
            });
        }
        if cursor >= self.next_seq {
            return Next::Idle;
        }
        Next::Events {
            from: cursor,
            stop: next_loss.map_or(self.next_seq, |(f, _)| f),
        }
    }

    /// After a restart: `present` are the runs `(first, end)` of numbers found on disk, in
    /// order. Every unacknowledged number below `next_seq` is on disk or dropped; what is
    /// neither (never written before a crash, a damaged frame) is dropped now. Returns the
    /// ranges newly recorded.
    pub fn reconcile(&mut self, present: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = self.low();
        let end = self.next_seq;
        for &(f, e) in present.iter().chain(std::iter::once(&(end, end))) {
            if f > at {
                for (mf, ml) in uncovered(&self.losses, at, f.min(end) - 1) {
                    if self.record_loss(mf, ml) > 0 {
                        out.push((mf, ml));
                    }
                }
            }
            at = at.max(e);
        }
        out
    }

    /// Moves `next_seq` up to `end` (numbers found on disk beyond the persisted state).
    pub fn raise_next(&mut self, end: u64) {
        self.next_seq = self.next_seq.max(end.min(MAX_SEQ));
    }

    /// The persisted form: `key=value` lines.
    pub fn encode(&self) -> String {
        use std::fmt::Write;
        let mut m = String::with_capacity(128 + 48 * self.losses.len());
        let _ = write!(
            m,
            "boot_id={}\nnext_seq={}\nacked={}\ndropped_total={}\ncollided_total={}\n",
            self.boot_id,
            self.next_seq,
            self.acked.map_or("-".to_string(), |a| a.to_string()),
            self.dropped_total,
            self.collided_total,
        );
        if let Some(u) = self.unconfirmed_from {
            let _ = writeln!(m, "unconfirmed_from={u}");
        }
        for (f, l) in &self.losses {
            let _ = writeln!(m, "loss={f}-{l}");
        }
        m
    }

    /// Parses and checks [`encode`](Self::encode)'s form (also the older one without
    /// `collided_total`). Every number is checked: below [`MAX_SEQ`], the watermark below
    /// `next_seq`, the ranges sorted, disjoint and between them.
    pub fn decode(text: &str) -> Result<Ledger, SeqError> {
        let bad = |what: &str| SeqError::Inconsistent(what.to_owned());
        let num = |v: &str, what: &str| v.parse::<u64>().map_err(|_| bad(what));
        let mut l = Ledger::new(0);
        let mut have_boot = false;
        for line in text.lines() {
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| bad("a line without '='"))?;
            match k {
                "boot_id" => {
                    l.boot_id = num(v, "boot_id")?;
                    have_boot = true;
                }
                "next_seq" => l.next_seq = num(v, "next_seq")?,
                "acked" if v == "-" => l.acked = None,
                "acked" => l.acked = Some(num(v, "acked")?),
                "dropped_total" => l.dropped_total = num(v, "dropped_total")?,
                "collided_total" => l.collided_total = num(v, "collided_total")?,
                "unconfirmed_from" => l.unconfirmed_from = Some(num(v, "unconfirmed_from")?),
                "loss" => {
                    let (f, t) = v.split_once('-').ok_or_else(|| bad("loss"))?;
                    l.losses.push((num(f, "loss")?, num(t, "loss")?));
                }
                _ => {}
            }
        }
        if !have_boot {
            return Err(bad("no boot_id"));
        }
        if l.next_seq > MAX_SEQ {
            return Err(SeqError::OutOfRange(l.next_seq));
        }
        if l.unconfirmed_from.is_some_and(|u| u > l.next_seq) {
            return Err(bad("unconfirmed_from beyond next_seq"));
        }
        if l.acked.is_some_and(|a| a >= l.next_seq) {
            return Err(bad("acked at or beyond next_seq"));
        }
        // Each range above the watermark and apart from the one before it.
        let mut above = l.low();
        for &(f, t) in &l.losses {
            if f > t || f < above || t >= l.next_seq {
                return Err(bad("loss ranges not sorted, overlapping or out of range"));
            }
            above = t + 2;
        }
        if l.losses.len() > MAX_LOSS_RANGES || l.collided_total > l.dropped_total {
            return Err(bad("too many loss ranges or counts that do not add up"));
        }
        Ok(l)
    }
}

/// The parts of `first..=last` that no range of `ranges` (sorted, disjoint) covers.
pub fn uncovered(ranges: &[(u64, u64)], first: u64, last: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = first;
    for &(f, l) in ranges {
        if l < at {
            continue;
        }
        if f > last {
            break;
        }
        if f > at {
            out.push((at, f - 1));
        }
        at = l.saturating_add(1);
        if at > last || l == u64::MAX {
            return out;
        }
    }
    if at <= last {
        out.push((at, last));
    }
    out
}

/// Indices of a longest strictly increasing subsequence of `seqs` (the frames of a damaged
/// segment to keep: a frame whose number was damaged breaks the order and goes alone, instead
/// of hiding the intact frames after it).
pub fn longest_increasing(seqs: &[u64]) -> Vec<usize> {
    // tails[k]: index of the smallest last element of an increasing run of length k + 1.
    let mut tails: Vec<usize> = Vec::new();
    let mut prev: Vec<Option<usize>> = vec![None; seqs.len()];
    for (i, &s) in seqs.iter().enumerate() {
        let k = tails.partition_point(|&t| seqs[t] < s);
        prev[i] = k.checked_sub(1).map(|k| tails[k]);
        if k == tails.len() {
            tails.push(i);
        } else {
            tails[k] = i;
        }
    }
    let mut out = Vec::with_capacity(tails.len());
    let mut at = tails.last().copied();
    while let Some(i) = at {
        out.push(i);
        at = prev[i];
    }
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger_with(n: u64) -> Ledger {
        let mut l = Ledger::new(7);
        for _ in 0..n {
            l.assign().unwrap();
        }
        l
    }

    #[test]
    fn resume_validates_and_counts_collisions() {
        let mut l = ledger_with(5);
        assert_eq!(
            l.resume(Some(MAX_SEQ)),
            Err(SeqError::OutOfRange(MAX_SEQ)),
            "no jump to the end of the space"
        );
        assert_eq!(
            l.resume(Some(u64::MAX)),
            Err(SeqError::OutOfRange(u64::MAX))
        );
        assert_eq!(l.next_seq(), 5);
        // Rolled back: the guest has 0..=11.
        let r = l.resume(Some(12)).unwrap();
        assert_eq!(
            r,
            Resume {
                cursor: 12,
                jumped: Some((5, 12, 5))
            }
        );
        assert_eq!(
            (l.dropped_total(), l.collided_total(), l.pending()),
            (5, 5, 0)
        );
        assert_eq!(l.assign(), Some(12));
        // An ack beyond what was handed out is clamped.
        assert!(l.ack(u64::MAX));
        assert_eq!(l.acked(), Some(12));
    }

    #[test]
    fn a_rollback_collides_only_the_numbers_handed_out_since_the_opening() {
        // Before the copy: 0..10 handed out, 0..=2 acknowledged; the guest went on to 0..=12
        // of that timeline.
        let mut l = ledger_with(10);
        l.ack(2);
        // Restarted on the copy, and killed once more before a guest resumed: the opening
        // is kept through the persisted form.
        l.opened();
        let mut l = Ledger::decode(&l.encode()).unwrap();
        l.opened();
        assert_eq!(l.unconfirmed_from(), Some(10));
        for _ in 0..5 {
            l.assign(); // 10..=14, after the rollback
        }
        let r = l.resume(Some(13)).unwrap();
        // 3..=9 are the guest's own events (acknowledged, not lost); 10..=12 collided.
        assert_eq!(
            r,
            Resume {
                cursor: 13,
                jumped: Some((15, 13, 3))
            }
        );
        assert_eq!(
            (l.dropped_total(), l.collided_total(), l.pending()),
            (3, 3, 2)
        );
        assert_eq!(l.unconfirmed_from(), None, "confirmed by the resume");
        // No opening since: an ordinary resume collides nothing.
        assert_eq!(l.resume(Some(14)).unwrap().jumped, None);
    }

    #[test]
    fn the_space_ends_below_max_seq() {
        let mut l = Ledger::new(1);
        l.resume(Some(MAX_SEQ - 1)).unwrap();
        assert_eq!(l.assign(), Some(MAX_SEQ - 1));
        assert_eq!(l.assign(), None);
        assert_eq!(l.next_seq(), MAX_SEQ);
    }

    #[test]
    fn losses_are_reported_from_the_cursor_and_bounded() {
        let mut l = ledger_with(1000);
        assert_eq!(l.record_loss(0, 9), 10);
        assert_eq!(l.record_loss(5, 12), 3);
        assert_eq!(
            l.next(0),
            Next::Loss(SpoolLoss {
                dropped: 13,
                first_seq: 0,
                last_seq: 12
            })
        );
        assert_eq!(
            l.next(13),
            Next::Events {
                from: 13,
                stop: 1000
            }
        );
        assert_eq!(l.next(1000), Next::Idle);
        // Every other number lost: beyond the cap the closest ranges merge, and what sat
        // between them counts as dropped too.
        let before = l.dropped_total();
        for s in (100..400).step_by(2) {
            l.record_loss(s, s);
        }
        assert_eq!(l.losses().len(), MAX_LOSS_RANGES);
        let covered: u64 = l.losses().iter().map(|(f, t)| t - f + 1).sum();
        assert_eq!(l.dropped_total(), covered);
        assert!(l.dropped_total() - before > 150);
        assert_eq!(l.pending() + l.dropped_total(), 1000);
    }

    #[test]
    fn reconcile_records_what_is_neither_on_disk_nor_lost() {
        let mut l = ledger_with(30);
        l.ack(2);
        l.record_loss(10, 11);
        let new = l.reconcile(&[(3, 8), (12, 20)]);
        assert_eq!(new, vec![(8, 9), (20, 29)]);
        assert_eq!(l.losses(), &[(8, 11), (20, 29)]);
        assert_eq!(l.pending(), 5 + 8);
    }

    #[test]
    fn persisted_state_is_checked() {
        let mut l = ledger_with(40);
        l.ack(4);
        l.record_loss(10, 12);
        l.resume(Some(50)).unwrap();
        assert_eq!(Ledger::decode(&l.encode()), Ok(l.clone()));
        for bad in [
            "next_seq=1\n",
            "boot_id=1\nnext_seq=18446744073709551615\n",
            "boot_id=1\nnext_seq=5\nacked=5\n",
            "boot_id=1\nnext_seq=5\nacked=1\nloss=1-2\n",
            "boot_id=1\nnext_seq=9\nloss=3-4\nloss=2-6\n",
            "boot_id=1\nnext_seq=9\nloss=3-9\n",
            "boot_id=x\n",
        ] {
            assert!(Ledger::decode(bad).is_err(), "{bad:?}");
        }
        // The previous version's state (no collided_total) still reads.
        let old = Ledger::decode("boot_id=3\nnext_seq=10\nacked=-\ndropped_total=0\n").unwrap();
        assert_eq!((old.boot_id(), old.next_seq()), (3, 10));
    }

    #[test]
    fn one_damaged_number_costs_one_frame() {
        // 100..110 with 104 flipped to a huge number and 107 to a smaller one.
        let seqs = [100, 101, 102, 103, 1 << 61, 105, 106, 3, 108, 109];
        let keep: Vec<u64> = longest_increasing(&seqs).iter().map(|&i| seqs[i]).collect();
        assert_eq!(keep, vec![100, 101, 102, 103, 105, 106, 108, 109]);
        assert!(longest_increasing(&[]).is_empty());
    }
}
