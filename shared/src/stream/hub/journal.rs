//! Optional event journal of the hub (`--event-journal FILE`): every accepted host event and
//! every loss report, one JSON line each, appended before the guest acknowledges them. At start
//! the journal seeds de-duplication, so a restarted (even SIGKILLed) guest neither delivers an
//! event twice nor asks for one it already has. Past `max_bytes` the journal is compacted to
//! one `mark` line (the watermark) per `(host, boot)`, written to a temporary file and renamed
//! over the journal.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};

use std::path::{Path, PathBuf};

use crate::proto::Dedup;
use serde::{Deserialize, Serialize};

use super::ReceivedEvent;

/// One journal line.
#[derive(Debug, Serialize, Deserialize)]
pub struct Line<'a> {
    pub host: std::borrow::Cow<'a, str>,
    pub boot: u64,
    /// Event sequence number (event lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_realtime_ns: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<serde_json::Value>,
    /// Loss lines: the reported range and how many of it were newly lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_first: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_last: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<u64>,
    /// Compaction lines: everything up to this sequence number was accounted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mark: Option<u64>,
}

pub struct Journal {
    path: PathBuf,
    file: File,
    buf: Vec<u8>,
    len: u64,
    max_bytes: u64,
}

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
                    Ok(l) => {
                        if let Some(w) = l.seq.or(l.loss_last).or(l.mark) {
                            dedup.seed(&l.host, l.boot, w);
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
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn add_event(&mut self, e: &ReceivedEvent) {
        let l = Line {
            host: e.host.as_str().into(),
            boot: e.boot_id,
            seq: Some(e.seq),
            kind: Some(e.kind),
            host_realtime_ns: Some(e.host_realtime_ns),
            event: serde_json::to_value(&e.event).ok(),
            loss_first: None,
            loss_last: None,
            lost: None,
            mark: None,
        };
        self.push(&l);
    }

    pub fn add_loss(&mut self, host: &str, boot: u64, first: u64, last: u64, lost: u64) {
        let l = Line {
            host: host.into(),
            boot,
            seq: None,
            kind: None,
            host_realtime_ns: None,
            event: None,
            loss_first: Some(first),
            loss_last: Some(last),
            lost: Some(lost),
            mark: None,
        };
        self.push(&l);
    }

    fn push(&mut self, l: &Line) {
        if serde_json::to_writer(&mut self.buf, l).is_ok() {
            self.buf.push(b'\n');
        }
    }

    /// Appends the buffered lines in one write; compacts when the journal is too large.
    pub fn commit(&mut self, dedup: &Dedup) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let r = self.file.write_all(&self.buf);
        let n = self.buf.len() as u64;
        self.buf.clear();
        if let Err(e) = r {
            // Cut what made it of the failed write, so that the next line does not start
            // inside a fragment (and vanish with it at the next start).
            let _ = self.file.set_len(self.len);
            return Err(e);
        }
        self.len += n;
        if self.len > self.max_bytes {
            self.compact(dedup)?;
        }
        Ok(())
    }

    fn compact(&mut self, dedup: &Dedup) -> std::io::Result<()> {
        let tmp = self.path.with_extension("compact");
        let mut out = Vec::new();
        for (host, boot, w) in dedup.iter() {
            let l = Line {
                host: host.into(),
                boot,
                seq: None,
                kind: None,
                host_realtime_ns: None,
                event: None,
                loss_first: None,
                loss_last: None,
                lost: None,
                mark: Some(w),
            };
            if serde_json::to_writer(&mut out, &l).is_ok() {
                out.push(b'\n');
            }
        }
        // Synced before and after the rename: a crash leaves the old journal or the new one.
        let mut f = File::create(&tmp)?;
        f.write_all(&out)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)?.sync_all()?;
        }
        self.file = OpenOptions::new()
            .append(true)
            .read(true)
            .open(&self.path)?;
        self.len = out.len() as u64;
        tracing::info!(path = %self.path.display(), bytes = self.len, "event journal compacted to watermarks");
        Ok(())
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
        // A torn tail.
        text.extend_from_slice(b"{\"host\":\"pve1\",\"bo");
        std::fs::write(&path, &text).unwrap();
        let mut dedup = Dedup::new();
        let mut j = Journal::open(&path, 1 << 20, &mut dedup).unwrap();
        assert_eq!(dedup.watermark("pve1", 7), Some(9));
        // The torn tail is cut; the next line starts on a line of its own.
        j.add_loss("pve1", 7, 10, 11, 2);
        j.commit(&dedup).unwrap();
        let mut dedup2 = Dedup::new();
        Journal::open(&path, 1 << 20, &mut dedup2).unwrap();
        assert_eq!(dedup2.watermark("pve1", 7), Some(11));
    }
}
