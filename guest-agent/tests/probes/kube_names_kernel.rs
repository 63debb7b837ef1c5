//! Pod names from the Kubernetes API on real cgroups: recorded API JSON served
//! over local HTTP to the agent's real kube-rs client; a pod deleted through the
//! watch loses its series after the grace period.

use crate::common;

use std::time::{Duration, Instant};

use common::fake_kube::{fixture, fixture_lines, FakeKube};
use common::*;

const NODE: &str = "talos-gpu-worker-1";
const VLLM_UID: &str = "8faa3759-bf25-436b-b765-e6efbb602f44";
const VLLM_NAME: &str = "vllm-llama3-8b-6f9c7d5b8-x2k4q";

/// The vllm pod's full container id and a DELETED watch event for it, both
/// taken from the recorded list.
fn vllm_fixture() -> (String, String) {
    let list: serde_json::Value = serde_json::from_str(&fixture("pods-list.json")).unwrap();
    let pod = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["metadata"]["uid"] == VLLM_UID)
        .unwrap()
        .clone();
    let cid = pod["status"]["containerStatuses"][0]["containerID"]
        .as_str()
        .unwrap();
    let cid = cid.strip_prefix("containerd://").unwrap().to_string();
    let deleted = serde_json::json!({"type": "DELETED", "object": pod}).to_string();
    (cid, deleted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_get_kubernetes_names_and_deleted_pods_vanish_after_grace() {
    let Some(_lock) = require_root() else { return };
    let (cid, deleted) = vllm_fixture();
    let kube = FakeKube::start(
        NODE,
        fixture("pods-list.json"),
        fixture_lines("pods-watch.jsonl"),
    )
    .await;

    let sb = CgroupSandbox::new();
    // the vllm container in the systemd layout, a pod unknown to the API in cgroupfs
    let mut vllm = Pod::new(&sb, Layout::Systemd, "burstable", VLLM_UID, &cid);
    let stranger_uid = random_uid();
    let mut stranger = Pod::new(
        &sb,
        Layout::Cgroupfs,
        "besteffort",
        &stranger_uid,
        &random_cid(),
    );
    vllm.spawn("while :; do sleep 0.01; done");
    stranger.spawn("while :; do sleep 0.01; done");

    let (agent, _kc) = agent_with_kube(&kube, &sched_on_node(NODE, "3s")).await;

    let sched_count = "ebpf_sched_latency_microseconds_count";
    let want = [
        ("namespace", "inference"),
        ("pod", VLLM_NAME),
        ("container", "vllm"),
    ];
    // Both pods' first samples: they need not land in the same map-reading interval.
    let stranger_labels = [("namespace", ""), ("pod", stranger_uid.as_str())];
    let s = wait_for(Duration::from_secs(15), || {
        let s = agent.scrape();
        let named = value(&s, sched_count, &want).is_some_and(|v| v > 0.0);
        let by_uid = value(&s, sched_count, &stranger_labels).is_some();
        (named && by_uid).then_some(s)
    });
    let s = s.unwrap_or_else(|| {
        panic!(
            "vllm labelled from the API and the stranger by UID: {:?}",
            agent
                .try_get("/metrics")
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with(sched_count))
                .collect::<Vec<_>>()
        )
    });
    assert_eq!(value(&s, "gpufeed_kube_synced", &[]), Some(1.0));
    // no series carries the raw UID of a pod the API named
    assert!(find(&s, sched_count, &[("pod", VLLM_UID)]).is_empty());
    // the field selector reached the API
    assert!(kube
        .requests()
        .iter()
        .any(|r| r.param("fieldSelector") == Some(&format!("spec.nodeName={NODE}"))));

    // The API deletes the pod and kubelet removes its cgroups.
    kube.push_event(deleted);
    let t0 = Instant::now();
    vllm.remove();
    std::thread::sleep(Duration::from_millis(1200));
    assert!(
        value(&agent.scrape(), sched_count, &want).is_some(),
        "series stay during the grace period ({:?} after deletion)",
        t0.elapsed()
    );
    let gone = wait_for(Duration::from_secs(8), || {
        value(&agent.scrape(), sched_count, &want)
            .is_none()
            .then_some(t0.elapsed())
    });
    let after = gone.expect("deleted pod's series vanish");
    eprintln!("deleted pod's series vanished {after:?} after deletion (grace 3s)");
    assert!(
        after >= Duration::from_secs(3),
        "not before the grace period"
    );
    // the other pod is untouched
    assert!(value(&agent.scrape(), sched_count, &[("pod", &stranger_uid)]).is_some());
    drop(agent);
}
