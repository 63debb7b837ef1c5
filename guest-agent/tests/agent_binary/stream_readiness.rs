//! The real binary with the host stream asked for and its TLS files missing or corrupt: it
//! keeps serving /metrics, /readyz answers 503 with the reason, the log says it once, and
//! the stream starts by itself once valid files appear. Without the stream it reads no TLS
//! files, says once that the stream is off, and is ready.

use crate::common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{certs_init_ok, http_get_status, value, wait_for, Agent};

fn udp_addr() -> SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

fn with_stream(tls_dir: &Path, quic: SocketAddr) -> Agent {
    Agent::no_kube(
        "1s",
        "none",
        &[
            "--quic-listen",
            &quic.to_string(),
            "--tls-dir",
            tls_dir.to_str().unwrap(),
        ],
    )
}

fn lines_with(agent: &Agent, needle: &str) -> usize {
    agent
        .log
        .lock()
        .unwrap()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

fn check_ok(agent: &Agent, check: &str) -> Option<f64> {
    value(&agent.scrape(), "gpufeed_check_ok", &[("check", check)])
}

/// Not ready with `reason`, /metrics served, one log line after several retries.
fn assert_waiting(agent: &Agent, reason: &str) {
    let (code, body) = http_get_status(agent.addr, "/readyz").unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.starts_with("host stream not started: "), "{body}");
    assert!(body.contains(reason), "{body}");
    assert!(agent.try_get("/metrics").is_some());
    assert_eq!(agent.try_get("/healthz").as_deref(), Some("ok\n"));
    // The doctor says the same (evaluated every 5 s).
    let g = wait_for(Duration::from_secs(10), || check_ok(agent, "host_stream"));
    assert_eq!(g, Some(0.0));
}

#[test]
fn stream_off_reads_no_tls_and_is_ready() {
    // A TLS directory that does not exist: without --quic-listen it is never read.
    let agent = Agent::no_kube("1s", "none", &["--tls-dir", "/nonexistent/gpufeed-tls"]);
    let (code, body) = http_get_status(agent.addr, "/readyz").unwrap();
    assert_eq!((code, body.as_str()), (200, "ready\n"));
    std::thread::sleep(Duration::from_secs(6)); // past a retry interval and a doctor round
    assert_eq!(
        lines_with(&agent, "host event stream off (no --quic-listen)"),
        1
    );
    assert_eq!(lines_with(&agent, "host stream not started"), 0);
    // Not applicable: no series.
    let s = agent.scrape();
    assert!(value(&s, "gpufeed_check_ok", &[("check", "lockdown")]).is_some());
    assert_eq!(
        value(&s, "gpufeed_check_ok", &[("check", "host_stream")]),
        None
    );
}

#[test]
fn missing_then_valid_tls_files() {
    let work = tempfile::tempdir().unwrap();
    let tls = work.path().join("tls"); // the optional Secret volume: an empty directory
    std::fs::create_dir(&tls).unwrap();
    let quic = udp_addr();
    let mut agent = with_stream(&tls, quic);
    assert_waiting(&agent, "No such file or directory");
    // 5 s retries: two or more have run by now, with the same reason.
    std::thread::sleep(Duration::from_secs(11));
    assert_eq!(lines_with(&agent, "host stream not started"), 1, "one line");
    // The doctor (evaluated every 5 s) logs the failure once too.
    assert_eq!(lines_with(&agent, "doctor: not started: "), 1);
    assert!(agent.child.try_wait().unwrap().is_none(), "still running");
    // `gpufeed-guest doctor` reads the agent's own checks from it.
    let o = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["doctor", "--url", &format!("http://{}", agent.addr)])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success(), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("FAIL  host_stream"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("not started: loading TLS files"), "{line}");
    assert!(
        out.contains("fix: apply the Secret gpufeed-guest-tls"),
        "{out}"
    );

    // The Secret appears: the kubelet fills the volume, the agent starts the stream.
    let out = work.path().join("certs");
    certs_init_ok(&out, &quic.to_string(), "pve1");
    for f in std::fs::read_dir(out.join("guest")).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), tls.join(f.file_name())).unwrap();
    }
    let ready = wait_for(Duration::from_secs(15), || {
        let (code, body) = http_get_status(agent.addr, "/readyz")?;
        (code == 200).then_some(body)
    });
    assert_eq!(ready.as_deref(), Some("ready\n"));
    assert_eq!(lines_with(&agent, "host stream started"), 1);
    // Started, but no host connected: the doctor says which.
    let doctor = wait_for(Duration::from_secs(10), || {
        let d = agent.try_get("/doctor")?;
        d.contains("not connected: pve1").then_some(d)
    });
    assert!(doctor.is_some(), "{:?}", agent.try_get("/doctor"));
}

#[test]
fn corrupt_tls_files() {
    let work = tempfile::tempdir().unwrap();
    let tls = work.path().join("tls");
    std::fs::create_dir(&tls).unwrap();
    for f in ["ca.pem", "guest.pem", "guest-key.pem"] {
        std::fs::write(tls.join(f), "-----BEGIN CERTIFICATE-----\nnot base64 !!\n").unwrap();
    }
    std::fs::write(tls.join("allowed-hosts"), "pve1\n").unwrap();
    let agent = with_stream(&tls, udp_addr());
    assert_waiting(&agent, "CA: bad PEM");
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(lines_with(&agent, "host stream not started"), 1);
    let line = agent
        .log
        .lock()
        .unwrap()
        .lines()
        .find(|l| l.contains("host stream not started"))
        .unwrap()
        .to_string();
    assert!(line.contains("ERROR"), "{line}");
    assert!(line.contains("Secret gpufeed-guest-tls"), "{line}");
}
