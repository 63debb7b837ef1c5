//! GPU cost per tenant on the real kernel, from what the GPUs did: four pods of two tenants
//! (their labels served by the fake API server) on a node with two GPUs, whose processes the
//! stand-in NVML reports with per-process SM utilisation and memory. The pods make no driver
//! call and no CUDA call (as a server that launches asynchronously and polls): compute time,
//! duty cycle, each tenant's cost and the idle cost are checked against values computed here
//! from what the stand-in's GPUs did (its truth file) and the memory the test gave them.

use crate::common;

use std::time::{Duration, Instant};

use common::gpu::*;
use common::*;

const NODE: &str = "gpu-node-finops";
/// 3.6 an hour: 0.001 a second.
const RATE_PER_S: f64 = 0.001;
const GIB: u64 = 1 << 30;
/// The stand-in's GPUs: 80 GiB and 24 GiB.
const MEMORY: f64 = (104 * GIB) as f64;
const GPUS: f64 = 2.0;
const INTERVAL: Duration = Duration::from_millis(200);
/// The default weights.
const W_COMPUTE: f64 = 0.55;
const W_VRAM: f64 = 0.35;
/// Rounding of sums of costs around 1e-3 EUR.
const EPS: f64 = 1e-12;

fn sum_where(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    find(samples, name, want).iter().map(|s| s.value).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_per_tenant_and_idle_follow_what_the_gpus_did() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let nvml = StandInNvml::new(scratch.path());
    let sb = CgroupSandbox::new();
    let (_pods, pids, kube) = two_tenants(&sb, NODE, CHAT_AND_EMBED).await;
    let flags = [
        "--probes",
        "nvml",
        "--nvml-library",
        nvml.path(),
        "--gpu-cost-currency",
        "EUR",
    ];
    let args = finops_flags(NODE, &flags);
    let (agent, _kc) = agent_with_kube(&kube, &args).await;
    let info = |pod: &str| {
        value(
            &agent.scrape(),
            "gpufeed_pod_info",
            &[("namespace", "ml"), ("pod", pod)],
        )
    };
    assert!(
        wait_for(Duration::from_secs(15), || [
            "chat-0", "chat-1", "embed-0", "embed-1"
        ]
        .iter()
        .all(|p| info(p).is_some())
        .then_some(()))
        .is_some(),
        "the pods known from the API"
    );
    let node_cost = |s: &[Sample]| value(s, "gpufeed_gpu_node_cost_total", &[("currency", "EUR")]);
    // the cost starts at the first tick that has NVML's capacity (none is configured)
    let (node_first, first) = wait_for(Duration::from_secs(10), || {
        let t = Instant::now();
        node_cost(&agent.scrape()).map(|v| (v, t))
    })
    .expect("the node's cost");

    // The pods start on the GPUs: chat-0 at 90% of GPU 0, chat-1 at 40% of GPU 1, embed-0 at
    // 10% of GPU 0, embed-1 holds memory on GPU 1 and computes nothing (an idle model).
    let (util, gpu, mem) = (
        [90u32, 40, 10, 0],
        [0u32, 1, 0, 1],
        [20 * GIB, 8 * GIB, 4 * GIB, 12 * GIB],
    );
    let names = ["chat-0", "chat-1", "embed-0", "embed-1"];
    let procs = |busy: bool| -> Vec<(u32, u32, u64, u32)> {
        (0..4)
            .map(|i| (pids[i], gpu[i], mem[i], if busy { util[i] } else { 0 }))
            .collect()
    };
    nvml.set_processes(&procs(true));
    let with_memory = Instant::now();
    // The node's cost at the first scrape that shows every pod's memory: the agent has booked
    // the memory at least since the tick that node cost was counted to (however late a loaded
    // machine ran that tick after the listing changed).
    let node_seen = wait_for(Duration::from_secs(15), || {
        let s = agent.scrape();
        (0..4)
            .all(|i| {
                let l = [("namespace", "ml"), ("pod", names[i])];
                sum_where(&s, "gpufeed_nvml_process_memory_bytes", &l) == mem[i] as f64
            })
            .then(|| node_cost(&s))
            .flatten()
    })
    .expect("every pod's memory by NVML");

    // Steady use for a full duty window: each pod's duty cycle on its GPU is its utilisation.
    std::thread::sleep(Duration::from_secs(3));
    let duty = |s: &[Sample], pod: &str, gpu: &str| {
        value(
            s,
            "ebpf_gpu_active_compute_duty_cycle",
            &[("pod", pod), ("gpu", gpu)],
        )
    };
    let steady = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        (0..4)
            .all(|i| {
                let want = f64::from(util[i]) / 100.0;
                duty(&s, names[i], &gpu[i].to_string())
                    .is_some_and(|d| (d - want).abs() <= 0.12 * want + 0.02)
            })
            .then_some(s)
    });
    assert!(
        steady.is_some(),
        "duty cycles: {:?}",
        find(&agent.scrape(), "ebpf_gpu_active_compute_duty_cycle", &[])
            .iter()
            .map(|x| (
                x.label("pod").to_string(),
                x.label("gpu").to_string(),
                x.value
            ))
            .collect::<Vec<_>>()
    );

    // The pods stop computing and keep their memory; every sample read, every interval booked.
    nvml.set_processes(&procs(false));
    std::thread::sleep(Duration::from_millis(1500));
    let scrape_start = Instant::now();
    let s = agent.scrape();
    let scrape_end = Instant::now();
    let node = node_cost(&s).unwrap();
    let idle = value(&s, "gpufeed_gpu_idle_cost_total", &[("currency", "EUR")]).unwrap();
    // the node's price for the time the agent booked, seen from the first scrape
    let booked = (node - node_first) / RATE_PER_S;
    let slack = (INTERVAL * 3).as_secs_f64();
    let (shortest, longest) = (scrape_start - first, scrape_end - first);
    assert!(
        booked >= shortest.as_secs_f64() - slack && booked <= longest.as_secs_f64() + slack,
        "node cost grew by {booked} s of rate between scrapes {shortest:?}..{longest:?} apart"
    );
    // memory was held from the stand-in's listing until the scrape: at most the booked time
    // since the first scrape less what passed before the listing (and a tick), at least the
    // booked time since the agent showed it
    let tick = INTERVAL.as_secs_f64();
    let held_max = booked - (with_memory - first).as_secs_f64() + 2.0 * tick;
    let held_min = (node - node_seen) / RATE_PER_S;
    assert!(held_min <= held_max, "memory held {held_min}..{held_max} s");

    // What each pod computed, by the stand-in: its SM seconds. The agent books a process's
    // first sample from its first read (up to one sample period less).
    let period = NVML_SAMPLE_US as f64 / 1e6;
    let truth: Vec<f64> = (0..4).map(|i| nvml.sm_seconds(&[pids[i]], None)).collect();
    for i in 0..4 {
        let g = gpu[i].to_string();
        let got = sum_where(
            &s,
            "ebpf_gpu_compute_time_seconds_total",
            &[("pod", names[i]), ("gpu", &g)],
        );
        let u = f64::from(util[i]) / 100.0;
        eprintln!("{}: {got} SM-s booked, {} computed", names[i], truth[i]);
        assert!(
            got <= truth[i] + 1e-6 && got >= truth[i] - u * period - 1e-6,
            "{}: booked {got} SM-s, the stand-in computed {}",
            names[i],
            truth[i]
        );
    }
    assert!(truth[0] > 2.0, "chat-0 computed {}", truth[0]);
    assert_eq!(truth[3], 0.0);

    // Each pod's cost, computed here: compute time over the node's two GPUs, memory over the
    // node's memory for the time it was held, at the rate × weights; no copies were made.
    let want = |i: usize, held_s: f64| {
        let compute = W_COMPUTE * truth[i] / GPUS;
        let vram = W_VRAM * mem[i] as f64 / MEMORY * held_s;
        RATE_PER_S * (compute + vram)
    };
    let cost = |pod: &str| {
        let l = [("namespace", "ml"), ("pod", pod), ("currency", "EUR")];
        value(&s, "gpufeed_gpu_cost_total", &l).unwrap_or_else(|| panic!("a cost line for {pod}"))
    };
    let mut tenants = [0.0f64; 2];
    let mut want_tenants = [(0.0f64, 0.0f64); 2];
    for i in 0..4 {
        let c = cost(names[i]);
        // low: the first sample's missing period, a period carried to the next interval (an
        // interval whose samples add up to more than its GPU's time is charged the GPU and
        // carries the rest: GPU 0 is full) and the least memory time; high: the most
        let u = f64::from(util[i]) / 100.0;
        // (both ends are reached where every tick ran on time: EPS for the float rounding)
        let (lo, hi) = (
            want(i, held_min) - RATE_PER_S * W_COMPUTE * 2.0 * u * period / GPUS - EPS,
            want(i, held_max) + EPS,
        );
        eprintln!("{}: cost {c} EUR, computed here {lo}..{hi}", names[i]);
        assert!(
            c >= lo && c <= hi,
            "{}: cost {c} not in {lo}..{hi}",
            names[i]
        );
        tenants[i / 2] += c;
        want_tenants[i / 2].0 += lo;
        want_tenants[i / 2].1 += hi;
    }
    for (t, name) in ["team-a", "team-b"].iter().enumerate() {
        let got = sum_where(&s, "gpufeed_gpu_cost_total", &[("tenant", name)]);
        assert!(
            (got - tenants[t]).abs() < 1e-12,
            "{name}: {got} vs its pods {}",
            tenants[t]
        );
        let (lo, hi) = want_tenants[t];
        assert!(got >= lo && got <= hi, "{name}: {got} not in {lo}..{hi}");
    }
    // The idle cost, computed here: what no pod used of each dimension over the time the agent
    // booked since it started (the node's cost ÷ rate).
    let total = node / RATE_PER_S;
    let sm: f64 = truth.iter().sum();
    let mem_total: f64 = mem.iter().map(|m| *m as f64).sum();
    let want_idle = |held_s: f64, sm_s: f64| {
        RATE_PER_S
            * (W_COMPUTE * (total - sm_s / GPUS)
                + W_VRAM * (total - mem_total / MEMORY * held_s)
                + 0.10 * total)
    };
    // the first samples' periods and what is carried, as above
    let missing = W_COMPUTE * (0.9 + 0.4 + 0.1) * 2.0 * period / GPUS;
    let (lo, hi) = (
        want_idle(held_max, sm) - EPS,
        want_idle(held_min, sm) + RATE_PER_S * missing + EPS,
    );
    eprintln!("idle {idle} EUR, computed here {lo}..{hi}; node {node} EUR");
    assert!(idle >= lo && idle <= hi, "idle {idle} not in {lo}..{hi}");
    drop(agent);
}
