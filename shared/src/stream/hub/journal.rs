//! Optional event journal of the hub (`--event-journal FILE`): every accepted host event
//! (decoded, or with why it is not: a kind this guest does not know, a corrupt payload), every
//! loss report and every gap the guest saw without one, one JSON line each, appended before
//! the guest acknowledges them: every number the guest moves past has its record. An
//! append that fails (a full disk) leaves nothing behind in the file, and the hub neither
//! delivers nor acknowledges what it held: the host keeps those frames and sends them again,
//! so the journal is where an event counts as accepted. At start
//! the journal seeds de-duplication, so a restarted (even SIGKILLed) guest neither delivers an
//! event twice nor asks for one it already has. Past `max_bytes` (and past twice what the last
//! compaction left, so that many sequence spaces cannot make every append compact) the
//! journal is compacted to
//! one `mark` line (the watermark, and the doubt where there is one) per `(host, boot)`, after
//! one `forgotten` line per host whose sequence spaces the table had to forget, written to a
//! temporary file and renamed over the journal.
//!
//! Lines that are no records (damage) are skipped at start and counted per record they held
//! (each record has its `"host":` and `"boot":` keys once, so two records whose newline was
//! destroyed count as two):
//! [`Journal::damaged_records`], exported as `gpufeed_stream_journal_damaged_records_total`.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::proto::{Dedup, EventFrame, Undecoded};
use serde::{Deserialize, Serialize};

use super::batch::EventLog;
use super::event::ReceivedEvent;

/// Declares [`Line`]: past `host` and `boot` every field is optional, left out of a line
/// where it is `None` (each kind of line holds only its own fields) and `None` where a line
/// lacks it (lines of older versions still read).
macro_rules! line {
    ($($(#[$doc:meta])* $field:ident: $ty:ty,)*) => {
        /// One journal line.
        #[derive(Debug, Default, Serialize, Deserialize)]
        pub struct Line<'a> {
            pub host: std::borrow::Cow<'a, str>,
            pub boot: u64,
            $(
                $(#[$doc])*
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $field: Option<$ty>,
            )*
        }
    };
}

line! {
    /// Event sequence number (event lines).
    seq: u64,
    kind: u16,
    host_realtime_ns: i64,
    event: serde_json::Value,
    /// Event lines without `event`: why it was not decoded (`unknown_kind`, `bad_payload`),
    /// and the payload's size.
    undecoded: String,
    payload_len: u64,
    /// Event lines: the sequence space was in doubt and the number below the doubt; the
    /// event may have been delivered before (see `Dedup`).
    possible_duplicate: bool,
    /// Loss lines: the reported range and how many of it were newly lost.
    loss_first: u64,
    loss_last: u64,
    lost: u64,
    /// Gap lines: numbers neither received nor reported lost (all counted as lost).
    gap_first: u64,
    gap_last: u64,
    /// Compaction lines: everything up to this sequence number was accounted.
    mark: u64,
    /// Doubt lines (and compaction lines): events below this number are possible duplicates.
    doubt_below: u64,
    /// Forgotten lines: sequence spaces of the host the table had to forget.
    forgotten: u64,
}

/// Records a damaged line held: every record has the keys `"host":` and `"boot":` once (no
/// event has fields of those names, and quotes inside strings are escaped), so a line whose
/// newline was destroyed counts the records on both sides of it, and a record that kept one
/// of its keys counts; every line held at least one.
fn records_in(line: &[u8]) -> u64 {
    let count = |key: &[u8]| line.windows(key.len()).filter(|w| *w == key).count() as u64;
    count(b"\"host\":").max(count(b"\"boot\":")).max(1)
}

pub struct Journal {
    path: PathBuf,
    file: File,
    buf: Vec<u8>,
    /// Bytes of whole lines in the file: where the next append starts.
    len: u64,
    max_bytes: u64,
    /// A failed append could not be cut back off: the file ends in a fragment past `len`
    /// that must go before anything else is written (the file is opened for appending).
    torn: bool,
    /// After a failed compaction, the next attempt waits until then (a full disk would
    /// otherwise retry, and log, at every append).
    compact_after: Option<Instant>,
    /// Bytes the last compaction left: the next one waits until the journal has doubled that
    /// (watermarks of many sequence spaces can exceed `max_bytes` on their own, and must not
    /// make every append compact).
    compacted: u64,
    /// Failed appends: when one was last logged, and how many since went unlogged.
    failures: (Option<Instant>, u64),
    /// Records found damaged (or torn off the end) when the journal was opened.
    damaged: u64,
}

/// How long a failed compaction waits before the next try.
const COMPACT_RETRY: Duration = Duration::from_secs(10);
/// At most one log line about failed appends this often.
pub const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(10);

impl Journal {
    /// Opens (creates) the journal, cuts a torn last line, and seeds `dedup` from it.
    pub fn open(path: &Path, max_bytes: u64, dedup: &mut Dedup) -> std::io::Result<Journal> {
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
        let (mut good, mut lines, mut damaged) = (0u64, 0u64, 0u64);
        {
            // Bytes, not text: one invalid UTF-8 byte must not keep the agent from starting.
            let mut r = BufReader::new(&file);
            let mut line = Vec::new();
            loop {
                line.clear();
                let n = r.read_until(b'\n', &mut line)?;
                if n == 0 || line.last() != Some(&b'\n') {
                    break;
                }
                good += n as u64;
                lines += 1;
                match serde_json::from_slice::<Line>(&line) {
                    // A number at or beyond MAX_SEQ is damage: not a watermark (seed refuses it).
                    Ok(l) => {
                        if let Some(n) = l.forgotten {
                            dedup.seed_forgotten(&l.host, n);
                        }
                        let seeded = l
                            .seq
                            .or(l.loss_last)
                            .or(l.gap_last)
                            .or(l.mark)
                            .is_none_or(|w| dedup.seed(&l.host, l.boot, w))
                            && l.doubt_below
                                .is_none_or(|d| dedup.seed_doubt(&l.host, l.boot, d));
                        if !seeded {
                            damaged += 1;
                        }
                    }
                    Err(_) => damaged += records_in(&line),
                }
            }
        }
        let len = file.seek(SeekFrom::End(0))?;
        let torn = if len > good {
            let mut tail = Vec::new();
            file.seek(SeekFrom::Start(good))?;
            (&file).take(1 << 20).read_to_end(&mut tail)?;
            records_in(&tail)
        } else {
            0
        };
        if damaged > 0 {
            tracing::warn!(path = %path.display(), records = damaged, "event journal: skipped damaged records (counted in gpufeed_stream_journal_damaged_records_total)");
        }
        if len > good {
            tracing::warn!(path = %path.display(), torn = len - good, records = torn, "event journal: cutting a torn last line");
            file.set_len(good)?;
        }
        let damaged = damaged + torn;
        tracing::info!(path = %path.display(), lines, "event journal opened");
        Ok(Journal {
            path: path.to_owned(),
            file,
            buf: Vec::new(),
            len: good,
            max_bytes: max_bytes.max(4096),
            torn: false,
            compact_after: None,
            compacted: 0,
            failures: (None, 0),
            damaged,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records found damaged when the journal was opened: lines that are no records (each
    /// counted for the records it held), records with impossible numbers, a torn last line.
    pub fn damaged_records(&self) -> u64 {
        self.damaged
    }

    /// Notes a failed append. `Some(n)` when a line is due (at most one per
    /// [`FAILURE_LOG_INTERVAL`]): `n` failures went unlogged before this one. While a disk
    /// stays full every reconnect of every host fails once.
    pub fn note_failure(&mut self, now: Instant) -> Option<u64> {
        let (last, unlogged) = &mut self.failures;
        if last.is_some_and(|t| now.duration_since(t) < FAILURE_LOG_INTERVAL) {
            *unlogged += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(unlogged))
    }

    fn push(&mut self, l: &Line) {
        if serde_json::to_writer(&mut self.buf, l).is_ok() {
            self.buf.push(b'\n');
        }
    }

    /// Compacts the journal to `dedup`'s watermarks when it grew too large. Call after the
    /// committed lines are in `dedup` (the watermarks replace them). A failed compaction
    /// leaves the journal as it is and is retried later.
    pub fn compact_if_due(&mut self, dedup: &Dedup) {
        let limit = self.max_bytes.max(self.compacted.saturating_mul(2));
        if self.len > limit && self.compact_after.is_none_or(|t| Instant::now() >= t) {
            match self.compact(dedup) {
                Ok(()) => self.compact_after = None,
                Err(e) => {
                    self.compact_after = Some(Instant::now() + COMPACT_RETRY);
                    tracing::warn!(path = %self.path.display(), error = %e, bytes = self.len, "event journal: compaction failed; the journal stays as it is and compaction is retried later");
                }
            }
        }
    }

    fn append(&mut self) -> std::io::Result<()> {
        if self.torn {
            // Without this the lines would be glued onto the fragment, and the whole line
            // skipped as damaged at the next start.
            self.file.set_len(self.len)?;
            self.torn = false;
        }
        if let Err(e) = self.file.write_all(&self.buf) {
            self.torn = self.file.set_len(self.len).is_err();
            return Err(e);
        }
        self.len += self.buf.len() as u64;
        Ok(())
    }

    fn compact(&mut self, dedup: &Dedup) -> std::io::Result<()> {
        let tmp = self.path.with_extension("compact");
        let mut out = Vec::new();
        // Forgotten counts first: replaying the marks after them forgets nothing more.
        let forgotten = dedup.forgotten_iter().map(|(host, n)| Line {
            host: host.into(),
            forgotten: Some(n),
            ..Line::default()
        });
        let marks = dedup.iter().map(|(host, boot, w)| Line {
            host: host.into(),
            boot,
            mark: Some(w),
            doubt_below: dedup.doubt_below(host, boot),
            ..Line::default()
        });
        for l in forgotten.chain(marks) {
            if serde_json::to_writer(&mut out, &l).is_ok() {
                out.push(b'\n');
            }
        }
        // A leftover of an interrupted compaction is stale; a new file is created in its
        // place (never opened through a link), and it becomes the journal's handle before
        // the rename, so that no failure after the rename leaves appends going to the
        // unlinked old file.
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f = OpenOptions::new()
            .read(true)
            .append(true)
            .create_new(true)
            .open(&tmp)?;
        // Synced before and after the rename: a crash leaves the old journal or the new one.
        let written = f.write_all(&out).and_then(|()| f.sync_all());
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &self.path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        self.file = f;
        self.len = out.len() as u64;
        self.compacted = self.len;
        self.torn = false;
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)?.sync_all()?;
        }
        tracing::info!(path = %self.path.display(), bytes = self.len, "event journal compacted to watermarks");
        Ok(())
    }
}

/// Events and losses count as accepted once [`EventLog::commit`] has them in the file.
impl EventLog for Journal {
    fn add_event(&mut self, e: &ReceivedEvent, possible_duplicate: bool) {
        self.push(&Line {
            host: e.host.as_str().into(),
            boot: e.boot_id,
            seq: Some(e.seq),
            kind: Some(e.kind),
            host_realtime_ns: Some(e.host_realtime_ns),
            event: serde_json::to_value(&e.event).ok(),
            possible_duplicate: possible_duplicate.then_some(true),
            ..Line::default()
        });
    }

    fn add_undecoded(
        &mut self,
        host: &str,
        boot: u64,
        f: &EventFrame,
        why: Undecoded,
        possible_duplicate: bool,
    ) {
        self.push(&Line {
            host: host.into(),
            boot,
            seq: Some(f.seq),
            kind: Some(f.kind),
            host_realtime_ns: Some(f.host_realtime_ns),
            undecoded: Some(why.reason().to_owned()),
            payload_len: Some(f.payload.len() as u64),
            possible_duplicate: possible_duplicate.then_some(true),
            ..Line::default()
        });
    }

    fn add_gap(&mut self, host: &str, boot: u64, first: u64, last: u64) {
        self.push(&Line {
            host: host.into(),
            boot,
            gap_first: Some(first),
            gap_last: Some(last),
            ..Line::default()
        });
    }

    fn add_doubt(&mut self, host: &str, boot: u64, below: u64) {
        self.push(&Line {
            host: host.into(),
            boot,
            doubt_below: Some(below),
            ..Line::default()
        });
    }

    fn add_loss(&mut self, host: &str, boot: u64, first: u64, last: u64, lost: u64) {
        self.push(&Line {
            host: host.into(),
            boot,
            loss_first: Some(first),
            loss_last: Some(last),
            lost: Some(lost),
            ..Line::default()
        });
    }

    /// Appends the buffered lines in one write.
    ///
    /// An error means none of the buffered lines is in the file (they are discarded, and what
    /// made it to disk of them is cut off again): the caller must treat their events as not
    /// received.
    fn commit(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let r = self.append();
        self.buf.clear();
        r
    }

    fn committed(&mut self, dedup: &Dedup) {
        self.compact_if_due(dedup);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_bytes_and_garbage_lines_do_not_stop_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.jsonl");
        let mut text = Vec::new();
        text.extend_from_slice(b"{\"host\":\"pve1\",\"boot\":7,\"seq\":4}\n");
        // Invalid UTF-8 and a line that is no record, in the middle.
        text.extend_from_slice(b"\xff\xfe{garbage\n");
        text.extend_from_slice(b"not json at all\n");
        text.extend_from_slice(b"{\"host\":\"pve1\",\"boot\":7,\"seq\":9}\n");
        // Numbers no sequence space reaches (a damaged digit, or a wrapped value).
        text.extend_from_slice(b"{\"host\":\"pve1\",\"boot\":7,\"seq\":18446744073709551615}\n");
        text.extend_from_slice(b"{\"host\":\"pve1\",\"boot\":7,\"mark\":4611686018427387904}\n");
        // A torn tail.
        text.extend_from_slice(b"{\"host\":\"pve1\",\"bo");
        std::fs::write(&path, &text).unwrap();
        let mut dedup = Dedup::new();
        let mut j = Journal::open(&path, 1 << 20, &mut dedup).unwrap();
        assert_eq!(dedup.watermark("pve1", 7), Some(9));
        // The torn tail is cut; the next line starts on a line of its own.
        j.add_loss("pve1", 7, 10, 11, 2);
        j.commit().unwrap();
        let mut dedup2 = Dedup::new();
        Journal::open(&path, 1 << 20, &mut dedup2).unwrap();
        assert_eq!(dedup2.watermark("pve1", 7), Some(11));
    }

    /// A journal of `n` event records of boot 7 written through the journal itself, and the
    /// byte ranges of its lines.
    fn written(path: &Path, n: u64) -> Vec<std::ops::Range<usize>> {
        let mut dedup = Dedup::new();
        let mut j = Journal::open(path, 1 << 20, &mut dedup).unwrap();
        for seq in 0..n {
            j.add_event(
                &ReceivedEvent {
                    host: "pve1".into(),
                    boot_id: 7,
                    seq,
                    kind: 10,
                    host_realtime_ns: 0,
                    host_monotonic_ns: 0,
                    received_realtime_ns: 0,
                    clock_offset_ns: None,
                    event: crate::event::HostEvent::KmsgLost { count: seq },
                },
                false,
            );
        }
        j.commit().unwrap();
        let text = std::fs::read(path).unwrap();
        let mut at = 0;
        text.split_inclusive(|&b| b == b'\n')
            .map(|l| {
                at += l.len();
                at - l.len()..at
            })
            .collect()
    }

    #[test]
    fn damage_is_counted_per_record_destroyed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.jsonl");
        let lines = written(&path, 20);
        let mut text = std::fs::read(&path).unwrap();
        let mut smash = |r: std::ops::Range<usize>| text[r].fill(b'#');
        // Record 3: its middle (one line, one record).
        smash(lines[3].start + 20..lines[3].start + 30);
        // Records 7 and 8: the end of 7 and its newline (one line, two records).
        smash(lines[7].end - 5..lines[7].end);
        // Records 11 and 12: 11's end, its newline and 12's start with its `"host":` key
        // (one line; 12 kept its `"boot":`).
        smash(lines[11].end - 3..lines[12].start + 12);
        // Record 15: all of it but its newline.
        smash(lines[15].start..lines[15].end - 1);
        // Record 19, the last: its newline (a torn tail).
        smash(lines[19].end - 1..lines[19].end);
        let destroyed = [3, 7, 8, 11, 12, 15, 19];
        std::fs::write(&path, &text).unwrap();
        let mut dedup = Dedup::new();
        let j = Journal::open(&path, 1 << 20, &mut dedup).unwrap();
        assert_eq!(j.damaged_records(), destroyed.len() as u64);
        // The others still seed: 18 is the highest whole record.
        assert_eq!(dedup.watermark("pve1", 7), Some(18));
        // An undamaged journal has none.
        let clean = dir.path().join("clean.jsonl");
        written(&clean, 5);
        let j = Journal::open(&clean, 1 << 20, &mut Dedup::new()).unwrap();
        assert_eq!(j.damaged_records(), 0);
    }

    #[test]
    fn new_records_load_and_old_journals_still_do() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.jsonl");
        // A journal of the previous format: events, a loss, a compaction mark.
        let old = "{\"host\":\"pve1\",\"boot\":7,\"seq\":3,\"kind\":10,\"host_realtime_ns\":3,\"event\":{\"KmsgLost\":{\"count\":3}}}\n\
                   {\"host\":\"pve1\",\"boot\":7,\"loss_first\":4,\"loss_last\":9,\"lost\":6}\n\
                   {\"host\":\"pve1\",\"boot\":8,\"mark\":41}\n";
        std::fs::write(&path, old).unwrap();
        let mut dedup = Dedup::new();
        let mut j = Journal::open(&path, 1 << 20, &mut dedup).unwrap();
        assert_eq!(j.damaged_records(), 0);
        assert_eq!(
            (dedup.watermark("pve1", 7), dedup.watermark("pve1", 8)),
            (Some(9), Some(41))
        );
        // The new records: a gap, undecoded events, a possible duplicate, a doubt.
        j.add_gap("pve1", 7, 10, 11);
        let frame = |seq, kind| EventFrame {
            seq,
            host_realtime_ns: 5,
            host_monotonic_ns: 0,
            kind,
            payload: vec![1, 2],
        };
        j.add_undecoded("pve1", 7, &frame(12, 10), Undecoded::BadPayload, false);
        j.add_undecoded("pve1", 7, &frame(13, 999), Undecoded::UnknownKind, true);
        j.add_doubt("pve1", 7, 20);
        j.commit().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let new: Vec<&str> = text.lines().skip(3).collect();
        assert_eq!(
            new,
            [
                "{\"host\":\"pve1\",\"boot\":7,\"gap_first\":10,\"gap_last\":11}",
                "{\"host\":\"pve1\",\"boot\":7,\"seq\":12,\"kind\":10,\"host_realtime_ns\":5,\"undecoded\":\"bad_payload\",\"payload_len\":2}",
                "{\"host\":\"pve1\",\"boot\":7,\"seq\":13,\"kind\":999,\"host_realtime_ns\":5,\"undecoded\":\"unknown_kind\",\"payload_len\":2,\"possible_duplicate\":true}",
                "{\"host\":\"pve1\",\"boot\":7,\"doubt_below\":20}",
            ]
        );
        let mut dedup = Dedup::new();
        let j = Journal::open(&path, 1 << 20, &mut dedup).unwrap();
        assert_eq!(j.damaged_records(), 0);
        assert_eq!(dedup.watermark("pve1", 7), Some(13));
        assert_eq!(dedup.doubt_below("pve1", 7), Some(20));
    }

    #[test]
    fn compaction_keeps_doubts_and_forgotten_spaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.jsonl");
        let mut dedup = Dedup::with_boots_per_host(2);
        let mut j = Journal::open(&path, 1 << 20, &mut dedup).unwrap();
        for boot in 1..=3 {
            dedup.seed("pve1", boot, 10 * boot);
        }
        dedup.seed_doubt("pve1", 3, 25);
        j.compact(&dedup).unwrap();
        let mut again = Dedup::with_boots_per_host(2);
        Journal::open(&path, 1 << 20, &mut again).unwrap();
        assert_eq!(again.forgotten("pve1"), 1);
        assert!(again.cannot_tell("pve1", 1));
        assert_eq!(again.watermark("pve1", 2), Some(20));
        assert_eq!(again.doubt_below("pve1", 3), Some(25));
    }

    #[test]
    fn watermarks_larger_than_the_limit_do_not_compact_at_every_append() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.jsonl");
        let mut dedup = Dedup::new();
        for boot in 0..200 {
            dedup.seed("pve1", boot, 3);
        }
        let mut j = Journal::open(&path, 4096, &mut dedup).unwrap();
        // Past the limit: compacted, to 200 marks, more than the limit.
        for _ in 0..100 {
            j.add_gap("pve1", 0, 4, 4);
        }
        j.commit().unwrap();
        dedup.seed("pve1", 0, 4);
        j.committed(&dedup);
        let compacted = std::fs::metadata(&path).unwrap().len();
        assert!(compacted > 4096, "{compacted}");
        // The next appends are not compacted away until the journal doubled.
        j.add_gap("pve1", 0, 5, 5);
        j.commit().unwrap();
        j.committed(&dedup);
        assert!(std::fs::metadata(&path).unwrap().len() > compacted);
        let mut again = Dedup::new();
        Journal::open(&path, 4096, &mut again).unwrap();
        assert_eq!(again.iter().count(), 200);
        assert_eq!(again.watermark("pve1", 0), Some(5));
    }
}
