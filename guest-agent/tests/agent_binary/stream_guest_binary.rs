//! The real `gpufeed-guest` binary as the hub: `certs init`, then `run --quic-listen
//! --tls-dir --event-journal`; a host speaking the real protocol streams to it; its /metrics
//! shows the stream series; after SIGKILL and restart it resumes from the journal and drops
//! retransmissions; a client without a certificate is rejected and counted. An event of a kind
//! from a newer host is counted and listed in /events as `unknown`, and the stream goes on.

use crate::common;

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

/// A deployment made by `certs init` in `work`, and the guest agent as a hub only (no probes, no
/// Kubernetes API) with its TLS files: the agent, the deployment's folder and the hub's address.
fn hub_agent(work: &std::path::Path) -> (Agent, std::path::PathBuf, SocketAddr) {
    let quic = free_udp();
    let out = work.join("deploy");
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
    (agent, out, quic)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_from_a_newer_host_is_counted_and_listed_as_unknown() {
    let work = tempfile::tempdir().unwrap();
    let (agent, out, quic) = hub_agent(work.path());
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

/// A link change of one of ten links, flapping as idle GPUs' links do (speed), now and then
/// narrowed (width), stamped at `at_ns` host time.
fn flap_frame(seq: u64, at_ns: i64) -> Vec<u8> {
    use gpufeed_shared::event::{samples::gpu_link_change, LinkChangeClass};
    let link = seq % 10;
    let bdf = format!("0000:{:02x}:00.0", 0x0a + link);
    let round = seq / 10;
    let state = |r: u64| match r % 4 {
        0 => (Some(16000), 4),
        1 => (Some(2500), 4),
        2 => (Some(16000), 4),
        _ => (Some(8000), 1),
    };
    let (old, new) = (state(round + 3), state(round));
    let class = match new.1.cmp(&old.1) {
        std::cmp::Ordering::Less => LinkChangeClass::WidthReduction,
        std::cmp::Ordering::Greater => LinkChangeClass::WidthIncrease,
        std::cmp::Ordering::Equal => LinkChangeClass::SpeedOnly,
    };
    let ev = HostEvent::PcieLinkChange(gpu_link_change(&bdf, "0000:09:01.0", old, new, class));
    let mut b = Vec::new();
    encode(
        &Message::Event(EventFrame {
            seq,
            host_realtime_ns: at_ns,
            host_monotonic_ns: seq,
            kind: ev.kind(),
            payload: postcard::to_allocvec(&ev).unwrap(),
        }),
        &mut b,
    )
    .unwrap();
    b
}

/// A GET from source address `from` (on loopback): the status and the body's length.
async fn get_from(from: std::net::IpAddr, to: SocketAddr, path: &str) -> Option<(u16, usize)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sock = tokio::net::TcpSocket::new_v4().ok()?;
    sock.bind(SocketAddr::new(from, 0)).ok()?;
    let mut s = sock.connect(to).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {to}\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, buf.len() - head_end - 4))
}

/// The agent's peak resident memory (`VmHWM`), bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap()
}

/// Ten links flapping for ten minutes (30,000 changes, five a second per link: an idle GPU's
/// rate in the field), sent in one burst as a host's spool replays after a guest restart: the
/// join takes every event the hub accepted (none dropped), and every answer of the agent stays
/// bounded: `/api/state` carries a bounded number of pictures of bounded size, an older
/// event's picture comes alone from `/api/picture`, and 64 clients asking at once from 8
/// addresses leave the agent far under the DaemonSet's memory limit while its scrape and
/// probe answer within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_link_in_a_burst_is_joined_in_full_and_every_answer_stays_bounded() {
    const N: u64 = 30_000;
    let work = tempfile::tempdir().unwrap();
    let (agent, out, quic) = hub_agent(work.path());
    let pve1 = [("host", "pve1")];
    let (conn, _ctl, _) = connect(&out, quic).await;
    let mut ev = conn.open_uni().await.unwrap();
    let now = gpufeed_shared::clock::realtime_ns();
    let span_ns: i64 = 600_000_000_000;
    let wire: Vec<u8> = (0..N)
        .flat_map(|seq| flap_frame(seq, now - span_ns + seq as i64 * (span_ns / N as i64)))
        .collect();
    ev.write_all(&wire).await.unwrap();
    // every event reaches the join: the correlator counts each one it classified
    let joined = || {
        let s = agent.scrape();
        (
            value(&s, "gpufeed_stream_events_received_total", &pve1).unwrap_or(0.0),
            value(&s, "gpufeed_host_events_total", &pve1).unwrap_or(0.0),
            value(&s, "gpufeed_join_events_dropped_total", &[]).unwrap_or(0.0),
        )
    };
    let all = wait_for(Duration::from_secs(120), || {
        let (received, classified, _) = joined();
        (received == N as f64 && classified == N as f64).then_some(())
    });
    let (received, classified, dropped) = joined();
    assert!(
        all.is_some(),
        "received {received}, joined {classified} of {N}: {}",
        agent.log.lock().unwrap()
    );
    assert_eq!(dropped, 0.0);
    assert!(
        !agent.log.lock().unwrap().contains("fell behind"),
        "no event is skipped on the way to the join"
    );

    // /api/state: the newest events' pictures, each bounded; the links flapped five times a
    // second, so a two-minute picture has coalesced steps
    let state: serde_json::Value =
        serde_json::from_str(&http_get(agent.addr, "/api/state").unwrap()).unwrap();
    let size = serde_json::to_vec(&state).unwrap().len();
    assert!(size < 2 << 20, "/api/state is {size} bytes");
    let pictures = state["timelines"].as_array().unwrap();
    assert!(
        !pictures.is_empty() && pictures.len() <= 12,
        "{}",
        pictures.len()
    );
    assert!(
        state["pictures_not_shown"].as_u64().unwrap() > 0,
        "more events are listed than pictured"
    );
    let mut coalesced = 0;
    for p in pictures {
        let links = p["links"].as_array().unwrap();
        assert!(links.len() <= 8, "{}", links.len());
        for l in links {
            assert!(l["steps"].as_array().unwrap().len() <= 241);
            coalesced += l["coalesced"].as_u64().unwrap();
        }
    }
    assert!(coalesced > 0, "the flapping links' steps were coalesced");
    // an older event's picture, alone
    let events: serde_json::Value =
        serde_json::from_str(&http_get(agent.addr, "/events").unwrap()).unwrap();
    let oldest = events.as_array().unwrap().last().unwrap();
    let path = format!(
        "/api/picture?host={}&event={}&time={}",
        oldest["host"].as_str().unwrap(),
        oldest["event"].as_str().unwrap(),
        oldest["time"].as_i64().unwrap()
    );
    let picture = http_get(agent.addr, &path).expect("the oldest event's picture");
    assert!(
        picture.len() < 256 << 10,
        "a picture is {} bytes",
        picture.len()
    );
    let picture: serde_json::Value = serde_json::from_str(&picture).unwrap();
    assert_eq!(picture["time"], oldest["time"]);
    assert_eq!(
        common::http_get_status(agent.addr, "/api/picture?host=pve1&event=link_down&time=1")
            .map(|(c, _)| c),
        Some(404)
    );

    // 64 clients at once from 8 addresses, four rounds, while a scraper and a probe time their
    // answers
    let before = peak_rss(agent.child.id());
    let addr = agent.addr;
    let watch = tokio::spawn(async move {
        let mut slowest = Duration::ZERO;
        let until = std::time::Instant::now() + Duration::from_secs(4);
        while std::time::Instant::now() < until {
            for path in ["/metrics", "/healthz"] {
                let t = std::time::Instant::now();
                let got = get_from("127.0.0.1".parse().unwrap(), addr, path).await;
                assert_eq!(got.map(|g| g.0), Some(200), "{path}");
                slowest = slowest.max(t.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        slowest
    });
    for _ in 0..4 {
        let clients: Vec<_> = (0..64u8)
            .map(|i| {
                let from = std::net::IpAddr::from([127, 0, 0, 1 + i % 8]);
                tokio::spawn(async move { get_from(from, addr, "/api/state").await })
            })
            .collect();
        for c in clients {
            let got = c.await.unwrap();
            assert!(matches!(got, Some((200, n)) if n < 2 << 20), "{got:?}");
        }
    }
    let slowest = watch.await.unwrap();
    let peak = peak_rss(agent.child.id());
    eprintln!(
        "/api/state {size} bytes, {} pictures; peak RSS {:.1} MB before the clients, {:.1} MB after; slowest scrape or probe {slowest:?}",
        pictures.len(),
        before as f64 / 1e6,
        peak as f64 / 1e6
    );
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    // the DaemonSet's limit is 256 MiB: half of it is the margin
    assert!(peak < 128 << 20, "peak RSS {peak}");
    drop(conn);
}
