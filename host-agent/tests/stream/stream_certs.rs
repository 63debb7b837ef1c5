//! `certs init` output is usable as is: the guest directory serves the hub, the CA key stays
//! apart from everything that is copied, and each host's bundle, installed as its
//! /etc/gpufeed, configures a stream to the guest with the generated certificates.

use gpufeed_shared::certs;

use std::time::Duration;

use gpufeed_host::config::Config;
use gpufeed_host::events::EventBus;
use gpufeed_shared::event::HostEvent;
use gpufeed_testkit::stream::*;

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
        guest_addr: vec![addr.to_string()],
        hosts: vec!["pve2".into(), "pve1".into()],
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
        force: false,
    };
    let files = certs::init(&args).unwrap();
    let dir = out.path().join("deploy");
    use std::os::unix::fs::PermissionsExt;
    let mode = |f: &str| std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
    for (f, want) in [
        ("ca/ca.pem", 0o644),
        ("ca/ca-key.pem", 0o600),
        ("guest/ca.pem", 0o644),
        ("guest/guest.pem", 0o644),
        ("guest/guest-key.pem", 0o600),
        ("guest/allowed-hosts", 0o644),
        ("gpufeed-guest-tls.yaml", 0o600),
        ("hosts/pve1/host.toml", 0o644),
        ("hosts/pve1/tls/ca.pem", 0o644),
        ("hosts/pve1/tls/host.pem", 0o644),
        ("hosts/pve1/tls/host-key.pem", 0o600),
        ("hosts/pve2/host.toml", 0o644),
        ("hosts/pve2/tls/host-key.pem", 0o600),
    ] {
        assert!(files.contains(&dir.join(f)), "{f} not reported");
        assert!(dir.join(f).is_file(), "{f} missing");
        assert_eq!(mode(f), want, "{f}");
    }
    assert_eq!(mode("ca"), 0o700);
    // The CA key is in no file that is copied to a host or into the cluster.
    let ca_key = std::fs::read_to_string(dir.join("ca/ca-key.pem")).unwrap();
    let body = ca_key.lines().nth(1).unwrap();
    for f in files.iter().filter(|f| !f.starts_with(dir.join("ca"))) {
        let text = std::fs::read_to_string(f).unwrap();
        assert!(!text.contains(body), "{} holds the CA key", f.display());
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

    // The bundle names its files where it is installed; read from a copy at that layout.
    let text = std::fs::read_to_string(dir.join("hosts/pve1/host.toml")).unwrap();
    let etc = tempfile::tempdir().unwrap();
    let path = etc.path().join("host.toml");
    std::fs::write(
        &path,
        text.replace("/etc/gpufeed", etc.path().to_str().unwrap()),
    )
    .unwrap();
    for f in [certs::BUNDLE_CA, certs::BUNDLE_CERT, certs::BUNDLE_KEY] {
        std::fs::create_dir_all(etc.path().join(f).parent().unwrap()).unwrap();
        std::fs::copy(dir.join("hosts/pve1").join(f), etc.path().join(f)).unwrap();
    }
    let cfg = Config::load(&path).unwrap();
    assert!(cfg.ignored_keys.is_empty(), "{:?}", cfg.ignored_keys);
    assert_eq!(cfg.host_id(), "pve1");
    let mut sc = cfg.stream.clone().expect("[stream] section");
    assert_eq!(sc.guests.len(), 1);
    assert_eq!(sc.guests[0].endpoint, addr.to_string());
    assert_eq!(sc.cert, etc.path().join("tls/host.pem"));
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
        None,
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
}

/// Host names `a` and `a-key`: each has a bundle of its own, whose certificate names it, whose
/// key is its own, and whose configuration says it.
#[test]
fn hosts_a_and_a_key_do_not_overwrite_each_other() {
    let out = tempfile::tempdir().unwrap();
    let args = certs::CertsInitArgs {
        out: out.path().to_owned(),
        guest_addr: vec!["127.0.0.1:7845".into()],
        hosts: vec!["a".into(), "a-key".into()],
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
        force: false,
    };
    certs::init(&args).unwrap();
    let dir = out.path();
    for h in ["a", "a-key"] {
        let b = dir.join("hosts").join(h);
        let pem = std::fs::read(b.join(certs::BUNDLE_CERT)).unwrap();
        let cert = &gpufeed_shared::tls::parse_certs(&pem, h).unwrap()[0];
        let allowed = vec![h.to_string()];
        assert_eq!(gpufeed_shared::tls::identity_of(cert, &allowed), Some(h));
        gpufeed_shared::tls::client_config(
            &std::fs::read(b.join(certs::BUNDLE_CA)).unwrap(),
            &pem,
            &std::fs::read(b.join(certs::BUNDLE_KEY)).unwrap(),
        )
        .unwrap_or_else(|e| panic!("host {h}: {e}"));
        let text = std::fs::read_to_string(b.join(certs::BUNDLE_CONFIG)).unwrap();
        assert!(text.contains(&format!("host_id = \"{h}\"")), "{text}");
    }
    let key = |h: &str| std::fs::read(dir.join("hosts").join(h).join(certs::BUNDLE_KEY)).unwrap();
    assert_ne!(key("a"), key("a-key"));
}

/// A site with two GPU VMs: one `certs init` with both nodes' addresses. The one guest
/// directory serves both hubs (its certificate names both addresses), and the host's bundle
/// lists both guests: each gets the host's events over the generated certificates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_site_ca_serves_every_guest_the_host_lists() {
    let _logs = capture_logs();
    let out = tempfile::tempdir().unwrap();
    let addrs: Vec<std::net::SocketAddr> = ["127.0.0.1:0", "127.0.0.2:0"]
        .iter()
        .map(|a| std::net::UdpSocket::bind(a).unwrap().local_addr().unwrap())
        .collect();
    let args = certs::CertsInitArgs {
        out: out.path().join("site"),
        guest_addr: addrs.iter().map(|a| a.to_string()).collect(),
        hosts: vec!["pve1".into()],
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
        force: false,
    };
    certs::init(&args).unwrap();
    let dir = out.path().join("site");
    let text = std::fs::read_to_string(dir.join("hosts/pve1/host.toml")).unwrap();
    let etc = tempfile::tempdir().unwrap();
    let path = etc.path().join("host.toml");
    std::fs::write(
        &path,
        text.replace("/etc/gpufeed", etc.path().to_str().unwrap()),
    )
    .unwrap();
    for f in [certs::BUNDLE_CA, certs::BUNDLE_CERT, certs::BUNDLE_KEY] {
        std::fs::create_dir_all(etc.path().join(f).parent().unwrap()).unwrap();
        std::fs::copy(dir.join("hosts/pve1").join(f), etc.path().join(f)).unwrap();
    }
    let cfg = Config::load(&path).unwrap();
    assert!(cfg.ignored_keys.is_empty(), "{:?}", cfg.ignored_keys);
    let mut sc = cfg.stream.clone().expect("[stream] section");
    let listed: Vec<(String, String)> = sc
        .guests
        .iter()
        .map(|g| (g.label().to_owned(), g.endpoint.clone()))
        .collect();
    assert_eq!(
        listed,
        addrs
            .iter()
            .map(|a| (a.ip().to_string(), a.to_string()))
            .collect::<Vec<_>>()
    );
    assert!(sc
        .guests
        .iter()
        .all(|g| g.vmids.is_empty() && g.devices.is_empty()));
    sc.spool_dir = Default::default();
    let mut hubs = Vec::new();
    for a in &addrs {
        let reg = prometheus::Registry::new();
        let mut hc = hub_config(&dir.join("guest"));
        hc.listen = *a;
        hubs.push((hub::serve(hc, &reg).await.unwrap(), reg));
    }
    let bus = EventBus::new(1024);
    let h = gpufeed_host::stream::spawn(
        sc,
        cfg.host_id(),
        bus.subscribe(),
        &prometheus::Registry::new(),
        None,
    )
    .unwrap();
    for i in 0..5 {
        bus.emit(HostEvent::KmsgLost { count: i });
    }
    for (i, (_, reg)) in hubs.iter().enumerate() {
        assert!(
            wait_for(Duration::from_secs(10), || {
                metric(
                    reg,
                    "gpufeed_stream_events_received_total",
                    &[("host", "pve1")],
                ) == 5.0
            })
            .await,
            "guest {i} got the host's events"
        );
    }
    h.shutdown().await;
    for (hub, _) in hubs {
        hub.shutdown().await;
    }
}

/// `host`'s bundle from the site in `dir`, installed in a directory of its own (its paths
/// rewritten from /etc/gpufeed), loaded as the agent loads it.
fn install_bundle(dir: &std::path::Path, host: &str) -> (Config, tempfile::TempDir) {
    let b = dir.join("hosts").join(host);
    let text = std::fs::read_to_string(b.join(certs::BUNDLE_CONFIG)).unwrap();
    let etc = tempfile::tempdir().unwrap();
    let path = etc.path().join("host.toml");
    std::fs::write(
        &path,
        text.replace("/etc/gpufeed", etc.path().to_str().unwrap()),
    )
    .unwrap();
    for f in [certs::BUNDLE_CA, certs::BUNDLE_CERT, certs::BUNDLE_KEY] {
        std::fs::create_dir_all(etc.path().join(f).parent().unwrap()).unwrap();
        std::fs::copy(b.join(f), etc.path().join(f)).unwrap();
    }
    let cfg = Config::load(&path).unwrap();
    assert!(cfg.ignored_keys.is_empty(), "{:?}", cfg.ignored_keys);
    (cfg, etc)
}

/// A site grows: `init` with one guest and host pve1, then `add-guest` (a second GPU VM's
/// node) and `add-host` (pve2). pve1's bundle, whose certificate and CA were not touched,
/// now lists both guests; both hosts stream to both guests, which share the re-issued guest
/// directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_guest_and_add_host_grow_one_site() {
    let _logs = capture_logs();
    let out = tempfile::tempdir().unwrap();
    let addrs: Vec<std::net::SocketAddr> = ["127.0.0.1:0", "127.0.0.2:0"]
        .iter()
        .map(|a| std::net::UdpSocket::bind(a).unwrap().local_addr().unwrap())
        .collect();
    let dir = out.path().join("site");
    certs::init(&certs::CertsInitArgs {
        out: dir.clone(),
        guest_addr: vec![addrs[0].to_string()],
        hosts: vec!["pve1".into()],
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
        force: false,
    })
    .unwrap();
    let pve1_cert = std::fs::read(dir.join("hosts/pve1").join(certs::BUNDLE_CERT)).unwrap();
    let ca = std::fs::read(dir.join("ca/ca.pem")).unwrap();
    certs::add_guest(&certs::CertsAddGuestArgs {
        out: dir.clone(),
        guest_addr: addrs[1].to_string(),
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
    })
    .unwrap();
    certs::add_host(&certs::CertsAddHostArgs {
        out: dir.clone(),
        host: "pve2".into(),
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
    })
    .unwrap();
    // the same CA, pve1's certificate untouched; a host added twice is refused
    assert_eq!(std::fs::read(dir.join("ca/ca.pem")).unwrap(), ca);
    assert_eq!(
        std::fs::read(dir.join("hosts/pve1").join(certs::BUNDLE_CERT)).unwrap(),
        pve1_cert
    );
    assert!(certs::add_host(&certs::CertsAddHostArgs {
        out: dir.clone(),
        host: "pve2".into(),
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
    })
    .is_err());
    assert_eq!(
        std::fs::read_to_string(dir.join("guest/allowed-hosts")).unwrap(),
        "pve1\npve2\n"
    );
    let secret = std::fs::read_to_string(dir.join(certs::SECRET_FILE)).unwrap();
    assert!(secret.contains("    pve2"), "{secret}");

    let mut hubs = Vec::new();
    for a in &addrs {
        let reg = prometheus::Registry::new();
        let mut hc = hub_config(&dir.join("guest"));
        hc.listen = *a;
        hubs.push((hub::serve(hc, &reg).await.unwrap(), reg));
    }
    let mut running = Vec::new();
    for host in ["pve1", "pve2"] {
        let (cfg, etc) = install_bundle(&dir, host);
        let mut sc = cfg.stream.clone().expect("[stream] section");
        let endpoints: Vec<String> = sc.guests.iter().map(|g| g.endpoint.clone()).collect();
        assert_eq!(
            endpoints,
            addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            "{host} lists every guest"
        );
        sc.spool_dir = Default::default();
        let bus = EventBus::new(1024);
        let h = gpufeed_host::stream::spawn(
            sc,
            cfg.host_id(),
            bus.subscribe(),
            &prometheus::Registry::new(),
            None,
        )
        .unwrap();
        running.push((h, bus, etc));
    }
    for (_, bus, _) in &running {
        for i in 0..3 {
            bus.emit(HostEvent::KmsgLost { count: i });
        }
    }
    for (i, (_, reg)) in hubs.iter().enumerate() {
        for host in ["pve1", "pve2"] {
            assert!(
                wait_for(Duration::from_secs(10), || {
                    metric(
                        reg,
                        "gpufeed_stream_events_received_total",
                        &[("host", host)],
                    ) == 3.0
                })
                .await,
                "guest {i} got {host}'s events"
            );
        }
    }
    for (h, _, _) in running {
        h.shutdown().await;
    }
    for (hub, _) in hubs {
        hub.shutdown().await;
    }
}
