//! The pod watcher against recorded kube-apiserver v1.30 JSON served over local HTTP to the
//! real kube-rs client.

use crate::common;

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use common::fake_kube::{fixture, fixture_lines, FakeKube};
use common::logs::captured as logs;
use gpufeed_guest::pods::{
    classify_cgroup, run_watcher_with_client, CgroupClass, PodStore, Qos, WatchConfig,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tracing::Instrument;

const NODE: &str = "talos-gpu-worker-1";
const VLLM: &str = "8faa3759-bf25-436b-b765-e6efbb602f44";
const CILIUM: &str = "1f6c15ba-e435-451c-a72d-53ff0a925d19";
const LOADER: &str = "b4ca9de1-5d49-48fd-ac5c-9db165de7ae8";
const BATCH: &str = "5c573fcd-0dfe-42d9-b13b-a7aecab39dca";
/// pods of the other node, in the list and in the watch stream
const OTHER_NODE_PODS: [&str; 2] = [
    "060ab061-b222-409f-b537-aa34ecca0ad3",
    "507ace47-8003-4322-be17-c6dc06a33748",
];

async fn start_fake() -> FakeKube {
    FakeKube::start(
        NODE,
        fixture("pods-list.json"),
        fixture_lines("pods-watch.jsonl"),
    )
    .await
}

/// A client built from the kubeconfig file the fake writes (as the agent would with KUBECONFIG).
async fn client_for(fake: &FakeKube, dir: &std::path::Path) -> kube::Client {
    let path = fake.write_kubeconfig(dir);
    let kc = Kubeconfig::read_from(&path).expect("read kubeconfig");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig to config");
    assert_eq!(cfg.cluster_url.to_string(), format!("{}/", fake.url()));
    kube::Client::try_from(cfg).expect("client")
}

async fn wait_for(what: &str, timeout: Duration, cond: impl FnMut() -> bool) {
    assert!(
        gpufeed_testkit::wait::until(timeout, cond).await,
        "timed out waiting for {what}"
    );
}

fn hm(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn ips(s: &[&str]) -> Vec<IpAddr> {
    s.iter().map(|i| i.parse().unwrap()).collect()
}

/// Everything the initial list + recorded watch stream must leave in the store.
fn assert_state_after_recorded_stream(store: &PodStore) {
    assert!(store.synced());
    assert_eq!(store.len(), 4, "uids: {:?}", store.uids());
    for uid in OTHER_NODE_PODS {
        assert_eq!(store.get(uid), None, "pod of another node in the store");
    }

    let vllm = store.get(VLLM).expect("vllm pod");
    assert_eq!(vllm.namespace, "inference");
    assert_eq!(vllm.name, "vllm-llama3-8b-6f9c7d5b8-x2k4q");
    assert_eq!(vllm.labels.get("tenant").map(String::as_str), Some("acme"));
    assert_eq!(
        vllm.labels.get("model").map(String::as_str),
        Some("llama3-8b")
    );
    assert_eq!(
        vllm.labels
            .get("app.kubernetes.io/name")
            .map(String::as_str),
        Some("vllm")
    );
    assert_eq!(vllm.labels.len(), 5);
    assert_eq!(
        vllm.annotations
            .get("prometheus.io/port")
            .map(String::as_str),
        Some("8000")
    );
    assert_eq!(
        vllm.containers,
        hm(&[
            (
                "7fed9a2cbf526eb27db49bebacac6aab877dd859fa9e1cc3c574703a6440e0ba",
                "vllm"
            ),
            (
                "d44d517f8fda464ec6eb65cca802c59c4f427530f4189fa1c9c2fa0a28b2c831",
                "model-fetch"
            ),
            // ephemeral container added by the MODIFIED event
            (
                "1b4b386c2e5f6fe577d119ad9af352a1791a5c9c8347febe460b6a5bb6c930db",
                "debugger-8wzxl"
            ),
        ])
    );
    assert_eq!(vllm.ips, ips(&["10.244.1.23", "fd00:10:244:1::17"]));
    assert!(!vllm.host_network);
    assert_eq!(vllm.deleted_at, None);

    let cilium = store.get(CILIUM).expect("cilium pod");
    assert_eq!(
        (cilium.namespace.as_str(), cilium.name.as_str()),
        ("kube-system", "cilium-xk2p9")
    );
    assert!(cilium.host_network);
    assert_eq!(
        cilium.containers,
        hm(&[
            (
                "691825fcbf89f653199d7fb8ff85f5ff6760f51aa26d1b34c903204992cf6c74",
                "cilium-agent"
            ),
            (
                "29c1ec66927f4c38067ddfca29a30e02d150ea30d9cdd3d00a5581bf2327b4f2",
                "config"
            ),
            (
                "aaf8dfc585ad4d4099a69466f269686dabb0a1d2971c427f96757e6e01003e0d",
                "mount-cgroup"
            ),
        ])
    );
    // host-network pods share the node IP: never resolved by IP
    assert_eq!(store.by_ip("192.168.1.50".parse().unwrap()), None);

    // Pending in the list (no container id, no IP), Running after the MODIFIED event
    let batch = store.get(BATCH).expect("batch pod");
    assert_eq!(
        (batch.namespace.as_str(), batch.name.as_str()),
        ("batch", "batch-embed-28563120-7wq9d")
    );
    assert_eq!(
        batch.containers,
        hm(&[(
            "589f5ce19847516423e6895a5961a571c242370fe86636f2c88b756cf70a14ed",
            "embed"
        )])
    );
    assert_eq!(batch.ips, ips(&["10.244.1.40"]));
    assert_eq!(
        store.by_ip("10.244.1.40".parse().unwrap()).map(|p| p.uid),
        Some(BATCH.to_string())
    );

    // DELETED in the stream: kept with deleted_at until pruned, IP released
    let loader = store.get(LOADER).expect("deleted pod kept until pruned");
    assert!(loader.deleted_at.is_some());
    assert_eq!(loader.name, "feature-loader-0");
    assert_eq!(
        loader.containers,
        hm(&[
            (
                "08f338f98d4519519d0be603d54f5c443d0a7dd00d6a4ddd05e379f5128e75c4",
                "loader"
            ),
            // the OOM-killed previous instance (lastState.terminated.containerID)
            (
                "3e5f0a8b1c2d4e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f",
                "loader"
            ),
            (
                "9bd1dd8c4dc8562f83943ac7f4b313af8e8256be8aa0be6d3d9e05894ef4e1d4",
                "metrics"
            ),
        ])
    );
    assert_eq!(store.by_ip("10.244.1.31".parse().unwrap()), None);
}

fn spawn_watcher(store: &PodStore, client: kube::Client) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run_watcher_with_client(
        store.clone(),
        WatchConfig {
            node_name: NODE.to_string(),
        },
        client,
    ))
}

#[tokio::test]
async fn watcher_fills_store_from_recorded_list_and_watch() {
    let dir = tempfile::tempdir().unwrap();
    let fake = start_fake().await;
    let client = client_for(&fake, dir.path()).await;
    let store = PodStore::default();
    let task = spawn_watcher(&store, client);

    wait_for(
        "list + recorded watch events",
        Duration::from_secs(15),
        || {
            store.get(LOADER).is_some_and(|p| p.deleted_at.is_some())
                && store.get(VLLM).is_some_and(|p| p.containers.len() == 3)
        },
    )
    .await;
    assert_state_after_recorded_stream(&store);

    // The requests: one node-scoped list, then a node-scoped watch from the list's version.
    let reqs = fake.requests();
    let lists: Vec<_> = reqs.iter().filter(|r| !r.is_watch()).collect();
    let watches: Vec<_> = reqs.iter().filter(|r| r.is_watch()).collect();
    assert_eq!(lists.len(), 1, "requests: {reqs:#?}");
    assert_eq!(lists[0].path, "/api/v1/pods");
    assert!(
        lists[0]
            .raw
            .contains("fieldSelector=spec.nodeName%3Dtalos-gpu-worker-1"),
        "selector not sent: {}",
        lists[0].raw
    );
    assert_eq!(
        lists[0].param("fieldSelector"),
        Some("spec.nodeName=talos-gpu-worker-1")
    );
    assert!(!watches.is_empty());
    assert_eq!(watches[0].path, "/api/v1/pods");
    assert_eq!(
        watches[0].param("fieldSelector"),
        Some("spec.nodeName=talos-gpu-worker-1")
    );
    assert_eq!(watches[0].param("resourceVersion"), Some("48213"));
    assert_eq!(watches[0].param("allowWatchBookmarks"), Some("true"));

    // cgroup path -> pod -> container name, end to end
    let cg = "/kubepods/burstable/pod8faa3759-bf25-436b-b765-e6efbb602f44/7fed9a2cbf526eb27db49bebacac6aab877dd859fa9e1cc3c574703a6440e0ba";
    let CgroupClass::Pod {
        uid,
        container_id,
        qos,
    } = classify_cgroup(cg)
    else {
        panic!("not a pod: {cg}");
    };
    assert_eq!(qos, Qos::Burstable);
    let pod = store.get(&uid).expect("pod of the cgroup");
    assert_eq!(pod.name, "vllm-llama3-8b-6f9c7d5b8-x2k4q");
    assert_eq!(pod.container_name(&container_id.unwrap()), Some("vllm"));
    let cg = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod8faa3759_bf25_436b_b765_e6efbb602f44.slice/cri-containerd-d44d517f8fda464ec6eb65cca802c59c4f427530f4189fa1c9c2fa0a28b2c831.scope";
    let CgroupClass::Pod {
        uid, container_id, ..
    } = classify_cgroup(cg)
    else {
        panic!("not a pod: {cg}");
    };
    assert_eq!(
        store
            .get(&uid)
            .unwrap()
            .container_name(&container_id.unwrap()),
        Some("model-fetch")
    );

    // A later deletion pushed on the open watch stream.
    fake.push_event(fixture("pod-vllm-deleted.json").trim().to_string());
    wait_for("pushed DELETED", Duration::from_secs(10), || {
        store.get(VLLM).is_some_and(|p| p.deleted_at.is_some())
    })
    .await;
    assert_eq!(store.by_ip("10.244.1.23".parse().unwrap()), None);
    assert_eq!(store.len(), 4);
    // not yet past a long grace period; past a zero one both deleted pods go
    assert_eq!(store.prune(Duration::from_secs(3600)), 0);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.prune(Duration::ZERO), 2);
    let mut left = store.uids();
    left.sort();
    assert_eq!(left, [CILIUM, BATCH]);
    assert_eq!(
        fake.requests().iter().filter(|r| !r.is_watch()).count(),
        1,
        "the push must arrive on the open watch, not by relisting"
    );

    assert!(!task.is_finished());
    task.abort();
}

#[tokio::test]
async fn watcher_resumes_from_last_version_when_the_watch_ends() {
    let dir = tempfile::tempdir().unwrap();
    let fake = start_fake().await;
    let client = client_for(&fake, dir.path()).await;
    let store = PodStore::default();
    let task = spawn_watcher(&store, client);
    wait_for("recorded stream", Duration::from_secs(15), || {
        store.get(LOADER).is_some_and(|p| p.deleted_at.is_some())
    })
    .await;
    let watches_before = fake.requests().iter().filter(|r| r.is_watch()).count();

    // The API server closes the watch (timeout); the client re-watches from the last version
    // it saw (the DELETED at 48251), without a relist.
    fake.end_watches();
    wait_for("re-watch", Duration::from_secs(10), || {
        fake.requests().iter().filter(|r| r.is_watch()).count() > watches_before
    })
    .await;
    let reqs = fake.requests();
    let rewatch = reqs.iter().rfind(|r| r.is_watch()).unwrap();
    assert_eq!(rewatch.param("resourceVersion"), Some("48251"));
    assert_eq!(
        rewatch.param("fieldSelector"),
        Some("spec.nodeName=talos-gpu-worker-1")
    );
    assert_eq!(reqs.iter().filter(|r| !r.is_watch()).count(), 1);

    // an event after the reconnect arrives, and nothing was replayed twice
    fake.push_event(fixture("pod-vllm-deleted.json").trim().to_string());
    wait_for("event after re-watch", Duration::from_secs(10), || {
        store.get(VLLM).is_some_and(|p| p.deleted_at.is_some())
    })
    .await;
    assert!(store.synced());
    assert_eq!(store.len(), 4);
    assert_eq!(store.get(BATCH).unwrap().deleted_at, None);
    task.abort();
}

#[tokio::test]
async fn relist_after_expired_watch_marks_vanished_pods_deleted() {
    // First sync from the recorded list alone.
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeKube::start(NODE, fixture("pods-list.json"), vec![]).await;
    let client = client_for(&fake, dir.path()).await;
    let store = PodStore::default();
    let task = spawn_watcher(&store, client);
    wait_for("first sync", Duration::from_secs(15), || {
        store.synced() && fake.requests().iter().any(|r| r.is_watch())
    })
    .await;
    assert_eq!(store.len(), 4);
    assert_eq!(store.get(LOADER).unwrap().deleted_at, None);

    // Outage; the loader is deleted meanwhile and the history compacted, so the watch from
    // the old version gets 410 Expired and kube-rs relists: the loader is gone from the list.
    fake.set_unavailable(true);
    let lines = fixture_lines("pods-watch.jsonl");
    let deleted = lines.iter().find(|l| l.contains("\"DELETED\"")).unwrap();
    fake.push_event(deleted.clone());
    fake.compact();
    fake.set_unavailable(false);
    wait_for("relist", Duration::from_secs(40), || {
        store.get(LOADER).is_some_and(|p| p.deleted_at.is_some())
    })
    .await;
    let reqs = fake.requests();
    assert!(
        reqs.iter().filter(|r| !r.is_watch()).count() >= 2,
        "no relist happened: {reqs:#?}"
    );
    assert_eq!(store.get(VLLM).unwrap().deleted_at, None);
    assert_eq!(store.get(CILIUM).unwrap().deleted_at, None);
    assert_eq!(store.get(BATCH).unwrap().deleted_at, None);
    assert_eq!(store.len(), 4);
    task.abort();
}

#[tokio::test]
async fn api_outage_warns_once_retries_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let fake = start_fake().await;
    fake.set_unavailable(true);
    let client = client_for(&fake, dir.path()).await;
    let store = PodStore::default();
    let logs = logs();
    let task = tokio::spawn(
        run_watcher_with_client(
            store.clone(),
            WatchConfig {
                node_name: NODE.to_string(),
            },
            client,
        )
        .instrument(tracing::info_span!("outage_test")),
    );

    // several failed attempts (backoff starts at 0.8 s), one warning
    wait_for("retries", Duration::from_secs(15), || {
        fake.requests().len() >= 3
    })
    .await;
    assert!(!store.synced());
    assert_eq!(store.len(), 0);
    assert!(!task.is_finished());
    let warns = logs.warn_lines("outage_test");
    assert_eq!(
        warns.len(),
        1,
        "log:\n{}",
        logs.lines_in("outage_test").join("\n")
    );
    assert!(warns[0].contains("cannot watch pods"), "{}", warns[0]);
    assert!(warns[0].contains("labelled by UID"), "{}", warns[0]);
    assert!(
        warns[0].contains("503") || warns[0].contains("ServiceUnavailable"),
        "{}",
        warns[0]
    );
    assert!(
        fake.requests()
            .iter()
            .all(|r| r.param("fieldSelector") == Some("spec.nodeName=talos-gpu-worker-1")),
        "every retry is node-scoped"
    );

    // the API comes back: the backoff retry lists and watches, no new warning
    fake.set_unavailable(false);
    wait_for("recovery", Duration::from_secs(40), || {
        store.synced() && store.get(LOADER).is_some_and(|p| p.deleted_at.is_some())
    })
    .await;
    assert_state_after_recorded_stream(&store);
    assert_eq!(
        logs.warn_lines("outage_test").len(),
        1,
        "log:\n{}",
        logs.lines_in("outage_test").join("\n")
    );
    assert!(
        logs.lines_in("outage_test")
            .iter()
            .any(|l| l.contains(" INFO ") && l.contains("reachable again")),
        "log:\n{}",
        logs.text()
    );
    task.abort();
}
