//! GPU cost per tenant on the real kernel: two pods of two tenants (their labels served by the
//! fake API server) use the stand-in GPU device and the stand-in libcuda.so.1; the agent's cost
//! series follow the formula on the series it exported, tenant by tenant, and the tenants' costs
//! plus the idle cost are the node's cost.

mod common;

use std::fs::File;
use std::time::{Duration, Instant};

use common::fake_kube::FakeKube;
use common::gpu::*;
use common::*;

const NODE: &str = "gpu-node-finops";
/// 3.6 an hour: 0.001 a second.
const RATE_PER_S: f64 = 0.001;
const MEMORY: f64 = (16 * MIB) as f64;
/// Bytes per second: the stand-in's copies (7168 bytes) fit in one 100 ms interval (10 000).
const LINK: f64 = 100_000.0;
const INTERVAL: Duration = Duration::from_millis(100);
const TENANT_KEY: &str = "team.example.com/tenant";

/// The agent's settings for both pods' cost: 3.6 EUR an hour, 16 MiB of GPU memory.
fn finops_flags() -> Vec<String> {
    [
        "--pod-label",
        "tenant=team.example.com/tenant",
        "--pod-label",
        "app=app.kubernetes.io/name",
        "--pod-label",
        "model=model",
        "--gpu-hourly-rate",
        "3.6",
        "--gpu-cost-currency",
        "EUR",
        "--gpu-memory-bytes",
        "16MiB",
        "--gpu-link-bytes-per-second",
        "100000",
    ]
    .map(String::from)
    .to_vec()
}

fn sum_where(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    find(samples, name, want).iter().map(|s| s.value).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_per_tenant_follows_the_formula_and_adds_up_to_the_node() {
    let Some(_lock) = require_root() else { return };
    let stand_ins = StandIns::new();
    let (dir, dev, cuda) = (stand_ins.dir(), &stand_ins.dev, &stand_ins.cuda);
    let sb = CgroupSandbox::new();
    let (pods, list) = labelled_pods(
        &sb,
        NODE,
        &[
            (
                "chat-0",
                Layout::Cgroupfs,
                &[
                    (TENANT_KEY, "team-a"),
                    ("app.kubernetes.io/name", "chat"),
                    ("model", "llama"),
                ],
            ),
            (
                "embed-0",
                Layout::Systemd,
                &[(TENANT_KEY, "team-b"), ("app.kubernetes.io/name", "embed")],
            ),
        ],
    );
    let [mut a, mut b]: [Pod; 2] = pods.try_into().ok().unwrap();
    let kube = FakeKube::start(NODE, list, vec![]).await;
    let mut args: Vec<String> = ["--interval", "100ms", "--node-name", NODE]
        .map(String::from)
        .to_vec();
    args.extend(stand_ins.probe_flags());
    args.extend(["--gpu-duty-window".into(), "2s".into()]);
    args.extend(finops_flags());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (agent, _kc) = agent_with_kube(&kube, &args).await;
    let info = |pod: &str| {
        value(
            &agent.scrape(),
            "gpufeed_pod_info",
            &[("namespace", "ml"), ("pod", pod)],
        )
    };
    assert!(
        wait_for(Duration::from_secs(15), || info("embed-0")
            .and(info("chat-0")))
        .is_some(),
        "both pods known from the API"
    );
    let node_cost = |s: &[Sample]| value(s, "gpufeed_gpu_node_cost_total", &[("currency", "EUR")]);
    let first = Instant::now();
    let node_first = node_cost(&agent.scrape()).expect("the node's cost");

    // Tenant a: driver time only, 10 calls held 100 ms each.
    let (go, out) = (dir.join("go"), dir.join("hold.out"));
    a.spawn(&dev.command(10, 1, &go, &out, ""));
    wait_probed(&agent, 1);
    File::create(&go).unwrap();
    wait_file(&out, "the ioctl client");
    let (_, measured_ns) = measured(&out);

    // Tenant b: VRAM held for a known time, and copies; killed without freeing (its exit
    // returns the bytes).
    let pid = b.spawn(&cuda.host_command(1));
    File::create(cuda.host_ctl.join("go0")).unwrap();
    wait_file(&cuda.host_ctl.join("done0"), "cuda_app loaded the library");
    assert!(
        wait_for(Duration::from_secs(5), || {
            value(&agent.scrape(), "gpufeed_cuda_libraries", &[]).filter(|v| *v == 1.0)
        })
        .is_some(),
        "the agent attached to the library"
    );
    let e = Expect { s: 1 };
    let vram = || {
        value(
            &agent.scrape(),
            "ebpf_gpu_vram_reserved_bytes",
            &[("pod", "embed-0")],
        )
    };
    let t1 = Instant::now();
    File::create(cuda.host_ctl.join("go1")).unwrap();
    let held = wait_for(Duration::from_secs(10), || {
        vram().filter(|v| *v == e.after_alloc() as f64)
    });
    assert!(held.is_some(), "VRAM after allocations; last {:?}", vram());
    let t1_seen = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let t2 = Instant::now();
    // SAFETY: kill(2) on a child this test spawned and has not reaped.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    b.wait_exit(pid, Duration::from_secs(10));
    assert!(
        wait_for(Duration::from_secs(10), || vram().filter(|v| *v == 0.0)).is_some(),
        "exit returns the VRAM"
    );
    let t4 = Instant::now();
    // every interval booked, then one scrape for all the numbers
    std::thread::sleep(INTERVAL * 3);
    let scrape_start = Instant::now();
    let s = agent.scrape();
    let scrape_end = Instant::now();

    // The GPU series carry the configured labels; the info series too.
    let a_labels = [
        ("namespace", "ml"),
        ("pod", "chat-0"),
        ("container", "main"),
        ("tenant", "team-a"),
        ("app", "chat"),
        ("model", "llama"),
    ];
    let compute_a = value(&s, "ebpf_gpu_compute_time_seconds_total", &a_labels)
        .expect("tenant a's driver time, labelled");
    assert!(
        within_10_percent(compute_a, measured_ns as f64 / 1e9),
        "driver time {compute_a} s vs measured {measured_ns} ns"
    );
    let b_labels = [
        ("pod", "embed-0"),
        ("tenant", "team-b"),
        ("app", "embed"),
        ("model", ""),
    ];
    assert_eq!(
        value(&s, "ebpf_gpu_vram_reserved_bytes", &b_labels),
        Some(0.0)
    );
    let pcie_b = sum_where(&s, "ebpf_gpu_pcie_bytes_total", &b_labels);
    assert_eq!(pcie_b, (e.h2d() + e.d2h()) as f64, "copied bytes");
    assert_eq!(
        value(
            &s,
            "gpufeed_pod_info",
            &[
                ("pod", "chat-0"),
                ("tenant", "team-a"),
                ("app", "chat"),
                ("model", "llama")
            ]
        ),
        Some(1.0)
    );

    // Cost per tenant: each pod's line is labelled with its tenant.
    let cost = |tenant: &str, pod: &str| {
        let l = [
            ("tenant", tenant),
            ("namespace", "ml"),
            ("pod", pod),
            ("currency", "EUR"),
        ];
        value(&s, "gpufeed_gpu_cost_total", &l)
            .unwrap_or_else(|| panic!("a cost line for {tenant} {pod}"))
    };
    let (cost_a, cost_b) = (cost("team-a", "chat-0"), cost("team-b", "embed-0"));
    let tenant_total = |t: &str| sum_where(&s, "gpufeed_gpu_cost_total", &[("tenant", t)]);
    assert_eq!(tenant_total("team-a"), cost_a);
    assert_eq!(tenant_total("team-b"), cost_b);

    // a: compute only, 0.55 × driver seconds × rate (an interval whose driver time read a
    // little over its length counts as the whole interval: within 2%)
    let want_a = RATE_PER_S * 0.55 * compute_a;
    assert!(
        (cost_a - want_a).abs() <= 0.02 * want_a,
        "tenant a: {cost_a} vs 0.55 × {compute_a} s × rate = {want_a}"
    );
    // b: 0.10 × copied bytes ÷ link bandwidth, exact, plus 0.35 × VRAM-seconds ÷ memory,
    // which lie between what the test saw held and the longest it can have been held
    let pcie_part = RATE_PER_S * 0.10 * pcie_b / LINK;
    let vram_s = |d: Duration| e.after_alloc() as f64 * d.as_secs_f64();
    let low = RATE_PER_S * 0.35 * vram_s((t2 - t1_seen).saturating_sub(INTERVAL)) / MEMORY;
    let high = RATE_PER_S * 0.35 * vram_s(t4 - t1 + INTERVAL) / MEMORY;
    eprintln!(
        "tenant a {cost_a} EUR ({compute_a} s of driver time); tenant b {cost_b} EUR \
         (copies {pcie_part}, VRAM in {low}..{high})"
    );
    assert!(
        cost_b - pcie_part >= low && cost_b - pcie_part <= high,
        "tenant b: {cost_b} − copies {pcie_part} outside VRAM bounds {low}..{high}"
    );

    // The sum check: tenants plus idle are the node, and the node is the rate × time.
    let idle = value(&s, "gpufeed_gpu_idle_cost_total", &[("currency", "EUR")]).unwrap();
    let node = value(&s, "gpufeed_gpu_node_cost_total", &[("currency", "EUR")]).unwrap();
    let tenants: f64 = find(&s, "gpufeed_gpu_cost_total", &[])
        .iter()
        .map(|x| x.value)
        .sum();
    assert!(
        (tenants + idle - node).abs() <= 1e-9 * node,
        "tenants {tenants} + idle {idle} vs node {node}"
    );
    // Between two scrapes the node's cost grows at the rate: each scrape shows the last
    // booked tick, so the two can be off by up to a tick each, plus a late tick's delay.
    let booked = (node - node_first) / RATE_PER_S;
    let (shortest, longest) = (scrape_start - first, scrape_end - first);
    let slack = (INTERVAL * 3).as_secs_f64();
    assert!(
        booked >= shortest.as_secs_f64() - slack && booked <= longest.as_secs_f64() + slack,
        "node cost grew by {booked} s of rate between scrapes {shortest:?}..{longest:?} apart"
    );
    assert!(idle > 0.0 && tenants > 0.0);
    drop(agent);
}
