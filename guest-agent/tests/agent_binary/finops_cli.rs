//! The real binary refuses each invalid FinOps setting at start, naming the setting, with a
//! non-zero exit, before it needs any privilege (so no root here).

use std::process::Command;

/// `gpufeed-guest run` with a valid FinOps configuration in which `flags` replace the
/// settings of the same name (each case changes one setting).
fn run_with(flags: &[&str]) -> (Option<i32>, String) {
    let mut args: Vec<(&str, &str)> = vec![
        ("--gpu-hourly-rate", "2.5"),
        ("--gpu-memory-bytes", "80GiB"),
        ("--gpu-link-bytes-per-second", "32GB"),
    ];
    for pair in flags.chunks(2) {
        args.retain(|(k, _)| *k != pair[0]);
        args.push((pair[0], pair[1]));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["run", "--metrics-listen", "127.0.0.1:0", "--no-kube"])
        .args(args.iter().flat_map(|(k, v)| [*k, *v]))
        .env_remove("GPUFEED_GPU_HOURLY_RATE")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn each_invalid_finops_setting_is_refused_by_name() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--gpu-cost-weights", "0.5,0.3,0.1"],
            "--gpu-cost-weights \"0.5,0.3,0.1\": the weights sum to 0.9",
        ),
        (
            &["--gpu-cost-weights", "0.5,0.5"],
            "--gpu-cost-weights \"0.5,0.5\": expected three numbers",
        ),
        (
            &["--gpu-hourly-rate", "-1"],
            "--gpu-hourly-rate -1: the node's hourly price must be a number ≥ 0",
        ),
        (
            &["--pod-label", "team=example.com/team"],
            "unknown label name \"team\" (allowed: tenant, model, app)",
        ),
        (
            &["--pod-label", "tenant"],
            "--pod-label \"tenant\": expected NAME=POD_LABEL_KEY",
        ),
        (
            &["--gpu-memory-bytes", "0"],
            "--gpu-memory-bytes: a GPU's capacity cannot be 0",
        ),
        (
            &["--gpu-link-bytes-per-second", "0"],
            "--gpu-link-bytes-per-second: a GPU's capacity cannot be 0",
        ),
        (
            &["--gpu-cost-currency", ""],
            "--gpu-cost-currency \"\": expected a currency code",
        ),
        (
            &["--mps-sustain", "0s"],
            "--mps-sustain 0ns: must be at least 1s",
        ),
    ];
    for (flags, want) in cases {
        let (code, err) = run_with(flags);
        assert_eq!(code, Some(2), "{flags:?}: exit status; stderr: {err}");
        assert!(err.contains(want), "{flags:?}: want {want:?} in: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A rate with no capacity configured (and here no NVML) is no refusal: the capacity comes
/// from NVML at run time, and an agent on a node without it must start (a DaemonSet would
/// crash-loop on every CPU node). Whatever else stops it (privileges when not root), it is
/// never a capacity flag. Malformed values stay refusals by name.
#[test]
fn a_rate_without_capacities_starts_and_malformed_values_are_refused() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["run", "--no-kube", "--metrics-listen", "127.0.0.1:0"])
        .args([
            "--probes",
            "nvml",
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
        ])
        .args(["--gpu-hourly-rate", "1", "--gpu-memory-bytes", "24GiB"])
        .env_remove("GPUFEED_GPU_LINK_BYTES_PER_SECOND")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let exited = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    if exited.is_none() {
        child.kill().unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("exited: {exited:?}");
    assert!(
        exited.is_none() || !err.contains("--gpu-link-bytes-per-second"),
        "refused for the capacity: {err}"
    );
    // a malformed rate is refused by the flag's parser, by name
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["run", "--no-kube", "--gpu-hourly-rate", "2.5EUR"])
        .env_remove("GPUFEED_GPU_HOURLY_RATE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--gpu-hourly-rate"), "{err}");
    // a unit it does not know is refused by the flag's parser, also by name
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["run", "--no-kube", "--gpu-memory-bytes", "80XB"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--gpu-memory-bytes") && err.contains("unknown unit"),
        "{err}"
    );
}
