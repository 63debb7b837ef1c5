//! `/dev/kmsg` reader. On the character device one `read()` returns one record; EPIPE means
//! records were overwritten (the sequence gap of the next record gives the count). A regular
//! file (a recorded stream under `--root`) is followed like `tail -f`.

use crate::kmsg::{classify, parse_record, RawRecord, SeqTracker};
use crate::metrics::Metrics;
use crate::watch::{RecentKmsg, Topology};
use gpufeed_shared::event::{HostEvent, KmsgRecord};
use std::io::Read;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

pub enum KmsgMsg {
    Record(RawRecord),
    /// Bytes that did not parse as a record.
    Garbage,
}

/// Open and follow; returns an error when the device cannot be opened (watcher off).
pub fn spawn_reader(
    path: &Path,
    read_history: bool,
    tx: tokio::sync::mpsc::Sender<KmsgMsg>,
) -> std::io::Result<()> {
    let meta = std::fs::metadata(path)?;
    let mut f = std::fs::File::open(path)?;
    let is_dev = meta.file_type().is_char_device();
    if is_dev && !read_history {
        use std::io::Seek;
        let _ = f.seek(std::io::SeekFrom::End(0));
    }
    std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || {
            if is_dev {
                let mut buf = vec![0u8; 16384];
                loop {
                    match f.read(&mut buf) {
                        Ok(0) => return,
                        Ok(n) => {
                            let msg = match parse_record(&buf[..n]) {
                                Ok(r) => KmsgMsg::Record(r),
                                Err(_) => KmsgMsg::Garbage,
                            };
                            if tx.blocking_send(msg).is_err() {
                                return;
                            }
                        }
                        Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            tracing::warn!("kmsg: read failed, watcher stops: {e}");
                            return;
                        }
                    }
                }
            } else {
                follow_file(f, tx)
            }
        })?;
    Ok(())
}

fn follow_file(mut f: std::fs::File, tx: tokio::sync::mpsc::Sender<KmsgMsg>) {
    let mut pending = String::new();
    let mut buf = vec![0u8; 16384];
    loop {
        match f.read(&mut buf) {
            Ok(0) => {
                // Flush a complete trailing record once the writer is quiet.
                if !pending.is_empty() && pending.ends_with('\n') {
                    for rec in crate::kmsg::split_records(&pending) {
                        let msg = match parse_record(rec.as_bytes()) {
                            Ok(r) => KmsgMsg::Record(r),
                            Err(_) => KmsgMsg::Garbage,
                        };
                        if tx.blocking_send(msg).is_err() {
                            return;
                        }
                    }
                    pending.clear();
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Ok(n) => pending.push_str(&String::from_utf8_lossy(&buf[..n])),
            Err(_) => return,
        }
    }
}

/// Stateful handling of records: loss counting, classification, events.
#[derive(Debug, Default)]
pub struct KmsgHandler {
    seq: SeqTracker,
    pub garbage: u64,
}

impl KmsgHandler {
    pub fn handle(
        &mut self,
        msg: KmsgMsg,
        topo: &Topology,
        metrics: &Metrics,
        recent: &RecentKmsg,
    ) -> Vec<HostEvent> {
        let rec = match msg {
            KmsgMsg::Record(r) => r,
            KmsgMsg::Garbage => {
                self.garbage += 1;
                metrics
                    .kmsg_records
                    .with_label_values(&["unparsable"])
                    .inc();
                return vec![];
            }
        };
        let mut out = Vec::new();
        let lost = self.seq.observe(rec.seq);
        if lost > 0 {
            metrics.kmsg_lost.inc_by(lost);
            out.push(HostEvent::KmsgLost { count: lost });
        }
        let Some(c) = classify(&rec) else {
            metrics.kmsg_records.with_label_values(&["other"]).inc();
            return out;
        };
        metrics
            .kmsg_records
            .with_label_values(&[c.class.as_str()])
            .inc();
        let vmid = c
            .vmid
            .or_else(|| c.bdf.as_deref().and_then(|b| topo.vmid_of(b)));
        let r = KmsgRecord {
            seq: rec.seq,
            usec: rec.usec,
            level: rec.level,
            facility: rec.facility,
            class: c.class,
            bdf: c.bdf,
            vmid,
            text: rec.text,
        };
        recent.push(r.clone());
        out.push(HostEvent::Kmsg(r));
        out
    }

    pub fn lost_total(&self) -> u64 {
        self.seq.lost_total
    }
}
