//! A real Prometheus (Debian's package) scraping the agent evaluates what the FinOps parts ship,
//! on data the test provokes through the stand-in GPU device and libcuda.so.1: the KEDA
//! ScaledObject's query as written in `talos/kubernetes/components/keda`, the MPS advice, and
//! the PrometheusRule's FinOps rules (the idle VRAM alert goes pending, the cost and traffic
//! recording rules and the cost-over-traffic alert evaluate without error), and the cost sum
//! check in PromQL.

mod common;
mod manifests;

use std::fs::File;
use std::time::Duration;

use common::fake_kube::FakeKube;
use common::gpu::*;
use common::*;
use manifests::{kustomize_dir, yaml_documents};

const NODE: &str = "gpu-node-finops-prom";
const TENANT_KEY: &str = "team.example.com/tenant";

/// The query of the shipped ScaledObject's prometheus trigger.
fn keda_query() -> String {
    let text = std::fs::read_to_string(kustomize_dir("components/keda/scaledobject.yaml")).unwrap();
    let so = &yaml_documents(&text, "scaledobject.yaml")[0];
    so["spec"]["triggers"][0]["metadata"]["query"]
        .as_str()
        .unwrap()
        .to_string()
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
async fn prometheus_evaluates_the_scaler_query_the_mps_advice_and_the_rules() {
    let Some(_lock) = require_root() else { return };
    let stand_ins = StandIns::new();
    let (dir, dev, cuda) = (stand_ins.dir(), &stand_ins.dev, &stand_ins.cuda);
    let sb = CgroupSandbox::new();
    let (pods, list) = labelled_pods(
        &sb,
        NODE,
        &[
            (
                "server-0",
                Layout::Cgroupfs,
                &[
                    (TENANT_KEY, "team-a"),
                    ("app.kubernetes.io/name", "inference-server"),
                ],
            ),
            (
                "idle-0",
                Layout::Systemd,
                &[
                    (TENANT_KEY, "team-b"),
                    ("app.kubernetes.io/name", "notebook"),
                ],
            ),
        ],
    );
    let [mut server, mut idle]: [Pod; 2] = pods.try_into().ok().unwrap();
    let kube = FakeKube::start(NODE, list, vec![]).await;
    let mut args: Vec<String> = ["--interval", "200ms", "--node-name", NODE]
        .map(String::from)
        .to_vec();
    args.extend(stand_ins.probe_flags());
    args.extend(
        [
            "--gpu-duty-window",
            "2s",
            "--mps-sustain",
            "3s",
            "--pod-label",
            "tenant=team.example.com/tenant",
            "--pod-label",
            "app=app.kubernetes.io/name",
            "--gpu-hourly-rate",
            "3.6",
            "--gpu-memory-bytes",
            "16MiB",
            "--gpu-link-bytes-per-second",
            "100000",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
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

    // The notebook pod loads a model: VRAM held, no driver call.
    let pid = idle.spawn(&cuda.host_command(1));
    for n in 0..2 {
        File::create(cuda.host_ctl.join(format!("go{n}"))).unwrap();
        wait_file(&cuda.host_ctl.join(format!("done{n}")), "cuda_app phase");
        if n == 0 {
            assert!(
                wait_for(Duration::from_secs(5), || {
                    value(&agent.scrape(), "gpufeed_cuda_libraries", &[]).filter(|v| *v == 1.0)
                })
                .is_some(),
                "the agent attached to the library"
            );
        }
    }

    // The server makes one short driver call, then none: after the sustain period its advice
    // is a small slice.
    let (go, out) = (dir.join("go-light"), dir.join("light.out"));
    server.spawn(&dev.command(1, 1, &go, &out, ""));
    wait_probed(&agent, 1);
    File::create(&go).unwrap();
    wait_file(&out, "the light client");
    let mps = "gpufeed_mps_recommended_active_thread_percentage{namespace=\"ml\",pod=\"server-0\"}";
    assert_eq!(wait_scalar(mps, &|v| v == 10.0, 20), 10.0);

    // Then two clients of the server queue on the device for ~8 s: the duty cycle goes to 1,
    // the scaler's query follows it, and the advice becomes the whole GPU.
    let go = dir.join("go-heavy");
    let outs = [dir.join("heavy1.out"), dir.join("heavy2.out")];
    for out in &outs {
        server.spawn(&dev.command(40, 1, &go, out, ""));
    }
    // the light client is gone: its process is no longer probed
    wait_probed(&agent, 2);
    File::create(&go).unwrap();
    let query = keda_query();
    let scaler = wait_scalar(&query, &|v| v > 0.75, 10);
    assert!(
        scaler <= 1.0,
        "{query} = {scaler}: one pod, at most one GPU"
    );
    eprintln!("KEDA query {query} = {scaler}: ceil({scaler}/0.75) replicas wanted");
    assert_eq!(wait_scalar(mps, &|v| v == 100.0, 15), 100.0);
    for out in &outs {
        wait_file(out, "a heavy client");
    }

    // The idle reservation: the alert is pending (it fires after 30 min) for the notebook only.
    let pending = "ALERTS{alertname=\"GpufeedGpuIdleVramReservation\",alertstate=\"pending\"}";
    let alerts = wait_for(Duration::from_secs(10), || {
        prom.query(pending).ok().filter(|r| !r.is_empty())
    })
    .expect("the idle VRAM alert pending");
    let pods: Vec<&str> = alerts
        .iter()
        .map(|a| a["metric"]["pod"].as_str().unwrap())
        .collect();
    assert_eq!(pods, ["idle-0"]);

    // Cost per tenant through the recording rule; the sum check over the last 10 s.
    let rate = |t: &str| {
        format!("tenant_currency:gpufeed_gpu_cost:rate5m{{tenant=\"{t}\",currency=\"USD\"}}")
    };
    assert!(wait_scalar(&rate("team-a"), &|v| v > 0.0, 10) > 0.0);
    assert!(wait_scalar(&rate("team-b"), &|v| v > 0.0, 10) > 0.0);
    let sum_check = "(sum(increase(gpufeed_gpu_cost_total[10s])) + sum(increase(gpufeed_gpu_idle_cost_total[10s]))) / sum(increase(gpufeed_gpu_node_cost_total[10s]))";
    let ratio = prom.scalar(sum_check).expect("the sum check evaluates");
    assert!((ratio - 1.0).abs() <= 0.02, "{sum_check} = {ratio}");
    // gpufeed_pod_info joins the tenant to any per-pod series
    let joined = "sum by (tenant) (ebpf_gpu_vram_reserved_bytes * on (namespace, pod) group_left () max by (namespace, pod, tenant) (gpufeed_pod_info))";
    let r = prom.query(joined).unwrap();
    assert!(
        r.iter().any(|s| s["metric"]["tenant"] == "team-b"),
        "{joined}: {r:?}"
    );

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
    File::create(cuda.host_ctl.join("go2")).unwrap();
    // SAFETY: kill(2) on a child this test spawned and has not reaped.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    idle.wait_exit(pid, Duration::from_secs(10));
    drop(prom);
    drop(agent);
}
