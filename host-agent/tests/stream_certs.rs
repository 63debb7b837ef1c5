//! `gpufeed-guest certs init` output is usable as is: the guest directory serves the hub, and
//! each `host-NAME.toml` parses as a host configuration whose `[stream]` section streams to the
//! guest with the generated certificates.

mod stream_support;

#[path = "../../guest-agent/src/certs.rs"]
#[allow(dead_code)]
mod certs;

use std::time::Duration;

use gpufeed_host::config::Config;
use gpufeed_host::events::EventBus;
use gpufeed_shared::event::HostEvent;
use stream_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certs_init_then_stream_with_the_generated_files() {
    let _logs = capture_logs();
    let out = tempfile::tempdir().unwrap();
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let args = certs::CertsInitArgs {
        out: out.path().join("deploy"),
        guest_addr: addr.to_string(),
        hosts: vec!["pve2".into(), "pve1".into()],
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
        force: false,
    };
    let files = certs::init(&args).unwrap();
    let dir = out.path().join("deploy").canonicalize().unwrap();
    for f in [
        "ca.pem",
        "ca-key.pem",
        "guest/ca.pem",
        "guest/guest.pem",
        "guest/guest-key.pem",
        "guest/allowed-hosts",
        "gpufeed-guest-tls.yaml",
        "host-pve1.pem",
        "host-pve1.key",
        "host-pve1.toml",
        "host-pve2.toml",
    ] {
        assert!(files.contains(&dir.join(f)), "{f} not reported");
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    use std::os::unix::fs::PermissionsExt;
    for secret in [
        "ca-key.pem",
        "guest/guest-key.pem",
        "host-pve1.key",
        "gpufeed-guest-tls.yaml",
    ] {
        let mode = std::fs::metadata(dir.join(secret))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{secret}");
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("guest/allowed-hosts")).unwrap(),
        "pve1\npve2\n"
    );
    let yaml = std::fs::read_to_string(dir.join("gpufeed-guest-tls.yaml")).unwrap();
    for key in [
        "  ca.pem: |",
        "  guest.pem: |",
        "  guest-key.pem: |",
        "  allowed-hosts: |",
        "kind: Secret",
        "namespace: gpufeed",
    ] {
        assert!(yaml.contains(key), "{key} missing in Secret");
    }
    // A second init refuses to overwrite the CA.
    assert!(certs::init(&args).is_err());

    // The host configuration parses with the agent's own loader.
    let path = dir.join("host-pve1.toml");
    let cfg = Config::load(&path).unwrap();
    assert_eq!(cfg.host_id(), "pve1");
    let mut sc = cfg.stream.clone().expect("[stream] section");
    assert_eq!(sc.guests.len(), 1);
    assert_eq!(sc.guests[0].endpoint, addr.to_string());
    assert_eq!(sc.cert, dir.join("host-pve1.pem"));
    // Keep the test's spool out of /var/lib.
    let spool = tempfile::tempdir().unwrap();
    sc.spool_dir = spool.path().to_owned();

    // The guest side with the generated directory, on the address the certificate names.
    let reg = prometheus::Registry::new();
    let mut hc = hub_config(&dir.join("guest"));
    hc.listen = addr;
    let hub = hub::serve(hc, &reg).await.unwrap();
    let bus = EventBus::new(1024);
    let h = gpufeed_host::stream::spawn(
        sc,
        cfg.host_id(),
        bus.subscribe(),
        &prometheus::Registry::new(),
    )
    .unwrap();
    for i in 0..10 {
        bus.emit(HostEvent::KmsgLost { count: i });
    }
    assert!(
        wait_for(Duration::from_secs(10), || {
            metric(
                &reg,
                "gpufeed_stream_events_received_total",
                &[("host", "pve1")],
            ) == 10.0
        })
        .await
    );
    let seqs: Vec<u64> = hub.recent().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (0..10).collect::<Vec<_>>());
    h.shutdown().await;
    hub.shutdown().await;

    assert!(certs::split_guest_addr("nohost").is_err());
    assert!(certs::split_guest_addr(":80").is_err());
    assert_eq!(
        certs::split_guest_addr("[::1]:7845").unwrap(),
        ("::1".to_string(), 7845)
    );
}

/// Host names `a` and `a-key`: each keeps its own certificate and key, and each host's
/// configuration passes the agent's start check (its certificate names it, its key parses).
#[test]
fn hosts_a_and_a_key_do_not_overwrite_each_other() {
    let out = tempfile::tempdir().unwrap();
    let args = certs::CertsInitArgs {
        out: out.path().to_owned(),
        guest_addr: "127.0.0.1:7845".into(),
        hosts: vec!["a".into(), "a-key".into()],
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
        force: false,
    };
    certs::init(&args).unwrap();
    let dir = out.path().canonicalize().unwrap();
    for h in ["a", "a-key"] {
        let cfg = Config::load(&dir.join(format!("host-{h}.toml"))).unwrap();
        let sc = cfg.stream.clone().unwrap();
        sc.check(&cfg.host_id())
            .unwrap_or_else(|e| panic!("host {h}: {e}"));
    }
}
