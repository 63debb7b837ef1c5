//! Hostile frames from an authenticated host: garbage is skipped, oversize and truncated
//! frames and protocol violations close the stream; every case logs one line and is counted
//! in `gpufeed_stream_frames_rejected_total{host="pve1",reason}`; the hub never panics and keeps
//! serving.

use std::time::Duration;

use gpufeed_shared::event::HostEvent;
use gpufeed_shared::proto::{encode, ClientSession, EventFrame, Message, Welcome, MAX_FRAME_LEN};
use gpufeed_shared::stream::by_hand;
use gpufeed_shared::tls;
use gpufeed_testkit::stream::*;

const REJ: &str = "gpufeed_stream_frames_rejected_total";

fn event(seq: u64, kind: u16, payload: Vec<u8>) -> Vec<u8> {
    let mut b = Vec::new();
    encode(
        &Message::Event(EventFrame {
            seq,
            host_realtime_ns: 1,
            host_monotonic_ns: 2,
            kind,
            payload,
        }),
        &mut b,
    )
    .unwrap();
    b
}

fn known(seq: u64) -> Vec<u8> {
    let ev = HostEvent::KmsgLost { count: seq };
    event(seq, ev.kind(), postcard::to_allocvec(&ev).unwrap())
}

/// Connects as pve1 with `boot`, returns the connection, its control stream and the Welcome.
async fn connect(
    fx: &Fixture,
    addr: std::net::SocketAddr,
    boot: u64,
) -> (
    quinn::Connection,
    quinn::SendStream,
    quinn::RecvStream,
    Welcome,
) {
    let (c, k) = fx.host_pems("pve1");
    let cfg = tls::client_config(&fx.ca_pem(), &c, &k).unwrap();
    by_hand::hello(cfg, addr, "pve1", boot).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames() {
    let logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hub_config(fx.path()), &reg).await.unwrap();
    let addr = hub.local_addr();
    let rej = |reason: &str| metric(&reg, REJ, &[("host", "pve1"), ("reason", reason)]);
    let received = || {
        metric(
            &reg,
            "gpufeed_stream_events_received_total",
            &[("host", "pve1")],
        )
    };

    // 1. Garbage and unknown kinds are skipped; good frames around them arrive.
    let (conn, _s, _r, w) = connect(&fx, addr, 7).await;
    assert_eq!(w.resume_from, None);
    let mut ev = conn.open_uni().await.unwrap();
    let mut wire = vec![3, 0, 0, 0, 0xde, 0xad, 0xff];
    wire.extend(known(0));
    wire.extend(event(1, 999, vec![1, 2, 3]));
    wire.extend(known(2));
    ev.write_all(&wire).await.unwrap();
    assert!(wait_for(Duration::from_secs(3), || received() == 2.0).await);
    assert_eq!(rej("garbage"), 1.0);
    assert_eq!(rej("unknown_kind"), 1.0);
    let seqs: Vec<u64> = hub.recent().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, vec![0, 2]);
    assert!(matches!(
        hub.recent()[1].event,
        HostEvent::KmsgLost { count: 2 }
    ));
    assert_eq!(
        log_lines(&logs, &["hub: rejected", "reason=\"garbage\""]).len(),
        1
    );
    // The stream still works after the garbage.
    ev.write_all(&known(3)).await.unwrap();
    assert!(wait_for(Duration::from_secs(3), || received() == 3.0).await);
    // 99 more garbage frames: each counted, the warning not repeated (rate-limited, with the
    // number suppressed in its next line).
    ev.write_all(&[3, 0, 0, 0, 0xde, 0xad, 0xff].repeat(99))
        .await
        .unwrap();
    assert!(wait_for(Duration::from_secs(3), || rej("garbage") == 100.0).await);
    assert_eq!(
        log_lines(&logs, &["hub: rejected", "reason=\"garbage\""]).len(),
        1,
        "one warning for 100 garbage frames"
    );

    // 2. Sequence going backwards on the same stream closes it.
    ev.write_all(&known(3)).await.unwrap();
    assert!(wait_for(Duration::from_secs(3), || rej("seq_backwards") == 1.0).await);
    assert!(tokio::time::timeout(Duration::from_secs(3), conn.closed())
        .await
        .is_ok());

    // 3. Oversize: the length prefix alone is enough to close the connection.
    let (conn, _s, _r, w) = connect(&fx, addr, 7).await;
    assert_eq!(
        w.resume_from,
        Some(4),
        "resume after the de-duplicated watermark"
    );
    let mut ev = conn.open_uni().await.unwrap();
    ev.write_all(&((MAX_FRAME_LEN as u32 + 1).to_le_bytes()))
        .await
        .unwrap();
    assert!(wait_for(Duration::from_secs(3), || rej("oversize") == 1.0).await);
    assert!(tokio::time::timeout(Duration::from_secs(3), conn.closed())
        .await
        .is_ok());
    assert_eq!(
        log_lines(&logs, &["hub: rejected", "reason=\"oversize\""]).len(),
        1
    );

    // 4. Truncated: the stream ends inside a frame.
    let (conn, _s, _r, _) = connect(&fx, addr, 7).await;
    let mut ev = conn.open_uni().await.unwrap();
    let f = known(4);
    ev.write_all(&f[..f.len() - 2]).await.unwrap();
    ev.finish().unwrap();
    assert!(wait_for(Duration::from_secs(3), || rej("truncated") == 1.0).await);
    assert_eq!(
        log_lines(&logs, &["hub: rejected", "reason=\"truncated\""]).len(),
        1
    );
    assert_eq!(received(), 3.0);

    // 5. A wrong message on the event stream.
    let (conn, _s, _r, _) = connect(&fx, addr, 7).await;
    let mut ev = conn.open_uni().await.unwrap();
    let mut b = Vec::new();
    encode(&ClientSession::new("pve1", 7).hello(), &mut b).unwrap();
    ev.write_all(&b).await.unwrap();
    assert!(wait_for(Duration::from_secs(3), || rej("unexpected_message") == 1.0).await);

    // 6. Random byte soup on fresh connections: never a panic, the hub keeps serving.
    let mut x = 0x1234_5678_u64;
    for _ in 0..5 {
        let (conn, _s, _r, _) = connect(&fx, addr, 7).await;
        let mut ev = conn.open_uni().await.unwrap();
        let soup: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let _ = ev.write_all(&soup).await;
        let _ = ev.finish();
        let _ = tokio::time::timeout(Duration::from_secs(3), conn.closed()).await;
    }
    let (conn, _s, _r, w) = connect(&fx, addr, 7).await;
    assert_eq!(w.resume_from, Some(4));
    let mut ev = conn.open_uni().await.unwrap();
    ev.write_all(&known(4)).await.unwrap();
    assert!(wait_for(Duration::from_secs(3), || received() == 4.0).await);
    assert_eq!(
        metric(
            &reg,
            "gpufeed_stream_events_duplicate_total",
            &[("host", "pve1")]
        ),
        0.0
    );
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_seeds_dedup_and_cuts_a_torn_tail() {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let j = fx.path().join("journal.jsonl");
    let good = "{\"host\":\"pve1\",\"boot\":7,\"seq\":3,\"kind\":10}\n\
                {\"host\":\"pve1\",\"boot\":7,\"loss_first\":4,\"loss_last\":9,\"lost\":6}\n\
                {\"host\":\"pve1\",\"boot\":8,\"seq\":1}\n";
    std::fs::write(
        &j,
        format!("{good}{{\"host\":\"pve1\",\"boot\":7,\"seq\":99"),
    )
    .unwrap();
    let reg = prometheus::Registry::new();
    let mut hc = hub_config(fx.path());
    hc.journal = Some(j.clone());
    let hub = hub::serve(hc, &reg).await.unwrap();
    assert_eq!(std::fs::read_to_string(&j).unwrap(), good, "torn line cut");
    let (_c, _s, _r, w) = connect(&fx, hub.local_addr(), 7).await;
    assert_eq!(w.resume_from, Some(10));
    let (_c, _s, _r, w) = connect(&fx, hub.local_addr(), 8).await;
    assert_eq!(w.resume_from, Some(2));
    let (conn, _s, _r, w) = connect(&fx, hub.local_addr(), 9).await;
    assert_eq!(w.resume_from, None);
    let mut ev = conn.open_uni().await.unwrap();
    ev.write_all(&known(0)).await.unwrap();
    let received = || {
        metric(
            &reg,
            "gpufeed_stream_events_received_total",
            &[("host", "pve1")],
        )
    };
    assert!(wait_for(Duration::from_secs(3), || received() == 1.0).await);
    let text = std::fs::read_to_string(&j).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["boot"], 9);
    assert_eq!(last["seq"], 0);
    assert_eq!(last["event"]["KmsgLost"]["count"], 0);
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_is_compacted_to_watermarks_past_its_limit() {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let j = fx.path().join("journal.jsonl");
    let mut hc = hub_config(fx.path());
    hc.journal = Some(j.clone());
    hc.journal_max_bytes = 4096;
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hc.clone(), &reg).await.unwrap();
    let (conn, _s, _r, _) = connect(&fx, hub.local_addr(), 7).await;
    let mut ev = conn.open_uni().await.unwrap();
    for seq in 0..200 {
        ev.write_all(&known(seq)).await.unwrap();
    }
    let received = || {
        metric(
            &reg,
            "gpufeed_stream_events_received_total",
            &[("host", "pve1")],
        )
    };
    assert!(wait_for(Duration::from_secs(5), || received() == 200.0).await);
    let len = std::fs::metadata(&j).unwrap().len();
    assert!(len <= 4096 + 2048, "journal {len} bytes");
    let text = std::fs::read_to_string(&j).unwrap();
    assert!(text.contains("\"mark\":"), "{text}");
    drop(conn);
    hub.shutdown().await;
    // A new hub on the compacted journal still knows everything up to 199.
    let hub = hub::serve(hc, &prometheus::Registry::new()).await.unwrap();
    let (_c, _s, _r, w) = connect(&fx, hub.local_addr(), 7).await;
    assert_eq!(w.resume_from, Some(200));
    hub.shutdown().await;
}

/// A frame of a known kind whose payload does not decode is corrupt, counted apart from a
/// kind this guest does not know; the journal holds a record for every number the guest
/// moved past (events decoded or not, the host's loss report, the gap it saw without one), so
/// that a restarted guest's journal explains each of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_event_is_no_unknown_kind_and_the_journal_explains_every_number() {
    let logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let j = fx.path().join("journal.jsonl");
    let mut hc = hub_config(fx.path());
    hc.journal = Some(j.clone());
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hc.clone(), &reg).await.unwrap();
    let rej = |reason: &str| metric(&reg, REJ, &[("host", "pve1"), ("reason", reason)]);
    let pve1 = [("host", "pve1")];
    let (conn, _s, _r, _) = connect(&fx, hub.local_addr(), 7).await;
    let mut ev = conn.open_uni().await.unwrap();
    let kmsg_lost = HostEvent::KmsgLost { count: 0 }.kind();
    let mut wire = known(0);
    // A known kind, a payload that is no such event (a varint that never ends).
    wire.extend(event(1, kmsg_lost, vec![0x89, 0xff, 0xff]));
    wire.extend(event(2, 999, vec![1, 2, 3]));
    // 3 and 4 never come and nothing reports them: a gap.
    wire.extend(known(5));
    encode(
        &Message::SpoolLoss(gpufeed_shared::proto::SpoolLoss {
            dropped: 2,
            first_seq: 6,
            last_seq: 7,
        }),
        &mut wire,
    )
    .unwrap();
    wire.extend(known(8));
    ev.write_all(&wire).await.unwrap();
    let received = || metric(&reg, "gpufeed_stream_events_received_total", &pve1);
    assert!(wait_for(Duration::from_secs(3), || received() == 3.0).await);
    assert_eq!((rej("bad_payload"), rej("unknown_kind")), (1.0, 1.0));
    // The gap (3, 4) and the reported loss (6, 7).
    assert_eq!(metric(&reg, "gpufeed_stream_events_lost_total", &pve1), 4.0);
    let bad = log_lines(&logs, &["bad_payload", "event 1 (boot 7) of known kind 10"]);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(log_lines(&logs, &["kind this guest does not know", "kind=10"]).is_empty());
    drop(conn);
    hub.shutdown().await;

    // Each number the test sent, 0..=8, has exactly one record saying what became of it.
    let mut what = vec![Vec::new(); 9];
    for line in std::fs::read_to_string(&j).unwrap().lines() {
        let l: hub::journal::Line = serde_json::from_str(line).unwrap();
        assert_eq!((l.host.as_ref(), l.boot), ("pve1", 7), "{line}");
        let (range, said) = match (l.seq, l.loss_first, l.gap_first) {
            (Some(s), ..) => (
                s..=s,
                l.undecoded.clone().unwrap_or_else(|| "event".to_owned()),
            ),
            (_, Some(f), _) => (f..=l.loss_last.unwrap(), "loss".to_owned()),
            (.., Some(f)) => (f..=l.gap_last.unwrap(), "gap".to_owned()),
            _ => panic!("a record that explains no number: {line}"),
        };
        for s in range {
            what[s as usize].push(said.clone());
        }
    }
    let what: Vec<String> = what.into_iter().map(|w| w.join("+")).collect();
    assert_eq!(
        what,
        [
            "event",
            "bad_payload",
            "unknown_kind",
            "gap",
            "gap",
            "event",
            "loss",
            "loss",
            "event"
        ]
    );
    // A guest restarted on it resumes after all of it, and found nothing damaged.
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hc, &reg).await.unwrap();
    let (_c, _s, _r, w) = connect(&fx, hub.local_addr(), 7).await;
    assert_eq!(w.resume_from, Some(9));
    assert_eq!(
        metric(&reg, "gpufeed_stream_journal_damaged_records_total", &[]),
        0.0
    );
    hub.shutdown().await;
}

/// Damage to the journal is counted per record destroyed, in a metric beside the warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_damage_is_counted_per_record_in_a_metric() {
    let logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let j = fx.path().join("journal.jsonl");
    let record = |seq: u64| {
        format!(
            "{{\"host\":\"pve1\",\"boot\":11,\"seq\":{seq},\"kind\":10,\"host_realtime_ns\":1,\"event\":{{\"KmsgLost\":{{\"count\":{seq}}}}}}}\n"
        )
    };
    let mut text: Vec<u8> = (0..10).flat_map(|s| record(s).into_bytes()).collect();
    let line = record(0).len();
    // Three records destroyed: the middle of record 2, and the end of record 5 with its
    // newline, which glues record 6 onto it.
    text[2 * line + 30..2 * line + 40].fill(b'#');
    text[6 * line - 4..6 * line].fill(b'#');
    std::fs::write(&j, &text).unwrap();
    let mut hc = hub_config(fx.path());
    hc.journal = Some(j.clone());
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hc, &reg).await.unwrap();
    assert_eq!(
        metric(&reg, "gpufeed_stream_journal_damaged_records_total", &[]),
        3.0
    );
    let warned = log_lines(&logs, &["skipped damaged records", "records=3"]);
    assert_eq!(warned.len(), 1, "{warned:?}");
    // The other records seed de-duplication: 9 is the highest.
    let (_c, _s, _r, w) = connect(&fx, hub.local_addr(), 11).await;
    assert_eq!(w.resume_from, Some(10));
    hub.shutdown().await;
}

/// A host's spool rolled back to a sequence space several resets old (more than the 4 the
/// guest used to keep): the guest still knows what it has of it, also after its own restart,
/// and nothing comes twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_space_many_resets_old_is_still_known() {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let j = fx.path().join("journal.jsonl");
    let mut hc = hub_config(fx.path());
    hc.journal = Some(j.clone());
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hc.clone(), &reg).await.unwrap();
    let received = || {
        metric(
            &reg,
            "gpufeed_stream_events_received_total",
            &[("host", "pve1")],
        )
    };
    let send = |boot: u64, seqs: std::ops::Range<u64>| {
        let fx = &fx;
        let addr = hub.local_addr();
        async move {
            let (conn, s, r, w) = connect(fx, addr, boot).await;
            let mut ev = conn.open_uni().await.unwrap();
            for s in seqs {
                ev.write_all(&known(s)).await.unwrap();
            }
            // The connection (and its control stream) stays until the caller drops it.
            ((conn, s, r, ev), w)
        }
    };
    // Boot 100 delivers 0..5, then ten resets each deliver one event.
    let (_c, w) = send(100, 0..5).await;
    assert_eq!(w.resume_from, None);
    assert!(wait_for(Duration::from_secs(3), || received() == 5.0).await);
    for (i, boot) in (101..111).enumerate() {
        let (_c, w) = send(boot, 0..1).await;
        assert_eq!(w.resume_from, None);
        let want = 6.0 + i as f64;
        assert!(wait_for(Duration::from_secs(3), || received() == want).await);
    }
    // The rollback: boot 100 again, re-sending 0..5 and one new event.
    let (_c, w) = send(100, 0..6).await;
    assert_eq!(w.resume_from, Some(5));
    assert!(wait_for(Duration::from_secs(3), || received() == 16.0).await);
    let dup = metric(
        &reg,
        "gpufeed_stream_events_duplicate_total",
        &[("host", "pve1")],
    );
    assert_eq!(dup, 5.0);
    hub.shutdown().await;
    // A guest restarted from its journal knows all eleven.
    let hub = hub::serve(hc, &prometheus::Registry::new()).await.unwrap();
    for boot in 100..111 {
        let (_c, _s, _r, w) = connect(&fx, hub.local_addr(), boot).await;
        assert_eq!(w.resume_from, Some(if boot == 100 { 6 } else { 1 }));
    }
    hub.shutdown().await;
}

/// Past the table's bound (a host that showed more sequence spaces than it keeps), a space
/// the guest does not hold may be one it forgot: it cannot tell, delivers what the host had
/// spooled before it connected, and counts each as a possible duplicate (metric, journal);
/// what the host numbers afterwards is not in doubt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_space_the_guest_may_have_forgotten_is_counted_as_possible_duplicates() {
    let logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let j = fx.path().join("journal.jsonl");
    // A journal of more spaces than the table keeps: the oldest 10 are forgotten at start.
    let spaces = gpufeed_shared::proto::Dedup::BOOTS_PER_HOST as u64 + 10;
    let text: String = (0..spaces)
        .map(|boot| format!("{{\"host\":\"pve1\",\"boot\":{boot},\"mark\":4}}\n"))
        .collect();
    std::fs::write(&j, text).unwrap();
    let mut hc = hub_config(fx.path());
    hc.journal = Some(j.clone());
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hc, &reg).await.unwrap();
    let pve1 = [("host", "pve1")];
    // Space 0 was forgotten, space 20 is held.
    let (_c, _s, _r, w) = connect(&fx, hub.local_addr(), 20).await;
    assert_eq!(w.resume_from, Some(5));
    let (conn, _s, _r, w) = connect(&fx, hub.local_addr(), 0).await;
    assert_eq!(w.resume_from, None);
    let mut ev = conn.open_uni().await.unwrap();
    // The host had handed out 0..5 when it connected (its first horizon); 5 and 6 it numbered
    // after (a later horizon).
    let mut wire = Vec::new();
    encode(
        &Message::Horizon(gpufeed_shared::proto::Horizon { below: 5 }),
        &mut wire,
    )
    .unwrap();
    for s in 0..5 {
        wire.extend(known(s));
    }
    encode(
        &Message::Horizon(gpufeed_shared::proto::Horizon { below: 7 }),
        &mut wire,
    )
    .unwrap();
    for s in 5..7 {
        wire.extend(known(s));
    }
    ev.write_all(&wire).await.unwrap();
    let received = || metric(&reg, "gpufeed_stream_events_received_total", &pve1);
    assert!(wait_for(Duration::from_secs(3), || received() == 7.0).await);
    let possible = metric(
        &reg,
        "gpufeed_stream_events_possible_duplicate_total",
        &pve1,
    );
    assert_eq!(possible, 5.0);
    assert!(!log_lines(
        &logs,
        &["5 events of boot 0 below 5 may have been accounted before"]
    )
    .is_empty());
    drop(conn);
    hub.shutdown().await;
    let flagged: Vec<u64> = std::fs::read_to_string(&j)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<hub::journal::Line>(l).unwrap())
        .filter(|l| l.boot == 0 && l.possible_duplicate == Some(true))
        .filter_map(|l| l.seq)
        .collect();
    assert_eq!(flagged, [0, 1, 2, 3, 4]);
}
