//! The real `gpufeed-guest` binary as the hub: `certs init`, then `run --quic-listen
//! --tls-dir --event-journal`; a host speaking the real protocol streams to it; its /metrics
//! shows the stream series; after SIGKILL and restart it resumes from the journal and drops
//! retransmissions; a client without a certificate is rejected and counted. An event of a kind
//! from a newer host is counted and listed in /events as `unknown`, and the stream goes on.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{certs_init, http_get, value, wait_for, Agent};
use gpufeed_shared::event::HostEvent;
use gpufeed_shared::proto::{encode, EventFrame, Message, Welcome};
use gpufeed_shared::stream::by_hand;
use gpufeed_shared::{certs, tls};

fn frame(seq: u64) -> Vec<u8> {
    let ev = HostEvent::KmsgLost { count: seq };
    raw_frame(seq, ev.kind(), postcard::to_allocvec(&ev).unwrap())
}

/// An event frame of any kind and payload, stamped now.
fn raw_frame(seq: u64, kind: u16, payload: Vec<u8>) -> Vec<u8> {
    let mut b = Vec::new();
    encode(
        &Message::Event(EventFrame {
            seq,
            host_realtime_ns: gpufeed_shared::clock::realtime_ns(),
            host_monotonic_ns: seq,
            kind,
            payload,
        }),
        &mut b,
    )
    .unwrap();
    b
}

fn free_udp() -> SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

/// Connects as pve1 (boot 5), returns the connection and the Welcome.
/// The control stream halves are returned: dropping the receive half would stop the hub's
/// acks and probes, which ends the connection.
async fn connect(
    dir: &std::path::Path,
    addr: SocketAddr,
) -> (
    quinn::Connection,
    (quinn::SendStream, quinn::RecvStream),
    Welcome,
) {
    // The host's bundle, as `certs init` wrote it.
    let rd = |f: &str| std::fs::read(dir.join("hosts/pve1").join(f)).unwrap();
    let cfg = tls::client_config(
        &rd(certs::BUNDLE_CA),
        &rd(certs::BUNDLE_CERT),
        &rd(certs::BUNDLE_KEY),
    )
    .unwrap();
    let (conn, s, r, w) = by_hand::hello(cfg, addr, "pve1", 5).await.unwrap();
    (conn, (s, r), w)
}

fn metric(agent: &Agent, name: &str, labels: &[(&str, &str)]) -> f64 {
    value(&agent.scrape(), name, labels).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_binary_hub() {
    let work = tempfile::tempdir().unwrap();
    let quic = free_udp();
    let out = work.path().join("deploy");
    let init = |extra: &[&str]| certs_init(&out, &quic.to_string(), "pve1", extra);
    let o = init(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("hosts/pve1/host.toml"));
    let o = init(&[]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--force"));
    let o = init(&["--force"]);
    assert!(o.status.success());

    let journal = work.path().join("events.jsonl");
    let args = [
        "--probes".to_string(),
        "none".into(),
        "--no-kube".into(),
        "--quic-listen".into(),
        quic.to_string(),
        "--tls-dir".into(),
        out.join("guest").display().to_string(),
        "--event-journal".into(),
        journal.display().to_string(),
    ];
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = Agent::start(&argv, &[]);
    let pve1 = [("host", "pve1")];

    let (conn, _ctl, w) = connect(&out, quic).await;
    assert_eq!(w.resume_from, None);
    let mut ev = conn.open_uni().await.unwrap();
    let mut wire: Vec<u8> = (0..100).flat_map(frame).collect();
    wire.extend([2, 0, 0, 0, 0xff, 0xff]); // a garbage frame, skipped
    ev.write_all(&wire).await.unwrap();
    let got = wait_for(Duration::from_secs(10), || {
        (metric(&agent, "gpufeed_stream_events_received_total", &pve1) == 100.0).then_some(())
    });
    assert!(got.is_some(), "{}", agent.log.lock().unwrap());
    assert_eq!(metric(&agent, "gpufeed_stream_connected", &pve1), 1.0);
    assert_eq!(
        metric(
            &agent,
            "gpufeed_stream_frames_rejected_total",
            &[("host", "pve1"), ("reason", "garbage")]
        ),
        1.0
    );
    let offset = wait_for(Duration::from_secs(5), || {
        value(&agent.scrape(), "gpufeed_clock_offset_seconds", &pve1)
    })
    .expect("clock offset exported");
    assert!(offset.abs() < 0.01, "same machine, offset {offset}");
    // The doctor's host_stream check passes with the host connected (evaluated every 5 s),
    // and the agent is ready.
    let ok = wait_for(Duration::from_secs(12), || {
        (value(
            &agent.scrape(),
            "gpufeed_check_ok",
            &[("check", "host_stream")],
        ) == Some(1.0))
        .then_some(())
    });
    assert!(ok.is_some(), "{:?}", agent.try_get("/doctor"));
    assert_eq!(agent.try_get("/readyz").as_deref(), Some("ready\n"));

    // SIGKILL and restart: the journal says what it has; retransmissions are dropped.
    let _ = agent.child.kill();
    let _ = agent.child.wait();
    drop(conn);
    let agent = Agent::start(&argv, &[]);
    let (conn, _ctl, w) = connect(&out, quic).await;
    assert_eq!(w.resume_from, Some(100));
    let mut ev = conn.open_uni().await.unwrap();
    let wire: Vec<u8> = (50..150).flat_map(frame).collect();
    ev.write_all(&wire).await.unwrap();
    let got = wait_for(Duration::from_secs(10), || {
        (metric(&agent, "gpufeed_stream_events_received_total", &pve1) == 50.0).then_some(())
    });
    assert!(got.is_some(), "{}", agent.log.lock().unwrap());
    assert_eq!(
        metric(&agent, "gpufeed_stream_events_duplicate_total", &pve1),
        50.0
    );
    let lines = std::fs::read_to_string(&journal).unwrap();
    let seqs: Vec<u64> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, (0..150).collect::<Vec<_>>());

    // No client certificate: rejected, logged, counted.
    let rd = |f: &str| std::fs::read(out.join("guest").join(f)).unwrap();
    let cfg = tls::client_config_with(&rd(tls::CA_FILE), None, vec![tls::ALPN.to_vec()]).unwrap();
    let (ep, cc) = by_hand::client_endpoint(cfg).unwrap();
    if let Ok(c) = ep.connect_with(cc, quic, "127.0.0.1").unwrap().await {
        let _ = tokio::time::timeout(Duration::from_secs(2), c.closed()).await;
    }
    let counted = wait_for(Duration::from_secs(5), || {
        (metric(
            &agent,
            "gpufeed_stream_frames_rejected_total",
            &[("host", "unverified"), ("reason", "no_cert")],
        ) == 1.0)
            .then_some(())
    });
    assert!(counted.is_some());
    assert!(agent.log.lock().unwrap().contains("hub: rejected"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_from_a_newer_host_is_counted_and_listed_as_unknown() {
    let work = tempfile::tempdir().unwrap();
    let quic = free_udp();
    let out = work.path().join("deploy");
    let o = certs_init(&out, &quic.to_string(), "pve1", &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tls_dir = out.join("guest").display().to_string();
    let agent = Agent::start(
        &[
            "--probes",
            "none",
            "--no-kube",
            "--quic-listen",
            &quic.to_string(),
            "--tls-dir",
            &tls_dir,
        ],
        &[],
    );
    let pve1 = [("host", "pve1")];
    let (conn, _ctl, _) = connect(&out, quic).await;
    let mut ev = conn.open_uni().await.unwrap();
    // A known event, one of kind 999 (no such kind yet) with 5 bytes this guest cannot
    // decode, and a known one after it: through the hub's real decoder.
    let mut wire = frame(0);
    wire.extend(raw_frame(1, 999, vec![0x2a, 1, 2, 3, 4]));
    wire.extend(frame(2));
    ev.write_all(&wire).await.unwrap();
    let got = wait_for(Duration::from_secs(10), || {
        (metric(
            &agent,
            "gpufeed_host_events_total",
            &[("host", "pve1"), ("event", "unknown")],
        ) == 1.0)
            .then_some(())
    });
    assert!(got.is_some(), "{}", agent.log.lock().unwrap());
    assert_eq!(
        metric(&agent, "gpufeed_stream_events_received_total", &pve1),
        2.0,
        "the known events around it arrive"
    );
    assert_eq!(
        metric(
            &agent,
            "gpufeed_stream_frames_rejected_total",
            &[("host", "pve1"), ("reason", "unknown_kind")]
        ),
        1.0
    );
    // /events lists it with what its frame said.
    let events: serde_json::Value =
        serde_json::from_str(&http_get(agent.addr, "/events").unwrap()).unwrap();
    let unknown: Vec<&serde_json::Value> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"] == "unknown")
        .collect();
    assert_eq!(unknown.len(), 1, "{events:#}");
    let e = unknown[0];
    assert_eq!(e["host"], "pve1");
    assert_eq!(e["host_kind"], "unknown");
    assert_eq!(e["title"], "unknown on pve1");
    let text = e["text"].as_str().unwrap();
    assert!(
        text.starts_with("host event of kind 999, unknown to this guest (seq 1, 5 bytes"),
        "{text}"
    );
    let now_ms = gpufeed_shared::clock::realtime_ns() / 1_000_000;
    let t = e["time"].as_i64().unwrap();
    assert!(
        (now_ms - 60_000..=now_ms).contains(&t),
        "time {t}, now {now_ms}"
    );
    // The stream goes on, and the agent is alive.
    ev.write_all(&frame(3)).await.unwrap();
    let more = wait_for(Duration::from_secs(10), || {
        (metric(&agent, "gpufeed_stream_events_received_total", &pve1) == 3.0).then_some(())
    });
    assert!(more.is_some(), "{}", agent.log.lock().unwrap());
    assert!(agent.log.lock().unwrap().contains("listed as unknown"));
}
