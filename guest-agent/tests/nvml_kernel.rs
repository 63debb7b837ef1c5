//! NVML through a stand-in libnvidia-ml.so.1 built here from C with NVML's
//! real signatures and struct layouts (no GPU and no NVIDIA driver exist on
//! the machines that run the tests), loaded at run time from a configured
//! path, with processes in two pod cgroups.

mod common;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use gpufeed_guest::nvml::{cgroup_id_of, GpuCapacity, Nvml};

const GIB: u64 = 1 << 30;

/// Builds the stand-in library in `dir`; (its path, the process list it reads).
fn stand_in(dir: &Path) -> (PathBuf, PathBuf) {
    let procs = dir.join("procs");
    let lib = dir.join("libnvidia-ml.so.1");
    let define = format!("-DSTANDIN_PROCS=\"{}\"", procs.display());
    compile_c(
        "nvml/fake_nvml.c",
        &lib,
        &["-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", &define],
    );
    (lib, procs)
}

#[test]
fn nvml_capacity_and_per_pod_usage_from_a_stand_in_library() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (lib, procs) = stand_in(scratch.path());

    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut b = Pod::random(&sb, Layout::Systemd, "besteffort");
    let a1 = a.spawn("exec sleep 60");
    let a2 = a.spawn("exec sleep 60");
    let b1 = b.spawn("exec sleep 60");
    assert!(
        wait_for(Duration::from_secs(5), || (a.pids().len() == 2
            && b.pids().len() == 1)
            .then_some(()))
        .is_some(),
        "the pods' processes started"
    );
    // a: one process on each GPU; b: one on GPU 0; and a pid that has
    // exited by now (NVML's list lags behind exits): left out
    std::fs::write(
        &procs,
        format!(
            "{a1} 0 {} 40\n{a2} 1 {} 25\n{b1} 0 {} 50\n999999999 0 {} 10\n",
            3 * GIB,
            GIB,
            5 * GIB,
            7 * GIB
        ),
    )
    .unwrap();

    let mut nvml = Nvml::load(lib.to_str().unwrap())
        .expect("the stand-in initialises")
        .expect("the stand-in is found at its path");
    assert_eq!(
        nvml.capacity().unwrap(),
        vec![
            GpuCapacity {
                index: 0,
                memory_total_bytes: 80 * GIB,
                // gen 4 x16
                link_bytes_per_second: 16 * 1_969_230_769,
            },
            GpuCapacity {
                index: 1,
                memory_total_bytes: 24 * GIB,
                // gen 3 x8
                link_bytes_per_second: 8 * 984_615_384,
            },
        ]
    );

    let usage = nvml.processes().unwrap();
    assert_eq!(usage.len(), 4, "{usage:?}");
    let per_cgroup = Nvml::per_cgroup(&usage, |pid| cgroup_id_of(pid, &sb.root));
    let id = |p: &Pod| std::fs::metadata(&p.cgroup).unwrap().ino();
    let got: HashMap<u64, (u64, f64)> = per_cgroup
        .iter()
        .map(|(k, v)| (*k, (v.memory_bytes, v.sm_utilization)))
        .collect();
    assert_eq!(
        got.len(),
        2,
        "two pods; the exited pid has no cgroup: {got:?}"
    );
    let (mem_a, sm_a) = got[&id(&a)];
    let (mem_b, sm_b) = got[&id(&b)];
    assert_eq!(mem_a, 4 * GIB, "pod a: 3 GiB on GPU 0 + 1 GiB on GPU 1");
    assert_eq!(mem_b, 5 * GIB);
    assert!((sm_a - 0.65).abs() < 1e-9, "pod a SM {sm_a}");
    assert!((sm_b - 0.5).abs() < 1e-9, "pod b SM {sm_b}");

    // a second reading asks only for newer samples, and gets them
    let again = Nvml::per_cgroup(&nvml.processes().unwrap(), |pid| {
        cgroup_id_of(pid, &sb.root)
    });
    assert!((again[&id(&b)].sm_utilization - 0.5).abs() < 1e-9);
}

/// The agent with the `nvml` probe on the stand-in: each pod's series follow
/// what NVML says of its processes; without the library the probe is up and
/// idle.
#[test]
fn nvml_series_per_pod_on_metrics() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let (lib, procs) = stand_in(scratch.path());
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut b = Pod::random(&sb, Layout::Systemd, "besteffort");
    let (a1, b1) = (a.spawn("exec sleep 60"), b.spawn("exec sleep 60"));
    std::fs::write(
        &procs,
        format!("{a1} 0 {} 30\n{b1} 1 {} 80\n", 2 * GIB, 6 * GIB),
    )
    .unwrap();

    let agent = Agent::no_kube("200ms", "nvml", &["--nvml-library", lib.to_str().unwrap()]);
    for (pod, mem, sm) in [(&a, 2 * GIB, 0.3), (&b, 6 * GIB, 0.8)] {
        let labels = [
            ("pod", pod.uid.as_str()),
            ("container", &pod.container_id[..12]),
        ];
        let got = wait_for(Duration::from_secs(10), || {
            let s = agent.scrape();
            let m = value(&s, "gpufeed_nvml_process_memory_bytes", &labels)?;
            let u = value(&s, "gpufeed_nvml_process_sm_utilization_ratio", &labels)?;
            Some((m, u))
        });
        assert_eq!(
            got.map(|(m, _)| m),
            Some(mem as f64),
            "pod {}: memory",
            pod.uid
        );
        let u = got.unwrap().1;
        assert!((u - sm).abs() < 1e-9, "pod {}: SM {u}", pod.uid);
    }
    let s = agent.scrape();
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(2.0));
    // each GPU's capacity, as the stand-in reports it
    for (gpu, memory, link) in [
        ("0", 80 * GIB, 16 * 1_969_230_769u64),
        ("1", 24 * GIB, 8 * 984_615_384),
    ] {
        let want = [("gpu", gpu)];
        assert_eq!(
            value(&s, "gpufeed_gpu_memory_total_bytes", &want),
            Some(memory as f64),
            "gpu {gpu}: memory"
        );
        assert_eq!(
            value(&s, "gpufeed_gpu_link_max_bytes_per_second", &want),
            Some(link as f64),
            "gpu {gpu}: link"
        );
    }
    drop(agent);

    // A cost asked for without capacities in the configuration: the GPUs' own, from NVML.
    let cost = |lib: &str| {
        Agent::no_kube(
            "200ms",
            "nvml",
            &["--nvml-library", lib, "--gpu-hourly-rate", "3.6"],
        )
    };
    let with = cost(lib.to_str().unwrap());
    assert!(
        wait_for(Duration::from_secs(10), || value(
            &with.scrape(),
            "gpufeed_gpu_node_cost_total",
            &[("currency", "USD")]
        )
        .filter(|v| *v > 0.0))
        .is_some(),
        "the node's cost accrues with NVML's capacities"
    );
    drop(with);
    // ... and without NVML the same command line is refused, naming what is missing
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args([
            "run",
            "--no-kube",
            "--probes",
            "nvml",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args([
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
            "--gpu-hourly-rate",
            "3.6",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--gpu-memory-bytes"), "{err}");

    let absent = Agent::no_kube(
        "200ms",
        "nvml",
        &["--nvml-library", "/nonexistent/libnvidia-ml.so.1"],
    );
    let s = absent.scrape();
    assert_eq!(
        value(&s, "gpufeed_probe_up", &[("probe", "nvml")]),
        Some(1.0)
    );
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(0.0));
    assert!(
        find(&s, "gpufeed_gpu_memory_total_bytes", &[]).is_empty(),
        "no capacity without NVML"
    );
}
