//! The shipped PodMonitor, turned into a Prometheus scrape configuration the way the Prometheus
//! Operator does it, run by a real Prometheus (Debian's package) against the real agent.
//!
//! The Operator writes, per `podMetricsEndpoints` entry, a scrape job with Kubernetes pod
//! discovery and a fixed list of relabelings: keep the selected pods and port, then set the
//! target labels `namespace`, `container`, `pod` (of the *scraped* pod: the agent's), `job` and
//! `endpoint`, then the user's relabelings. With `honorLabels: false` (its default) a scraped
//! series that carries a label of the same name keeps its value only as `exported_<name>`, and
//! every per-pod series of the agent would name the agent's own pod.
//!
//! Kubernetes discovery needs an API server, which these machines do not have: the one stand-in
//! here is a file_sd target that carries exactly the `__meta_kubernetes_pod_*` labels that pod
//! discovery attaches to the agent's pod. Everything after discovery is Prometheus's own.

use crate::common;
use crate::manifests;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::*;

/// The PodMonitor in the shipped manifests, as `kubectl apply -k` applies it.
fn shipped_pod_monitor() -> serde_yaml::Value {
    manifests::object(&manifests::kustomize("overlays/operator"), "PodMonitor").clone()
}

/// A Kubernetes label name as a Prometheus label name suffix (what discovery does).
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The scrape job the Operator generates for endpoint `i` of a PodMonitor, with the pod
/// discovery replaced by `file_sd` at `sd_file`.
fn operator_scrape_config(pm: &serde_yaml::Value, i: usize, sd_file: &Path) -> serde_json::Value {
    use serde_json::json;
    let ns = pm["metadata"]["namespace"].as_str().unwrap();
    let name = pm["metadata"]["name"].as_str().unwrap();
    let ep = &pm["spec"]["podMetricsEndpoints"][i];
    let port = ep["port"].as_str().expect("a named port");
    let mut relabel =
        vec![json!({"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"})];
    if let Some(m) = pm["spec"]["selector"]["matchLabels"].as_mapping() {
        let mut sorted: Vec<(String, String)> = m
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().into(), v.as_str().unwrap().into()))
            .collect();
        sorted.sort();
        for (k, v) in sorted {
            let k = sanitize(&k);
            relabel.push(json!({
                "action": "keep",
                "source_labels": [format!("__meta_kubernetes_pod_label_{k}"),
                                  format!("__meta_kubernetes_pod_labelpresent_{k}")],
                "regex": format!("({v});true"),
            }));
        }
    }
    relabel.push(json!({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port}));
    for (meta, target) in [
        ("__meta_kubernetes_namespace", "namespace"),
        ("__meta_kubernetes_pod_container_name", "container"),
        ("__meta_kubernetes_pod_name", "pod"),
    ] {
        relabel.push(json!({"source_labels": [meta], "target_label": target}));
    }
    relabel.push(json!({"target_label": "job", "replacement": format!("{ns}/{name}")}));
    if let Some(jl) = pm["spec"]["jobLabel"].as_str() {
        relabel.push(json!({
            "source_labels": [format!("__meta_kubernetes_pod_label_{}", sanitize(jl))],
            "target_label": "job", "regex": "(.+)", "replacement": "${1}",
        }));
    }
    relabel.push(json!({"target_label": "endpoint", "replacement": port}));
    for r in ep["relabelings"].as_sequence().into_iter().flatten() {
        let mut out = serde_json::Map::new();
        for (k, v) in r.as_mapping().unwrap() {
            let key = match k.as_str().unwrap() {
                "sourceLabels" => "source_labels",
                "targetLabel" => "target_label",
                other => other,
            };
            let mut v: serde_json::Value = serde_json::to_value(v).unwrap();
            if key == "action" {
                v = json!(v.as_str().unwrap().to_lowercase());
            }
            out.insert(key.to_string(), v);
        }
        relabel.push(serde_json::Value::Object(out));
    }
    // one shard
    relabel.push(json!({"source_labels": ["__address__"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"}));
    relabel.push(json!({"source_labels": ["__tmp_hash"], "regex": "0", "action": "keep"}));
    json!({
        "job_name": format!("podMonitor/{ns}/{name}/{i}"),
        "honor_labels": ep["honorLabels"].as_bool().unwrap_or(false),
        "metrics_path": ep["path"].as_str().unwrap_or("/metrics"),
        "file_sd_configs": [{"files": [sd_file.display().to_string()]}],
        "relabel_configs": relabel,
    })
}

/// What pod discovery attaches to the agent's pod (a DaemonSet pod with the manifest's labels).
fn discovered_agent_pod(pm: &serde_yaml::Value, addr: std::net::SocketAddr) -> serde_json::Value {
    let mut labels: BTreeMap<String, String> = BTreeMap::new();
    labels.insert(
        "__meta_kubernetes_namespace".into(),
        pm["metadata"]["namespace"].as_str().unwrap().into(),
    );
    labels.insert(
        "__meta_kubernetes_pod_name".into(),
        "gpufeed-guest-x7k2p".into(),
    );
    labels.insert(
        "__meta_kubernetes_pod_container_name".into(),
        "gpufeed-guest".into(),
    );
    labels.insert(
        "__meta_kubernetes_pod_container_port_name".into(),
        pm["spec"]["podMetricsEndpoints"][0]["port"]
            .as_str()
            .unwrap()
            .into(),
    );
    labels.insert(
        "__meta_kubernetes_pod_node_name".into(),
        "gpu-node-1".into(),
    );
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
        let k = sanitize(k.as_str().unwrap());
        labels.insert(
            format!("__meta_kubernetes_pod_label_{k}"),
            v.as_str().unwrap().into(),
        );
        labels.insert(
            format!("__meta_kubernetes_pod_labelpresent_{k}"),
            "true".into(),
        );
    }
    serde_json::json!([{ "targets": [addr.to_string()], "labels": labels }])
}

fn prometheus_for(pm: &serde_yaml::Value, agent: std::net::SocketAddr) -> Prometheus {
    Prometheus::start_with(|dir| {
        let file = dir.join("agent-pod.json");
        let sd = discovered_agent_pod(pm, agent);
        std::fs::write(&file, serde_json::to_vec(&sd).unwrap()).unwrap();
        let job = operator_scrape_config(pm, 0, &file);
        format!(
            "scrape_configs:\n{}",
            serde_yaml::to_string(&vec![job]).unwrap()
        )
    })
}

#[test]
fn operator_translation_keeps_the_workload_pod_labels() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    pod.spawn("exec sh -c 'while :; do :; done'");
    pod.spawn("exec sh -c 'while :; do :; done'");
    let agent = Agent::start(&["--interval", "500ms", "--no-kube"], &[]);

    let pm = shipped_pod_monitor();
    assert_eq!(
        pm["spec"]["podMetricsEndpoints"][0]["honorLabels"].as_bool(),
        Some(true),
        "the agent labels other pods' series: its labels must win"
    );
    let prom = prometheus_for(&pm, agent.addr);
    let q = format!(
        "ebpf_sched_latency_microseconds_count{{pod=\"{}\"}}",
        pod.uid
    );
    let series = wait_for(Duration::from_secs(40), || {
        let r = prom.query(&q).ok()?;
        (!r.is_empty()).then_some(r)
    })
    .unwrap_or_else(|| panic!("no series for the workload pod: {:?}", prom.query("up")));
    for s in &series {
        let m = &s["metric"];
        assert_eq!(
            m["job"], "gpufeed-guest",
            "jobLabel gives the job the rules use"
        );
        assert_eq!(m["node"], "gpu-node-1");
        assert!(m.get("exported_pod").is_none(), "{m}");
    }
    // Nothing anywhere was renamed, and no agent series claims the agent's own pod: node-level
    // series (slices) have no pod at all.
    assert_eq!(
        prom.query("count({exported_pod!=\"\"} or {exported_namespace!=\"\"} or {exported_container!=\"\"})")
            .unwrap()
            .len(),
        0
    );
    assert_eq!(
        prom.query("count({pod=\"gpufeed-guest-x7k2p\"})")
            .unwrap()
            .len(),
        0,
        "no series is labelled with the agent's own pod"
    );
    let slices = prom
        .query("ebpf_sched_latency_microseconds_count{slice!=\"\"}")
        .unwrap();
    assert!(!slices.is_empty(), "node-level slices are exported");
    for s in &slices {
        assert!(s["metric"].get("pod").is_none(), "{}", s["metric"]);
    }
    // The agent's own series are still found by the rules' selector.
    assert_eq!(
        prom.query("gpufeed_build_info{job=\"gpufeed-guest\"}")
            .unwrap()
            .len(),
        1
    );
}

/// The same translation with the Operator's defaults (no honorLabels, no label drop) shows
/// what the fix prevents: the workload's pod label survives only as `exported_pod`.
#[test]
fn operator_defaults_would_rename_the_workload_labels() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    pod.spawn("exec sh -c 'while :; do :; done'");
    let agent = Agent::start(&["--interval", "500ms", "--no-kube"], &[]);

    let mut pm = shipped_pod_monitor();
    let ep = &mut pm["spec"]["podMetricsEndpoints"][0];
    ep.as_mapping_mut().unwrap().remove("honorLabels");
    ep["relabelings"] = serde_yaml::Value::Sequence(vec![]);
    let prom = prometheus_for(&pm, agent.addr);
    let q = format!(
        "ebpf_sched_latency_microseconds_count{{exported_pod=\"{}\"}}",
        pod.uid
    );
    let series = wait_for(Duration::from_secs(40), || {
        let r = prom.query(&q).ok()?;
        (!r.is_empty()).then_some(r)
    })
    .expect("with the Operator's defaults the workload pod is renamed exported_pod");
    assert_eq!(series[0]["metric"]["pod"], "gpufeed-guest-x7k2p");
}
