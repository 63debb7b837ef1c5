//! NVML through a stand-in libnvidia-ml.so.1 built here from C with NVML's real signatures and
//! struct layouts (no GPU and no NVIDIA driver exist on the machines that run the tests),
//! loaded at run time from a configured path. The stand-in samples each process's SM
//! utilisation every 100 ms as the driver does, hands out the latest sample per process with
//! its timestamp, and writes what its GPUs did to a truth file: the SM time the agent books
//! is checked against that file, summed here.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::gpu::{StandInNvml, NVML_SAMPLE_US};
use common::*;
use gpufeed_guest::nvml::sm_time::SmClock;
use gpufeed_guest::nvml::{GpuCapacity, LinkState, Nvml};

const GIB: u64 = 1 << 30;
/// One sample period in seconds: the most a process's first sample can miss.
const PERIOD_S: f64 = NVML_SAMPLE_US as f64 / 1e6;

/// The library on its own (no agent, no root): capacity, processes and memory, samples turned
/// into SM time, links.
#[test]
fn nvml_reads_processes_samples_and_links_from_a_stand_in() {
    let scratch = tempfile::tempdir().unwrap();
    let nvml_lib = StandInNvml::new(scratch.path());
    // pid 101 on GPU 0 at 40%, 102 on GPU 1 at 25%, 103 on GPU 0 at 50%, 104 on GPU 1 with a
    // utilisation no GPU has (drivers have been seen to report such)
    nvml_lib.set_processes(&[
        (101, 0, 3 * GIB, 40),
        (102, 1, GIB, 25),
        (103, 0, 5 * GIB, 50),
        (104, 1, 7, 250),
    ]);
    let mut nvml = Nvml::load(nvml_lib.path())
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

    let mut clock = SmClock::default();
    let mut sm: HashMap<u32, u64> = HashMap::new();
    let mut read = |clock: &mut SmClock| {
        let r = nvml.read().unwrap();
        for p in clock.advance(&r) {
            *sm.entry(p.pid).or_default() += p.sm_ns;
        }
        r
    };
    let first = read(&mut clock);
    let memory: HashMap<(u32, u32), Option<u64>> = first
        .iter()
        .flat_map(|g| g.processes.iter().map(move |(p, m)| ((g.gpu, *p), *m)))
        .collect();
    assert_eq!(memory.len(), 4, "{memory:?}");
    assert_eq!(memory[&(0, 101)], Some(3 * GIB));
    assert_eq!(memory[&(1, 102)], Some(GIB));
    // reads at two speeds: faster than the samples, then slower (NVML then returns only
    // each process's latest sample, which stands for the gap)
    for pause in [50u64; 12].into_iter().chain([350; 4]) {
        std::thread::sleep(Duration::from_millis(pause));
        read(&mut clock);
    }
    for (pid, util) in [(101u32, 0.40), (102, 0.25), (103, 0.50)] {
        let want = nvml_lib.sm_seconds(&[pid], None);
        let got = sm[&pid] as f64 / 1e9;
        assert!(want > 1.5 * util, "pid {pid}: the stand-in ran {want} SM-s");
        // the first sample stands for the time since the first read: up to one period less
        assert!(
            got <= want + 1e-6 && got >= want - util * PERIOD_S - 1e-6,
            "pid {pid}: booked {got} SM-s, the stand-in computed {want}"
        );
    }
    assert_eq!(sm[&104], 0, "a utilisation above 100% counts nothing");
    assert!(clock.invalid_samples() > 0);

    // links: GPU 0 renegotiated down to gen 1 and moves data; GPU 1 as at its maximum
    nvml_lib.set_links(&[(0, 1, 16, 1000, 2000)]);
    assert_eq!(
        nvml.links().unwrap(),
        vec![
            LinkState {
                gpu: 0,
                generation: 1,
                width: 16,
                tx_bytes_per_second: 1000 * 1024,
                rx_bytes_per_second: 2000 * 1024,
            },
            LinkState {
                gpu: 1,
                generation: 3,
                width: 8,
                tx_bytes_per_second: 0,
                rx_bytes_per_second: 0,
            },
        ]
    );
}

/// The agent with the `nvml` probe on the stand-in: NVML is the node's compute-time source;
/// each container's SM time per GPU is what the stand-in's GPUs did for its processes, its
/// duty cycle that time's share of the window, and its memory and SM gauges what NVML says;
/// each GPU's link and each pod's GPUs' throughput follow the stand-in's links. Without the
/// library the probe is up and idle.
#[test]
fn nvml_series_per_pod_on_metrics() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let nvml = StandInNvml::new(scratch.path());
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut b = Pod::random(&sb, Layout::Systemd, "besteffort");
    let (a1, a2, b1) = (
        a.spawn("exec sleep 60"),
        a.spawn("exec sleep 60"),
        b.spawn("exec sleep 60"),
    );
    // a: one process on each GPU; b: one on GPU 1
    let busy = [(a1, 0, 2 * GIB, 30), (a2, 1, GIB, 60), (b1, 1, 6 * GIB, 20)];
    nvml.set_processes(&busy);
    nvml.set_links(&[(0, 4, 16, 3_000_000, 1_000_000), (1, 2, 8, 500, 700)]);

    let agent = Agent::no_kube(
        "200ms",
        "nvml",
        &["--nvml-library", nvml.path(), "--gpu-duty-window", "2s"],
    );
    let container = |p: &Pod| p.container_id[..12].to_string();
    let (ca, cb) = (container(&a), container(&b));
    let sel = |p: &Pod, c: &str, gpu: &str| {
        [
            ("pod", p.uid.clone()),
            ("container", c.to_string()),
            ("gpu", gpu.to_string()),
        ]
    };
    let v = |s: &[Sample], name: &str, l: &[(&str, String)]| {
        let l: Vec<(&str, &str)> = l.iter().map(|(k, v)| (*k, v.as_str())).collect();
        value(s, name, &l)
    };
    // the duty cycle over a full window of steady use: the processes' utilisation
    let duties = [
        (&a, &ca, "0", 0.30),
        (&a, &ca, "1", 0.60),
        (&b, &cb, "1", 0.20),
    ];
    // a full window of compute time first
    assert!(
        wait_for(Duration::from_secs(10), || {
            find(&agent.scrape(), "ebpf_gpu_compute_time_seconds_total", &[])
                .iter()
                .any(|x| x.value > 0.0)
                .then_some(())
        })
        .is_some(),
        "compute time appears"
    );
    std::thread::sleep(Duration::from_millis(2500));
    let steady = wait_for(Duration::from_secs(15), || {
        std::thread::sleep(Duration::from_millis(300));
        let s = agent.scrape();
        let ok = duties.iter().all(|(p, c, g, want)| {
            v(&s, "ebpf_gpu_active_compute_duty_cycle", &sel(p, c, g))
                .is_some_and(|d| (d - want).abs() <= 0.12 * want + 0.02)
        });
        ok.then_some(s)
    });
    let s = steady.unwrap_or_else(|| {
        panic!(
            "duty cycles {:?}",
            find(&agent.scrape(), "ebpf_gpu_active_compute_duty_cycle", &[])
        )
    });
    assert_eq!(
        value(&s, "gpufeed_gpu_compute_source", &[("source", "nvml")]),
        Some(1.0)
    );
    // NVML's own gauges: a's two processes together, b's one
    for (p, c, sm, mem) in [(&a, &ca, 0.9, 3 * GIB), (&b, &cb, 0.2, 6 * GIB)] {
        let l = [("pod", p.uid.as_str()), ("container", c.as_str())];
        let u = value(&s, "gpufeed_nvml_process_sm_utilization_ratio", &l).unwrap();
        assert!((u - sm).abs() < 1e-9, "pod {}: SM {u}", p.uid);
        assert_eq!(
            value(&s, "gpufeed_nvml_process_memory_bytes", &l),
            Some(mem as f64)
        );
    }
    // links, per GPU, and per pod the links of its GPUs
    for (gpu, generation, width, tx, rx) in [
        ("0", 4.0, 16.0, 3_000_000.0, 1_000_000.0),
        ("1", 2.0, 8.0, 500.0, 700.0),
    ] {
        let g = [("gpu", gpu)];
        assert_eq!(
            value(&s, "gpufeed_gpu_pcie_link_generation", &g),
            Some(generation)
        );
        assert_eq!(value(&s, "gpufeed_gpu_pcie_link_width", &g), Some(width));
        for (dir, kib) in [("tx", tx), ("rx", rx)] {
            let l = [("gpu", gpu), ("direction", dir)];
            assert_eq!(
                value(&s, "gpufeed_gpu_pcie_throughput_bytes_per_second", &l),
                Some(kib * 1024.0)
            );
        }
    }
    let pod_link = |p: &Pod, gpu: &str| {
        value(
            &s,
            "gpufeed_nvml_pod_gpu_pcie_bytes_per_second",
            &[("pod", p.uid.as_str()), ("gpu", gpu), ("direction", "rx")],
        )
    };
    assert_eq!(pod_link(&a, "0"), Some(1_000_000.0 * 1024.0));
    assert_eq!(pod_link(&a, "1"), Some(700.0 * 1024.0));
    assert_eq!(pod_link(&b, "1"), Some(700.0 * 1024.0));
    assert_eq!(pod_link(&b, "0"), None, "b has no process on GPU 0");

    // The processes stop computing (they keep their memory); once the agent has read the last
    // samples, each container's SM time per GPU is what the stand-in's GPUs did for it.
    let idle: Vec<_> = busy.iter().map(|&(p, g, m, _)| (p, g, m, 0)).collect();
    nvml.set_processes(&idle);
    std::thread::sleep(Duration::from_millis(1000));
    let s = agent.scrape();
    for (p, c, gpu, pids, util) in [
        (&a, &ca, 0, vec![a1], 0.30),
        (&a, &ca, 1, vec![a2], 0.60),
        (&b, &cb, 1, vec![b1], 0.20),
    ] {
        let got = v(
            &s,
            "ebpf_gpu_compute_time_seconds_total",
            &sel(p, c, &gpu.to_string()),
        )
        .unwrap();
        let want = nvml.sm_seconds(&pids, Some(gpu));
        let t = nvml.truth();
        eprintln!(
            "pod {} gpu {gpu}: {got} SM-s booked, {want} computed ({} periods, {:?}..{:?})",
            p.uid,
            t.len(),
            t.first().map(|x| x.timestamp_us),
            t.last().map(|x| x.timestamp_us)
        );
        assert!(want > 2.0 * util, "the stand-in computed {want} SM-s");
        assert!(
            got <= want + 1e-6 && got >= want - util * PERIOD_S - 1e-6,
            "pod {} GPU {gpu}: booked {got} SM-s, the stand-in computed {want}",
            p.uid
        );
    }
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
    let with = Agent::no_kube(
        "200ms",
        "nvml",
        &["--nvml-library", nvml.path(), "--gpu-hourly-rate", "3.6"],
    );
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
    assert!(
        find(&s, "gpufeed_gpu_compute_source", &[]).is_empty(),
        "no compute source without a GPU"
    );
}
