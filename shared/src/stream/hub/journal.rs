//! Optional event journal of the hub (`--event-journal FILE`): every accepted host event and
//! every loss report, one JSON line each, appended before the guest acknowledges them. An
//! append that fails (a full disk) leaves nothing behind in the file, and the hub neither
//! delivers nor acknowledges what it held: the host keeps those frames and sends them again,
//! so the journal is where an event counts as accepted. At start
//! the journal seeds de-duplication, so a restarted (even SIGKILLed) guest neither delivers an
//! event twice nor asks for one it already has. Past `max_bytes` the journal is compacted to
//! one `mark` line (the watermark) per `(host, boot)`, written to a temporary file and renamed
//! over the journal.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::proto::Dedup;
use serde::{Deserialize, Serialize};

use super::batch::EventLog;
use super::ReceivedEvent;

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
    /// Loss lines: the reported range and how many of it were newly lost.
    loss_first: u64,
    loss_last: u64,
    lost: u64,
    /// Compaction lines: everything up to this sequence number was accounted.
    mark: u64,
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
    /// Failed appends: when one was last logged, and how many since went unlogged.
    failures: (Option<Instant>, u64),
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
        let (mut good, mut lines, mut corrupt) = (0u64, 0u64, 0u64);
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
                        let seeded = l
                            .seq
                            .or(l.loss_last)
                            .or(l.mark)
                            .is_none_or(|w| dedup.seed(&l.host, l.boot, w));
                        if !seeded {
                            corrupt += 1;
                        }
                    }
                    Err(_) => corrupt += 1,
                }
            }
        }
        if corrupt > 0 {
            tracing::warn!(path = %path.display(), corrupt, "event journal: skipped lines that are not journal records");
        }
        let len = file.seek(SeekFrom::End(0))?;
        if len > good {
            tracing::warn!(path = %path.display(), torn = len - good, "event journal: cutting a torn last line");
            file.set_len(good)?;
        }
        tracing::info!(path = %path.display(), lines, "event journal opened");
        Ok(Journal {
            path: path.to_owned(),
            file,
            buf: Vec::new(),
            len: good,
            max_bytes: max_bytes.max(4096),
            torn: false,
            compact_after: None,
            failures: (None, 0),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
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
        if self.len > self.max_bytes && self.compact_after.is_none_or(|t| Instant::now() >= t) {
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
        for (host, boot, w) in dedup.iter() {
            let l = Line {
                host: host.into(),
                boot,
                mark: Some(w),
                ..Line::default()
            };
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
    fn add_event(&mut self, e: &ReceivedEvent) {
        self.push(&Line {
            host: e.host.as_str().into(),
            boot: e.boot_id,
            seq: Some(e.seq),
            kind: Some(e.kind),
            host_realtime_ns: Some(e.host_realtime_ns),
            event: serde_json::to_value(&e.event).ok(),
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
}
