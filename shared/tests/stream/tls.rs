//! TLS admission of the hub: only certificates from the deployment CA that name an allowed host
//! and speak ALPN `gpufeed/1` get in; each rejection logs one line and bumps
//! `gpufeed_stream_frames_rejected_total{host="unverified",reason}`. Reload on file change.

use std::time::Duration;

use gpufeed_shared::proto::{encode, FrameDecoder, Message, ALPN};
use gpufeed_shared::tls::{self, Ca};
use gpufeed_testkit::stream::*;

const REJ: &str = "gpufeed_stream_frames_rejected_total";

/// A connection that got its Welcome, with its stream kept open: dropping the stream would end
/// the session at once, and the hub's `connected` gauge with it.
struct Admitted {
    _ep: quinn::Endpoint,
    _conn: quinn::Connection,
    _streams: (quinn::SendStream, quinn::RecvStream),
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Admitted")
    }
}

async fn try_connect(
    hub_addr: std::net::SocketAddr,
    cfg: rustls::ClientConfig,
) -> Result<Admitted, String> {
    let (ep, cc) = raw_client(cfg);
    let conn = ep
        .connect_with(cc, hub_addr, "127.0.0.1")
        .unwrap()
        .await
        .map_err(|e| e.to_string())?;
    // A server that rejects the client certificate does so after the client finished its
    // handshake (TLS 1.3): the failure then shows on the first stream operation.
    let (mut s, mut r) = conn.open_bi().await.map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    encode(
        &gpufeed_shared::proto::ClientSession::new("pve1", 1).hello(),
        &mut buf,
    )
    .unwrap();
    s.write_all(&buf).await.map_err(|e| e.to_string())?;
    let mut d = FrameDecoder::default();
    loop {
        if let Some(m) = d.next_frame().unwrap() {
            return match m {
                Message::Welcome(_) => Ok(Admitted {
                    _ep: ep,
                    _conn: conn,
                    _streams: (s, r),
                }),
                m => Err(format!("{m:?}")),
            };
        }
        match r
            .read_chunk(1 << 16, true)
            .await
            .map_err(|e| e.to_string())?
        {
            Some(c) => d.push(&c.bytes),
            None => return Err("closed".into()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_are_logged_and_counted() {
    let logs = capture_logs();
    let fx = Fixture::new(&["pve1", "pve2"]);
    // pve2 has a valid certificate from the CA but is not listed.
    std::fs::write(fx.path().join(tls::ALLOWED_HOSTS_FILE), "pve1\n").unwrap();
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hub_config(fx.path()), &reg).await.unwrap();
    let addr = hub.local_addr();
    let ca = fx.ca_pem();
    let (c1, k1) = fx.host_pems("pve1");
    let alpn = || vec![ALPN.to_vec()];

    // The good one.
    let good = try_connect(addr, tls::client_config(&ca, &c1, &k1).unwrap()).await;
    assert!(good.is_ok(), "{good:?}");
    assert!(
        wait_for(Duration::from_secs(2), || metric(
            &reg,
            "gpufeed_stream_connected",
            &[("host", "pve1")]
        ) == 1.0)
        .await
    );

    let other = Ca::new("other").unwrap().issue_host("pve1").unwrap();
    let y: i32 = 1970 + (gpufeed_shared::clock::realtime_ns() / 1_000_000_000 / 31_556_952) as i32;
    let expired = fx
        .dep
        .ca
        .issue(&["pve1".into()], true, Some(((y - 3, 1, 1), (y - 2, 1, 1))))
        .unwrap();
    let (c2, k2) = fx.host_pems("pve2");
    let cases: Vec<(&str, rustls::ClientConfig)> = vec![
        (
            "unknown_ca",
            tls::client_config_with(
                &ca,
                Some((other.cert_pem.as_bytes(), other.key_pem.as_bytes())),
                alpn(),
            )
            .unwrap(),
        ),
        (
            "no_cert",
            tls::client_config_with(&ca, None, alpn()).unwrap(),
        ),
        (
            "expired",
            tls::client_config_with(
                &ca,
                Some((expired.cert_pem.as_bytes(), expired.key_pem.as_bytes())),
                alpn(),
            )
            .unwrap(),
        ),
        (
            "unlisted_host",
            tls::client_config_with(&ca, Some((&c2, &k2)), alpn()).unwrap(),
        ),
        (
            "alpn",
            tls::client_config_with(&ca, Some((&c1, &k1)), vec![b"gpufeed/2".to_vec()]).unwrap(),
        ),
    ];
    for (reason, cfg) in cases {
        let r = try_connect(addr, cfg).await;
        assert!(r.is_err(), "{reason}: connected");
        let counted = wait_for(Duration::from_secs(2), || {
            metric(&reg, REJ, &[("host", "unverified"), ("reason", reason)]) == 1.0
        })
        .await;
        assert!(counted, "{reason}: counter not 1");
        // the counter and the log line are written one after the other: wait for the line too
        let reason_kv = format!("reason=\"{reason}\"");
        wait_for(Duration::from_secs(2), || {
            log_lines(&logs, &["hub: rejected", &reason_kv]).len() == 1
        })
        .await;
        let lines = log_lines(&logs, &["hub: rejected", &reason_kv]);
        assert_eq!(lines.len(), 1, "{reason}: {lines:?}");
    }
    // Exactly those five, nothing else.
    let total: f64 = [
        "unknown_ca",
        "no_cert",
        "expired",
        "unlisted_host",
        "alpn",
        "tls",
        "bad_cert",
    ]
    .iter()
    .map(|r| metric(&reg, REJ, &[("host", "unverified"), ("reason", r)]))
    .sum();
    assert_eq!(total, 5.0);
    // No ALPN at all is refused after the handshake.
    let r = try_connect(
        addr,
        tls::client_config_with(&ca, Some((&c1, &k1)), vec![]).unwrap(),
    )
    .await;
    assert!(r.is_err());
    assert!(
        wait_for(Duration::from_secs(2), || metric(
            &reg,
            REJ,
            &[("host", "unverified"), ("reason", "alpn")]
        ) == 2.0)
        .await
    );

    // Reload: list pve2, and it gets in without restarting the hub.
    std::fs::write(fx.path().join(tls::ALLOWED_HOSTS_FILE), "pve1\npve2\n").unwrap();
    let mut ok = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut cfg = tls::client_config(&ca, &c2, &k2).unwrap();
        cfg.alpn_protocols = alpn();
        // pve2's Hello must claim pve2.
        let (ep, cc) = raw_client(cfg);
        let conn = match ep.connect_with(cc, addr, "127.0.0.1").unwrap().await {
            Ok(c) => c,
            Err(_) => continue,
        };
        let Ok((mut s, mut r)) = conn.open_bi().await else {
            continue;
        };
        let mut buf = Vec::new();
        encode(
            &gpufeed_shared::proto::ClientSession::new("pve2", 1).hello(),
            &mut buf,
        )
        .unwrap();
        if s.write_all(&buf).await.is_err() {
            continue;
        }
        let mut d = FrameDecoder::default();
        if let Ok(Some(c)) = r.read_chunk(1 << 16, true).await {
            d.push(&c.bytes);
            if let Ok(Some(Message::Welcome(_))) = d.next_frame() {
                ok = true;
                break;
            }
        }
    }
    assert!(ok, "pve2 not admitted after reload");
    assert_eq!(log_lines(&logs, &["TLS files changed: reloaded"]).len(), 1);
    drop(good);
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_with_foreign_identity_is_refused() {
    let logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hub_config(fx.path()), &reg).await.unwrap();
    let (c1, k1) = fx.host_pems("pve1");
    let (ep, cc) = raw_client(tls::client_config(&fx.ca_pem(), &c1, &k1).unwrap());
    let conn = ep
        .connect_with(cc, hub.local_addr(), "127.0.0.1")
        .unwrap()
        .await
        .unwrap();
    let (mut s, mut r) = conn.open_bi().await.unwrap();
    let mut buf = Vec::new();
    encode(
        &gpufeed_shared::proto::ClientSession::new("impostor", 1).hello(),
        &mut buf,
    )
    .unwrap();
    s.write_all(&buf).await.unwrap();
    let mut d = FrameDecoder::default();
    let mut got = None;
    while got.is_none() {
        match r.read_chunk(1 << 16, true).await {
            Ok(Some(c)) => {
                d.push(&c.bytes);
                got = d.next_frame().unwrap();
            }
            _ => break,
        }
    }
    assert!(
        matches!(got, Some(Message::Reject(ref rj)) if rj.reason.contains("impostor")),
        "{got:?}"
    );
    assert!(
        wait_for(Duration::from_secs(2), || metric(
            &reg,
            REJ,
            &[("host", "pve1"), ("reason", "hello_refused")]
        ) == 1.0)
        .await
    );
    assert_eq!(
        log_lines(&logs, &["hub: rejected", "hello_refused", "impostor"]).len(),
        1
    );
    hub.shutdown().await;
}

/// A host removed from `allowed-hosts` loses its live connection at the reload (the
/// certificate check only runs at the handshake), and cannot connect again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_host_from_allowed_hosts_drops_its_connection() {
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1", "pve2"]);
    let reg = prometheus::Registry::new();
    let hub = hub::serve(hub_config(fx.path()), &reg).await.unwrap();
    let (h, hreg) = start_host(fx.stream_config("pve1", hub.local_addr(), None));
    let connected = || metric(&reg, "gpufeed_stream_connected", &[("host", "pve1")]);
    assert!(wait_for(Duration::from_secs(2), || connected() == 1.0).await);
    std::fs::write(fx.path().join(tls::ALLOWED_HOSTS_FILE), "pve2\n").unwrap();
    assert!(
        wait_for(Duration::from_secs(2), || connected() == 0.0).await,
        "pve1 still connected after its removal"
    );
    // Its reconnects are refused: it stays out.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(connected(), 0.0);
    let host_side = metric(
        &hreg,
        "gpufeed_host_stream_connected",
        &[("guest", "guest")],
    );
    assert_eq!(host_side, 0.0);
    h.shutdown().await;
    hub.shutdown().await;
}
