//! Hostile load on the guest hub's port, which any pod on the node can reach: 20,000 half-open
//! QUIC handshakes (real client Initial packets, each a fresh connection, whose sender never
//! answers) must not grow the process by more than 40 MB, must not write a log line per
//! attempt, and a legitimate host must connect and stream meanwhile.
//!
//! From 64 addresses, handshakes that pass address validation and then go silent (what a
//! flooder that answers the Retry does) must not keep a host that connected before from
//! connecting again within 3 s of its restart, and replaying.
//!
//! The hub runs in this test process, so the measured RSS covers hub, flooder and host client
//! together (stricter than the hub alone). The tests take turns (`SERIAL`): RSS is per process.

use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpufeed_shared::tls;
use gpufeed_testkit::stream::*;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const ATTEMPTS: usize = 20_000;
const RSS_BUDGET: u64 = 40 << 20;

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb << 10
}

/// Sends QUIC Initial packets (each a new connection with a TLS ClientHello) from the
/// addresses `from`, in turn, to `to` while `more(i)`, and never reads an answer: every one is
/// a half-open handshake. Paced in bursts so that the loopback socket buffer does not simply
/// drop them.
fn flood(
    from: &[&str],
    to: SocketAddr,
    client: quinn::ClientConfig,
    mut more: impl FnMut(usize) -> bool,
) -> usize {
    let socks: Vec<UdpSocket> = from.iter().map(|a| UdpSocket::bind(a).unwrap()).collect();
    let mut sent = 0;
    let mut buf = Vec::with_capacity(1500);
    let mut ep = None;
    for i in (0..).take_while(|i| more(*i)) {
        let sock = &socks[i % socks.len()];
        // A fresh endpoint now and then: the dropped connections' ids stay in it.
        if i % 1000 == 0 {
            ep = Some(quinn_proto::Endpoint::new(
                Arc::new(quinn_proto::EndpointConfig::default()),
                None,
                false,
                None,
            ));
        }
        let now = Instant::now();
        let (_, mut conn) = ep
            .as_mut()
            .unwrap()
            .connect(now, client.clone(), to, "127.0.0.1")
            .unwrap();
        buf.clear();
        if let Some(t) = conn.poll_transmit(now, 1, &mut buf) {
            sock.send_to(&buf[..t.size], t.destination).unwrap();
            sent += 1;
        }
        if i % 100 == 99 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    sent
}

fn client_config(fx: &Fixture) -> quinn::ClientConfig {
    let (c, k) = fx.host_pems("pve1");
    raw_client(tls::client_config(&fx.ca_pem(), &c, &k).unwrap()).1
}

/// Floods `hub` from 127.0.0.2 while host `pve1` (from 127.0.0.1) connects and streams 1,000
/// events; returns the RSS growth.
async fn flood_while_streaming(
    fx: &Fixture,
    hub: &hub::Hub,
    reg: &prometheus::Registry,
) -> (u64, usize) {
    let base = rss_bytes();
    let peak = Arc::new(Mutex::new(base));
    let addr = hub.local_addr();
    let flooder = {
        let cfg = client_config(fx);
        tokio::task::spawn_blocking(move || flood(&["127.0.0.2:0"], addr, cfg, |i| i < ATTEMPTS))
    };
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                let r = rss_bytes();
                {
                    let mut p = peak.lock().unwrap();
                    *p = (*p).max(r);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // The legitimate host starts once the flood is under way.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sc = fx.stream_config("pve1", addr, None);
    let (h, _) = start_host(sc);
    h.push_raw(0, kmsg_lost_raw(0, 1000));
    let received = || {
        metric(
            reg,
            "gpufeed_stream_events_received_total",
            &[("host", "pve1")],
        )
    };
    let ok = wait_for(Duration::from_secs(6), || received() == 1000.0).await;
    let sent = flooder.await.unwrap();
    assert!(ok, "host streamed only {} of 1000 events", received());
    // Half-open connections that got state live until a timeout: measure past it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    sampler.abort();
    let peak = *peak.lock().unwrap();
    h.shutdown().await;
    (peak.saturating_sub(base), sent)
}

fn serve_config(fx: &Fixture) -> hub::HubConfig {
    let mut c = hub_config(fx.path());
    // Production timeouts: the flood must not rely on the tests' short ones.
    c.idle_timeout = Duration::from_secs(15);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_handshake_flood_costs_no_memory_and_the_host_streams() {
    let _serial = SERIAL.lock().await;
    let logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let reg = prometheus::Registry::new();
    let hub = hub::serve(serve_config(&fx), &reg).await.unwrap();
    let (grown, sent) = flood_while_streaming(&fx, &hub, &reg).await;
    eprintln!("flood: {sent} Initials sent, RSS grew {} KiB", grown >> 10);
    assert_eq!(sent, ATTEMPTS);
    assert!(grown < RSS_BUDGET, "RSS grew {} MiB", grown >> 20);
    let lines = log_lines(&logs, &["hub: rejected", "unverified"]);
    assert!(lines.len() < 20, "{} rejection lines", lines.len());
    hub.shutdown().await;
}

/// Without address validation (a flooder that answers Retries gets this far), the caps hold:
/// one address gets `max_per_address` handshakes, the rest are refused, counted, and logged
/// a few lines in all; the admitted ones are dropped at the handshake timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_address_validation_the_caps_hold() {
    let _serial = SERIAL.lock().await;
    let logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let reg = prometheus::Registry::new();
    let mut c = serve_config(&fx);
    c.retry_above = usize::MAX;
    c.handshake_timeout = Duration::from_secs(1);
    let hub = hub::serve(c, &reg).await.unwrap();
    let t0 = Instant::now();
    let (grown, sent) = flood_while_streaming(&fx, &hub, &reg).await;
    let took = t0.elapsed();
    eprintln!(
        "flood without retry: {sent} Initials sent, RSS grew {} KiB",
        grown >> 10
    );
    assert!(grown < RSS_BUDGET, "RSS grew {} MiB", grown >> 20);
    let rej = |reason| {
        metric(
            &reg,
            "gpufeed_stream_frames_rejected_total",
            &[("host", "unverified"), ("reason", reason)],
        )
    };
    // Most of the flood was refused (some datagrams may be dropped by the socket buffer).
    assert!(rej("per_address") > 10_000.0, "{}", rej("per_address"));
    assert!(
        rej("handshake_timeout") >= 8.0,
        "{}",
        rej("handshake_timeout")
    );
    // One line per 10 s at most (the flood takes longer on a loaded machine), plus the first.
    let lines = log_lines(&logs, &["hub: rejected", "per_address"]);
    let allowed = 2 + took.as_secs() as usize / 10;
    assert!(lines.len() <= allowed, "{took:?}: {lines:?}");
    hub.shutdown().await;
}

/// Addresses of the flood below.
const FLOOD_ADDRESSES: u8 = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_host_reconnects_within_3s_through_a_flood_from_64_addresses() {
    let _serial = SERIAL.lock().await;
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let reg = prometheus::Registry::new();
    let mut c = serve_config(&fx);
    // As if every flooder answered the Retry: each Initial takes a handshake place for the
    // production handshake timeout (3 s) and never completes.
    c.retry_above = usize::MAX;
    let hub = hub::serve(c, &reg).await.unwrap();
    let addr = hub.local_addr();
    let received = || {
        metric(
            &reg,
            "gpufeed_stream_events_received_total",
            &[("host", "pve1")],
        )
    };
    // Production reconnect timing for the host (from 127.0.0.1).
    let sc = fx.production_stream_config("pve1", addr);
    let (h, _) = start_host(sc.clone());
    h.push_raw(0, kmsg_lost_raw(0, 100));
    assert!(wait_for(Duration::from_secs(10), || received() == 100.0).await);
    h.shutdown().await;

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooder = {
        let (cfg, stop) = (client_config(&fx), stop.clone());
        tokio::task::spawn_blocking(move || {
            let from: Vec<String> = (0..FLOOD_ADDRESSES)
                .map(|a| format!("127.0.2.{}:0", 10 + a))
                .collect();
            let from: Vec<&str> = from.iter().map(String::as_str).collect();
            flood(&from, addr, cfg, |_| {
                !stop.load(std::sync::atomic::Ordering::Relaxed)
            })
        })
    };
    let busy = || {
        metric(
            &reg,
            "gpufeed_stream_frames_rejected_total",
            &[("host", "unverified"), ("reason", "busy")],
        )
    };
    // The flood holds every handshake place (strangers are refused as busy) ...
    let full = wait_for(Duration::from_secs(10), || busy() > 100.0).await;
    // ... when the host restarts and has 100 new events.
    let t0 = Instant::now();
    let (h, _) = start_host(sc);
    h.push_raw(0, kmsg_lost_raw(100, 200));
    let replayed = wait_for(Duration::from_secs(20), || received() == 200.0).await;
    let took = t0.elapsed();
    let busy_during = busy();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = flooder.await.unwrap();
    h.shutdown().await;
    hub.shutdown().await;
    eprintln!(
        "flood from {FLOOD_ADDRESSES} addresses ({sent} Initials, {busy_during} refused as busy): \
         the restarted host connected and replayed in {took:?}"
    );
    assert!(
        full,
        "the flood never filled the handshake places ({} busy)",
        busy()
    );
    assert!(replayed, "only {} of 200 events after 20 s", received());
    assert!(took < Duration::from_secs(3), "took {took:?}");
}
