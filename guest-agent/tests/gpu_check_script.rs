//! scripts/gpu-check.sh, the check prepared for a machine with a real GPU,
//! run end to end here against the stand-in driver libraries (libcuda.so.1
//! whose kernels take the time their cycle count asks for, libnvidia-ml.so.1
//! with two GPUs): the real agent binary, the real program in a pod-shaped
//! cgroup, and the report it writes, row by row.

mod common;

use std::collections::HashMap;
use std::process::Command;

use common::gpu::StandInCuda;
use common::*;

/// The report's table as (row name → cells after the name).
fn rows(report: &str) -> HashMap<String, Vec<String>> {
    report
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| what"))
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_string())
                .collect();
            (cells[0].clone(), cells[1..].to_vec())
        })
        .collect()
}

/// The number a cell starts with.
fn number(cell: &str) -> f64 {
    let n = cell.split_whitespace().next().unwrap_or("");
    n.parse()
        .unwrap_or_else(|_| panic!("no number in {cell:?}"))
}

#[test]
fn gpu_check_script_reports_what_each_probe_saw_beside_the_programs_own_counts() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let cuda = StandInCuda::new(dir);
    let nvml = dir.join("libnvidia-ml.so.1");
    let procs = dir.join("procs");
    std::fs::write(&procs, "").unwrap();
    compile_c(
        "nvml/fake_nvml.c",
        &nvml,
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libnvidia-ml.so.1",
            &format!("-DSTANDIN_PROCS=\"{}\"", procs.display()),
        ],
    );
    let report = dir.join("report.md");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/gpu-check.sh");
    let out = Command::new("bash")
        .arg(script)
        .args(["--agent", env!("CARGO_BIN_EXE_gpufeed-guest")])
        .arg("--out")
        .arg(&report)
        .arg("--")
        .arg("--nvml-library")
        .arg(&nvml)
        .env("LD_LIBRARY_PATH", &cuda.lib_dir)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gpu-check failed:\n{log}");
    let text = std::fs::read_to_string(&report).unwrap();
    eprintln!("{text}");
    let rows = rows(&text);

    // counted exactly: the program's own number, the agent's, "equal"
    for (row, want) in [
        ("VRAM held at peak (bytes)", (80 + 32) << 20),
        ("VRAM after the frees (bytes)", 0),
        ("host-to-device bytes", 72 << 20),
        ("device-to-host bytes", 16 << 20),
        ("kernel launches", 50),
        ("synchronisation calls", 6),
    ] {
        let cells = &rows[row];
        assert_eq!(number(&cells[0]), want as f64, "{row}: the program's count");
        assert_eq!(number(&cells[1]), want as f64, "{row}: the agent's");
        assert_eq!(cells[2], "equal", "{row}");
    }
    // timed: 50 kernels of 2 ms, waited for in six calls
    for row in [
        "time blocked in them (ns)",
        "first launch → last synchronisation (ns)",
    ] {
        let cells = &rows[row];
        let (own, got) = (number(&cells[0]), number(&cells[1]));
        assert!(
            (95e6..130e6).contains(&own),
            "{row}: the program measured {own} ns for 100 ms of kernels"
        );
        assert!(
            (got - own).abs() <= 0.1 * own,
            "{row}: agent {got} vs program {own}"
        );
    }
    assert!(
        text.contains("memory 85899345920 bytes, link 31507692304 bytes/s"),
        "GPU 0's capacity by NVML"
    );
    // it cleaned up after itself
    let leftovers: Vec<_> = std::fs::read_dir(cgroup2_root())
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("gpufeed-gpu-check-")
        })
        .collect();
    assert!(leftovers.is_empty(), "cgroups left behind: {leftovers:?}");
}
