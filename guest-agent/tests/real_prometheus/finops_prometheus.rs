//! A real Prometheus (Debian's package) scraping the agent evaluates what the FinOps parts ship,
//! on data the test provokes through the stand-in NVML (per-process SM utilisation and memory)
//! and the stand-in GPU device (driver calls that queue): the KEDA ScaledObject's query as
//! written in `talos/kubernetes/components/keda` beside the query of the design this project
//! started from, each turned into the replica count KEDA's prometheus trigger asks the HPA
//! for, for a busy and an idle application; the MPS advice; the PrometheusRule's FinOps rules
//! (the idle VRAM alert goes pending, the cost and traffic recording rules and the
//! cost-over-traffic alert evaluate without error); and the cost sum check in PromQL.

use crate::common;
use crate::manifests;

use std::fs::File;
use std::time::Duration;

use common::gpu::*;
use common::*;
use manifests::{kustomize_dir, shipped_scaler, yaml_documents};

const NODE: &str = "gpu-node-finops-prom";
const GIB: u64 = 1 << 30;

/// The scaler query of the original design (a per-replica average of the compute time's
/// rate), for namespace `ml` and app `APP`; it was used with threshold 0.75 and KEDA's default
/// metric type, AverageValue (docs/finops.md).
const SEED_QUERY: &str = "sum(rate(ebpf_gpu_compute_time_seconds_total{namespace=\"ml\", app=\"APP\"}[30s])) by (app) / count(ebpf_gpu_compute_time_seconds_total{namespace=\"ml\", app=\"APP\"})";
/// ... as it was meant: the same average with the division's label sets matching (the
/// original divides a vector labelled `app` by one without labels, which matches nothing).
const SEED_MEANT: &str = "sum(rate(ebpf_gpu_compute_time_seconds_total{namespace=\"ml\", app=\"APP\"}[30s])) / count(ebpf_gpu_compute_time_seconds_total{namespace=\"ml\", app=\"APP\"})";

/// What the HPA makes of an AverageValue target: `ceil(value / target)` replicas, within the
/// bounds (the current count cancels out: the usage ratio is value ÷ (target × current)).
fn replicas(value: f64, threshold: f64, min: u32, max: u32) -> u32 {
    ((value / threshold).ceil() as u32).clamp(min, max)
}

/// The shipped PrometheusRule's groups as a plain rule file.
fn rule_file() -> String {
    let path = kustomize_dir("components/prometheus-operator/prometheus-rules.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let pr = &yaml_documents(&text, "prometheus-rules.yaml")[0];
    let mut file = serde_yaml::Mapping::new();
    file.insert("groups".into(), pr["spec"]["groups"].clone());
    serde_yaml::to_string(&file).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_evaluates_the_scaler_queries_the_mps_advice_and_the_rules() {
    let Some(_lock) = require_root() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let dev = StandInDevice::new(dir);
    let nvml = StandInNvml::new(dir);
    let sb = CgroupSandbox::new();
    let (mut pods, pids, kube) = two_tenants(
        &sb,
        NODE,
        [
            ("team-a", "inference-server", ["server-0", "server-1"]),
            ("team-b", "notebook", ["idle-0", "idle-1"]),
        ],
    )
    .await;
    let prefix = format!("{}/nvidia", dir.display());
    let flags = [
        "--probes",
        "gpu_driver,nvml",
        "--gpu-device-prefix",
        &prefix,
        "--gpu-driver-name",
        UART_DRIVER,
        "--nvml-library",
        nvml.path(),
        "--mps-sustain",
        "3s",
    ];
    let args = finops_flags(NODE, &flags);
    let (agent, _kc) = agent_with_kube(&kube, &args).await;
    let target = agent.addr;
    let prom = tokio::task::spawn_blocking(move || {
        Prometheus::start_with(|pdir| {
            std::fs::write(pdir.join("rules.yaml"), rule_file()).unwrap();
            format!(
                "rule_files:\n  - {}\nscrape_configs:\n  - job_name: gpufeed-guest\n    \
                 static_configs:\n      - targets: ['{target}']\n",
                pdir.join("rules.yaml").display()
            )
        })
    })
    .await
    .unwrap();
    let wait_scalar = |q: &str, ok: &dyn Fn(f64) -> bool, secs: u64| {
        let got = wait_for(Duration::from_secs(secs), || {
            prom.scalar(q).filter(|v| ok(*v))
        });
        got.unwrap_or_else(|| panic!("{q}: last {:?}", prom.query(q)))
    };

    // The notebooks hold models: one computes 3% of GPU 0, the other nothing on GPU 1; the
    // servers: server-1 computes 90% of GPU 1, server-0 has loaded its model and waits.
    let on_gpus = |server0: u32| {
        vec![
            (pids[0], 0, 10 * GIB, server0),
            (pids[1], 1, 10 * GIB, 90),
            (pids[2], 0, 2 * GIB, 3),
            (pids[3], 1, 4 * GIB, 0),
        ]
    };
    nvml.set_processes(&on_gpus(0));
    let mps = |pod: &str| {
        format!(
            "gpufeed_mps_recommended_active_thread_percentage{{namespace=\"ml\",pod=\"{pod}\"}}"
        )
    };
    // sustained under 15%: a small slice, twice the peak rounded up to 10, at least 10
    for pod in ["idle-0", "idle-1", "server-0"] {
        assert_eq!(wait_scalar(&mps(pod), &|v| v == 10.0, 30), 10.0, "{pod}");
    }

    // server-0 gets busy: 90% of GPU 0, and two of its threads queue in the driver (~8 s of
    // 100 ms calls, one after the other on the device): the whole GPU, no slice
    let go = dir.join("go-heavy");
    let outs = [dir.join("heavy1.out"), dir.join("heavy2.out")];
    for out in &outs {
        pods[0].spawn(&dev.command(40, 1, &go, out, ""));
    }
    wait_probed(&agent, 2);
    File::create(&go).unwrap();
    nvml.set_processes(&on_gpus(90));

    // KEDA: the shipped query over a full duty window of both servers busy, and the original
    // design's, each as the replica count the HPA gets
    let shipped = shipped_scaler();
    assert_eq!(shipped.metric_type, "AverageValue");
    let query_of = |app: &str| shipped.query.replace("inference-server", app);
    // (its 30 s rate window shortened to the seconds this test runs: the window changes
    // neither the matching nor the averaging)
    let seed_of = |q: &str, app: &str| q.replace("APP", app).replace("[30s]", "[4s]");
    let busy_total = wait_scalar(&query_of("inference-server"), &|v| v > 1.6, 15);
    let busy_meant = wait_scalar(&seed_of(SEED_MEANT, "inference-server"), &|v| v > 0.8, 15);
    let idle_total = prom.scalar(&query_of("notebook")).unwrap();
    let idle_meant = prom.scalar(&seed_of(SEED_MEANT, "notebook")).unwrap();
    let decide = |v: f64| replicas(v, shipped.threshold, shipped.min, shipped.max);
    eprintln!(
        "busy app: shipped {busy_total} -> {} replicas, original as meant {busy_meant} -> {}; \
         idle app: shipped {idle_total} -> {}, original as meant {idle_meant} -> {}",
        decide(busy_total),
        decide(busy_meant),
        decide(idle_total),
        decide(idle_meant)
    );
    // two replicas at 90%: the sum asks for a third
    assert!(
        busy_total <= 2.0,
        "two pods, each at most one GPU: {busy_total}"
    );
    assert_eq!(decide(busy_total), 3, "shipped query {busy_total}");
    // the original as written returns nothing at all, which KEDA reads as 0 (its
    // ignoreNullValues default): the minimum, whatever the load
    for app in ["inference-server", "notebook"] {
        let q = seed_of(SEED_QUERY, app);
        assert_eq!(prom.query(&q), Ok(vec![]), "{q}");
    }
    assert_eq!(decide(0.0), 1);
    // ... and as meant, a per-replica average (0.9) under AverageValue keeps two replicas
    assert!(busy_meant <= 1.0, "an average: {busy_meant}");
    assert_eq!(
        decide(busy_meant),
        2,
        "original query as meant {busy_meant}"
    );
    // the notebooks: one replica either way
    assert!(idle_total < 0.1, "{idle_total}");
    assert_eq!(decide(idle_total), 1);
    assert_eq!(
        decide(idle_meant),
        1,
        "original query as meant {idle_meant}"
    );

    assert_eq!(wait_scalar(&mps("server-0"), &|v| v == 100.0, 20), 100.0);
    for out in &outs {
        wait_file(out, "a heavy client");
    }
    // ... while the notebooks keep their slices
    assert_eq!(prom.scalar(&mps("idle-0")), Some(10.0));

    // The idle reservation: pending (it fires after 30 min) for the notebook that computes
    // nothing; NVML's memory count finds it though it made no CUDA call the uprobes saw.
    let pending = "ALERTS{alertname=\"GpufeedGpuIdleVramReservation\",alertstate=\"pending\"}";
    let only_idle_1 = wait_for(Duration::from_secs(15), || {
        let r = prom.query(pending).ok()?;
        let pods: Vec<&str> = r
            .iter()
            .map(|a| a["metric"]["pod"].as_str().unwrap())
            .collect();
        (pods == ["idle-1"]).then_some(())
    });
    assert!(
        only_idle_1.is_some(),
        "{pending}: {:?}",
        prom.query(pending)
    );

    // Cost per tenant through the recording rule; the sum check over the last 10 s.
    let rate = |t: &str| {
        format!("tenant_currency:gpufeed_gpu_cost:rate5m{{tenant=\"{t}\",currency=\"USD\"}}")
    };
    let a = wait_scalar(&rate("team-a"), &|v| v > 0.0, 10);
    let b = wait_scalar(&rate("team-b"), &|v| v > 0.0, 10);
    assert!(a > b, "the busy tenant pays more: {a} vs {b}");
    let sum_check = "(sum(increase(gpufeed_gpu_cost_total[10s])) + sum(increase(gpufeed_gpu_idle_cost_total[10s]))) / sum(increase(gpufeed_gpu_node_cost_total[10s]))";
    let ratio = prom.scalar(sum_check).expect("the sum check evaluates");
    assert!((ratio - 1.0).abs() <= 0.02, "{sum_check} = {ratio}");
    // gpufeed_pod_info joins the tenant to any per-pod series
    let joined = "sum by (tenant) (gpufeed_nvml_process_memory_bytes * on (namespace, pod) group_left (tenant) max by (namespace, pod, tenant) (gpufeed_pod_info))";
    let r = prom.query(joined).unwrap();
    let team_b = r.iter().find(|s| s["metric"]["tenant"] == "team-b");
    let held: Option<f64> = team_b.and_then(|s| s["value"][1].as_str()?.parse().ok());
    assert_eq!(held, Some((6 * GIB) as f64), "{joined}: {r:?}");

    // Every FinOps rule was evaluated without error.
    let rules = prom.api("/api/v1/rules");
    let finops = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "gpufeed.finops")
        .expect("the gpufeed.finops group loaded");
    let list = finops["rules"].as_array().unwrap();
    assert_eq!(list.len(), 4);
    for r in list {
        assert_eq!(r["health"], "ok", "{r}");
    }
    drop(prom);
    drop(agent);
}
