//! In-memory store of this node's pods, filled by the Kubernetes watcher and read by the
//! exporter (pod UID → namespace/name/labels, container id → container name).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

/// Annotation the kubelet puts on mirror pods of static pods: the config hash, which is the UID
/// the kubelet uses for the pod's cgroup (the API object has a different `metadata.uid`).
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
/// Annotations not kept in the store (large and useless for labelling).
const DROPPED_ANNOTATIONS: &[&str] = &["kubectl.kubernetes.io/last-applied-configuration"];

#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodMeta {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// All annotations except `kubectl.kubernetes.io/last-applied-configuration`.
    pub annotations: BTreeMap<String, String>,
    /// container id (64 hex, runtime prefix like "containerd://" stripped) -> container name,
    /// from status.containerStatuses, initContainerStatuses, ephemeralContainerStatuses
    pub containers: HashMap<String, String>,
    pub ips: Vec<IpAddr>,
    pub host_network: bool,
    /// set when the API reported the pod deleted (watch DELETED or gone from a relist)
    pub deleted_at: Option<Instant>,
}

impl PodMeta {
    /// A pod the API named, with nothing else known: what unit tests start from (a test sets
    /// the fields it needs with `PodMeta { ips, ..PodMeta::named(..) }`).
    #[cfg(test)]
    pub fn named(uid: &str, namespace: &str, name: &str) -> PodMeta {
        PodMeta {
            uid: uid.into(),
            namespace: namespace.into(),
            name: name.into(),
            ..PodMeta::default()
        }
    }

    /// Build from an API Pod object. `None` when the object has no UID (never the case for
    /// objects the API server returns).
    pub fn from_pod(pod: &Pod) -> Option<PodMeta> {
        let md = &pod.metadata;
        let uid = md.uid.as_deref().filter(|u| !u.is_empty())?.to_string();
        let mut annotations = md.annotations.clone().unwrap_or_default();
        for a in DROPPED_ANNOTATIONS {
            annotations.remove(*a);
        }
        let mut containers = HashMap::new();
        let mut ips = Vec::new();
        if let Some(st) = &pod.status {
            let lists = [
                &st.init_container_statuses,
                &st.container_statuses,
                &st.ephemeral_container_statuses,
            ];
            for cs in lists.into_iter().flatten().flatten() {
                add_container(&mut containers, cs);
            }
            for ip in st.pod_ips.iter().flatten() {
                if let Ok(ip) = ip.ip.trim().parse::<IpAddr>() {
                    if !ips.contains(&ip) {
                        ips.push(ip);
                    }
                }
            }
            if let Some(ip) = st.pod_ip.as_deref().and_then(|s| s.trim().parse().ok()) {
                if !ips.contains(&ip) {
                    ips.insert(0, ip);
                }
            }
        }
        Some(PodMeta {
            uid,
            namespace: md.namespace.clone().unwrap_or_default(),
            name: md.name.clone().unwrap_or_default(),
            labels: md.labels.clone().unwrap_or_default(),
            annotations,
            containers,
            ips,
            host_network: pod
                .spec
                .as_ref()
                .and_then(|s| s.host_network)
                .unwrap_or(false),
            deleted_at: None,
        })
    }

    /// Container name for a container id as classified from a cgroup path.
    pub fn container_name(&self, container_id: &str) -> Option<&str> {
        self.containers.get(container_id).map(String::as_str)
    }
}

fn add_container(map: &mut HashMap<String, String>, cs: &ContainerStatus) {
    // The current container and, after a restart, the previous one (its cgroup may still be
    // draining when the new one starts).
    let current = cs.container_id.as_deref();
    let previous = cs
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .and_then(|t| t.container_id.as_deref());
    for id in [current, previous].into_iter().flatten() {
        if let Some(id) = strip_container_id(id) {
            map.insert(id, cs.name.clone());
        }
    }
}

/// "containerd://<hex>" / "cri-o://<hex>" / "docker://<hex>" → "<hex>" (lower case).
/// `None` for an empty id.
pub fn strip_container_id(id: &str) -> Option<String> {
    let id = id.trim();
    let id = match id.find("://") {
        Some(i) => &id[i + 3..],
        None => id,
    };
    if id.is_empty() {
        None
    } else {
        Some(id.to_ascii_lowercase())
    }
}

#[derive(Default)]
struct Inner {
    pods: HashMap<String, PodMeta>,
    /// pod IP -> uid, for pods not on the host network
    by_ip: HashMap<IpAddr, String>,
    /// static pod config hash (cgroup UID) -> API uid of its mirror pod
    aliases: HashMap<String, String>,
}

impl Inner {
    fn unindex(&mut self, uid: &str) {
        if let Some(old) = self.pods.get(uid) {
            for ip in &old.ips {
                if self.by_ip.get(ip).map(String::as_str) == Some(uid) {
                    self.by_ip.remove(ip);
                }
            }
            if let Some(hash) = old.annotations.get(MIRROR_ANNOTATION) {
                if self.aliases.get(hash).map(String::as_str) == Some(uid) {
                    self.aliases.remove(hash);
                }
            }
        }
    }

    fn resolve<'a>(&'a self, uid: &'a str) -> Option<&'a PodMeta> {
        self.pods.get(uid).or_else(|| {
            self.aliases
                .get(&uid.to_ascii_lowercase())
                .and_then(|u| self.pods.get(u))
        })
    }
}

/// Shared, cheaply clonable pod store.
#[derive(Clone, Default)]
pub struct PodStore {
    inner: Arc<RwLock<Inner>>,
    synced: Arc<AtomicBool>,
    /// Bumped by every change, so that readers keeping what they derived
    /// from the store (names, labels) know when to look again.
    version: Arc<AtomicU64>,
}

impl PodStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        let g = self.inner.write().unwrap_or_else(|e| e.into_inner());
        // bumped while the lock is held: a reader that saw the new version
        // and then takes the lock sees the change
        self.version.fetch_add(1, Ordering::AcqRel);
        g
    }

    /// A number that changes whenever the store does.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Pod by UID as found in a cgroup path. For static pods the cgroup carries the kubelet's
    /// config hash; that finds the mirror pod too.
    pub fn get(&self, uid: &str) -> Option<PodMeta> {
        self.read().resolve(uid).cloned()
    }

    /// `f` of the pod [`PodStore::get`] finds, without copying it (for per-tick readers).
    pub fn with<R>(&self, uid: &str, f: impl FnOnce(&PodMeta) -> R) -> Option<R> {
        self.read().resolve(uid).map(f)
    }

    /// Insert or replace a pod (keyed by `meta.uid`). Replacing keeps the container ids of the
    /// previous version that are no longer reported (a restarted container's old cgroup may
    /// still produce samples), and a `deleted_at` already set.
    pub fn upsert(&self, mut meta: PodMeta) {
        let mut g = self.write();
        let inner = &mut *g;
        if let Some(old) = inner.pods.get(&meta.uid) {
            for (id, name) in &old.containers {
                meta.containers
                    .entry(id.clone())
                    .or_insert_with(|| name.clone());
            }
            if meta.deleted_at.is_none() {
                meta.deleted_at = old.deleted_at;
            }
        }
        inner.unindex(&meta.uid);
        if !meta.host_network && meta.deleted_at.is_none() {
            for ip in &meta.ips {
                inner.by_ip.insert(*ip, meta.uid.clone());
            }
        }
        if let Some(hash) = meta.annotations.get(MIRROR_ANNOTATION) {
            inner
                .aliases
                .insert(hash.to_ascii_lowercase(), meta.uid.clone());
        }
        inner.pods.insert(meta.uid.clone(), meta);
    }

    /// Mark a pod deleted now (no-op if unknown or already marked). Its IPs stop resolving
    /// (they may be reused by a new pod); `get` still returns it until `prune`.
    pub fn mark_deleted(&self, uid: &str) {
        let mut g = self.write();
        let inner = &mut *g;
        let Some(p) = inner.pods.get_mut(uid) else {
            return;
        };
        if p.deleted_at.is_some() {
            return;
        }
        p.deleted_at = Some(Instant::now());
        let ips = p.ips.clone();
        for ip in ips {
            if inner.by_ip.get(&ip).map(String::as_str) == Some(uid) {
                inner.by_ip.remove(&ip);
            }
        }
    }

    /// Drop entries deleted longer ago than `grace`; returns how many were dropped.
    pub fn prune(&self, grace: Duration) -> usize {
        let now = Instant::now();
        let expired = |p: &PodMeta| {
            p.deleted_at
                .is_some_and(|d| now.saturating_duration_since(d) > grace)
        };
        // every tick calls this: a write (and a new version) only when
        // something is due
        if !self.read().pods.values().any(expired) {
            return 0;
        }
        let mut g = self.write();
        let expired: Vec<String> = g
            .pods
            .values()
            .filter(|p| expired(p))
            .map(|p| p.uid.clone())
            .collect();
        for uid in &expired {
            g.unindex(uid);
            g.pods.remove(uid);
        }
        expired.len()
    }

    /// Number of entries, deleted-but-not-pruned ones included.
    pub fn len(&self) -> usize {
        self.read().pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// UIDs of all entries (deleted-but-not-pruned ones included).
    pub fn uids(&self) -> Vec<String> {
        self.read().pods.keys().cloned().collect()
    }

    /// true once the watcher has completed its first list (the API is reachable)
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Called by the watcher when a (re)list completed.
    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::Release);
    }

    /// Live (not deleted, not host-network) pod owning `ip`.
    pub fn by_ip(&self, ip: IpAddr) -> Option<PodMeta> {
        let g = self.read();
        g.by_ip.get(&ip).and_then(|u| g.pods.get(u)).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::sleep;

    fn meta(uid: &str, ips: &[&str]) -> PodMeta {
        PodMeta {
            labels: BTreeMap::from([("app".into(), "x".into())]),
            containers: HashMap::from([("c1".into(), "main".into())]),
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            ..PodMeta::named(uid, "ns", &format!("pod-{uid}"))
        }
    }

    #[test]
    fn upsert_get_len_replace() {
        let s = PodStore::new();
        assert!(s.is_empty());
        assert_eq!(s.get("a"), None);
        s.upsert(meta("a", &["10.0.0.1"]));
        s.upsert(meta("b", &["10.0.0.2"]));
        assert_eq!(s.len(), 2);
        assert_eq!(s.get("a").unwrap().name, "pod-a");
        let mut a2 = meta("a", &["10.0.0.1"]);
        a2.name = "renamed".into();
        a2.containers = HashMap::from([("c2".into(), "main".into())]);
        s.upsert(a2);
        assert_eq!(s.len(), 2);
        let a = s.get("a").unwrap();
        assert_eq!(a.name, "renamed");
        // the restarted container's old id stays known
        assert_eq!(a.container_name("c1"), Some("main"));
        assert_eq!(a.container_name("c2"), Some("main"));
        let mut uids = s.uids();
        uids.sort();
        assert_eq!(uids, ["a", "b"]);
    }

    #[test]
    fn mark_deleted_then_prune_after_grace() {
        let s = PodStore::new();
        s.upsert(meta("a", &["10.0.0.1"]));
        s.upsert(meta("b", &["10.0.0.2"]));
        s.mark_deleted("a");
        s.mark_deleted("nope");
        let d = s.get("a").unwrap().deleted_at.unwrap();
        // idempotent: a second mark keeps the first time
        s.mark_deleted("a");
        assert_eq!(s.get("a").unwrap().deleted_at, Some(d));
        // an update after deletion (final DELETED object) keeps deleted_at
        s.upsert(meta("a", &["10.0.0.1"]));
        assert_eq!(s.get("a").unwrap().deleted_at, Some(d));
        assert_eq!(s.get("b").unwrap().deleted_at, None);
        assert_eq!(s.prune(Duration::from_secs(3600)), 0);
        assert_eq!(s.len(), 2);
        sleep(Duration::from_millis(20));
        assert_eq!(s.prune(Duration::from_millis(5)), 1);
        assert_eq!(s.len(), 1);
        assert_eq!(s.get("a"), None);
        assert!(s.get("b").is_some());
        assert_eq!(s.prune(Duration::ZERO), 0);
    }

    #[test]
    fn by_ip_tracks_live_pods_and_reuse() {
        let s = PodStore::new();
        s.upsert(meta("a", &["10.0.0.1", "fd00::1"]));
        let v6: IpAddr = "fd00::1".parse().unwrap();
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(s.by_ip(v4).unwrap().uid, "a");
        assert_eq!(s.by_ip(v6).unwrap().uid, "a");
        s.mark_deleted("a");
        assert_eq!(s.by_ip(v4), None);
        // IP reused by a new pod, then the old one pruned: the new owner stays
        s.upsert(meta("b", &["10.0.0.1"]));
        assert_eq!(s.by_ip(v4).unwrap().uid, "b");
        sleep(Duration::from_millis(5));
        assert_eq!(s.prune(Duration::ZERO), 1);
        assert_eq!(s.by_ip(v4).unwrap().uid, "b");
        // IP change on update drops the old mapping
        s.upsert(meta("b", &["10.0.0.9"]));
        assert_eq!(s.by_ip(v4), None);
        assert_eq!(s.by_ip("10.0.0.9".parse().unwrap()).unwrap().uid, "b");
    }

    #[test]
    fn host_network_pods_do_not_claim_ips() {
        let s = PodStore::new();
        let mut h = meta("h", &["192.168.1.50"]);
        h.host_network = true;
        s.upsert(h);
        assert_eq!(s.by_ip("192.168.1.50".parse().unwrap()), None);
        assert!(s.get("h").is_some());
    }

    #[test]
    fn mirror_pod_found_by_config_hash() {
        let s = PodStore::new();
        let mut m = meta("3f0e1b6a-0000-4000-8000-000000000001", &[]);
        m.annotations.insert(
            MIRROR_ANNOTATION.into(),
            "5d6e8c0c9a1f7b2e3d4c5b6a79880716".into(),
        );
        s.upsert(m);
        assert_eq!(
            s.get("5d6e8c0c9a1f7b2e3d4c5b6a79880716").unwrap().uid,
            "3f0e1b6a-0000-4000-8000-000000000001"
        );
        s.mark_deleted("3f0e1b6a-0000-4000-8000-000000000001");
        sleep(Duration::from_millis(5));
        assert_eq!(s.prune(Duration::ZERO), 1);
        assert_eq!(s.get("5d6e8c0c9a1f7b2e3d4c5b6a79880716"), None);
    }

    #[test]
    fn synced_flag_is_shared_between_clones() {
        let s = PodStore::new();
        let c = s.clone();
        assert!(!c.synced());
        s.set_synced();
        assert!(c.synced());
        s.upsert(meta("a", &[]));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn from_pod_reads_api_fields() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "vllm-0", "namespace": "inference",
                "uid": "1b2c3d4e-5f60-4718-9a2b-3c4d5e6f7a8b",
                "labels": {"app": "vllm"},
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{...}",
                    "team": "ml"
                }
            },
            "spec": {"containers": [{"name": "vllm"}], "hostNetwork": false},
            "status": {
                "podIP": "10.244.1.23",
                "podIPs": [{"ip": "10.244.1.23"}, {"ip": "fd00:10:244:1::17"}, {"ip": "bogus"}],
                "containerStatuses": [{
                    "name": "vllm", "image": "x", "imageID": "", "ready": true, "restartCount": 1,
                    "containerID": "containerd://AAAA",
                    "lastState": {"terminated": {"exitCode": 137, "containerID": "containerd://bbbb"}}
                }],
                "initContainerStatuses": [{
                    "name": "fetch", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                    "containerID": "cri-o://cccc"
                }],
                "ephemeralContainerStatuses": [{
                    "name": "debugger", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                    "containerID": "docker://dddd"
                }, {
                    "name": "waiting", "image": "x", "imageID": "", "ready": false, "restartCount": 0
                }]
            }
        }))
        .unwrap();
        let m = PodMeta::from_pod(&pod).unwrap();
        assert_eq!(m.uid, "1b2c3d4e-5f60-4718-9a2b-3c4d5e6f7a8b");
        assert_eq!(
            (m.namespace.as_str(), m.name.as_str()),
            ("inference", "vllm-0")
        );
        assert_eq!(m.labels.get("app").map(String::as_str), Some("vllm"));
        assert_eq!(
            m.annotations,
            BTreeMap::from([("team".to_string(), "ml".to_string())])
        );
        assert_eq!(
            m.containers,
            HashMap::from([
                ("aaaa".to_string(), "vllm".to_string()),
                ("bbbb".to_string(), "vllm".to_string()),
                ("cccc".to_string(), "fetch".to_string()),
                ("dddd".to_string(), "debugger".to_string()),
            ])
        );
        let want: Vec<IpAddr> = vec![
            "10.244.1.23".parse().unwrap(),
            "fd00:10:244:1::17".parse().unwrap(),
        ];
        assert_eq!(m.ips, want);
        assert!(!m.host_network);
        assert_eq!(m.deleted_at, None);
        // no uid: not a pod we can key
        let bare: Pod =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "x"}})).unwrap();
        assert_eq!(PodMeta::from_pod(&bare), None);
    }

    #[test]
    fn strip_container_id_forms() {
        assert_eq!(
            strip_container_id("containerd://ABC").as_deref(),
            Some("abc")
        );
        assert_eq!(strip_container_id("cri-o://abc").as_deref(), Some("abc"));
        assert_eq!(strip_container_id("abc").as_deref(), Some("abc"));
        assert_eq!(strip_container_id("containerd://"), None);
        assert_eq!(strip_container_id(""), None);
    }
}
