//! `/dev/kmsg` reader. On the character device one `read()` returns one record; EPIPE means
//! records were overwritten (the sequence gap of the next record gives the count); the reader
//! thread blocks in `read(2)`, so an idle kernel log costs no wake-ups. A regular file (a
//! recorded stream under `--root`) is followed like `tail -f`, woken by inotify.

use super::recent::RecentKmsg;
use super::topology::Topology;
use super::unit::vm_suffix;
use super::unit::{Cx, Outcome, Starting, Unit, Watcher};
use crate::kmsg::{classify, parse_record, RawRecord, SeqTracker};
use crate::metrics;
use gpufeed_shared::event::{HostEvent, KmsgRecord};
use prometheus::{IntCounter, IntCounterVec, Registry};
use serde::Deserialize;
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
    let path = path.to_path_buf();
    let mut f = std::fs::File::open(&path)?;
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
                follow_file(&path, f, tx)
            }
        })?;
    Ok(())
}

/// Waits for writes to a followed regular file: inotify (`IN_MODIFY`) where available, so an
/// idle file costs no wake-ups; otherwise a 100 ms sleep.
struct FileWaiter {
    fd: Option<std::os::fd::OwnedFd>,
}

impl FileWaiter {
    fn new(path: &Path) -> FileWaiter {
        use std::os::fd::{FromRawFd, OwnedFd};
        use std::os::unix::ffi::OsStrExt;
        let Ok(cpath) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
            return FileWaiter { fd: None };
        };
        // SAFETY: plain syscalls; the fd is owned by the OwnedFd from here on.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            return FileWaiter { fd: None };
        }
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        use std::os::fd::AsRawFd;
        let wd = unsafe {
            libc::inotify_add_watch(
                fd.as_raw_fd(),
                cpath.as_ptr(),
                libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_CLOSE_WRITE,
            )
        };
        FileWaiter {
            fd: (wd >= 0).then_some(fd),
        }
    }

    /// Block until the file was written to (true) or `timeout` passed (false). Without
    /// inotify: sleep 100 ms at most and answer false (unknown; the caller reads again).
    fn wait(&self, timeout: std::time::Duration) -> bool {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.fd else {
            std::thread::sleep(timeout.min(std::time::Duration::from_millis(100)));
            return false;
        };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n <= 0 {
            return false;
        }
        // Drain the queued events (non-blocking fd); their content does not matter.
        let mut buf = [0u8; 4096];
        // SAFETY: reads into a local buffer of the given length.
        while unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
        true
    }
}

/// How long a partial record may wait for its continuation lines before it is flushed.
const QUIET: std::time::Duration = std::time::Duration::from_millis(100);
/// Wake-up interval of an idle follower, to notice that the agent stopped.
const IDLE_CHECK: std::time::Duration = std::time::Duration::from_secs(30);

/// Follow a regular file like `tail -f`: records are handed on once the writer has been quiet
/// for [`QUIET`] (so that continuation lines written separately stay with their record).
fn follow_file(path: &Path, mut f: std::fs::File, tx: tokio::sync::mpsc::Sender<KmsgMsg>) {
    // Watch before the first read: a write between a read and the wait is still seen.
    let waiter = FileWaiter::new(path);
    let mut pending = String::new();
    let mut buf = vec![0u8; 16384];
    loop {
        match f.read(&mut buf) {
            Ok(0) => {
                if !pending.ends_with('\n') {
                    // Nothing complete to hand on: sleep until the writer writes.
                    if !waiter.wait(IDLE_CHECK) && tx.is_closed() {
                        return;
                    }
                    continue;
                }
                if waiter.wait(QUIET) {
                    continue; // more is coming: read it first
                }
                // The writer is quiet: flush the complete records.
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
        metrics: &KmsgMetrics,
        recent: &RecentKmsg,
    ) -> Vec<HostEvent> {
        let rec = match msg {
            KmsgMsg::Record(r) => r,
            KmsgMsg::Garbage => {
                self.garbage += 1;
                metrics.records.with_label_values(&["unparsable"]).inc();
                return vec![];
            }
        };
        let mut out = Vec::new();
        let lost = self.seq.observe(rec.seq);
        if lost > 0 {
            metrics.lost.inc_by(lost);
            out.push(HostEvent::KmsgLost { count: lost });
        }
        let Some(c) = classify(&rec) else {
            metrics.records.with_label_values(&["other"]).inc();
            return out;
        };
        metrics.records.with_label_values(&[c.class.as_str()]).inc();
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

// ---- The unit: configuration, series, loop. ----

/// `[kmsg]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KmsgConfig {
    pub enabled: bool,
    /// Also classify records already in the ring buffer at start.
    pub read_history: bool,
}

impl Default for KmsgConfig {
    fn default() -> Self {
        KmsgConfig {
            enabled: true,
            read_history: false,
        }
    }
}

pub struct KmsgMetrics {
    pub records: IntCounterVec,
    pub lost: IntCounter,
}

impl KmsgMetrics {
    pub fn new(r: &Registry) -> KmsgMetrics {
        KmsgMetrics {
            records: metrics::int_counter_vec(
                r,
                "gpufeed_host_kmsg_records_total",
                "Kernel log records by class",
                &["class"],
            ),
            lost: metrics::int_counter(
                r,
                "gpufeed_host_kmsg_lost_records_total",
                "Kernel log records lost (sequence gaps)",
            ),
        }
    }
}

pub const UNIT: Unit = Unit {
    name: "kmsg",
    describe,
};

/// Builds the unit from its section `[kmsg]`, registering its series in `r`.
pub fn watcher(r: &Registry, cfg: KmsgConfig) -> Box<dyn Watcher> {
    Box::new(KmsgWatcher {
        metrics: KmsgMetrics::new(r),
        cfg,
    })
}

struct KmsgWatcher {
    metrics: KmsgMetrics,
    cfg: KmsgConfig,
}

impl Watcher for KmsgWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            let cfg = self.cfg;
            let path = a.roots.dev().join("kmsg");
            let (tx, mut rx) = tokio::sync::mpsc::channel::<KmsgMsg>(1024);
            if let Err(e) = spawn_reader(&path, cfg.read_history, tx) {
                return Outcome::Off(format!("cannot open {}: {e}", path.display()));
            }
            let m = self.metrics;
            Outcome::On(vec![tokio::spawn(async move {
                let mut h = KmsgHandler::default();
                while let Some(msg) = rx.recv().await {
                    let t = a.topo.get();
                    a.emit_all(h.handle(msg, &t, &m, &a.recent));
                }
            })])
        })
    }
}

fn describe(e: &HostEvent) -> Option<String> {
    Some(match e {
        HostEvent::Kmsg(k) => format!("[{}]{} {}", k.class.as_str(), vm_suffix(k.vmid), k.text),
        HostEvent::KmsgLost { count } => format!("{count} kernel log records lost"),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::{Duration, Instant};

    fn recv(rx: &mut tokio::sync::mpsc::Receiver<KmsgMsg>, within: Duration) -> RawRecord {
        let t0 = Instant::now();
        loop {
            match rx.try_recv() {
                Ok(KmsgMsg::Record(r)) => return r,
                Ok(KmsgMsg::Garbage) => panic!("garbage"),
                Err(_) if t0.elapsed() < within => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("no record within {within:?}: {e}"),
            }
        }
    }

    /// A recorded file is followed through inotify: a record written after a long idle spell
    /// arrives at once (not at the next 30 s check), and continuation lines written separately
    /// but promptly stay with their record.
    #[test]
    fn follows_a_regular_file_woken_by_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kmsg");
        std::fs::write(&path, "6,1,100,-;first\n").unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        spawn_reader(&path, false, tx).unwrap();
        let r = recv(&mut rx, Duration::from_secs(2));
        assert_eq!((r.seq, r.text.as_str()), (1, "first"));
        std::thread::sleep(Duration::from_millis(500));
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        let t0 = Instant::now();
        f.write_all(b"3,2,200,-;pcieport 0000:00:1c.4: AER: x\n")
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        f.write_all(b" SUBSYSTEM=pci\n DEVICE=+pci:0000:00:1c.4\n")
            .unwrap();
        let r = recv(&mut rx, Duration::from_secs(2));
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        assert_eq!((r.seq, r.level), (2, 3));
        assert_eq!(
            r.dict,
            vec![
                ("SUBSYSTEM".to_string(), "pci".to_string()),
                ("DEVICE".to_string(), "+pci:0000:00:1c.4".to_string())
            ]
        );
        assert!(rx.try_recv().is_err());
    }
}
