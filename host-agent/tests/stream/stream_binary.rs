//! The real `gpufeed-host` binary, configured by the host bundle that `certs init` writes,
//! streams its events to the hub; a SIGTERM and restart resumes the same spool (same sequence
//! space, numbering continues, nothing delivered twice).

use gpufeed_shared::certs;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpufeed_shared::event::HostEvent;
use gpufeed_testkit::stream::*;

fn start_host(config: &std::path::Path, log: &std::path::Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_gpufeed-host"))
        .args(["run", "--config"])
        .arg(config)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// The agent colours its log even into a file.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\x1b' {
            for d in it.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn sigterm_and_wait(c: &mut Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(c.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let st = c.wait().unwrap();
    assert!(st.success(), "gpufeed-host exit: {st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpufeed_host_binary_streams_and_resumes_after_restart() {
    let _logs = capture_logs();
    let work = tempfile::tempdir().unwrap();
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let args = certs::CertsInitArgs {
        out: work.path().join("deploy"),
        guest_addr: vec![addr.to_string()],
        hosts: vec!["pve1".into()],
        namespace: "gpufeed".into(),
        secret_name: "gpufeed-guest-tls".into(),
        force: false,
    };
    certs::init(&args).unwrap();
    let dir = work.path().join("deploy").canonicalize().unwrap();
    // The generated file as is, plus what a test needs: an empty system tree (watchers find
    // nothing and say so with WatcherDisabled events), a free metrics port, a private spool,
    // and the bundle's directory where it would be /etc/gpufeed.
    let root = work.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let spool = work.path().join("spool");
    let bundle = dir.join("hosts/pve1");
    let generated = std::fs::read_to_string(bundle.join(certs::BUNDLE_CONFIG))
        .unwrap()
        .replace(certs::HOST_ETC, bundle.to_str().unwrap());
    let text = format!(
        "root = {:?}\nmetrics_listen = \"127.0.0.1:0\"\n{}",
        root.display().to_string(),
        generated.replace(
            "\"/var/lib/gpufeed/spool\"",
            &format!("{:?}", spool.display().to_string())
        )
    );
    let config = work.path().join("host.toml");
    std::fs::write(&config, text).unwrap();

    let reg = prometheus::Registry::new();
    let mut hc = hub_config(&dir.join("guest"));
    hc.listen = addr;
    hc.recent_capacity = 100_000;
    let hub = hub::serve(hc, &reg).await.unwrap();
    let received = || {
        metric(
            &reg,
            "gpufeed_stream_events_received_total",
            &[("host", "pve1")],
        )
    };

    let mut host = start_host(&config, &work.path().join("host-0.log"));
    let ok = wait_for(Duration::from_secs(20), || received() >= 1.0).await;
    assert!(
        ok,
        "no event from gpufeed-host:\n{}",
        std::fs::read_to_string(work.path().join("host-0.log")).unwrap()
    );
    // Let the first burst settle, then restart the host.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sigterm_and_wait(&mut host);
    let first = hub.recent();
    assert!(first
        .iter()
        .any(|e| matches!(e.event, HostEvent::WatcherDisabled { .. })));
    let boot = first[0].boot_id;
    let n1 = first.len();

    let mut host = start_host(&config, &work.path().join("host-1.log"));
    let ok = wait_for(Duration::from_secs(20), || hub.recent().len() > n1).await;
    assert!(
        ok,
        "nothing after restart:\n{}",
        std::fs::read_to_string(work.path().join("host-1.log")).unwrap()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    sigterm_and_wait(&mut host);
    let all = hub.recent();
    for (i, e) in all.iter().enumerate() {
        assert_eq!(
            e.boot_id, boot,
            "the restarted host kept its spool's sequence space"
        );
        assert_eq!(
            e.seq, i as u64,
            "numbering continues without gaps or repeats"
        );
        assert_eq!(e.host, "pve1");
    }
    assert_eq!(received(), all.len() as f64);
    assert_eq!(
        metric(
            &reg,
            "gpufeed_stream_events_lost_total",
            &[("host", "pve1")]
        ),
        0.0
    );
    let log1 = strip_ansi(&std::fs::read_to_string(work.path().join("host-1.log")).unwrap());
    assert!(log1.contains(&format!("next_seq={n1}")), "{log1}");
    assert!(log1.contains(&format!("resume_from=Some({n1})")), "{log1}");
    hub.shutdown().await;
}
