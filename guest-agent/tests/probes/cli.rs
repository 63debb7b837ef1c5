//! The binary's behaviour for people: missing privileges, bad flags.

use crate::common;

use std::process::Command;

fn guest() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
}

#[test]
fn unprivileged_start_names_the_missing_capability() {
    let Some(_lock) = common::require_root() else {
        return;
    };
    // drop to nobody with no capabilities at all
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
        ])
        .arg(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["run", "--metrics-listen", "127.0.0.1:0", "--no-kube"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("missing capability CAP_BPF"), "{err}");
    assert!(err.contains("CAP_PERFMON"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!err.contains("libbpf:"), "no libbpf noise: {err}");
}

#[test]
fn bad_flags_get_clear_errors() {
    let out = guest()
        .args(["run", "--interval", "10ms"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("outside 100ms..60s"));

    let out = guest()
        .args(["run", "--probes", "sched_latency,gpu", "--no-kube"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown probe \"gpu\""), "{err}");

    let out = guest()
        .args(["run", "--dst", "cluster=10.0.0.0/33", "--no-kube"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("10.0.0.0/33") && err.contains("cluster"),
        "{err}"
    );
}
