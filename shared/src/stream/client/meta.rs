//! `spool.meta`: the spool's [`Ledger`], in a file that is written in place.
//!
//! The state must never fall behind the sequence numbers the spool handed out, also while its
//! disk is full (then the events wait in memory, and a crash must still know their numbers).
//! A file rewritten through a temporary file and a rename needs free blocks for every write;
//! this one is created once with two fixed-size slots and afterwards only overwritten, so a
//! write needs no new space. The slots take turns: each holds a generation number, the
//! ledger's text and a SHA-256 over both; a read takes the valid slot of the highest
//! generation, so a write torn by a power loss leaves the previous state. A write goes to the
//! page cache (it survives a crash of the agent); [`MetaFile::write`] syncs it when asked.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::proto::Ledger;

/// Bytes of one slot: the header and the ledger's text (at most
/// [`crate::proto::ledger::MAX_LOSS_RANGES`] ranges fit).
pub const SLOT_BYTES: usize = 4096;
const MAGIC: &[u8; 8] = b"GFSPOOL2";
/// magic, generation (u64), text length (u32), SHA-256.
const HEADER: usize = 8 + 8 + 4 + 32;

/// What a spool directory's state file says.
pub enum MetaRead {
    /// A valid state, and where it came from.
    Valid(Ledger, Format),
    /// No state file.
    Missing,
    /// A state file that cannot be used (neither slot valid, or an unreadable text).
    Damaged(String),
}

/// The state file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Two slots written in place (this version).
    Slots { generation: u64 },
    /// One text rewritten through a temporary file (older versions).
    Text,
}

/// The open state file.
pub struct MetaFile {
    path: PathBuf,
    file: File,
    generation: u64,
}

fn digest(generation: u64, text: &[u8]) -> ring::digest::Digest {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(&generation.to_le_bytes());
    ctx.update(&(text.len() as u32).to_le_bytes());
    ctx.update(text);
    ctx.finish()
}

fn slot_bytes(generation: u64, text: &str) -> std::io::Result<Vec<u8>> {
    let t = text.as_bytes();
    if HEADER + t.len() > SLOT_BYTES {
        return Err(std::io::Error::other(format!(
            "spool state of {} bytes does not fit a {SLOT_BYTES}-byte slot",
            t.len()
        )));
    }
    let mut b = vec![0u8; SLOT_BYTES];
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&generation.to_le_bytes());
    b[16..20].copy_from_slice(&(t.len() as u32).to_le_bytes());
    b[20..52].copy_from_slice(digest(generation, t).as_ref());
    b[HEADER..HEADER + t.len()].copy_from_slice(t);
    Ok(b)
}

/// The generation and text of a valid slot.
fn parse_slot(b: &[u8]) -> Option<(u64, &str)> {
    if b.len() < HEADER || &b[..8] != MAGIC {
        return None;
    }
    let generation = u64::from_le_bytes(b[8..16].try_into().ok()?);
    let len = u32::from_le_bytes(b[16..20].try_into().ok()?) as usize;
    let text = b.get(HEADER..HEADER + len)?;
    (digest(generation, text).as_ref() == &b[20..52]).then_some(())?;
    Some((generation, std::str::from_utf8(text).ok()?))
}

/// Reads the state in `path` (either format).
pub fn read(path: &Path) -> MetaRead {
    let mut data = Vec::new();
    match File::open(path).and_then(|mut f| f.read_to_end(&mut data)) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return MetaRead::Missing,
        Err(e) => return MetaRead::Damaged(e.to_string()),
    }
    if data.starts_with(MAGIC) {
        let best = data
            .chunks(SLOT_BYTES)
            .take(2)
            .filter_map(parse_slot)
            .filter_map(|(g, t)| Ledger::decode(t).ok().map(|l| (g, l)))
            .max_by_key(|(g, _)| *g);
        return match best {
            Some((generation, l)) => MetaRead::Valid(l, Format::Slots { generation }),
            None => MetaRead::Damaged("neither slot of the state file is valid".into()),
        };
    }
    match std::str::from_utf8(&data)
        .map_err(|e| e.to_string())
        .and_then(|t| Ledger::decode(t).map_err(|e| e.to_string()))
    {
        Ok(l) => MetaRead::Valid(l, Format::Text),
        Err(e) => MetaRead::Damaged(e),
    }
}

impl MetaFile {
    /// Creates the file anew with `ledger` in its first slot (through a synced temporary
    /// file and a synced rename, so that a crash leaves the old file or the new one).
    pub fn create(path: &Path, ledger: &Ledger) -> std::io::Result<MetaFile> {
        let tmp = path.with_extension("meta.tmp");
        let mut body = slot_bytes(1, &ledger.encode())?;
        body.resize(2 * SLOT_BYTES, 0);
        let written = File::create(&tmp).and_then(|mut f| {
            f.write_all(&body)?;
            f.sync_all()
        });
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        sync_dir(path)?;
        Self::open(path, 1)
    }

    /// Opens a file in this format whose newest valid slot has `generation`.
    pub fn open(path: &Path, generation: u64) -> std::io::Result<MetaFile> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        if file.metadata()?.len() < 2 * SLOT_BYTES as u64 {
            return Err(std::io::Error::other(
                "spool state file is shorter than its two slots",
            ));
        }
        Ok(MetaFile {
            path: path.to_owned(),
            file,
            generation,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `ledger` over the older slot (no new blocks needed); `sync`: and waits until it
    /// is on the device.
    pub fn write(&mut self, ledger: &Ledger, sync: bool) -> std::io::Result<()> {
        let generation = self.generation + 1;
        let b = slot_bytes(generation, &ledger.encode())?;
        let at = (generation % 2) * SLOT_BYTES as u64;
        self.file.write_all_at(&b, at)?;
        self.generation = generation;
        if sync {
            self.file.sync_data()?;
        }
        Ok(())
    }
}

/// Syncs the directory holding `path` (a rename in it is durable then).
pub fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_take_turns_and_a_damaged_one_leaves_the_other() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spool.meta");
        let mut l = Ledger::new(9);
        let mut f = MetaFile::create(&path, &l).unwrap();
        for _ in 0..5 {
            l.assign();
            f.write(&l, false).unwrap();
        }
        let MetaRead::Valid(got, Format::Slots { generation }) = read(&path) else {
            panic!("not valid")
        };
        assert_eq!((got.next_seq(), generation), (5, 6));
        // The newest slot (generation 6 is in slot 0) torn: the one before it is read.
        let mut data = std::fs::read(&path).unwrap();
        data[HEADER + 3] ^= 0xff;
        std::fs::write(&path, &data).unwrap();
        let MetaRead::Valid(got, Format::Slots { generation }) = read(&path) else {
            panic!("not valid")
        };
        assert_eq!((got.next_seq(), generation), (4, 5));
        // Both damaged.
        data[SLOT_BYTES + 30] ^= 0xff;
        std::fs::write(&path, &data).unwrap();
        assert!(matches!(read(&path), MetaRead::Damaged(_)));
        std::fs::write(&path, "garbage").unwrap();
        assert!(matches!(read(&path), MetaRead::Damaged(_)));
        std::fs::write(&path, "boot_id=4\nnext_seq=3\nacked=-\n").unwrap();
        assert!(matches!(read(&path), MetaRead::Valid(l, Format::Text) if l.boot_id() == 4));
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(read(&path), MetaRead::Missing));
    }
}
