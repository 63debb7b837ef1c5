//! Faults under the host's spool: a disk that fills up (a small tmpfs). Every event the spool
//! accepted must either reach the guest exactly once or be counted as lost (host
//! `gpufeed_host_stream_events_dropped_total`, guest `gpufeed_stream_events_lost_total`), events
//! that memory can hold are not lost because the disk is full, nothing panics, and the disk is
//! written again once it has room.

use std::time::Duration;

use gpufeed_shared::proto::{EncodedEvent, FrameDecoder, Message, SpoolLoss};
use gpufeed_shared::stream::client::spool::{Spool, SpoolLimits};
use gpufeed_shared::stream::client::RawEvent;
use gpufeed_testkit::stream::*;

fn ev(i: u64) -> EncodedEvent {
    EncodedEvent::new(i as i64, i, 1, &[7; 100]).unwrap()
}

/// Everything the spool sends from `cursor` on: event sequence numbers and loss reports.
fn drain(s: &mut Spool, mut cursor: u64) -> (Vec<u64>, Vec<SpoolLoss>) {
    let (mut seqs, mut losses) = (Vec::new(), Vec::new());
    loop {
        let b = s.read_batch(cursor, 16 * 1024).unwrap();
        if b.bytes.is_empty() {
            return (seqs, losses);
        }
        let mut d = FrameDecoder::default();
        d.push(&b.bytes);
        while let Some(m) = d.next_frame().unwrap() {
            match m {
                Message::Event(e) => seqs.push(e.seq),
                Message::SpoolLoss(l) => losses.push(l),
                m => panic!("{m:?}"),
            }
        }
        cursor = b.next_cursor;
    }
}

/// Every sequence number below `end` is sent exactly once or inside exactly one loss report.
fn assert_accounted(seqs: &[u64], losses: &[SpoolLoss], end: u64) {
    let mut seen = vec![0u32; end as usize];
    for &s in seqs {
        seen[s as usize] += 1;
    }
    for l in losses {
        assert_eq!(l.dropped, l.last_seq - l.first_seq + 1, "{l:?}");
        for s in l.first_seq..=l.last_seq {
            seen[s as usize] += 1;
        }
    }
    let bad: Vec<_> = (0..end).filter(|&s| seen[s as usize] != 1).collect();
    assert!(bad.is_empty(), "not accounted exactly once: {bad:?}");
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "out of order");
}

/// Memory for 1000 events, a disk far larger than the tmpfs under it.
const LIMITS: SpoolLimits = SpoolLimits {
    memory_bytes: usize::MAX,
    memory_events: 1000,
    disk_max_bytes: 16 << 20,
    segment_bytes: 16 << 10,
};

/// A spool (in `dir`, with [`LIMITS`]) on a 64 KiB disk.
fn spool_on_a_small_disk() -> (TinyFs, std::path::PathBuf, Spool) {
    let fs = TinyFs::mount(64);
    let dir = fs.path().join("guest");
    let s = Spool::open(&dir, LIMITS).unwrap();
    (fs, dir, s)
}

/// Pushes events `0..n`, flushing after every tenth: the sequence numbers handed out, the
/// events dropped, the flushes that failed.
fn push_flushing(s: &mut Spool, n: u64) -> (Vec<u64>, u64, u32) {
    let (mut seqs, mut dropped, mut flush_errors) = (Vec::new(), 0, 0);
    for i in 0..n {
        let (seq, d) = s.push(ev(i)).unwrap();
        seqs.push(seq);
        dropped += d;
        if i % 10 == 9 {
            match s.flush(Duration::ZERO) {
                Ok(d) => dropped += d,
                Err(_) => flush_errors += 1,
            }
        }
    }
    (seqs, dropped, flush_errors)
}

#[test]
fn spool_on_a_full_disk_keeps_what_memory_holds_and_counts_the_rest() {
    let (fs, dir, mut s) = spool_on_a_small_disk();
    let (pushed, dropped, flush_errors) = push_flushing(&mut s, 3000);
    // A full disk refuses no event and takes no sequence number without an event.
    assert_eq!(pushed, (0..3000).collect::<Vec<_>>());
    assert!(flush_errors > 0, "the 64 KiB disk never filled up");
    assert_eq!(s.next_seq(), 3000);
    assert_eq!(s.dropped_total(), dropped);
    let (seqs, losses) = drain(&mut s, 0);
    assert_accounted(&seqs, &losses, 3000);
    // What memory holds (the newest 1000) is all there; the loss is what neither could hold.
    assert!((2000..3000).all(|x| seqs.binary_search(&x).is_ok()));
    assert!(dropped > 0 && dropped <= 2000, "{dropped}");
    assert_eq!(seqs.len() as u64 + dropped, 3000);

    // Room again: the disk catches up by itself, and a restart finds everything it holds.
    fs.resize(8 << 10);
    // push retries a failed disk at most every 100 ms (a flush always does).
    std::thread::sleep(Duration::from_millis(150));
    for i in 3000..3010 {
        s.push(ev(i)).unwrap();
    }
    s.flush(Duration::ZERO).unwrap();
    drop(s);
    let mut s = Spool::open(&dir, LIMITS).unwrap();
    assert_eq!(s.next_seq(), 3010);
    assert_eq!(s.dropped_total(), dropped);
    let (seqs2, losses2) = drain(&mut s, 0);
    assert_accounted(&seqs2, &losses2, 3010);
    assert!((2000..3010).all(|x| seqs2.binary_search(&x).is_ok()));
}

/// Killed (no flush, no shutdown: what SIGKILL or the watchdog leaves) while the disk is full
/// and memory holds what the disk could not: the restarted spool hands out no number again, and
/// every event memory held is a counted loss (reported to the guest and fed to the drop
/// counter), not a silent one.
#[test]
fn spool_killed_while_its_disk_is_full_counts_what_memory_held() {
    let (fs, dir, mut s) = spool_on_a_small_disk();
    let (_, dropped, flush_errors) = push_flushing(&mut s, 3000);
    assert!(flush_errors > 0, "the 64 KiB disk never filled up");
    let held = s.unwritten();
    assert!(held > 0, "memory holds nothing the disk lacks");
    drop(s); // killed: what only memory held is gone
    fs.resize(8 << 10);
    let mut s = Spool::open(&dir, LIMITS).unwrap();
    assert_eq!(
        s.next_seq(),
        3000,
        "the state fell behind the numbers handed out"
    );
    // The restart's own count: the events only memory held.
    let missing = s.take_dropped();
    eprintln!("killed on a full disk: {held} events only in memory, {missing} counted lost at the restart, {dropped} dropped before");
    assert_eq!(missing, held);
    assert_eq!(s.dropped_total(), dropped + held);
    let (seqs, losses) = drain(&mut s, 0);
    assert_accounted(&seqs, &losses, 3000);
    assert_eq!(
        losses.iter().map(|l| l.dropped).sum::<u64>(),
        dropped + held
    );
    assert_eq!(
        s.push(ev(3000)).unwrap().0,
        3000,
        "a number handed out again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_on_a_full_disk_delivers_every_event_exactly_once() {
    let logs = capture_logs();
    let fs = TinyFs::mount(64);
    let fx = Fixture::new(&["pve1"]);
    let (hub, greg, h, hreg) =
        hub_and_host(&fx, Some(fs.path()), |hc| hc.recent_capacity = 20_000).await;
    // About 200 KiB of frames (20 bytes each) into a 64 KiB disk, with the guest online.
    for from in (0..10_000).step_by(100) {
        h.push_raw(0, kmsg_lost_raw(from, from + 100));
        tokio::task::yield_now().await;
    }
    let received = || events_received(&greg);
    assert!(
        wait_for(Duration::from_secs(10), || received() == 10_000.0).await,
        "received {}",
        received()
    );
    // The disk really was full.
    assert!(!log_lines(&logs, &["spool write failed", "No space left on device"]).is_empty());
    let seqs: Vec<u64> = hub.recent().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (0..10_000).collect::<Vec<_>>());
    let lost = hub_metric(&greg, "gpufeed_stream_events_lost_total");
    let dup = hub_metric(&greg, "gpufeed_stream_events_duplicate_total");
    assert_eq!((lost, dup), (0.0, 0.0));
    let host_dropped = host_metric(&hreg, "gpufeed_host_stream_events_dropped_total");
    assert_eq!(host_dropped, 0.0);
    assert_eq!(host_metric(&hreg, "gpufeed_host_stream_connected"), 1.0);
    // Acknowledged while the disk was full: the spool empties; more events still stream.
    assert!(
        wait_for(Duration::from_secs(5), || h.status()[0].pending == 0).await,
        "{:?}",
        h.status()
    );
    h.push_raw(0, kmsg_lost_raw(10_000, 10_010));
    assert!(wait_for(Duration::from_secs(5), || received() == 10_010.0).await);
    h.shutdown().await;
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_spool_snapshot_does_not_reuse_sequence_numbers() {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let (hub, greg) = serve_hub(&fx, 10_000).await;
    let work = tempfile::tempdir().unwrap();
    let spool = work.path().join("spool");
    let cfg = fx.stream_config("pve1", hub.local_addr(), Some(&spool));
    let received = || events_received(&greg);
    // A host run that connects, then streams `events`, and exits cleanly.
    let run = |events: Vec<RawEvent>, total: f64| {
        let cfg = cfg.clone();
        let received = &received;
        async move {
            let (h, hreg) = start_host(cfg);
            let connected = || host_metric(&hreg, "gpufeed_host_stream_connected") == 1.0;
            assert!(wait_for(Duration::from_secs(5), connected).await);
            h.push_raw(0, events);
            assert!(
                wait_for(Duration::from_secs(5), || received() == total).await,
                "received {} of {total}",
                received()
            );
            let st = h.status()[0].clone();
            h.shutdown().await;
            st
        }
    };
    run(kmsg_lost_raw(0, 20), 20.0).await;
    // Snapshot of the spool after 20 events; 30 more stream; then the snapshot comes back.
    let snap = work.path().join("snap");
    copy_dir(&spool, &snap);
    run(kmsg_lost_raw(20, 50), 50.0).await;
    std::fs::remove_dir_all(&spool).unwrap();
    copy_dir(&snap, &spool);
    // The rolled-back host would number the next events from 20 again; the guest has 49.
    let st = run(kmsg_lost_raw(50, 150), 150.0).await;
    assert!(st.next_seq >= 150, "{st:?}");
    let dup = hub_metric(&greg, "gpufeed_stream_events_duplicate_total");
    let lost = hub_metric(&greg, "gpufeed_stream_events_lost_total");
    assert_eq!((dup, lost), (0.0, 0.0));
    let counts: Vec<u64> = hub
        .recent()
        .iter()
        .map(|e| match e.event {
            gpufeed_shared::event::HostEvent::KmsgLost { count } => count,
            _ => u64::MAX,
        })
        .collect();
    assert_eq!(counts, (0..150).collect::<Vec<_>>());
    hub.shutdown().await;
}

/// The guest's journal on a disk that fills up: a failed append is neither delivered nor
/// acknowledged (the host keeps the events and sends them again), leaves no fragment in the
/// file, and once the disk has room every event is delivered and journaled exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_journal_on_a_full_disk_acks_only_what_it_wrote() {
    let logs = capture_logs();
    // 16 KiB: about 150 journal lines.
    let fs = TinyFs::mount(16);
    let fx = Fixture::new(&["pve1"]);
    let journal = fs.path().join("journal.jsonl");
    let (hub, greg, h, hreg) = hub_and_host(&fx, None, |hc| {
        hc.recent_capacity = 10_000;
        hc.journal = Some(journal.clone());
    })
    .await;
    const N: u64 = 2_000;
    h.push_raw(0, kmsg_lost_raw(0, N));
    let received = || events_received(&greg);
    assert!(
        wait_for(Duration::from_secs(10), || !log_lines(
            &logs,
            &["event journal write failed", "No space left on device"]
        )
        .is_empty())
        .await,
        "the 16 KiB journal never filled up"
    );
    // The host still holds what the journal could not take: nothing of it was acknowledged.
    let st = h.status()[0].clone();
    assert_eq!(st.next_seq, N);
    assert!(
        st.pending > 0 && st.acked.is_none_or(|a| a < N - 1),
        "{st:?}"
    );
    let stalled = received();
    assert!(stalled < N as f64, "received {stalled} of {N}");
    assert_eq!(
        hub.recent().len() as f64,
        stalled,
        "delivered what was not journaled"
    );

    // Room again: the host's retries get through by themselves.
    fs.resize(1024);
    assert!(
        wait_for(Duration::from_secs(10), || received() == N as f64).await,
        "received {} of {N} after the disk had room",
        received()
    );
    assert!(wait_for(Duration::from_secs(5), || h.status()[0].pending == 0).await);
    let seqs: Vec<u64> = hub.recent().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (0..N).collect::<Vec<_>>());
    for (name, labels) in [
        ("gpufeed_stream_events_lost_total", [("host", "pve1")]),
        (
            "gpufeed_host_stream_events_dropped_total",
            [("guest", "guest")],
        ),
    ] {
        let reg = if name.contains("host_") { &hreg } else { &greg };
        assert_eq!(metric(reg, name, &labels), 0.0, "{name}");
    }
    h.shutdown().await;
    hub.shutdown().await;

    // The journal holds every event exactly once, in order, each on a whole line of its own
    // (no retried line glued onto a fragment of a failed one).
    let text = std::fs::read(&journal).unwrap();
    assert_eq!(text.last(), Some(&b'\n'));
    let mut journaled = Vec::new();
    for line in text.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let l: hub::journal::Line = serde_json::from_slice(line)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(line)));
        journaled.extend(l.seq);
    }
    assert_eq!(journaled, (0..N).collect::<Vec<_>>());
    // A restart from it resumes after the last event.
    let mut dedup = gpufeed_shared::proto::Dedup::new();
    let boot = st.boot_id;
    hub::journal::Journal::open(&journal, 1 << 20, &mut dedup).unwrap();
    assert_eq!(dedup.watermark("pve1", boot), Some(N - 1));
}

/// One loss, one count. The host spools 10,000 events to a 64 KiB disk with memory for 1,000
/// while its guest is not there yet, and restarts (what only memory held is lost with the
/// process); then the guest comes. The events the test made the host lose are those it emitted
/// and the guest never got (the test's own truth: the sequence numbers in the guest's ring).
/// The guest's `gpufeed_stream_events_lost_total{host}` (docs/stream.md: the count of events
/// lost per host) holds each of them once; the host's `gpufeed_host_stream_events_dropped_total`
/// is its own view of the same events (what it could not spool), so adding it would count each
/// loss twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_on_a_full_disk_and_a_host_restart_is_counted_once_where_the_docs_say() {
    let logs = capture_logs();
    let fs = TinyFs::mount(64);
    let fx = Fixture::new(&["pve1"]);
    // The guest's address, unused until the guest comes.
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut cfg = fx.stream_config("pve1", addr, Some(&fs.path().join("spool")));
    cfg.memory_events = 1_000;
    // About 200 KiB of frames.
    const N: u64 = 10_000;
    let (h, hreg) = start_host(cfg.clone());
    for from in (0..N).step_by(100) {
        h.push_raw(0, kmsg_lost_raw(from, from + 100));
        tokio::task::yield_now().await;
    }
    assert!(
        wait_for(Duration::from_secs(5), || !log_lines(
            &logs,
            &["spool write failed", "No space left on device"]
        )
        .is_empty())
        .await,
        "the 64 KiB disk never filled up"
    );
    // Every event got its number: emitted.
    assert_eq!(h.status()[0].next_seq, N);
    const DROPPED: &str = "gpufeed_host_stream_events_dropped_total";
    let dropped_before_restart = host_metric(&hreg, DROPPED);
    h.shutdown().await;
    let (h, hreg) = start_host(cfg);
    let (hub, greg) = serve_hub_with(&fx, |hc| {
        hc.listen = addr;
        hc.recent_capacity = 2 * N as usize;
    })
    .await;
    // The guest has accounted every number (delivered, or reported lost) when its ack reaches
    // the last one.
    assert!(
        wait_for(Duration::from_secs(10), || h.status()[0].acked
            == Some(N - 1))
        .await,
        "{:?}",
        h.status()
    );
    let delivered: std::collections::BTreeSet<u64> = hub.recent().iter().map(|e| e.seq).collect();
    assert_eq!(
        delivered.len(),
        hub.recent().len(),
        "an event delivered twice"
    );
    assert_eq!(events_received(&greg), delivered.len() as f64);
    let made_lost = N - delivered.len() as u64;
    let guest_lost = hub_metric(&greg, "gpufeed_stream_events_lost_total");
    let host_view = dropped_before_restart + host_metric(&hreg, DROPPED);
    eprintln!(
        "emitted {N}, delivered {}, lost {made_lost}: guest counted {guest_lost}, host dropped {dropped_before_restart} before its restart and {} after",
        delivered.len(),
        host_metric(&hreg, DROPPED)
    );
    // Both sides were provoked: events lost on the full disk and with the restart, and events
    // delivered from the disk.
    assert!(made_lost > 0 && !delivered.is_empty());
    assert!(dropped_before_restart > 0.0 && host_metric(&hreg, DROPPED) > 0.0);
    // The documented count holds each loss once ...
    assert_eq!(guest_lost, made_lost as f64);
    // ... and the host's view is the same events again, not more losses.
    assert_eq!(host_view, made_lost as f64);
    h.shutdown().await;
    hub.shutdown().await;
}
