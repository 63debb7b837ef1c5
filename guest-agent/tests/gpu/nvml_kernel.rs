//! NVML through a stand-in libnvidia-ml.so.1 built here from C with NVML's real signatures and
//! struct layouts (no GPU and no NVIDIA driver exist on the machines that run the tests),
//! loaded at run time from a configured path. The stand-in samples each process's SM
//! utilisation every 100 ms as the driver does, hands out the latest sample per process with
//! its timestamp, and writes what its GPUs did to a truth file: the SM time the agent books
//! is checked against that file, summed here.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::gpu::{StandInDevice, StandInNvml, NVML_SAMPLE_US, UART_DRIVER};
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
    let capacity = nvml.capacity();
    assert!(capacity.failures.is_empty(), "{:?}", capacity.failures);
    assert_eq!(
        capacity.gpus,
        vec![
            GpuCapacity {
                index: 0,
                memory_total_bytes: Some(80 * GIB),
                // gen 4 x16
                link_bytes_per_second: Some(16 * 1_969_230_769),
            },
            GpuCapacity {
                index: 1,
                memory_total_bytes: Some(24 * GIB),
                // gen 3 x8
                link_bytes_per_second: Some(8 * 984_615_384),
            },
        ]
    );

    let mut clock = SmClock::default();
    let mut sm: HashMap<u32, u64> = HashMap::new();
    let mut read = |clock: &mut SmClock| {
        let r = nvml.read();
        assert!(r.failures.is_empty(), "{:?}", r.failures);
        let r = r.gpus;
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
        nvml.links().gpus,
        vec![
            LinkState {
                gpu: 0,
                generation: Some(1),
                width: Some(16),
                tx_bytes_per_second: Some(1000 * 1024),
                rx_bytes_per_second: Some(2000 * 1024),
            },
            LinkState {
                gpu: 1,
                generation: Some(3),
                width: Some(8),
                tx_bytes_per_second: Some(0),
                rx_bytes_per_second: Some(0),
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
    // ... and without NVML the same command line starts (nvml_cost_without_nvml_at_start_*)

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

const HANDLE: &str = "nvmlDeviceGetHandleByIndex_v2";
const MEMORY_INFO: &str = "nvmlDeviceGetMemoryInfo";
const PROCESSES: &str = "nvmlDeviceGetComputeRunningProcesses_v3";
const UTILIZATION: &str = "nvmlDeviceGetProcessUtilization";
const CURR_GEN: &str = "nvmlDeviceGetCurrPcieLinkGeneration";
/// nvml.h's codes.
const NOT_SUPPORTED: i32 = 3;
const NO_PERMISSION: i32 = 4;
const INSUFFICIENT_SIZE: i32 = 7;
const GPU_IS_LOST: i32 = 15;
const UNKNOWN: i32 = 999;

/// The library on its own against the stand-in's faults: each GPU and each call fails on its
/// own, with NVML's codes, and what the others said is kept; a process list that grows
/// between the size query and the read is asked for again until it fits.
#[test]
fn nvml_each_gpu_and_each_call_fail_on_their_own() {
    let scratch = tempfile::tempdir().unwrap();
    let lib = StandInNvml::new(scratch.path());
    let nvml = Nvml::load(lib.path()).unwrap().unwrap();
    assert!(nvml.missing().is_empty(), "{:?}", nvml.missing());

    // GPU 1 lost: every call about it, its handle included, answers GPU_IS_LOST
    lib.set_control(&["fail 1 * 15"]);
    let c = nvml.capacity();
    assert_eq!(
        c.gpus,
        vec![GpuCapacity {
            index: 0,
            memory_total_bytes: Some(80 * GIB),
            link_bytes_per_second: Some(16 * 1_969_230_769),
        }]
    );
    let f: Vec<_> = c
        .failures
        .iter()
        .map(|f| (f.gpu, f.call, f.code_name()))
        .collect();
    assert_eq!(f, [(Some(1), HANDLE, "GPU_IS_LOST")]);
    assert_eq!(lib.errors_answered(1, HANDLE, GPU_IS_LOST), 1);

    // four GPUs, GPU 2's memory not supported, GPU 3's samples not permitted
    lib.set_control(&[
        "count 4",
        &format!("fail 2 {MEMORY_INFO} {NOT_SUPPORTED}"),
        &format!("fail 3 {UTILIZATION} {NO_PERMISSION}"),
    ]);
    lib.set_processes(&[(301, 3, 5 * GIB, 70)]);
    let c = nvml.capacity();
    assert_eq!(c.gpus.len(), 4);
    assert_eq!(c.gpus[2].memory_total_bytes, None);
    // gen 5 x16 still read
    assert_eq!(c.gpus[2].link_bytes_per_second, Some(16 * 3_938_461_538));
    assert_eq!(c.gpus[3].memory_total_bytes, Some(16 * GIB));
    let mut nvml = nvml;
    let r = nvml.read();
    let f: Vec<_> = r
        .failures
        .iter()
        .map(|f| (f.gpu, f.call, f.code_name()))
        .collect();
    assert_eq!(f, [(Some(3), UTILIZATION, "NO_PERMISSION")]);
    // GPU 3's processes and memory are there without its samples
    assert_eq!(r.gpus[3].processes, vec![(301, Some(5 * GIB))]);
    assert!(r.gpus[3].samples.is_empty());

    // the device count itself fails: no GPU, one failure about no GPU
    lib.set_control(&["fail * nvmlDeviceGetCount_v2 999"]);
    let r = nvml.read();
    assert!(r.gpus.is_empty());
    assert_eq!(r.failures.len(), 1);
    assert_eq!(
        (r.failures[0].gpu, r.failures[0].code_name()),
        (None, "UNKNOWN")
    );
    let _ = UNKNOWN;

    // 40 processes on GPU 0 (more than the first buffer), and a list that grew three times
    // between the size query and the read: asked for again each time, every process read
    lib.set_control(&["grow 0 3"]);
    let many: Vec<(u32, u32, u64, u32)> = (0..40)
        .map(|i| (1000 + i, 0, GIB + u64::from(i), 1))
        .collect();
    lib.set_processes(&many);
    let r = nvml.read();
    assert!(r.failures.is_empty(), "{:?}", r.failures);
    let mut got = r.gpus[0].processes.clone();
    got.sort();
    let want: Vec<(u32, Option<u64>)> = many.iter().map(|p| (p.0, Some(p.2))).collect();
    assert_eq!(got, want);
    assert_eq!(
        lib.errors_answered(0, PROCESSES, INSUFFICIENT_SIZE),
        3,
        "asked again after each of the three growths, the fourth call fits"
    );
    // the next read asks with room for the 40 at once: one call, no size answer; the same
    // list read at every tick costs one round trip to the driver, not two
    lib.set_control(&[]);
    for _ in 0..3 {
        let r = nvml.read();
        assert_eq!(r.gpus[0].processes.len(), 40);
    }
    assert_eq!(
        lib.errors_answered(0, PROCESSES, INSUFFICIENT_SIZE),
        3,
        "a list as long as the last one fits the first buffer"
    );
    // and a list that grew past the room left asks again, once
    let more: Vec<(u32, u32, u64, u32)> = (0..60)
        .map(|i| (2000 + i, 0, GIB + u64::from(i), 1))
        .collect();
    lib.set_processes(&more);
    assert_eq!(nvml.read().gpus[0].processes.len(), 60);
    assert_eq!(lib.errors_answered(0, PROCESSES, INSUFFICIENT_SIZE), 4);
}

/// An NVML without one optional call (built without nvmlDeviceGetCurrPcieLinkGeneration):
/// it loads, says the call is missing, and every other reading is there.
#[test]
fn nvml_without_an_optional_call_reads_the_rest() {
    let scratch = tempfile::tempdir().unwrap();
    let lib = StandInNvml::variant(scratch.path(), &[&format!("OMIT_{CURR_GEN}")]);
    lib.set_links(&[(0, 2, 16, 10, 20)]);
    let nvml = Nvml::load(lib.path()).unwrap().unwrap();
    assert_eq!(nvml.missing(), [CURR_GEN]);
    let c = nvml.capacity();
    assert!(c.failures.is_empty() && c.gpus.iter().all(GpuCapacity::complete));
    let l = nvml.links();
    assert!(l.failures.is_empty(), "a missing call is not a failure");
    assert_eq!(
        l.gpus[0],
        LinkState {
            gpu: 0,
            generation: None,
            width: Some(16),
            tx_bytes_per_second: Some(10 * 1024),
            rx_bytes_per_second: Some(20 * 1024),
        }
    );
}

/// The agent on a stand-in whose GPU 1 is lost from the start (every call about it answers
/// GPU_IS_LOST), with a cost asked for and no capacity configured: it starts; GPU 0 keeps its
/// numbers (its capacity, and its process's SM time equal to what the stand-in computed); the
/// cost divides by GPU 0's capacity alone; the failures are counted per GPU, call and code,
/// no more than the stand-in answered, and logged once. GPU 1 back (an eGPU replugged) is
/// counted again with its capacity read anew; lost again, left out again.
#[test]
fn nvml_a_lost_gpu_is_counted_and_the_others_keep_their_numbers() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let nvml = StandInNvml::new(scratch.path());
    nvml.set_control(&["fail 1 * 15"]);
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let (a0, a1) = (a.spawn("exec sleep 60"), a.spawn("exec sleep 60"));
    nvml.set_processes(&[(a0, 0, 3 * GIB, 40), (a1, 1, 2 * GIB, 50)]);
    let agent = Agent::no_kube(
        "200ms",
        "nvml",
        &[
            "--nvml-library",
            nvml.path(),
            "--gpu-hourly-rate",
            "3.6",
            "--gpu-duty-window",
            "2s",
        ],
    );
    let ca = a.container_id[..12].to_string();
    let on = |gpu: &'static str| {
        [
            ("pod", a.uid.clone()),
            ("container", ca.clone()),
            ("gpu", gpu.to_string()),
        ]
    };
    let v = |s: &[Sample], name: &str, l: &[(&str, String)]| {
        let l: Vec<(&str, &str)> = l.iter().map(|(k, v)| (*k, v.as_str())).collect();
        value(s, name, &l)
    };
    assert!(
        wait_for(Duration::from_secs(10), || v(
            &agent.scrape(),
            "ebpf_gpu_compute_time_seconds_total",
            &on("0")
        )
        .filter(|x| *x > 0.5)
        .map(|_| ()))
        .is_some(),
        "GPU 0's compute time accrues"
    );
    let s = agent.scrape();
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(1.0));
    assert_eq!(
        value(&s, "gpufeed_gpu_compute_source", &[("source", "nvml")]),
        Some(1.0)
    );
    assert_eq!(
        value(&s, "gpufeed_gpu_memory_total_bytes", &[("gpu", "0")]),
        Some((80 * GIB) as f64)
    );
    assert_eq!(
        value(&s, "gpufeed_gpu_memory_total_bytes", &[("gpu", "1")]),
        None
    );
    assert_eq!(
        v(&s, "ebpf_gpu_compute_time_seconds_total", &on("1")),
        None,
        "nothing is read of a lost GPU"
    );
    // the process on GPU 0 only: GPU 1's is not known
    let l = [("pod", a.uid.as_str()), ("container", ca.as_str())];
    assert_eq!(
        value(&s, "gpufeed_nvml_process_memory_bytes", &l),
        Some((3 * GIB) as f64)
    );
    // the cost's denominators: GPU 0's alone
    for (resource, want) in [
        ("memory_bytes", (80 * GIB) as f64),
        ("link_bytes_per_second", (16 * 1_969_230_769u64) as f64),
        ("gpus", 1.0),
    ] {
        assert_eq!(
            value(&s, "gpufeed_gpu_cost_capacity", &[("resource", resource)]),
            Some(want),
            "{resource}"
        );
    }
    let lost = [("gpu", "1"), ("call", HANDLE), ("code", "GPU_IS_LOST")];
    let counted = value(&s, "gpufeed_nvml_errors_total", &lost).unwrap();
    let answered = nvml.errors_answered(1, HANDLE, GPU_IS_LOST) as f64;
    eprintln!("GPU 1 lost: {counted} counted, {answered} answered by the stand-in");
    // the scrape may come a tick after the stand-in answered (the agent's survey at start and
    // per tick; the cost takes the probe's capacity, it makes no call of its own)
    assert!(counted >= 5.0 && counted <= answered && answered - counted <= 3.0);
    assert_eq!(
        find(&s, "gpufeed_nvml_errors_total", &[])
            .iter()
            .filter(|x| x.labels.get("code").map(String::as_str) != Some("GPU_IS_LOST"))
            .count(),
        0,
        "only the lost GPU's failures"
    );

    // GPU 0's process stops computing; its SM time is what the stand-in's GPU 0 did for it
    nvml.set_processes(&[(a0, 0, 3 * GIB, 0), (a1, 1, 2 * GIB, 0)]);
    std::thread::sleep(Duration::from_millis(1000));
    let s = agent.scrape();
    let got = v(&s, "ebpf_gpu_compute_time_seconds_total", &on("0")).unwrap();
    let want = nvml.sm_seconds(&[a0], Some(0));
    eprintln!("GPU 0: {got} SM-s booked, {want} computed by the stand-in");
    assert!(
        got <= want + 1e-6 && got >= want - 0.40 * PERIOD_S - 1e-6,
        "GPU 0: booked {got} SM-s, the stand-in computed {want}"
    );
    assert!(
        nvml.sm_seconds(&[a1], None) == 0.0,
        "the stand-in never sampled the lost GPU"
    );

    // GPU 1 comes back: counted again, its capacity read anew
    nvml.set_control(&[]);
    let back = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        (value(&s, "gpufeed_nvml_gpus", &[]) == Some(2.0)).then_some(s)
    })
    .expect("GPU 1 counted again");
    assert_eq!(
        value(&back, "gpufeed_gpu_memory_total_bytes", &[("gpu", "1")]),
        Some((24 * GIB) as f64)
    );
    assert_eq!(
        value(
            &back,
            "gpufeed_gpu_link_max_bytes_per_second",
            &[("gpu", "1")]
        ),
        Some((8 * 984_615_384u64) as f64)
    );
    // lost again, this time answering its utilisation call so
    nvml.set_control(&[&format!("fail 1 {UTILIZATION} 15")]);
    assert!(
        wait_for(Duration::from_secs(10), || {
            let s = agent.scrape();
            (value(&s, "gpufeed_nvml_gpus", &[]) == Some(1.0)
                && value(&s, "gpufeed_gpu_memory_total_bytes", &[("gpu", "1")]).is_none())
            .then_some(())
        })
        .is_some(),
        "GPU 1 left out again"
    );
    std::thread::sleep(Duration::from_millis(600));
    let log = agent.log_text();
    let lines = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        lines("nvmlDeviceGetHandleByIndex_v2 returned NVML_ERROR_GPU_IS_LOST (15); that reading"),
        1,
        "each (GPU, call, code) logged once:\n{log}"
    );
    assert_eq!(lines("GPU back"), 1, "{log}");
    assert_eq!(lines("GPU lost"), 2, "{log}");
}

/// An NVML without nvmlDeviceGetCurrPcieLinkGeneration: the agent asked for a cost without
/// configured capacities starts, prices with the capacity NVML gave, says which call is
/// missing, and exports every other number.
#[test]
fn nvml_without_an_optional_call_the_agent_prices_with_what_it_read() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let nvml = StandInNvml::variant(scratch.path(), &[&format!("OMIT_{CURR_GEN}")]);
    nvml.set_links(&[(0, 2, 16, 10, 20)]);
    let agent = Agent::no_kube(
        "200ms",
        "nvml",
        &["--nvml-library", nvml.path(), "--gpu-hourly-rate", "3.6"],
    );
    let s = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        value(&s, "gpufeed_gpu_node_cost_total", &[("currency", "USD")])
            .filter(|v| *v > 0.0)
            .map(|_| s)
    })
    .expect("the node's cost accrues");
    for (resource, want) in [
        ("memory_bytes", ((80 + 24) * GIB) as f64),
        (
            "link_bytes_per_second",
            (16 * 1_969_230_769u64 + 8 * 984_615_384) as f64,
        ),
        ("gpus", 2.0),
    ] {
        assert_eq!(
            value(&s, "gpufeed_gpu_cost_capacity", &[("resource", resource)]),
            Some(want),
            "{resource}"
        );
    }
    assert_eq!(
        value(&s, "gpufeed_nvml_call_missing", &[("call", CURR_GEN)]),
        Some(1.0)
    );
    assert!(find(&s, "gpufeed_nvml_errors_total", &[]).is_empty());
    assert!(find(&s, "gpufeed_gpu_pcie_link_generation", &[]).is_empty());
    assert_eq!(
        value(&s, "gpufeed_gpu_pcie_link_width", &[("gpu", "0")]),
        Some(16.0)
    );
    assert_eq!(
        value(
            &s,
            "gpufeed_gpu_pcie_throughput_bytes_per_second",
            &[("gpu", "0"), ("direction", "rx")]
        ),
        Some(20.0 * 1024.0)
    );
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(2.0));
}

/// A cost asked for with no capacity configured and no NVML at start (the path
/// `--nvml-library` names is created later): the agent starts, serves every other number and
/// says with `gpufeed_gpu_cost_capacity{reason}` and one log line why there is no cost. Once
/// the library appears the cost divides by the capacity NVML reports: a pod holding VRAM
/// (weights 0,1,0: VRAM alone) costs, per unit of the node's cost, its VRAM ÷ the stand-in's
/// memory; GPU 1 lost, then back, changes that memory, and the cost follows each.
#[test]
fn nvml_cost_without_nvml_at_start_waits_then_follows_the_capacity() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let late = scratch.path().join("late");
    std::fs::create_dir(&late).unwrap();
    let lib_path = late.join("libnvidia-ml.so.1");
    let nvml = StandInNvml::new(scratch.path());
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let a0 = a.spawn("exec sleep 60");
    let vram = 3 * GIB;
    nvml.set_processes(&[(a0, 0, vram, 0)]);
    let agent = Agent::no_kube(
        "200ms",
        "nvml",
        &[
            "--nvml-library",
            lib_path.to_str().unwrap(),
            "--gpu-hourly-rate",
            "3.6",
            "--gpu-cost-weights",
            "0,1,0",
        ],
    );
    let capacity = |s: &[Sample], resource: &str| {
        let f = find(s, "gpufeed_gpu_cost_capacity", &[("resource", resource)]);
        assert_eq!(f.len(), 1, "{resource}: {f:?}");
        (
            f[0].value,
            f[0].labels.get("reason").cloned().unwrap_or_default(),
        )
    };
    let s = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        // past the first tick (`not_read_yet` before it)
        let read = find(&s, "gpufeed_gpu_cost_capacity", &[])
            .iter()
            .any(|x| x.labels.get("reason").is_some_and(|r| r != "not_read_yet"));
        read.then_some(s)
    })
    .unwrap_or_else(|| panic!("the capacity series; log:\n{}", agent.log_text()));
    for resource in ["memory_bytes", "link_bytes_per_second", "gpus"] {
        let got = capacity(&s, resource);
        eprintln!("without NVML: {resource} = {got:?}");
        assert_eq!(got, (0.0, "nvml_not_loaded".to_string()), "{resource}");
    }
    assert_eq!(
        value(&s, "gpufeed_probe_up", &[("probe", "nvml")]),
        Some(1.0)
    );
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(0.0));
    assert!(find(&s, "gpufeed_gpu_node_cost_total", &[]).is_empty());
    assert!(find(&s, "gpufeed_gpu_cost_total", &[]).is_empty());

    nvml.build(&lib_path, &[]);
    let link0 = 16 * 1_969_230_769u64;
    let link1 = 8 * 984_615_384u64;
    // the pod's cost over an interval ÷ the node's cost over it, the capacity at `memory`
    // throughout; compared with vram ÷ memory, from the test's own numbers
    let ratio_at = |memory: u64, link: u64, gpus: f64| {
        let stable = |s: &[Sample]| {
            capacity(s, "memory_bytes") == (memory as f64, String::new())
                && capacity(s, "link_bytes_per_second") == (link as f64, String::new())
                && capacity(s, "gpus") == (gpus, String::new())
        };
        let costs = |s: &[Sample]| {
            let pod = value(s, "gpufeed_gpu_cost_total", &[("pod", a.uid.as_str())])?;
            let node = value(s, "gpufeed_gpu_node_cost_total", &[("currency", "USD")])?;
            (pod > 0.0).then_some((pod, node))
        };
        wait_for(Duration::from_secs(10), || {
            let s = agent.scrape();
            (stable(&s) && costs(&s).is_some()).then_some(())
        })
        .unwrap_or_else(|| panic!("capacity {memory}; log:\n{}", agent.log_text()));
        // a tick after the change, then an interval with the capacity stable at both ends
        std::thread::sleep(Duration::from_millis(400));
        let s1 = agent.scrape();
        std::thread::sleep(Duration::from_millis(1000));
        let s2 = agent.scrape();
        assert!(stable(&s1) && stable(&s2), "the capacity moved");
        let ((p1, n1), (p2, n2)) = (costs(&s1).unwrap(), costs(&s2).unwrap());
        let got = (p2 - p1) / (n2 - n1);
        let want = vram as f64 / memory as f64;
        eprintln!(
            "capacity {memory} B, {link} B/s, {gpus} GPUs: pod {p1}..{p2}, node {n1}..{n2}: {got} of the node, want {want}"
        );
        assert!(n2 > n1, "the node's cost accrues");
        assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    };
    ratio_at((80 + 24) * GIB, link0 + link1, 2.0);
    // GPU 1 lost: the cost divides by GPU 0 alone
    nvml.set_control(&["fail 1 * 15"]);
    ratio_at(80 * GIB, link0, 1.0);
    // back: both again
    nvml.set_control(&[]);
    ratio_at((80 + 24) * GIB, link0 + link1, 2.0);

    let log = agent.log_text();
    let lines = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        lines("no GPU capacity, the cost is not computed until there is one: NVML not loaded ("),
        1,
        "said once:\n{log}"
    );
    assert_eq!(
        lines("--gpu-memory-bytes and --gpu-link-bytes-per-second not set"),
        1,
        "{log}"
    );
    assert_eq!(
        lines("GPU capacity for the cost: memory_bytes="),
        1,
        "{log}"
    );
    assert_eq!(lines("GPU capacity for the cost changed"), 2, "{log}");
}

/// NVML that appears after start (the path `--nvml-library` names is created later), and
/// then sees no GPU: the compute source moves from driver time to NVML and back, the
/// change is logged with why, and `gpufeed_gpu_compute_source` follows.
#[test]
fn nvml_appearing_after_start_is_elected_and_its_going_away_too() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let late = scratch.path().join("late");
    std::fs::create_dir(&late).unwrap();
    let lib_path = late.join("libnvidia-ml.so.1");
    let nvml = StandInNvml::new(scratch.path());
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let a0 = a.spawn("exec sleep 60");
    nvml.set_processes(&[(a0, 0, GIB, 30)]);
    let agent = Agent::no_kube(
        "200ms",
        "nvml,gpu_driver",
        &["--nvml-library", lib_path.to_str().unwrap()],
    );
    let source = |s: &[Sample]| {
        find(s, "gpufeed_gpu_compute_source", &[])
            .iter()
            .filter(|x| x.value == 1.0)
            .filter_map(|x| x.labels.get("source").cloned())
            .collect::<Vec<_>>()
    };
    let s = agent.scrape();
    assert_eq!(source(&s), ["driver_time"]);
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(0.0));

    nvml.build(&lib_path, &[]);
    let s = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        (source(&s) == ["nvml"]).then_some(s)
    })
    .unwrap_or_else(|| panic!("NVML elected; log:\n{}", agent.log_text()));
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(2.0));
    assert_eq!(
        value(
            &s,
            "gpufeed_nvml_library_info",
            &[("library", lib_path.to_str().unwrap())]
        ),
        Some(1.0)
    );
    let ca = a.container_id[..12].to_string();
    let sel = [
        ("pod", a.uid.as_str()),
        ("container", ca.as_str()),
        ("gpu", "0"),
    ];
    assert!(
        wait_for(Duration::from_secs(10), || value(
            &agent.scrape(),
            "ebpf_gpu_compute_time_seconds_total",
            &sel
        )
        .filter(|v| *v > 0.0))
        .is_some(),
        "NVML's compute time once elected"
    );

    // NVML sees no GPU any more: back to driver time
    nvml.set_control(&["count 0"]);
    let s = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        (source(&s) == ["driver_time"]).then_some(s)
    })
    .expect("driver time elected again");
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(0.0));
    let log = agent.log_text();
    let elections: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("GPU compute time source"))
        .collect();
    assert_eq!(elections.len(), 3, "{log}");
    assert!(
        elections[0].contains("source=\"driver_time\"")
            || elections[0].contains("source=driver_time"),
        "{}",
        elections[0]
    );
    assert!(
        elections[0].contains("cannot be opened"),
        "why not NVML: {}",
        elections[0]
    );
    assert!(elections[2].contains("sees 0 GPUs"), "{}", elections[2]);
}

/// The shipped PrometheusRule's groups as a plain rule file.
fn rule_file() -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../talos/kubernetes/components/prometheus-operator/prometheus-rules.yaml");
    let pr: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut file = serde_yaml::Mapping::new();
    file.insert("groups".into(), pr["spec"]["groups"].clone());
    serde_yaml::to_string(&file).unwrap()
}

/// A GPU node where a pod makes driver calls and the agent has no NVML (its `--nvml-library`
/// path does not exist yet): the real Prometheus, scraping the agent with the shipped rules,
/// has GpufeedGpuWithoutNvml pending for that source, and the agent's doctor fails
/// `gpu_compute_source` naming the pod, where it looked and the fix. Once the library
/// appears the agent elects NVML without a restart, the alert clears and the check passes.
#[test]
fn prometheus_alerts_on_a_gpu_node_without_nvml_and_the_doctor_says_why() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let dev = StandInDevice::new(dir);
    let nvml = StandInNvml::new(dir);
    let late = dir.join("late");
    std::fs::create_dir(&late).unwrap();
    let lib_path = late.join("libnvidia-ml.so.1");
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let go = dir.join("go");
    let pid = a.spawn(&dev.command(600, 1, &go, &dir.join("a.out"), ""));
    std::fs::write(&go, "").unwrap();
    nvml.set_processes(&[(pid, 0, GIB, 50)]);
    let prefix = format!("{}/nvidia", dir.display());
    let agent = Agent::no_kube(
        "200ms",
        "nvml,gpu_driver",
        &[
            "--gpu-device-prefix",
            &prefix,
            "--gpu-driver-name",
            UART_DRIVER,
            "--nvml-library",
            lib_path.to_str().unwrap(),
        ],
    );
    let target = agent.addr;
    let prom = Prometheus::start_with(|pdir| {
        std::fs::write(pdir.join("rules.yaml"), rule_file()).unwrap();
        format!(
            "rule_files:\n  - {}\nscrape_configs:\n  - job_name: gpufeed-guest\n    \
             static_configs:\n      - targets: ['{target}']\n",
            pdir.join("rules.yaml").display()
        )
    });
    let alerts = || {
        prom.query("ALERTS{alertname=\"GpufeedGpuWithoutNvml\"}")
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["metric"]["alertstate"].as_str().unwrap_or("").to_string(),
                    s["metric"]["source"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect::<Vec<_>>()
    };
    let pending = wait_for(Duration::from_secs(30), || {
        let a = alerts();
        (!a.is_empty()).then_some(a)
    })
    .unwrap_or_else(|| panic!("no alert; agent log:\n{}", agent.log_text()));
    eprintln!("alerts without NVML: {pending:?}");
    assert_eq!(
        pending,
        [("pending".to_string(), "driver_time".to_string())]
    );

    let check = || {
        value(
            &agent.scrape(),
            "gpufeed_check_ok",
            &[("check", "gpu_compute_source")],
        )
    };
    wait_for(Duration::from_secs(15), || {
        (check() == Some(0.0)).then_some(())
    })
    .expect("the doctor fails gpu_compute_source");
    let findings: serde_json::Value =
        serde_json::from_str(&agent.try_get("/doctor").unwrap()).unwrap();
    let f = findings
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "gpu_compute_source")
        .unwrap()
        .clone();
    let detail = f["detail"].as_str().unwrap();
    eprintln!("doctor: {f}");
    assert!(detail.contains(&a.uid), "{detail}");
    assert!(detail.contains("driver_time"), "{detail}");
    assert!(
        detail.contains(&format!(
            "--nvml-library {} cannot be opened",
            lib_path.display()
        )),
        "{detail}"
    );
    assert!(f["fix"].as_str().unwrap().contains("runtimeClassName"));

    // the library appears: NVML elected, the alert clears, the check passes
    nvml.build(&lib_path, &[]);
    wait_for(Duration::from_secs(30), || {
        alerts().is_empty().then_some(())
    })
    .unwrap_or_else(|| panic!("the alert stays: {:?}", alerts()));
    wait_for(Duration::from_secs(15), || {
        (check() == Some(1.0)).then_some(())
    })
    .expect("the doctor passes gpu_compute_source");
    assert_eq!(
        prom.scalar("gpufeed_gpu_compute_source{source=\"nvml\"}"),
        Some(1.0)
    );
}

/// A MIG GPU with GPM (the stand-in's GPU 1, as on Hopper): each instance's SM utilisation
/// between two GPM samples, shared by its processes: first through the library (an instance's
/// first sample books nothing, the next its SMs' busy share of the time between), then the
/// agent: two pods on two instances of GPU 1 get the compute time the stand-in's instances
/// did (its truth file) within the first interval and a sample period, their duty cycles
/// their instances' utilisation, and the GPU is not said unattributed.
#[test]
fn nvml_mig_compute_per_instance_from_gpm() {
    let scratch = tempfile::tempdir().unwrap();
    let lib = StandInNvml::new(scratch.path());
    lib.set_control(&["mig 1", "gpm 1", "instance 202 3 1"]);
    lib.set_processes(&[(202, 1, 5 * GIB, 60)]);
    let mut nvml = Nvml::load(lib.path()).unwrap().unwrap();
    let first = nvml.read();
    assert!(first.failures.is_empty(), "{:?}", first.failures);
    assert_eq!(first.gpus[0].mig_sm, None, "GPU 0 is not in MIG mode");
    assert_eq!(
        first.gpus[1].mig_sm,
        Some(vec![]),
        "a first sample books nothing"
    );
    std::thread::sleep(Duration::from_millis(1000));
    let r = nvml.read();
    let i = r.gpus[1].mig_sm.clone().unwrap();
    assert_eq!(i.len(), 1, "{i:?}");
    assert_eq!(i[0].gpu_instance, 3);
    // the stand-in's GPM rate is on its 100 ms grid, the span the library's own clock
    let busy = i[0].sm_ns as f64 / i[0].span_ns as f64;
    assert!((busy - 0.6).abs() < 0.08, "instance 3 busy {busy}");
    drop(nvml);

    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut b = Pod::random(&sb, Layout::Systemd, "burstable");
    let (a1, b1) = (a.spawn("exec sleep 60"), b.spawn("exec sleep 60"));
    lib.set_control(&[
        "mig 1",
        "gpm 1",
        &format!("instance {a1} 3 1"),
        &format!("instance {b1} 5 0"),
    ]);
    let (ua, ub) = (60u32, 30u32);
    lib.set_processes(&[(a1, 1, 5 * GIB, ua), (b1, 1, 3 * GIB, ub)]);
    let agent = Agent::no_kube(
        "200ms",
        "nvml",
        &["--nvml-library", lib.path(), "--gpu-duty-window", "2s"],
    );
    let compute = |s: &[Sample], pod: &Pod| {
        value(
            s,
            "ebpf_gpu_compute_time_seconds_total",
            &[("pod", pod.uid.as_str()), ("gpu", "1")],
        )
    };
    let duty = |s: &[Sample], pod: &Pod| {
        value(
            s,
            "ebpf_gpu_active_compute_duty_cycle",
            &[("pod", pod.uid.as_str()), ("gpu", "1")],
        )
    };
    let steady = wait_for(Duration::from_secs(15), || {
        let s = agent.scrape();
        let near =
            |d: Option<f64>, u: u32| d.is_some_and(|d| (d - f64::from(u) / 100.0).abs() <= 0.05);
        (near(duty(&s, &a), ua) && near(duty(&s, &b), ub)).then_some(s)
    });
    let s = steady.unwrap_or_else(|| {
        let s = agent.scrape();
        panic!(
            "duty cycles {:?} {:?} for 0.6 and 0.3; log:\n{}",
            duty(&s, &a),
            duty(&s, &b),
            agent.log.lock().unwrap()
        )
    });
    assert!(
        find(&s, "gpufeed_gpu_compute_unattributed", &[("gpu", "1")]).is_empty(),
        "GPM gives the MIG GPU's compute"
    );
    std::thread::sleep(Duration::from_secs(2));
    lib.set_processes(&[(a1, 1, 5 * GIB, 0), (b1, 1, 3 * GIB, 0)]);
    std::thread::sleep(Duration::from_millis(1500));
    let s = agent.scrape();
    let period = NVML_SAMPLE_US as f64 / 1e6;
    for (pod, pid, u) in [(&a, a1, ua), (&b, b1, ub)] {
        let truth = lib.sm_seconds(&[pid], Some(1));
        let got = compute(&s, pod).unwrap_or(0.0);
        let u = f64::from(u) / 100.0;
        eprintln!("{}: {got:.3} SM-s booked, its instance {truth:.3}", pod.uid);
        // the first interval (an instance's first sample) and a grid period either way
        assert!(
            (got - truth).abs() <= u * (0.2 + 2.0 * period) + 1e-6 && truth > 0.5,
            "{}: booked {got} SM-s, its instance computed {truth}",
            pod.uid
        );
    }
    assert!(find(&s, "gpufeed_nvml_errors_total", &[]).is_empty());
}

/// A GPU in MIG mode (the stand-in's GPU 1): NVML keeps no per-process utilisation there, so
/// the library reads each process's MIG instance and memory and asks for no samples; the
/// agent exports each container's memory per instance and says that GPU's compute is
/// unattributed: no compute time for it (absent, not 0), while GPU 0's is booked as before.
#[test]
fn nvml_mig_memory_per_instance_and_compute_said_unattributed() {
    use gpufeed_guest::nvml::sm_time::MigProcess;
    let scratch = tempfile::tempdir().unwrap();
    let lib = StandInNvml::new(scratch.path());
    lib.set_control(&["mig 1", "instance 202 3 1"]);
    lib.set_processes(&[(201, 0, GIB, 40), (202, 1, 5 * GIB, 60)]);
    let mut nvml = Nvml::load(lib.path()).unwrap().unwrap();
    let r = nvml.read();
    assert!(r.failures.is_empty(), "{:?}", r.failures);
    assert_eq!(r.gpus[0].mig, None);
    assert_eq!(
        r.gpus[1].mig,
        Some(vec![MigProcess {
            pid: 202,
            gpu_instance: 3,
            compute_instance: 1,
            memory_bytes: Some(5 * GIB),
        }])
    );
    assert!(r.gpus[1].samples.is_empty());
    assert_eq!(
        lib.errors_answered(1, UTILIZATION, NOT_SUPPORTED),
        0,
        "no utilisation asked of a MIG GPU"
    );
    drop(nvml);

    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let (a0, a1) = (a.spawn("exec sleep 60"), a.spawn("exec sleep 60"));
    lib.set_control(&["mig 1", &format!("instance {a1} 3 1")]);
    lib.set_processes(&[(a0, 0, GIB, 40), (a1, 1, 5 * GIB, 60)]);
    let agent = Agent::no_kube("200ms", "nvml", &["--nvml-library", lib.path()]);
    let ca = a.container_id[..12].to_string();
    let compute = |s: &[Sample], gpu: &str| {
        value(
            s,
            "ebpf_gpu_compute_time_seconds_total",
            &[
                ("pod", a.uid.as_str()),
                ("container", ca.as_str()),
                ("gpu", gpu),
            ],
        )
    };
    let s = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        compute(&s, "0").filter(|v| *v > 0.2).map(|_| s)
    })
    .expect("GPU 0's compute time");
    assert_eq!(
        compute(&s, "1"),
        None,
        "a MIG GPU's compute is not read as 0"
    );
    assert_eq!(
        value(
            &s,
            "gpufeed_gpu_compute_unattributed",
            &[("gpu", "1"), ("reason", "mig")]
        ),
        Some(1.0)
    );
    assert!(find(&s, "gpufeed_gpu_compute_unattributed", &[("gpu", "0")]).is_empty());
    assert_eq!(
        value(
            &s,
            "gpufeed_nvml_mig_process_memory_bytes",
            &[
                ("pod", a.uid.as_str()),
                ("container", ca.as_str()),
                ("gpu", "1"),
                ("gpu_instance", "3"),
                ("compute_instance", "1"),
            ]
        ),
        Some((5 * GIB) as f64)
    );
    // the container's memory over all GPUs still counts the MIG process
    assert_eq!(
        value(
            &s,
            "gpufeed_nvml_process_memory_bytes",
            &[("pod", a.uid.as_str()), ("container", ca.as_str())]
        ),
        Some((6 * GIB) as f64)
    );
    assert!(find(&s, "gpufeed_nvml_errors_total", &[]).is_empty());
}

/// CUDA MPS: NVML samples only the MPS server (pod c's `nvidia-cuda-mps-server`, 60% of GPU
/// 0); its clients have no samples of their own: pod a makes GPU driver calls throughout, pod
/// b only at the start. The agent splits the server's SM time among the client containers by
/// their recent driver activity: together exactly what the stand-in's GPU did for the server,
/// most of it to a (an equal split would give a and b the same), some to b (never 0), none to
/// the server's own container.
///
/// a and b hold their ioctls on the one stand-in tty, whose break lock makes them take turns:
/// while both call, each is in the driver all the time (one holding, one waiting), so b's six
/// 100 ms calls span about 1.2 s, and a is alone for the 4 s window's rest.
#[test]
fn nvml_mps_server_time_goes_to_its_clients_by_their_gpu_activity() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let dev = StandInDevice::new(dir);
    let nvml = StandInNvml::new(dir);
    let server_bin = dir.join("nvidia-cuda-mps-server");
    std::fs::copy("/bin/sleep", &server_bin).unwrap();
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut b = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut c = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let go = dir.join("go");
    // 100 ms calls back to back: a 80 (past the window), b 6 (taking turns with a's)
    let a1 = a.spawn(&dev.command(80, 1, &go, &dir.join("a1.out"), ""));
    let b1 = b.spawn(&dev.command(6, 1, &go, &dir.join("b1.out"), ""));
    let srv = c.spawn(&format!("exec {} 60", server_bin.display()));
    let clients = |server_sm: u32| {
        vec![
            (srv, 0, GIB, server_sm),
            (a1, 0, 2 * GIB, 0),
            (b1, 0, 2 * GIB, 0),
        ]
    };
    nvml.set_processes(&clients(60));
    let prefix = format!("{}/nvidia", dir.display());
    let agent = Agent::no_kube(
        "200ms",
        "nvml,gpu_driver",
        &[
            "--gpu-device-prefix",
            &prefix,
            "--gpu-driver-name",
            UART_DRIVER,
            "--nvml-library",
            nvml.path(),
        ],
    );
    // the clients start once the agent reads NVML and knows the server (on a loaded machine
    // its start takes seconds): their activity is then all seen, a's four seconds against b's
    // one and a bit
    let up = wait_for(Duration::from_secs(30), || {
        let s = agent.scrape();
        (value(&s, "gpufeed_nvml_mps_servers", &[]) == Some(1.0)
            && value(&s, "gpufeed_gpu_compute_source", &[("source", "nvml")]) == Some(1.0))
        .then_some(())
    });
    assert!(up.is_some(), "{}", agent.log.lock().unwrap());
    std::fs::write(&go, "").unwrap();
    let sum_of = |s: &[Sample], name: &str, p: &Pod| {
        find(s, name, &[("pod", p.uid.as_str())])
            .iter()
            .map(|x| x.value)
            .sum::<f64>()
    };
    std::thread::sleep(Duration::from_millis(4000));
    // the server stops; once its last samples are read, every SM-second it had is booked
    nvml.set_processes(&clients(0));
    std::thread::sleep(Duration::from_millis(1000));
    let s = agent.scrape();
    let compute = "ebpf_gpu_compute_time_seconds_total";
    let (got_a, got_b, got_c) = (
        sum_of(&s, compute, &a),
        sum_of(&s, compute, &b),
        sum_of(&s, compute, &c),
    );
    let driver = "ebpf_gpu_driver_time_seconds_total";
    let (drv_a, drv_b) = (sum_of(&s, driver, &a), sum_of(&s, driver, &b));
    let want = nvml.sm_seconds(&[srv], Some(0));
    eprintln!(
        "MPS: server computed {want} SM-s; booked a {got_a}, b {got_b}, server's pod {got_c}; \
         driver time a {drv_a} s, b {drv_b} s"
    );
    assert!(want > 1.0, "the stand-in computed {want} SM-s");
    assert!(
        drv_a > 1.5 * drv_b && drv_b >= 0.6 - 0.05,
        "driver time a {drv_a}, b {drv_b}"
    );
    assert_eq!(got_c, 0.0, "nothing to the server's own container");
    let sum = got_a + got_b;
    assert!(
        sum <= want + 1e-6 && sum >= want - 0.6 * PERIOD_S - 1e-6,
        "clients booked {sum} SM-s, the server computed {want}"
    );
    assert!(got_b > 0.0, "never 0 to a client");
    assert!(
        got_a >= 1.5 * got_b,
        "a, busy throughout, over b, busy its first second: {}",
        got_a / got_b
    );
}

/// A process NVML lists that no pod or slice has (here a pid no process holds: one that exited
/// while NVML still lists it): its memory and SM time are said per GPU, equal to what the
/// stand-in reported and computed, beside a pod's own.
#[test]
fn nvml_processes_outside_pods_are_said_not_dropped() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let nvml = StandInNvml::new(scratch.path());
    let sb = CgroupSandbox::new();
    let mut a = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let a0 = a.spawn("exec sleep 60");
    // above any pid in use (pid_max is 4194304 at most), so no process and no cgroup
    let gone = 4_194_301;
    let procs = |sm: u32| vec![(a0, 0, GIB, sm), (gone, 1, 3 * GIB, sm)];
    nvml.set_processes(&procs(50));
    let agent = Agent::no_kube("200ms", "nvml", &["--nvml-library", nvml.path()]);
    let s = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        value(
            &s,
            "gpufeed_nvml_outside_pods_sm_seconds_total",
            &[("gpu", "1")],
        )
        .filter(|v| *v > 0.5)
        .map(|_| s)
    })
    .expect("SM time outside pods");
    assert_eq!(
        value(
            &s,
            "gpufeed_nvml_outside_pods_memory_bytes",
            &[("gpu", "1")]
        ),
        Some((3 * GIB) as f64)
    );
    assert_eq!(
        value(
            &s,
            "gpufeed_nvml_outside_pods_memory_bytes",
            &[("gpu", "0")]
        ),
        None,
        "GPU 0's only process is the pod's"
    );
    nvml.set_processes(&procs(0));
    std::thread::sleep(Duration::from_millis(1000));
    let s = agent.scrape();
    let got = value(
        &s,
        "gpufeed_nvml_outside_pods_sm_seconds_total",
        &[("gpu", "1")],
    )
    .unwrap();
    let want = nvml.sm_seconds(&[gone], Some(1));
    eprintln!("outside pods: {got} SM-s booked, {want} computed by the stand-in");
    assert!(
        got <= want + 1e-6 && got >= want - 0.5 * PERIOD_S - 1e-6,
        "booked {got} SM-s, the stand-in computed {want}"
    );
}
