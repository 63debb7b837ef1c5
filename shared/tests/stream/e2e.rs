//! The real stream client against the real hub, in one process over loopback: delivery in
//! order, and spool overflow accounting (the guest's `gpufeed_stream_events_lost_total` equals
//! what the host's spool dropped), for the memory and the disk spool.

use std::time::Duration;

use gpufeed_shared::event::{HostEvent, Stamped};
use gpufeed_testkit::stream::*;

fn events(from: u64, to: u64) -> Vec<Stamped> {
    (from..to)
        .map(|i| Stamped {
            realtime_ns: gpufeed_shared::clock::realtime_ns(),
            monotonic_ns: i,
            event: HostEvent::KmsgLost { count: i },
        })
        .collect()
}

fn free_udp_port() -> std::net::SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivers_in_order_and_acks() {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let (hub, greg, h, hreg) = hub_and_host(&fx, None, |hc| hc.recent_capacity = 10_000).await;
    for chunk in events(0, 5000).chunks(500) {
        h.push(chunk);
    }
    let received = || events_received(&greg);
    assert!(
        wait_for(Duration::from_secs(10), || received() == 5000.0).await,
        "{}",
        received()
    );
    let recent = hub.recent();
    assert_eq!(recent.len(), 5000);
    for (i, e) in recent.iter().enumerate() {
        assert_eq!(e.seq, i as u64);
        assert!(matches!(e.event, HostEvent::KmsgLost { count } if count == i as u64));
        assert_eq!(e.host, "pve1");
    }
    let mut rx = hub.intake().expect("the hub's intake, taken once");
    h.push(&events(5000, 5001));
    let next = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(next.seq(), 5000);
    // Acks come back and empty the spool.
    assert!(
        wait_for(Duration::from_secs(5), || h.status()[0].acked == Some(5000)).await,
        "{:?}",
        h.status()
    );
    assert_eq!(h.status()[0].pending, 0);
    assert_eq!(host_metric(&hreg, "gpufeed_host_stream_acked_seq"), 5000.0);
    assert_eq!(host_metric(&hreg, "gpufeed_host_stream_connected"), 1.0);
    assert_eq!(hub_metric(&greg, "gpufeed_stream_connected"), 1.0);
    assert_eq!(hub_metric(&greg, "gpufeed_stream_events_lost_total"), 0.0);
    let lag = hub_metric(&greg, "gpufeed_stream_lag_seconds");
    assert!((0.0..2.0).contains(&lag), "lag {lag}");
    h.shutdown().await;
    hub.shutdown().await;
}

async fn overflow(disk: bool) {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let addr = free_udp_port();
    let spool = tempfile::tempdir().unwrap();
    let mut cfg = fx.stream_config("pve1", addr, disk.then(|| spool.path()));
    cfg.memory_events = 1000;
    cfg.disk_max_bytes = 64 * 1024;
    cfg.segment_bytes = 4096;
    let (h, hreg) = start_host(cfg);
    // The guest is not there yet: everything stays in the spool, which overflows.
    h.push(&events(0, 6000));
    let st = h.status()[0].clone();
    let dropped = st.dropped_total;
    assert!(dropped > 0);
    if !disk {
        assert_eq!(dropped, 5000);
    }
    assert_eq!(st.pending + dropped, 6000);
    assert_eq!(
        host_metric(&hreg, "gpufeed_host_stream_events_dropped_total"),
        dropped as f64
    );
    // Now the guest comes up.
    let (hub, greg) = serve_hub_with(&fx, |hc| {
        hc.listen = addr;
        hc.recent_capacity = 10_000;
    })
    .await;
    let received = || events_received(&greg);
    assert!(
        wait_for(Duration::from_secs(10), || received() == st.pending as f64).await,
        "received {} of {}",
        received(),
        st.pending
    );
    assert_eq!(
        hub_metric(&greg, "gpufeed_stream_events_lost_total"),
        dropped as f64,
        "guest's lost count must equal the host's dropped count"
    );
    // The survivors are the newest ones, in order.
    let seqs: Vec<u64> = hub.recent().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (dropped..6000).collect::<Vec<_>>());
    // More traffic afterwards: no further loss.
    h.push(&events(6000, 6100));
    assert!(
        wait_for(Duration::from_secs(5), || received()
            == (st.pending + 100) as f64)
        .await
    );
    assert_eq!(
        hub_metric(&greg, "gpufeed_stream_events_lost_total"),
        dropped as f64
    );
    h.shutdown().await;
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_spool_overflow_is_reported_exactly() {
    overflow(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_spool_overflow_is_reported_exactly() {
    overflow(true).await;
}

/// An AER event whose kmsg context is above the frame limit (an error storm) reaches the guest
/// with its context cut, and the guest's recent ring holds at most `recent_max_bytes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_context_is_cut_and_the_recent_ring_is_bounded_in_bytes() {
    use gpufeed_shared::event::{AerCounter, AerSeverity, Source};
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let (hub, greg, h, _) = hub_and_host(&fx, None, |hc| {
        hc.recent_capacity = 10_000;
        hc.recent_max_bytes = 256 << 10;
    })
    .await;
    let storm = |i: u64| Stamped {
        realtime_ns: i as i64,
        monotonic_ns: i,
        event: HostEvent::AerCounter(AerCounter {
            bdf: "0000:01:00.0".into(),
            vmid: Some(100),
            severity: AerSeverity::Correctable,
            error: "RxErr".into(),
            delta: 1,
            total: i,
            detail: None,
            // 512 lines of 200 bytes: 100 KiB, above the 64 KiB frame limit.
            kmsg_context: (0..512)
                .map(|l| format!("{l:04} {}", "x".repeat(195)))
                .collect(),
            source: Source::Poll,
        }),
    };
    let batch: Vec<Stamped> = (0..100).map(storm).collect();
    h.push(&batch);
    let received = || events_received(&greg);
    assert!(
        wait_for(Duration::from_secs(10), || received() == 100.0).await,
        "{}",
        received()
    );
    let recent = hub.recent();
    let HostEvent::AerCounter(last) = &recent.last().unwrap().event else {
        panic!()
    };
    assert_eq!(last.total, 99);
    let ctx: usize = last.kmsg_context.iter().map(String::len).sum();
    assert!(
        ctx <= gpufeed_shared::proto::KMSG_CONTEXT_MAX_BYTES,
        "{ctx}"
    );
    assert!(last.kmsg_context.last().unwrap().contains("more lines cut"));
    // Each event is some 16 KiB in the ring's estimate: 256 KiB hold about 16 of the 100.
    assert!(
        (8..=20).contains(&recent.len()),
        "{} events in the ring",
        recent.len()
    );
    h.shutdown().await;
    hub.shutdown().await;
}
