//! scripts/gpu-check.sh, the check prepared for a machine with a real GPU,
//! run end to end here against the stand-in driver libraries (libcuda.so.1
//! whose kernels take the time their cycle count asks for, libnvidia-ml.so.1
//! with two GPUs, which reports the program at 50% SM while it runs): the real
//! agent binary, the real program in a pod-shaped cgroup, and the report it
//! writes, row by row.

use crate::common;

use std::collections::HashMap;
use std::process::Command;

use common::gpu::{StandInCuda, StandInNvml};
use common::*;

/// The report's table as (row name → cells after the name).
fn rows(report: &str) -> HashMap<String, Vec<String>> {
    report
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| what"))
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split('|')
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

/// The program the script started: its control directory is `/tmp/gpufeed-gpu-check.*/ctl`.
fn program_pid() -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let ctl = std::str::from_utf8(args.get(1)?).ok()?;
        (ctl.starts_with("/tmp/gpufeed-gpu-check.") && ctl.ends_with("/ctl")).then_some(pid)
    })
}

#[test]
fn gpu_check_script_reports_what_each_probe_saw_beside_the_programs_own_counts() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let cuda = StandInCuda::new(dir);
    let nvml = StandInNvml::new(dir);
    // NVML reports the program (found by the control directory the script gives it) on GPU 0
    // at 50% SM with 96 MiB while it runs; what the stand-in's GPU did is its truth file
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (done, nvml_procs) = (done.clone(), nvml.clone());
        std::thread::spawn(move || {
            let mut seen = None;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let client = program_pid();
                if client != seen {
                    let procs: Vec<_> = client.iter().map(|p| (*p, 0, 96 << 20, 50)).collect();
                    nvml_procs.set_processes(&procs);
                    seen = client;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            seen
        })
    };
    let report = dir.join("report.md");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/gpu-check.sh");
    let out = Command::new("bash")
        .arg(script)
        .args(["--agent", env!("CARGO_BIN_EXE_gpufeed-guest")])
        .arg("--out")
        .arg(&report)
        .arg("--")
        .arg("--nvml-library")
        .arg(&nvml.lib)
        .env("LD_LIBRARY_PATH", &cuda.lib_dir)
        .output()
        .unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().unwrap();
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
    // compute time by the node's best source, NVML: what the stand-in's GPU did for the
    // program (its first sample stands for the time since the agent's previous read: up to
    // one sample period less)
    let cells = &rows["GPU compute time (ns)"];
    assert!(cells[1].contains("source nvml"), "{cells:?}");
    let (got, want) = (number(&cells[1]) / 1e9, nvml.sm_seconds_all());
    assert!(
        want > 0.5 && got <= want + 1e-6 && got >= want - 0.05 - 1e-6,
        "compute time {got} s by the agent, {want} SM-s by the stand-in"
    );
    let duty = &rows["duty cycle at peak (10 s window)"];
    assert!(
        number(&duty[1]) > 0.0 && number(&duty[1]) <= 1.0,
        "{duty:?}"
    );
    assert!(rows["time in driver ioctls (ns)"][1].contains("ebpf_gpu_driver_time_seconds_total"));
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
