//! Bounded spool of one guest: every event waits here, as its encoded wire frame, until the
//! guest acknowledges it. Which numbers were handed out, acknowledged or dropped, where a
//! connection resumes and what it sends next are decided by the sans-IO [`Ledger`]; this
//! module keeps the frames and the ledger's file.
//!
//! * **Memory** holds the newest `memory_events` events, at most `memory_bytes` of them (their
//!   encoded size; the newest event is always kept), shared with the other guests' spools
//!   (each [`EncodedEvent`] is encoded once; the per-guest frame is written when sent). Without
//!   a spool directory that is the whole spool: when it is full, the oldest frame is dropped.
//! * **Disk** (with a spool directory): every frame is also appended to segment files
//!   `seg-<boot id>-<first seq>.gfs` (the frames exactly as on the wire, contiguous sequence
//!   numbers), so memory is only a cache and a restarted (or killed) agent resumes from disk.
//!   When the files exceed `disk_max_bytes`, the oldest segment is dropped. Writes go to the
//!   page cache (no fsync): they survive a crash of the agent, not of the machine.
//! * `spool.meta` ([`super::meta`]) keeps the ledger. It is written in place at every flush
//!   that changed it (so it never falls behind the numbers handed out, also on a full disk:
//!   writing it needs no new blocks) and synced at most every `meta_interval`, and before
//!   segment files are deleted.
//!
//! Dropped events are counted and their ranges are reported to the guest as [`SpoolLoss`]
//! before the events that follow them, until the guest acknowledges past them.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::meta::{self, Format, MetaFile, MetaRead};
use crate::proto::ledger::{longest_increasing, Next, Resume};
use crate::proto::{encode, EncodedEvent, Ledger, Message, SeqError, SpoolLoss, HEADER_LEN};

/// Size limits of a spool.
#[derive(Debug, Clone, Copy)]
pub struct SpoolLimits {
    pub memory_events: usize,
    /// Encoded bytes of the events in memory (a count alone lets 64 KiB events take 4 GiB).
    pub memory_bytes: usize,
    pub disk_max_bytes: u64,
    pub segment_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("spool {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("spool: event does not fit in a frame: {0}")]
    Encode(#[from] crate::proto::EncodeError),
    #[error("spool: {0}")]
    Seq(#[from] SeqError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io {
        path: path.to_owned(),
        source,
    }
}

/// What to send next on the event stream.
#[derive(Debug, Default)]
pub struct Batch {
    /// Encoded frames, ready to write.
    pub bytes: Vec<u8>,
    /// Event frames in `bytes`.
    pub events: u64,
    /// A loss report at the start of `bytes`, if any.
    pub loss: Option<SpoolLoss>,
    /// The cursor after this batch.
    pub next_cursor: u64,
    /// Host realtime of the last event in the batch.
    pub last_realtime_ns: Option<i64>,
    /// Every number in the batch is below this (the ledger's `next_seq` when it was read).
    pub horizon: u64,
}

/// A segment file: frames of increasing sequence numbers in `first..end`. Written segments are
/// contiguous; a recovered one may have holes (events lost to corruption, recorded as losses),
/// so readers take each frame's sequence number from the frame itself.
struct Segment {
    first: u64,
    end: u64,
    bytes: u64,
    path: PathBuf,
}

struct Disk {
    dir: PathBuf,
    meta: MetaFile,
    /// Only whole frames that were written: a failed write is cut back off the file.
    segments: VecDeque<Segment>,
    /// The last segment, open for appending; `None` after a write error or a gap, so that the
    /// next write reopens (or starts) a segment at the right place.
    active: Option<File>,
    total_bytes: u64,
    cache: Option<(u64, Vec<u8>, usize, u64)>,
    /// Every event below this sequence number is on disk, acknowledged or accounted as lost;
    /// the ones from here to `next_seq` are only in memory (the memory never lets them go
    /// before they are written, see [`Spool::push`]).
    end: u64,
    /// Frames being written (reused).
    scratch: Vec<u8>,
    /// Set by a failed write until one succeeds.
    failing: bool,
    /// After a failed write, when [`Spool::push`] may try again (a flush always tries).
    retry_at: Option<Instant>,
}

/// The spool of one guest.
pub struct Spool {
    ledger: Ledger,
    mem: VecDeque<(u64, EncodedEvent)>,
    /// [`EncodedEvent::heap_bytes`] of `mem`.
    mem_bytes: usize,
    limits: SpoolLimits,
    disk: Option<Disk>,
    /// The ledger changed since it was last written.
    meta_dirty: bool,
    /// When the state file was last synced.
    meta_synced: Instant,
    /// Drops not yet taken by [`Spool::take_dropped`].
    dropped_untaken: u64,
    /// The ledger's `dropped_total` when last looked at.
    dropped_seen: u64,
}

const META: &str = "spool.meta";
/// The smallest event frame: length prefix, tag, and one byte each for the number, both
/// timestamps, the kind and the payload length.
const MIN_FRAME_BYTES: u64 = HEADER_LEN as u64 + 6;
/// How long [`Spool::push`] waits after a failed disk write before trying again.
const WRITE_RETRY: Duration = Duration::from_millis(100);

fn segment_name(boot: u64, first: u64) -> String {
    format!("seg-{boot:016x}-{first:020}.gfs")
}

/// `(boot, first)` of a segment file name; the boot is absent in the older naming
/// (`seg-<first>.gfs`, one sequence space per directory).
fn parse_segment_name(name: &str) -> Option<(Option<u64>, u64)> {
    let body = name.strip_prefix("seg-")?.strip_suffix(".gfs")?;
    match body.split_once('-') {
        Some((boot, first)) => Some((
            Some(u64::from_str_radix(boot, 16).ok()?),
            first.parse().ok()?,
        )),
        None => Some((None, body.parse().ok()?)),
    }
}

/// A segment file found in a spool directory.
struct Found {
    boot: Option<u64>,
    first: u64,
    path: PathBuf,
}

impl Spool {
    /// A memory-only spool with a fresh sequence space.
    pub fn memory(limits: SpoolLimits) -> Self {
        Spool {
            ledger: Ledger::new(fresh_boot_id()),
            mem: VecDeque::new(),
            mem_bytes: 0,
            limits: SpoolLimits {
                memory_events: limits.memory_events.max(1),
                ..limits
            },
            disk: None,
            meta_dirty: false,
            meta_synced: Instant::now(),
            dropped_untaken: 0,
            dropped_seen: 0,
        }
    }

    /// Opens (or creates) the spool in `dir`, recovering what a previous run left there.
    ///
    /// A state file that cannot be read (both slots damaged) does not cost the events on disk:
    /// the sequence space is recovered from the segment files (their names carry it, their
    /// frames the numbers), and the guest's `resume_from` says what it still needs.
    pub fn open(dir: &Path, limits: SpoolLimits) -> Result<Self, SpoolError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut s = Spool::memory(limits);
        s.limits.disk_max_bytes = limits.disk_max_bytes.max(4096);
        s.limits.segment_bytes = limits
            .segment_bytes
            .clamp(1024, (s.limits.disk_max_bytes / 4).max(1024));
        let meta_path = dir.join(META);
        let mut found: Vec<Found> = std::fs::read_dir(dir)
            .map_err(io_err(dir))?
            .flatten()
            .filter_map(|e| {
                let (boot, first) = parse_segment_name(e.file_name().to_str()?)?;
                Some(Found {
                    boot,
                    first,
                    path: e.path(),
                })
            })
            .collect();
        found.sort_by_key(|f| f.first);
        let read = meta::read(&meta_path);
        let (mut ledger, format, trusted) = match read {
            MetaRead::Valid(l, f) => (l, Some(f), true),
            MetaRead::Missing if found.is_empty() => (Ledger::new(fresh_boot_id()), None, true),
            MetaRead::Missing => {
                tracing::error!(dir = %dir.display(), "spool: state file missing beside segment files; recovering the sequence space from them");
                (recovered_ledger(&found), None, false)
            }
            MetaRead::Damaged(why) => {
                tracing::error!(dir = %dir.display(), error = %why, "spool: state file damaged; recovering the sequence space from the segment files");
                (recovered_ledger(&found), None, false)
            }
        };
        let persisted_dropped = ledger.dropped_total();
        // Segments of another sequence space (or, recovered, of no known one) cannot be
        // sent: their events are lost, counted.
        let boot = ledger.boot_id();
        let mut foreign = 0u64;
        found.retain(|f| {
            let ours = f.boot.map_or(trusted, |b| b == boot);
            if !ours {
                foreign += recover_segment(&f.path, f.first, u64::MAX).map_or(0, |r| r.kept_seqs);
                let _ = std::fs::remove_file(&f.path);
            }
            ours
        });
        if foreign > 0 {
            tracing::error!(dir = %dir.display(), events = foreign, "spool: segment files of an unknown sequence space deleted; their events are counted as dropped");
            s.dropped_untaken += foreign;
        }
        let mut segments = VecDeque::new();
        let mut total_bytes = 0;
        // Runs of sequence numbers found on disk, in order.
        let mut present: Vec<(u64, u64)> = Vec::new();
        for i in 0..found.len() {
            let f = &found[i];
            // A segment's numbers lie below the next one's first; the last one's below what
            // the ledger handed out, or, where the files are ahead of the state (an older
            // state file), below its first number plus its frame count.
            let bound = match found.get(i + 1) {
                Some(next) => next.first,
                None => u64::MAX,
            };
            let r = recover_segment(&f.path, f.first, bound)?;
            let r = if found.get(i + 1).is_none() {
                // Skipped bytes may have held frames: at most one per smallest frame.
                let room = r.kept_seqs + r.skipped_bytes / MIN_FRAME_BYTES;
                let cap = ledger.next_seq().max(f.first.saturating_add(room));
                if r.end > cap {
                    recover_segment(&f.path, f.first, cap)?
                } else {
                    r
                }
            } else {
                r
            };
            if r.end == r.first || ledger.acked().is_some_and(|a| r.end <= a + 1) {
                let _ = std::fs::remove_file(&f.path);
                continue;
            }
            // The highest sequence number on disk, not the number of frames.
            ledger.raise_next(r.end);
            total_bytes += r.bytes;
            segments.push_back(Segment {
                first: r.first,
                end: r.end,
                bytes: r.bytes,
                path: f.path.clone(),
            });
            present.extend(r.runs);
        }
        for (mf, ml) in ledger.reconcile(&present) {
            tracing::warn!(dir = %dir.display(), first = mf, last = ml, "spool: events missing from disk after a restart; reported as lost");
        }
        // This disk may be an older copy: what is handed out from here on is checked against
        // the guest's numbers at the next resume.
        ledger.opened();
        let meta = match format {
            Some(Format::Slots { generation }) => {
                let mut m = MetaFile::open(&meta_path, generation).map_err(io_err(&meta_path))?;
                m.write(&ledger, true).map_err(io_err(&meta_path))?;
                m
            }
            // A new directory, the older format, or a damaged file: a new file in its place.
            _ => MetaFile::create(&meta_path, &ledger).map_err(io_err(&meta_path))?,
        };
        // Drops found now (missing events) are this process's to count; earlier ones were
        // counted by the process that made them.
        s.dropped_seen = persisted_dropped;
        s.ledger = ledger;
        s.disk = Some(Disk {
            dir: dir.to_owned(),
            meta,
            end: s.ledger.next_seq(),
            segments,
            active: None,
            total_bytes,
            cache: None,
            scratch: Vec::new(),
            failing: false,
            retry_at: None,
        });
        Ok(s)
    }

    pub fn boot_id(&self) -> u64 {
        self.ledger.boot_id()
    }
    /// The sequence number the next event gets.
    pub fn next_seq(&self) -> u64 {
        self.ledger.next_seq()
    }
    pub fn acked(&self) -> Option<u64> {
        self.ledger.acked()
    }
    /// The sequence space's state.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }
    /// Events dropped in this sequence space (reported to the guest, or collided with its
    /// numbers after a rollback).
    pub fn dropped_total(&self) -> u64 {
        self.ledger.dropped_total()
    }
    /// Events held and not yet acknowledged.
    pub fn pending(&self) -> u64 {
        self.ledger.pending()
    }
    /// Whether the last write to the segment files failed (events wait in memory).
    pub fn disk_failing(&self) -> bool {
        self.disk.as_ref().is_some_and(|d| d.failing)
    }
    /// Bytes in segment files.
    pub fn disk_bytes(&self) -> u64 {
        self.disk.as_ref().map_or(0, |d| d.total_bytes)
    }
    /// Events held only in memory (not yet written to the segment files).
    pub fn unwritten(&self) -> u64 {
        match &self.disk {
            Some(d) => self.ledger.next_seq().saturating_sub(d.end),
            None => self.ledger.pending(),
        }
    }
    /// Bytes of the events held in memory.
    pub fn memory_bytes(&self) -> usize {
        self.mem_bytes
    }

    /// Events this spool dropped since the last call, whatever dropped them (a full spool, the
    /// disk limit, a collision after a rollback, events found missing at the start, segment
    /// files of an unknown sequence space): the one number the drop counter is fed from.
    pub fn take_dropped(&mut self) -> u64 {
        let total = self.ledger.dropped_total();
        let n = total.saturating_sub(self.dropped_seen) + std::mem::take(&mut self.dropped_untaken);
        self.dropped_seen = total;
        n
    }

    /// Lets the oldest event in memory go.
    fn mem_pop_front(&mut self) {
        if let Some((_, ev)) = self.mem.pop_front() {
            self.mem_bytes -= ev.heap_bytes();
        }
    }

    fn record_loss(&mut self, first: u64, last: u64) -> u64 {
        self.meta_dirty = true;
        self.ledger.record_loss(first, last)
    }

    /// A sequence space used up (at `MAX_SEQ`, only reachable through a hostile guest's
    /// `resume_from`): a new one starts; what was pending in the old one is dropped.
    fn renew(&mut self) {
        let lost = self.ledger.pending();
        self.dropped_untaken += lost
            + self
                .ledger
                .dropped_total()
                .saturating_sub(self.dropped_seen);
        tracing::error!(
            boot_id = self.ledger.boot_id(),
            lost,
            "spool: sequence space used up; starting a new one"
        );
        self.ledger = Ledger::new(fresh_boot_id());
        self.dropped_seen = 0;
        self.mem.clear();
        self.mem_bytes = 0;
        if let Some(d) = &mut self.disk {
            for seg in d.segments.drain(..) {
                let _ = std::fs::remove_file(&seg.path);
            }
            d.total_bytes = 0;
            d.cache = None;
            d.active = None;
            d.end = 0;
        }
        self.meta_dirty = true;
    }

    /// Appends an event; returns its sequence number and how many events were dropped to make
    /// room. Only an event that cannot be framed is refused (and takes no sequence number). A
    /// disk that cannot be written does not refuse events: they wait in memory (and go to the
    /// guest from there) until a later write succeeds; only when memory is full too is the
    /// oldest unwritten event dropped, and counted like any other loss.
    pub fn push(&mut self, ev: EncodedEvent) -> Result<(u64, u64), SpoolError> {
        ev.frame_len(self.ledger.next_seq())?;
        let seq = match self.ledger.assign() {
            Some(s) => s,
            None => {
                self.renew();
                self.ledger.assign().unwrap_or_default()
            }
        };
        // The ledger is written at the next flush (in place: a full disk does not stop it).
        self.meta_dirty = true;
        self.mem_bytes += ev.heap_bytes();
        self.mem.push_back((seq, ev));
        let mut dropped = 0;
        while self.mem.len() > self.limits.memory_events
            || (self.mem.len() > 1 && self.mem_bytes > self.limits.memory_bytes)
        {
            let Some(&(s, _)) = self.mem.front() else {
                break;
            };
            let acked = self.ledger.acked().is_some_and(|a| s <= a);
            if let Some(d) = &self.disk {
                if s >= d.end && !acked {
                    // Not on disk yet: write (everything unwritten) before letting it go; after a
                    // failure, not again before the retry time (a full disk would otherwise
                    // cost a failing write per event).
                    if d.retry_at.is_none_or(|t| Instant::now() >= t) {
                        if let Ok(n) = self.write_out() {
                            dropped += n;
                            if self.disk.as_ref().is_some_and(|d| s < d.end) {
                                continue;
                            }
                        }
                    }
                    // Neither on disk nor kept in memory: lost (counted and reported).
                    dropped += self.record_loss(s, s);
                    if let Some(d) = &mut self.disk {
                        // The disk continues after the hole, in a new segment.
                        d.end = s + 1;
                        d.active = None;
                    }
                }
            } else if !acked {
                dropped += self.record_loss(s, s);
            }
            self.mem_pop_front();
        }
        Ok((seq, dropped))
    }

    /// Writes the events that are only in memory to the segment files; returns how many
    /// events the disk limit dropped. On a write error, what was written of the failed chunk is
    /// cut off again, so that the files hold whole frames only; the events stay in memory.
    fn write_out(&mut self) -> Result<u64, SpoolError> {
        let Some(d) = &mut self.disk else {
            return Ok(0);
        };
        let Some(&(front, _)) = self.mem.front() else {
            d.end = d.end.max(self.ledger.next_seq());
            return Ok(0);
        };
        if d.end < front {
            // Acknowledged before they were written: nothing to keep, the disk skips them.
            d.end = front;
            d.active = None;
        }
        let mut i = (d.end - front) as usize;
        while i < self.mem.len() {
            let seq = front + i as u64;
            let len = self.mem[i].1.frame_len(seq)? as u64;
            // Append to the last segment only where it ends right before this event.
            let fits = d
                .segments
                .back()
                .is_some_and(|s| s.end == seq && s.bytes + len <= self.limits.segment_bytes);
            if !fits {
                let path = d.dir.join(segment_name(self.ledger.boot_id(), seq));
                let f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .and_then(|f| f.set_len(0).map(|_| f))
                    .map_err(io_err(&path))?;
                d.active = Some(f);
                d.segments.push_back(Segment {
                    first: seq,
                    end: seq,
                    bytes: 0,
                    path,
                });
            }
            let Some(seg) = d.segments.back_mut() else {
                break;
            };
            if d.active.is_none() {
                d.active = Some(
                    OpenOptions::new()
                        .append(true)
                        .open(&seg.path)
                        .map_err(io_err(&seg.path))?,
                );
            }
            // One write for as many frames as fit in this segment.
            d.scratch.clear();
            let mut n = 0u64;
            while i < self.mem.len() {
                let (seq, ev) = &self.mem[i];
                let len = ev.frame_len(*seq)? as u64;
                if (seg.bytes > 0 || n > 0)
                    && seg.bytes + d.scratch.len() as u64 + len > self.limits.segment_bytes
                {
                    break;
                }
                ev.write_frame(*seq, &mut d.scratch)?;
                n += 1;
                i += 1;
            }
            let Some(f) = &mut d.active else {
                break;
            };
            if let Err(e) = f.write_all(&d.scratch) {
                // Cut a partial write back to the last whole frame; drop an empty segment.
                let _ = f.set_len(seg.bytes);
                d.active = None;
                d.failing = true;
                d.retry_at = Some(Instant::now() + WRITE_RETRY);
                let err = SpoolError::Io {
                    path: seg.path.clone(),
                    source: e,
                };
                if seg.end == seg.first {
                    let _ = std::fs::remove_file(&seg.path);
                    d.segments.pop_back();
                }
                return Err(err);
            }
            seg.end += n;
            seg.bytes += d.scratch.len() as u64;
            d.total_bytes += d.scratch.len() as u64;
            d.end += n;
            d.failing = false;
            d.retry_at = None;
            if seg.bytes >= self.limits.segment_bytes {
                d.active = None;
            }
        }
        let mut dropped = 0;
        while self
            .disk
            .as_ref()
            .is_some_and(|d| d.total_bytes > self.limits.disk_max_bytes && d.segments.len() > 1)
        {
            dropped += self.drop_oldest_segment();
        }
        Ok(dropped)
    }

    /// Drops the oldest segment (the disk limit); returns how many unacknowledged events went
    /// with it.
    fn drop_oldest_segment(&mut self) -> u64 {
        let Some(d) = self.disk.as_mut() else {
            return 0;
        };
        let Some(seg) = d.segments.pop_front() else {
            return 0;
        };
        d.total_bytes -= seg.bytes;
        if d.cache.as_ref().is_some_and(|c| c.0 == seg.first) {
            d.cache = None;
        }
        let last = seg.end.saturating_sub(1);
        let n = self.record_loss(seg.first, last);
        while self.mem.front().is_some_and(|(s, _)| *s <= last) {
            self.mem_pop_front();
        }
        // The loss must be on disk before the events disappear from it: where the state
        // cannot be written, the file stays (a restart re-sends those events, which the guest
        // then counts as duplicates instead of as lost).
        match self.write_meta(true) {
            Ok(()) => {
                let _ = std::fs::remove_file(&seg.path);
            }
            Err(e) => {
                tracing::warn!(error = %e, path = %seg.path.display(), "spool: state not written; keeping the dropped segment's file")
            }
        }
        n
    }

    /// Gives up every event held for the guest, as if it had acknowledged them: for a guest
    /// this host no longer serves (its VM moved to another host). Returns how many there were.
    pub fn give_up_pending(&mut self) -> Result<u64, SpoolError> {
        let n = self.pending();
        if let Some(last) = self.next_seq().checked_sub(1) {
            self.ack(last)?;
        }
        Ok(n)
    }

    /// The guest has everything up to `up_to`.
    pub fn ack(&mut self, up_to: u64) -> Result<(), SpoolError> {
        if !self.ledger.ack(up_to) {
            return Ok(());
        }
        let up_to = self.ledger.acked().unwrap_or_default();
        self.meta_dirty = true;
        while self.mem.front().is_some_and(|(s, _)| *s <= up_to) {
            self.mem_pop_front();
        }
        let deletable = self
            .disk
            .as_ref()
            .is_some_and(|d| d.segments.len() > 1 && d.segments[0].end <= up_to + 1);
        // The watermark must be on disk before the files go; where it cannot be written they
        // stay until a later ack, and the stream goes on.
        if deletable && self.write_meta(true).is_ok() {
            let Some(d) = self.disk.as_mut() else {
                return Ok(());
            };
            while d.segments.len() > 1 && d.segments[0].end <= up_to + 1 {
                let Some(seg) = d.segments.pop_front() else {
                    break;
                };
                d.total_bytes -= seg.bytes;
                if d.cache.as_ref().is_some_and(|c| c.0 == seg.first) {
                    d.cache = None;
                }
                let _ = std::fs::remove_file(&seg.path);
            }
        }
        Ok(())
    }

    /// Writes the events that are only in memory to the segment files (the page cache), then
    /// the ledger when it changed: in place at every call (a crash never finds it behind the
    /// numbers handed out), synced at most every `meta_interval`. Returns how many events the
    /// disk limit dropped. A failed segment write does not keep the ledger from being
    /// written; the spool goes on from memory, and the next flush tries again.
    pub fn flush(&mut self, meta_interval: Duration) -> Result<u64, SpoolError> {
        if self.disk.is_none() {
            return Ok(0);
        }
        let written = self.write_out();
        if self.meta_dirty {
            self.write_meta(self.meta_synced.elapsed() >= meta_interval)?;
        }
        written
    }

    fn write_meta(&mut self, sync: bool) -> Result<(), SpoolError> {
        let Some(d) = &mut self.disk else {
            return Ok(());
        };
        d.meta
            .write(&self.ledger, sync)
            .map_err(io_err(d.meta.path()))?;
        self.meta_dirty = false;
        if sync {
            self.meta_synced = Instant::now();
        }
        Ok(())
    }

    /// Where a (re)connected stream starts ([`Ledger::resume`]): after the guest's
    /// `resume_from`, or after our own ack watermark. A `resume_from` at or beyond
    /// [`crate::proto::MAX_SEQ`] is refused.
    pub fn start_cursor(&mut self, resume_from: Option<u64>) -> Result<u64, SpoolError> {
        let confirming = self.ledger.unconfirmed_from().is_some();
        let Resume { cursor, jumped } = self.ledger.resume(resume_from)?;
        self.meta_dirty = true;
        let up_to = self.ledger.acked();
        while self
            .mem
            .front()
            .is_some_and(|(s, _)| up_to.is_some_and(|a| *s <= a))
        {
            self.mem_pop_front();
        }
        if let Some((from, to, collided)) = jumped {
            tracing::warn!(
                boot_id = self.ledger.boot_id(),
                next_seq = from,
                resume_from = to,
                collided,
                "spool: the guest is ahead of this spool (rolled back?); continuing after the guest's numbers, the events spooled since count as dropped"
            );
            if let Some(d) = &mut self.disk {
                d.end = d.end.max(to);
                d.active = None;
            }
        }
        // The guest confirmed the numbers (and the jump moved them): written now, or a crash
        // before the next flush would take the confirmed numbers for unconfirmed ones again
        // (and count the guest's own events as collided). Best effort: the stream must not
        // wait for the disk; the next flush retries.
        if confirming || jumped.is_some() {
            if let Err(e) = self.write_meta(true) {
                tracing::warn!(error = %e, "spool: cannot write the state yet");
            }
        }
        Ok(cursor)
    }

    /// Frames to send from `cursor` on, at most about `max_bytes`.
    pub fn read_batch(&mut self, cursor: u64, max_bytes: usize) -> Result<Batch, SpoolError> {
        let cursor = cursor.max(self.ledger.low());
        let mut b = Batch {
            next_cursor: cursor,
            horizon: self.ledger.next_seq(),
            ..Batch::default()
        };
        let stop = match self.ledger.next(cursor) {
            Next::Idle => return Ok(b),
            // Losses can sit between kept events (a full disk drops from the middle): one is
            // reported when the cursor reaches it, after the events before it.
            Next::Loss(loss) => {
                encode(&Message::SpoolLoss(loss.clone()), &mut b.bytes)?;
                b.next_cursor = loss.last_seq + 1;
                b.loss = Some(loss);
                return Ok(b);
            }
            Next::Events { stop, .. } => stop,
        };
        if let Some(&(front, _)) = self.mem.front() {
            if front <= cursor {
                let start = self.mem.partition_point(|(s, _)| *s < cursor);
                for (seq, ev) in self.mem.range(start..) {
                    if *seq >= stop {
                        break;
                    }
                    let before = b.bytes.len();
                    ev.write_frame(*seq, &mut b.bytes)?;
                    if before > 0 && b.bytes.len() > max_bytes {
                        b.bytes.truncate(before);
                        break;
                    }
                    b.events += 1;
                    b.next_cursor = seq + 1;
                    b.last_realtime_ns = Some(ev.host_realtime_ns());
                }
                return Ok(b);
            }
        }
        self.read_disk(cursor, stop, max_bytes, &mut b)?;
        Ok(b)
    }

    /// Frames from `cursor` on (and before `stop`) from the segment files.
    fn read_disk(
        &mut self,
        cursor: u64,
        stop: u64,
        max_bytes: usize,
        b: &mut Batch,
    ) -> Result<(), SpoolError> {
        let Some(d) = &mut self.disk else {
            return Ok(());
        };
        let Some(idx) = d.segments.iter().position(|s| cursor < s.end) else {
            return Ok(());
        };
        let seg = &d.segments[idx];
        let cursor = cursor.max(seg.first);
        // Re-read when the cache is of another segment, behind the cursor, or used up while
        // the segment has grown since it was read (it may have been the last one then and
        // filled up since, so whether it is the last one now says nothing).
        let stale = match &d.cache {
            Some((first, data, pos, pos_seq)) => {
                *first != seg.first
                    || cursor < *pos_seq
                    || (*pos >= data.len() && (data.len() as u64) < seg.bytes)
            }
            None => true,
        };
        if stale {
            let mut data = Vec::with_capacity(seg.bytes as usize);
            File::open(&seg.path)
                .and_then(|mut f| f.read_to_end(&mut data))
                .map_err(io_err(&seg.path))?;
            d.cache = Some((seg.first, data, 0, seg.first));
        }
        let Some((_, data, pos, pos_seq)) = d.cache.as_mut() else {
            return Ok(());
        };
        // `pos_seq`: one past the sequence number of the last frame passed.
        while let Some((len, seq)) = frame_at(&data[*pos..]) {
            if seq >= cursor {
                if seq >= stop || !b.bytes.is_empty() && b.bytes.len() + len > max_bytes {
                    break;
                }
                b.bytes.extend_from_slice(&data[*pos..*pos + len]);
                b.events += 1;
                b.next_cursor = seq + 1;
            }
            *pos += len;
            *pos_seq = seq + 1;
        }
        Ok(())
    }
}

/// Length and sequence number of the complete event frame at the start of `buf`, if there is
/// one (the sequence number is the varint right after the message tag).
fn frame_at(buf: &[u8]) -> Option<(usize, u64)> {
    if buf.len() < HEADER_LEN + 2 {
        return None;
    }
    let len = HEADER_LEN + u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if buf.len() < len {
        return None;
    }
    let mut seq = 0u64;
    for (i, b) in buf[HEADER_LEN + 1..len].iter().take(10).enumerate() {
        seq |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((len, seq));
        }
    }
    None
}

/// What recovery kept of a segment file.
struct Recovered {
    first: u64,
    /// One past the highest sequence number kept (`first` when nothing was).
    end: u64,
    bytes: u64,
    /// Frames kept.
    kept_seqs: u64,
    /// Bytes of the file that are not kept frames.
    skipped_bytes: u64,
    /// Runs of consecutive sequence numbers kept, `(first, end)`.
    runs: Vec<(u64, u64)>,
}

/// Reads a segment written from sequence number `first` on and keeps only whole, valid event
/// frames numbered in `first..bound`, in increasing order: anything that does not decode (a
/// torn tail, zeroes from a crash, empty frames, corrupted bytes anywhere) is skipped by
/// searching for the next valid frame byte by byte, and of the frames that decode the longest
/// increasing run of numbers is kept, so that a frame whose number was damaged costs only
/// itself. When something was skipped the file is rewritten (to a temporary file, synced,
/// renamed) with the kept frames only.
fn recover_segment(path: &Path, first: u64, bound: u64) -> Result<Recovered, SpoolError> {
    let data = std::fs::read(path).map_err(io_err(path))?;
    // (position, length, seq) of every frame that decodes with a number in range.
    let mut frames: Vec<(usize, usize, u64)> = Vec::new();
    let mut pos = 0usize;
    while pos < data.len() {
        match crate::proto::decode_one(&data[pos..]) {
            Ok((Message::Event(e), n)) if (first..bound).contains(&e.seq) => {
                frames.push((pos, n, e.seq));
                pos += n;
            }
            // A whole frame numbered out of range: it goes alone.
            Ok((Message::Event(_), n)) => pos += n,
            // A torn tail, zeroes, an empty or corrupted frame, a length prefix pointing past
            // the end: search on from the next byte.
            _ => pos += 1,
        }
    }
    let seqs: Vec<u64> = frames.iter().map(|f| f.2).collect();
    let kept: Vec<(usize, usize, u64)> = longest_increasing(&seqs)
        .into_iter()
        .map(|i| frames[i])
        .collect();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &(_, _, seq) in &kept {
        match runs.last_mut() {
            Some((_, end)) if *end == seq => *end += 1,
            _ => runs.push((seq, seq + 1)),
        }
    }
    let bytes: usize = kept.iter().map(|(_, n, _)| n).sum();
    if bytes < data.len() {
        tracing::warn!(path = %path.display(), kept_bytes = bytes, skipped_bytes = data.len() - bytes, "spool segment damaged or torn; keeping its valid frames");
        let mut out = Vec::with_capacity(bytes);
        for (p, n, _) in &kept {
            out.extend_from_slice(&data[*p..*p + *n]);
        }
        let tmp = path.with_extension("gfs.tmp");
        File::create(&tmp)
            .and_then(|mut f| {
                f.write_all(&out)?;
                f.sync_all()
            })
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(io_err(path))?;
    }
    Ok(Recovered {
        first,
        end: runs.last().map_or(first, |r| r.1),
        bytes: bytes as u64,
        kept_seqs: kept.len() as u64,
        skipped_bytes: (data.len() - bytes) as u64,
        runs,
    })
}

/// The sequence space the segment files of a spool without a readable state belong to: the
/// one named by the most recently written segment, continued after its numbers (found when
/// the segments are read); everything below its first segment counts as acknowledged (the
/// guest's `resume_from` says otherwise, and a gap it sees is counted as lost there).
fn recovered_ledger(found: &[Found]) -> Ledger {
    let newest = found
        .iter()
        .filter(|f| f.boot.is_some())
        .max_by_key(|f| std::fs::metadata(&f.path).and_then(|m| m.modified()).ok());
    let Some(boot) = newest.and_then(|f| f.boot) else {
        return Ledger::new(fresh_boot_id());
    };
    let mut l = Ledger::new(boot);
    if let Some(first) = found
        .iter()
        .filter(|f| f.boot == Some(boot))
        .map(|f| f.first)
        .min()
    {
        l.raise_next(first);
        if first > 0 {
            l.ack(first - 1);
        }
    }
    l
}

/// A random 64-bit id from the kernel's entropy (falls back to time and pid).
fn fresh_boot_id() -> u64 {
    let mut b = [0u8; 8];
    if File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    let t = crate::clock::realtime_ns() as u64;
    t ^ ((std::process::id() as u64) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::FrameDecoder;

    fn ev(rt: i64, mono: u64, kind: u16, payload: Vec<u8>) -> EncodedEvent {
        EncodedEvent::new(rt, mono, kind, &payload).unwrap()
    }

    fn limits(mem: usize, disk: u64, seg: u64) -> SpoolLimits {
        SpoolLimits {
            memory_bytes: usize::MAX,
            memory_events: mem,
            disk_max_bytes: disk,
            segment_bytes: seg,
        }
    }

    fn decode_all(bytes: &[u8]) -> Vec<Message> {
        let mut d = FrameDecoder::default();
        d.push(bytes);
        let mut v = Vec::new();
        while let Some(m) = d.next_frame().unwrap() {
            v.push(m);
        }
        v
    }

    fn drain(s: &mut Spool, mut cursor: u64) -> (Vec<u64>, Vec<SpoolLoss>) {
        let (mut seqs, mut losses) = (Vec::new(), Vec::new());
        loop {
            let b = s.read_batch(cursor, 1000).unwrap();
            if b.bytes.is_empty() {
                return (seqs, losses);
            }
            for m in decode_all(&b.bytes) {
                match m {
                    Message::Event(e) => seqs.push(e.seq),
                    Message::SpoolLoss(l) => losses.push(l),
                    m => panic!("{m:?}"),
                }
            }
            cursor = b.next_cursor;
        }
    }

    #[test]
    fn memory_spool_drops_oldest_and_reports() {
        let mut s = Spool::memory(limits(10, 0, 0));
        let mut dropped = 0;
        for i in 0..25 {
            dropped += s.push(ev(i, i as u64, 1, vec![i as u8])).unwrap().1;
        }
        assert_eq!(dropped, 15);
        assert_eq!(s.dropped_total(), 15);
        assert_eq!(s.pending(), 10);
        let (seqs, losses) = drain(&mut s, 0);
        assert_eq!(seqs, (15..25).collect::<Vec<_>>());
        assert_eq!(
            losses,
            vec![SpoolLoss {
                dropped: 15,
                first_seq: 0,
                last_seq: 14
            }]
        );
        s.ack(20).unwrap();
        assert_eq!(s.pending(), 4);
        let (seqs, losses) = drain(&mut s, 0);
        assert_eq!(seqs, (21..25).collect::<Vec<_>>());
        assert!(losses.is_empty());
    }

    #[test]
    fn memory_is_bounded_in_bytes_too() {
        let big = |i: u64| ev(i as i64, i, 1, vec![7; 60_000]);
        // Timestamps of later events take a byte or two more.
        let one = big(0).heap_bytes() + 8;
        let mut s = Spool::memory(SpoolLimits {
            memory_bytes: 10 * one,
            ..limits(65536, 0, 0)
        });
        let mut dropped = 0;
        for i in 0..100 {
            dropped += s.push(big(i)).unwrap().1;
            assert!(s.memory_bytes() <= 10 * one);
        }
        assert_eq!((s.pending(), dropped), (10, 90));
        let (seqs, losses) = drain(&mut s, 0);
        assert_eq!(seqs, (90..100).collect::<Vec<_>>());
        assert_eq!(losses[0].dropped, 90);
        // One event larger than the bound is still kept (alone).
        let mut tiny = Spool::memory(SpoolLimits {
            memory_bytes: 10,
            ..limits(65536, 0, 0)
        });
        tiny.push(big(0)).unwrap();
        assert_eq!(tiny.pending(), 1);
        s.ack(99).unwrap();
        assert_eq!(s.memory_bytes(), 0);
    }

    #[test]
    fn disk_spool_survives_reopen_and_drops_whole_segments() {
        let dir = tempfile::tempdir().unwrap();
        let lim = limits(8, 64 * 1024, 2048);
        let boot;
        {
            let mut s = Spool::open(dir.path(), lim).unwrap();
            boot = s.boot_id();
            for i in 0..100 {
                s.push(ev(i, 0, 7, vec![0; 20])).unwrap();
            }
            s.ack(9).unwrap();
            s.flush(Duration::ZERO).unwrap();
            // A guest connects (confirming the numbers) and reads the disk part (memory holds
            // only 8).
            assert_eq!(s.start_cursor(Some(10)).unwrap(), 10);
            let (seqs, _) = drain(&mut s, 0);
            assert_eq!(seqs, (10..100).collect::<Vec<_>>());
        }
        let mut s = Spool::open(dir.path(), lim).unwrap();
        assert_eq!(s.boot_id(), boot);
        assert_eq!(s.next_seq(), 100);
        assert_eq!(s.acked(), Some(9));
        let c = s.start_cursor(Some(50)).unwrap();
        assert_eq!(c, 50);
        let (seqs, _) = drain(&mut s, c);
        assert_eq!(seqs, (50..100).collect::<Vec<_>>());
        // Overflow: 64 KiB of ~35-byte frames; drops whole 2 KiB segments, oldest first.
        let mut dropped = 0;
        for i in 0..5000 {
            dropped += s.push(ev(i, 0, 7, vec![0; 20])).unwrap().1;
        }
        assert!(dropped > 0);
        assert_eq!(s.dropped_total(), dropped);
        assert!(s.disk_bytes() <= 64 * 1024);
        let (seqs, losses) = drain(&mut s, 50);
        assert_eq!(losses.len(), 1);
        assert_eq!(losses[0].first_seq, 50);
        assert_eq!(losses[0].dropped, dropped);
        assert_eq!(seqs.first().copied(), Some(losses[0].last_seq + 1));
        assert_eq!(seqs.last().copied(), Some(5099));
        assert_eq!(seqs.len() as u64 + dropped, 5050);
        // The loss survives a restart until acknowledged.
        s.flush(Duration::ZERO).unwrap();
        drop(s);
        let mut s = Spool::open(dir.path(), lim).unwrap();
        assert_eq!(s.dropped_total(), dropped);
        let (_, losses2) = drain(&mut s, 0);
        assert_eq!(losses2, losses);
        s.ack(losses[0].last_seq).unwrap();
        let (_, losses3) = drain(&mut s, 0);
        assert!(losses3.is_empty());
    }

    #[test]
    fn torn_segment_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let lim = limits(4, 1 << 20, 1 << 16);
        let boot = {
            let mut s = Spool::open(dir.path(), lim).unwrap();
            for i in 0..10 {
                s.push(ev(i, 0, 1, vec![1, 2, 3])).unwrap();
            }
            s.flush(Duration::ZERO).unwrap();
            s.boot_id()
        };
        let seg = dir.path().join(segment_name(boot, 0));
        let mut data = std::fs::read(&seg).unwrap();
        data.extend_from_slice(&[50, 0, 0, 0, 1, 2]);
        std::fs::write(&seg, &data).unwrap();
        let mut s = Spool::open(dir.path(), lim).unwrap();
        assert_eq!(s.next_seq(), 10);
        let (seqs, _) = drain(&mut s, 0);
        assert_eq!(seqs, (0..10).collect::<Vec<_>>());
        s.push(ev(0, 0, 1, vec![])).unwrap();
        assert_eq!(drain(&mut s, 10).0, vec![10]);
    }

    #[test]
    fn a_damaged_state_file_keeps_the_sequence_space_and_its_events() {
        let dir = tempfile::tempdir().unwrap();
        let lim = limits(4, 1 << 20, 1024);
        let boot = {
            let mut s = Spool::open(dir.path(), lim).unwrap();
            for i in 0..100 {
                s.push(ev(i, 0, 1, vec![0; 20])).unwrap();
            }
            s.flush(Duration::ZERO).unwrap();
            // The first segments are acknowledged and deleted.
            s.ack(59).unwrap();
            s.boot_id()
        };
        std::fs::write(dir.path().join(META), "garbage").unwrap();
        let mut s = Spool::open(dir.path(), lim).unwrap();
        assert_eq!(
            s.boot_id(),
            boot,
            "the segment names carry the sequence space"
        );
        assert_eq!(s.next_seq(), 100);
        assert_eq!(s.take_dropped(), 0);
        // The guest says where it is; nothing is sent twice, nothing skipped.
        let c = s.start_cursor(Some(60)).unwrap();
        let (seqs, losses) = drain(&mut s, c);
        assert_eq!(seqs, (60..100).collect::<Vec<_>>());
        assert!(losses.is_empty());
        assert_eq!(s.push(ev(0, 0, 1, vec![])).unwrap().0, 100);
        // Segments of the old naming with no state: their events are counted as dropped.
        drop(s);
        let old = dir.path().join(format!("seg-{:020}.gfs", 500));
        let mut frames = Vec::new();
        for i in 500..503 {
            ev(i, 0, 1, vec![1])
                .write_frame(i as u64, &mut frames)
                .unwrap();
        }
        std::fs::write(&old, &frames).unwrap();
        std::fs::remove_file(dir.path().join(META)).unwrap();
        let mut s = Spool::open(dir.path(), lim).unwrap();
        assert_eq!(s.boot_id(), boot);
        assert_eq!(s.take_dropped(), 3);
        assert!(!old.exists());
    }

    #[test]
    fn reading_a_segment_that_filled_up_after_it_was_cached() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Spool::open(dir.path(), limits(4, 1 << 20, 1024)).unwrap();
        for i in 0..10 {
            s.push(ev(i, 0, 1, vec![0; 20])).unwrap();
        }
        s.flush(Duration::ZERO).unwrap();
        // Read a little of the (then last) segment from disk: it is cached.
        let b = s.read_batch(0, 60).unwrap();
        assert!(b.events > 0 && b.next_cursor < 10);
        // It fills up and the next segment starts.
        for i in 10..200 {
            s.push(ev(i, 0, 1, vec![0; 20])).unwrap();
        }
        s.flush(Duration::ZERO).unwrap();
        let (seqs, losses) = drain(&mut s, b.next_cursor);
        assert!(losses.is_empty());
        assert_eq!(seqs, (b.next_cursor..200).collect::<Vec<_>>());
    }

    /// A spool dir with events 0..30 in one segment (frames of 30 bytes), state on disk.
    fn thirty(dir: &Path) -> (u64, Vec<u8>) {
        let mut s = Spool::open(dir, limits(64, 1 << 20, 1 << 16)).unwrap();
        for i in 0..30 {
            s.push(ev(i, 0, 1, vec![9; 20])).unwrap();
        }
        s.flush(Duration::ZERO).unwrap();
        let seg = std::fs::read(dir.join(segment_name(s.boot_id(), 0))).unwrap();
        assert_eq!(seg.len(), 30 * 30);
        (s.boot_id(), seg)
    }

    /// Reopens after `damage` to the segment; returns (next_seq, sent seqs, loss ranges).
    fn reopen_damaged(damage: impl FnOnce(&mut Vec<u8>)) -> (u64, Vec<u64>, Vec<(u64, u64)>) {
        let dir = tempfile::tempdir().unwrap();
        let (boot, mut seg) = thirty(dir.path());
        damage(&mut seg);
        std::fs::write(dir.path().join(segment_name(boot, 0)), &seg).unwrap();
        let mut s = Spool::open(dir.path(), limits(64, 1 << 20, 1 << 16)).unwrap();
        assert_eq!(s.boot_id(), boot);
        let (seqs, losses) = drain(&mut s, 0);
        for l in &losses {
            assert_eq!(l.dropped, l.last_seq - l.first_seq + 1);
        }
        assert_eq!(
            s.dropped_total(),
            losses.iter().map(|l| l.dropped).sum::<u64>()
        );
        // New events continue after the highest number ever handed out.
        let (next, _) = s.push(ev(0, 0, 1, vec![])).unwrap();
        let ranges = losses.iter().map(|l| (l.first_seq, l.last_seq)).collect();
        (next, seqs, ranges)
    }

    #[test]
    fn recovery_keeps_every_valid_frame_around_damage() {
        // Corrupted head: the first frame's length prefix.
        let (next, seqs, losses) = reopen_damaged(|d| d[..3].copy_from_slice(&[0xff; 3]));
        assert_eq!(next, 30);
        assert_eq!(seqs, (1..30).collect::<Vec<_>>());
        assert_eq!(losses, vec![(0, 0)]);
        // Zeroes in the middle (frames 10 and 11), as a crash can leave them: the frames
        // after them are kept.
        let (next, seqs, losses) =
            reopen_damaged(|d| d[10 * 30..12 * 30].iter_mut().for_each(|b| *b = 0));
        assert_eq!(next, 30);
        let want: Vec<u64> = (0..10).chain(12..30).collect();
        assert_eq!(seqs, want);
        assert_eq!(losses, vec![(10, 11)]);
        // Garbage inside a frame's body (frame 20): only that frame goes.
        let (next, seqs, losses) = reopen_damaged(|d| d[20 * 30 + 6] = 0xff);
        assert_eq!(next, 30);
        assert_eq!(seqs.len(), 29);
        assert_eq!(losses, vec![(20, 20)]);
        // Corrupted tail: the last frame's header; next_seq comes from the state, not from
        // the frames left, so 29 is not handed out again. (A flipped payload byte decodes
        // and cannot be told from the original: frames carry no checksum.)
        let (next, seqs, losses) = reopen_damaged(|d| {
            let n = d.len();
            d[n - 30..n - 24].copy_from_slice(&[0xee; 6]);
        });
        assert_eq!(next, 30);
        assert_eq!(seqs, (0..29).collect::<Vec<_>>());
        assert_eq!(losses, vec![(29, 29)]);
        // One flipped bit in a frame's number (frame 5; the number is the byte after the
        // prefix and the tag): out of range, or out of order; either way only that frame goes.
        for bit in [6, 3] {
            let (next, seqs, losses) = reopen_damaged(|d| d[5 * 30 + 5] ^= 1 << bit);
            assert_eq!(next, 30, "bit {bit}");
            assert_eq!(seqs, (0..5).chain(6..30).collect::<Vec<_>>(), "bit {bit}");
            assert_eq!(losses, vec![(5, 5)], "bit {bit}");
        }
        // Empty frames (zero length prefixes) in between are not events.
        let (next, seqs, losses) = reopen_damaged(|d| {
            d.splice(5 * 30..5 * 30, [0u8; 12]);
        });
        assert_eq!(next, 30);
        assert_eq!(seqs, (0..30).collect::<Vec<_>>());
        assert!(losses.is_empty());
    }

    #[test]
    fn next_seq_comes_from_the_highest_number_on_disk() {
        // Old state (next_seq 0 written at open), segments beyond it with a damaged stretch:
        // numbers continue after the highest one, not after the frame count.
        let dir = tempfile::tempdir().unwrap();
        let (boot, _) = thirty(dir.path());
        std::fs::write(
            dir.path().join(META),
            format!("boot_id={boot}\nnext_seq=0\nacked=-\n"),
        )
        .unwrap();
        let path = dir.path().join(segment_name(boot, 0));
        let mut seg = std::fs::read(&path).unwrap();
        seg[3 * 30..13 * 30].iter_mut().for_each(|b| *b = 0);
        std::fs::write(&path, &seg).unwrap();
        let mut s = Spool::open(dir.path(), limits(64, 1 << 20, 1 << 16)).unwrap();
        assert_eq!(s.next_seq(), 30);
        let (seqs, losses) = drain(&mut s, 0);
        assert_eq!(seqs, (0..3).chain(13..30).collect::<Vec<_>>());
        assert_eq!(
            losses,
            vec![SpoolLoss {
                dropped: 10,
                first_seq: 3,
                last_seq: 12
            }]
        );
    }

    #[test]
    fn a_guest_ahead_of_the_spool_moves_next_seq_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let lim = limits(64, 1 << 20, 1 << 16);
        let mut s = Spool::open(dir.path(), lim).unwrap();
        // Rolled back: the guest has 0..=11 of this sequence space, the spool only knows 0..5.
        for i in 0..5 {
            s.push(ev(i, 0, 1, vec![])).unwrap();
        }
        assert_eq!(s.start_cursor(Some(12)).unwrap(), 12);
        // The five spooled since the rollback carry numbers the guest has: lost, counted.
        assert_eq!(s.dropped_total(), 5);
        assert_eq!(s.pending(), 0);
        assert_eq!(s.push(ev(0, 0, 1, vec![])).unwrap().0, 12);
        assert_eq!(drain(&mut s, 12).0, vec![12]);
        s.flush(Duration::ZERO).unwrap();
        drop(s);
        // ... and the move survives a restart.
        let mut s = Spool::open(dir.path(), lim).unwrap();
        assert_eq!(s.next_seq(), 13);
        assert_eq!(s.push(ev(0, 0, 1, vec![])).unwrap().0, 13);
    }
}
