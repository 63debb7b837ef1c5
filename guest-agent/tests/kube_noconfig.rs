//! `run_watcher` without any Kubernetes configuration: one warning, quiet retries, and it picks
//! up a kubeconfig that appears later. Its own test binary because it sets KUBECONFIG.

mod common;

use std::time::{Duration, Instant};

use common::fake_kube::{fixture, FakeKube};
use common::logs::captured;
use gpufeed_guest::pods::{run_watcher, PodStore, WatchConfig};

#[tokio::test]
async fn no_config_warns_once_and_picks_up_a_later_kubeconfig() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    // Only this test in this binary touches the environment.
    std::env::set_var("KUBECONFIG", &kubeconfig);
    std::env::remove_var("KUBERNETES_SERVICE_HOST");
    std::env::remove_var("KUBERNETES_SERVICE_PORT");

    let logs = captured();

    let store = PodStore::default();
    let task = tokio::spawn(run_watcher(
        store.clone(),
        WatchConfig {
            node_name: "talos-gpu-worker-1".into(),
        },
    ));

    // attempts at 0 s and 1 s (then 3 s): one warning, the retry only at debug level
    let module = "gpufeed_guest::pods::watch";
    let start = Instant::now();
    while logs.lines("DEBUG", module).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10), "no retry logged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let warns = logs.lines("WARN", module);
    assert_eq!(warns.len(), 1, "{warns:#?}");
    assert!(warns[0].contains("KUBECONFIG"), "{}", warns[0]);
    assert!(warns[0].contains("labelled by UID"), "{}", warns[0]);
    assert!(!task.is_finished());
    assert!(!store.synced());

    // the configuration appears: the next retry uses it and syncs
    let fake = FakeKube::start("talos-gpu-worker-1", fixture("pods-list.json"), vec![]).await;
    let written = fake.write_kubeconfig(dir.path());
    assert_eq!(written, kubeconfig);
    let start = Instant::now();
    while !store.synced() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "kubeconfig not picked up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(store.len(), 4);
    assert_eq!(
        store
            .get("8faa3759-bf25-436b-b765-e6efbb602f44")
            .map(|p| p.name),
        Some("vllm-llama3-8b-6f9c7d5b8-x2k4q".to_string())
    );
    assert_eq!(logs.lines("WARN", module).len(), 1);
    assert!(fake
        .requests()
        .iter()
        .all(|r| r.param("fieldSelector") == Some("spec.nodeName=talos-gpu-worker-1")));
    task.abort();
}
