//! `gpufeed-host run --check-config` refuses every stream configuration that `run` refuses,
//! with the same message: a guest name that is no directory name, duplicate guests, a missing
//! certificate file, a `host_id` that the client certificate does not name.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpufeed_shared::tls;
use gpufeed_testkit::stream::*;

/// Runs `gpufeed-host run [--check-config] --config cfg`; the exit success and the
/// `gpufeed-host: ` error line. `run` must end by itself (a refused config) within 20 s.
fn gpufeed_host(cfg: &Path, check: bool) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpufeed-host"));
    cmd.arg("run");
    if check {
        cmd.arg("--check-config");
    }
    let mut child = cmd
        .arg("--config")
        .arg(cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "`run` (check {check}) accepted {} and kept running",
                cfg.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    let line = err
        .lines()
        .find(|l| l.starts_with("gpufeed-host: "))
        .unwrap_or_default()
        .to_owned();
    (status.success(), line)
}

#[test]
fn check_config_refuses_what_run_refuses_with_the_same_message() {
    let fx = Fixture::new(&["pve1"]);
    let root = tempfile::tempdir().unwrap();
    let write = |name: &str, host_id: &str, ca: &Path, guests: &[&str]| {
        let mut t = format!(
            "host_id = \"{host_id}\"\nroot = \"{}\"\nmetrics_listen = \"127.0.0.1:0\"\n\
             [stream]\nca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\nspool_dir = \"\"\n",
            root.path().display(),
            ca.display(),
            fx.path().join(tls::host_cert_file("pve1")).display(),
            fx.path().join(tls::host_key_file("pve1")).display(),
        );
        for g in guests {
            t.push_str(&format!(
                "[[stream.guests]]\nendpoint = \"127.0.0.1:9\"\nname = \"{g}\"\n"
            ));
        }
        let p = root.path().join(name);
        std::fs::write(&p, t).unwrap();
        p
    };
    let ca = fx.path().join(tls::CA_FILE);
    let cases = [
        ("dotdot.toml", "pve1", ca.clone(), vec!["../x"], "../x"),
        ("dup.toml", "pve1", ca.clone(), vec!["g", "g"], "\"g\""),
        (
            "noca.toml",
            "pve1",
            fx.path().join("missing-ca.pem"),
            vec!["g"],
            "missing-ca.pem",
        ),
        ("otherid.toml", "pve2", ca.clone(), vec!["g"], "pve2"),
    ];
    for (name, host_id, ca, guests, names) in cases {
        let cfg = write(name, host_id, &ca, &guests);
        let (ok_check, msg_check) = gpufeed_host(&cfg, true);
        let (ok_run, msg_run) = gpufeed_host(&cfg, false);
        assert!(!ok_run, "{name}: run accepted it");
        assert!(!ok_check, "{name}: --check-config accepted it");
        assert_eq!(msg_check, msg_run, "{name}");
        assert!(msg_check.contains(names), "{name}: {msg_check}");
    }
    // The good one passes.
    let good = write("good.toml", "pve1", &ca, &["g"]);
    let (ok, msg) = gpufeed_host(&good, true);
    assert!(ok, "{msg}");
}

/// A key this version does not know (a later version removed it) is a warning naming it, in
/// `--check-config` and in `run`, and the agent starts.
#[test]
fn unknown_keys_are_a_warning_not_a_failed_start() {
    let root = tempfile::tempdir().unwrap();
    let cfg = root.path().join("host.toml");
    std::fs::write(
        &cfg,
        format!(
            "root = \"{}\"\nmetrics_listen = \"127.0.0.1:0\"\nretired_key = 1\n\
             [pcie]\npoll_interval_ms = 1000\nold_knob = true\n",
            root.path().display()
        ),
    )
    .unwrap();
    let warned = |err: &str| {
        ["`retired_key`", "`pcie.old_knob`"]
            .iter()
            .all(|k| err.lines().any(|l| l.contains("WARN") && l.contains(k)))
    };
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed-host"))
        .args(["run", "--check-config", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(warned(&err), "{err}");

    let mut child = Command::new(env!("CARGO_BIN_EXE_gpufeed-host"))
        .args(["run", "--config"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stderr.take().unwrap()));
    let mut err = String::new();
    let started = loop {
        match lines.next() {
            Some(Ok(l)) => {
                err.push_str(&l);
                err.push('\n');
                if l.contains("started: metrics on") {
                    break true;
                }
            }
            _ => break false,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "run did not start:\n{err}");
    assert!(warned(&err), "{err}");
}
