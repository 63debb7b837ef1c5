//! Node-scoped pod watcher (kube-rs) feeding the [`PodStore`].

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::store::{PodMeta, PodStore};

/// Watcher settings.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// This node's name (`spec.nodeName` of the pods to watch).
    pub node_name: String,
}

/// First and maximum delay between attempts to find a usable Kubernetes client configuration.
const CONFIG_RETRY_FIRST: Duration = Duration::from_secs(1);
const CONFIG_RETRY_MAX: Duration = Duration::from_secs(300);

/// Watches only this node's pods (fieldSelector spec.nodeName=<node>) with kube-rs, from
/// in-cluster config or KUBECONFIG (`kube::Config::infer`). With no config or an unreachable
/// API it logs one warning and keeps retrying with backoff; never returns, never panics.
pub async fn run_watcher(store: PodStore, cfg: WatchConfig) {
    let mut delay = CONFIG_RETRY_FIRST;
    let mut warned = false;
    loop {
        let err = match kube::Config::infer().await {
            Ok(config) => match Client::try_from(config) {
                Ok(client) => return run_watcher_with_client(store, cfg, client).await,
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        };
        if warned {
            tracing::debug!(error = %err, "still no Kubernetes client configuration");
        } else {
            tracing::warn!(
                error = %err,
                "no usable Kubernetes API configuration (neither in-cluster nor KUBECONFIG); \
                 pods are labelled by UID until one appears, retrying in the background"
            );
            warned = true;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(CONFIG_RETRY_MAX);
    }
}

/// [`run_watcher`] with an explicit client (tests, or an agent that built its own).
/// Never returns, never panics; API errors are retried with kube-rs' default backoff
/// (0.8 s doubling to 30 s), logged at `warn` once per outage and at `debug` otherwise.
pub async fn run_watcher_with_client(store: PodStore, cfg: WatchConfig, client: Client) {
    let wc = watcher::Config::default()
        .fields(&format!("spec.nodeName={}", cfg.node_name))
        // served from the API server's watch cache, not etcd
        .any_semantic();
    let mut state = WatchState::default();
    loop {
        let api: Api<Pod> = Api::all(client.clone());
        let mut stream = watcher::watcher(api, wc.clone()).default_backoff().boxed();
        while let Some(item) = stream.next().await {
            match item {
                Ok(ev) => state.apply(&store, &cfg, ev),
                Err(e) => state.error(&cfg, &e),
            }
        }
        // The watcher stream does not end by itself; if it ever does, start over.
        tracing::debug!("pod watch stream ended; restarting");
        tokio::time::sleep(CONFIG_RETRY_FIRST).await;
    }
}

#[derive(Default)]
struct WatchState {
    /// UIDs seen since the last `Init` (a relist in progress).
    relist: Option<HashSet<String>>,
    /// In an outage that has already been reported.
    failing: bool,
}

impl WatchState {
    fn apply(&mut self, store: &PodStore, cfg: &WatchConfig, ev: Event<Pod>) {
        match ev {
            Event::Init => self.relist = Some(HashSet::new()),
            Event::InitApply(pod) => {
                if let Some(meta) = PodMeta::from_pod(&pod) {
                    if let Some(seen) = &mut self.relist {
                        seen.insert(meta.uid.clone());
                    }
                    store.upsert(meta);
                }
            }
            Event::InitDone => {
                let seen = self.relist.take().unwrap_or_default();
                let mut gone = 0usize;
                for uid in store.uids() {
                    if !seen.contains(&uid)
                        && store.get(&uid).is_some_and(|p| p.deleted_at.is_none())
                    {
                        store.mark_deleted(&uid);
                        gone += 1;
                    }
                }
                store.set_synced();
                if self.failing {
                    tracing::info!(
                        node = %cfg.node_name,
                        pods = seen.len(),
                        "Kubernetes API reachable again; pod list resynced"
                    );
                    self.failing = false;
                } else {
                    tracing::info!(node = %cfg.node_name, pods = seen.len(), gone, "pod list synced");
                }
            }
            Event::Apply(pod) => {
                if let Some(meta) = PodMeta::from_pod(&pod) {
                    store.upsert(meta);
                }
                self.recovered(cfg);
            }
            Event::Delete(pod) => {
                if let Some(meta) = PodMeta::from_pod(&pod) {
                    let uid = meta.uid.clone();
                    store.upsert(meta);
                    store.mark_deleted(&uid);
                }
                self.recovered(cfg);
            }
        }
    }

    fn recovered(&mut self, cfg: &WatchConfig) {
        if self.failing {
            tracing::info!(node = %cfg.node_name, "Kubernetes API reachable again");
            self.failing = false;
        }
    }

    fn error(&mut self, cfg: &WatchConfig, e: &watcher::Error) {
        if self.failing {
            tracing::debug!(error = %e, "pod watch still failing");
        } else {
            tracing::warn!(
                node = %cfg.node_name,
                error = %e,
                "cannot watch pods on the Kubernetes API; pods are labelled by UID until it is \
                 reachable, retrying with backoff"
            );
            self.failing = true;
        }
    }
}
