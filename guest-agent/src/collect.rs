//! The tick: read every live cgroup's kernel aggregates, turn them into deltas
//! and add them to per-owner accumulators (a pod's container, a pod, or a
//! top-level slice for everything that is not a pod).
//!
//! Accumulating by owner rather than by cgroup keeps counters monotonic when a
//! container restarts into a new cgroup, sums all non-pod cgroups into one
//! series per slice, and lets the exporter relabel an owner (pod UID → name)
//! without restarting its counters.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::bandwidth;
use crate::cgroups::CgroupTree;
use crate::dst::MAX_DST;
use crate::ifaces::{self, PodIface};
use crate::pods::{classify_cgroup, CgroupClass, PodStore};
use crate::probes::hist::Hist;
use crate::probes::sched::SchedProbe;
use crate::probes::tc::{Direction, DropKey, IfBytes, TcProbe};
use crate::probes::tcp::{TcpCgroup, TcpProbe};

/// Who a cgroup's numbers belong to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    Pod {
        uid: String,
        container_id: Option<String>,
    },
    Slice(String),
    /// tc drops nobody could be found for (no socket, unknown device, unknown IPs)
    Unattributed,
}

impl Owner {
    fn of(class: CgroupClass) -> Owner {
        match class {
            CgroupClass::Pod {
                uid, container_id, ..
            } => Owner::Pod { uid, container_id },
            CgroupClass::Slice(s) => Owner::Slice(s),
        }
    }
}

/// Cumulative numbers of one owner since the agent first saw it.
#[derive(Debug, Clone)]
pub struct OwnerStats {
    pub sched: Hist,
    pub rtt: Vec<Hist>,
    pub retrans_segs: Vec<u64>,
    /// bytes at the tc layer of the pod's host-side interfaces, by direction
    pub tc_bytes: BTreeMap<Direction, u64>,
    /// tc/qdisc drops by (direction if known, reason)
    pub tc_drops: BTreeMap<(Option<Direction>, String), u64>,
    /// Live cgroups that map to this owner in the last tick.
    pub live_cgroups: usize,
    /// When the owner lost its last cgroup or was deleted from the API.
    pub gone_since: Option<Instant>,
}

impl Default for OwnerStats {
    fn default() -> Self {
        OwnerStats {
            sched: Hist::default(),
            rtt: vec![Hist::default(); MAX_DST],
            retrans_segs: vec![0; MAX_DST],
            tc_bytes: BTreeMap::new(),
            tc_drops: BTreeMap::new(),
            live_cgroups: 0,
            gone_since: None,
        }
    }
}

/// Self-observation numbers exported beside the data.
#[derive(Debug, Clone, Default)]
pub struct SelfStats {
    pub cgroups: usize,
    /// cgroups that have an entry in each storage map
    pub sched_entries: usize,
    pub tcp_entries: usize,
    pub owners_pod: usize,
    pub owners_slice: usize,
    pub last_tick_seconds: f64,
    pub ticks: u64,
    pub sched_negative_deltas: u64,
    pub sched_alloc_failures: u64,
    pub tcp_lost: u64,
    pub tc_interfaces: usize,
    pub tc_drop_overflow: u64,
}

/// A bandwidth cap from a pod's annotations.
#[derive(Debug, Clone, PartialEq)]
pub struct BandwidthLimit {
    pub uid: String,
    pub direction: Direction,
    pub bits_per_second: f64,
}

/// What the exporter reads.
#[derive(Default)]
pub struct Shared {
    pub owners: HashMap<Owner, OwnerStats>,
    pub stats: SelfStats,
    pub bandwidth: Vec<BandwidthLimit>,
}

/// Per-cgroup memory of the last absolute values read, to compute deltas.
struct CgroupState {
    owner: Owner,
    sched: Option<Hist>,
    tcp: Option<TcpCgroup>,
}

/// Kernel numbers of one cgroup read in this tick.
struct Reading {
    sched: Option<Hist>,
    tcp: Option<TcpCgroup>,
}

/// The tc probe with what the collector knows about pod interfaces.
pub struct TcState {
    probe: TcProbe,
    own_netns: u32,
    /// host ifindex → pod
    by_host: HashMap<u32, PodIface>,
    /// (pod netns, pod ifindex) → pod
    by_pod_side: HashMap<(u32, u32), String>,
    last: HashMap<u32, IfBytes>,
    last_discovery: Option<Instant>,
    node_spec: ifaces::NodeDevices,
    /// node devices counted per socket owner (hostNetwork pods)
    node_devices: HashSet<u32>,
    /// last node-device counters per socket-owner cgroup
    last_cg: HashMap<u64, IfBytes>,
}

impl TcState {
    pub fn new(probe: TcProbe, node_spec: ifaces::NodeDevices) -> std::io::Result<TcState> {
        Ok(TcState {
            probe,
            own_netns: ifaces::netns_inode(std::process::id() as i32)?,
            by_host: HashMap::new(),
            by_pod_side: HashMap::new(),
            last: HashMap::new(),
            last_discovery: None,
            node_spec,
            node_devices: HashSet::new(),
            last_cg: HashMap::new(),
        })
    }
}

/// How often pod interfaces and annotations are looked at again when no
/// cgroup came or went.
const REDISCOVER: Duration = Duration::from_secs(5);

pub struct Collector {
    tree: CgroupTree,
    sched: Option<SchedProbe>,
    tcp: Option<TcpProbe>,
    tc: Option<TcState>,
    state: HashMap<u64, CgroupState>,
    pods: PodStore,
    grace: Duration,
    /// (pod uid, annotation value) pairs already warned about
    warned: HashSet<(String, String)>,
    pub shared: Arc<Mutex<Shared>>,
}

impl Collector {
    pub fn new(
        tree: CgroupTree,
        sched: Option<SchedProbe>,
        tcp: Option<TcpProbe>,
        tc: Option<TcState>,
        pods: PodStore,
        grace: Duration,
    ) -> Collector {
        Collector {
            tree,
            sched,
            tcp,
            tc,
            state: HashMap::new(),
            pods,
            grace,
            warned: HashSet::new(),
            shared: Arc::default(),
        }
    }

    fn read(&self, dir: std::os::fd::BorrowedFd<'_>) -> Reading {
        Reading {
            sched: self.sched.as_ref().and_then(|p| p.read(dir)),
            tcp: self.tcp.as_ref().and_then(|p| p.read(dir)),
        }
    }

    /// One tick. Returns an error only if the cgroup hierarchy itself can't be read.
    pub fn tick(&mut self) -> std::io::Result<()> {
        let started = Instant::now();
        let now = started;
        // Cgroups present last tick: read them once more before the refresh
        // forgets removed ones, so their last numbers are not lost. A removed
        // cgroup's storage is freed by the kernel with the cgroup.
        let mut readings: Vec<(u64, Reading)> = Vec::with_capacity(self.tree.cgroups.len());
        let changes = self.tree.refresh()?;
        for (id, c) in &changes.removed {
            readings.push((*id, self.read(std::os::fd::AsFd::as_fd(&c.dir))));
        }
        for (id, cg) in &self.tree.cgroups {
            readings.push((*id, self.read(std::os::fd::AsFd::as_fd(&cg.dir))));
        }

        let mut deltas: HashMap<Owner, (Hist, Vec<Hist>, Vec<u64>)> = HashMap::new();
        let mut live: HashMap<Owner, usize> = HashMap::new();
        let (mut sched_entries, mut tcp_entries) = (0, 0);
        for (id, r) in readings {
            let path = match self.tree.cgroups.get(&id) {
                Some(c) => c.path.as_str(),
                None => changes
                    .removed
                    .get(&id)
                    .map(|c| c.path.as_str())
                    .unwrap_or("/"),
            };
            let st = self.state.entry(id).or_insert_with(|| CgroupState {
                owner: Owner::of(classify_cgroup(path)),
                sched: None,
                tcp: None,
            });
            if self.tree.cgroups.contains_key(&id) {
                *live.entry(st.owner.clone()).or_default() += 1;
            }
            let d = deltas.entry(st.owner.clone()).or_insert_with(|| {
                (
                    Hist::default(),
                    vec![Hist::default(); MAX_DST],
                    vec![0; MAX_DST],
                )
            });
            if let Some(h) = r.sched {
                sched_entries += 1;
                let delta = match &st.sched {
                    Some(prev) => h.delta_since(prev),
                    None => h.clone(),
                };
                d.0.add(&delta);
                st.sched = Some(h);
            }
            if let Some(t) = r.tcp {
                tcp_entries += 1;
                for i in 0..MAX_DST {
                    let prev = st.tcp.as_ref();
                    let rd = match prev {
                        Some(p) => t.rtt[i].delta_since(&p.rtt[i]),
                        None => t.rtt[i].clone(),
                    };
                    d.1[i].add(&rd);
                    let before = prev.map(|p| p.retrans_segs[i]).unwrap_or(0);
                    d.2[i] += if t.retrans_segs[i] >= before {
                        t.retrans_segs[i] - before
                    } else {
                        t.retrans_segs[i]
                    };
                }
                st.tcp = Some(t);
            }
        }
        let tc_deltas = self.tc_tick(!changes.added.is_empty() || !changes.removed.is_empty());
        for id in changes.removed.keys() {
            self.state.remove(id);
        }

        let (neg, alloc) = self
            .sched
            .as_ref()
            .map(|s| s.kernel_stats())
            .unwrap_or((0, 0));
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        for (owner, (sched, rtt, retrans)) in deltas {
            // No series before the first sample: idle cgroups cost nothing, and a
            // retired owner is not revived by zero deltas.
            let empty = sched.is_empty()
                && rtt.iter().all(Hist::is_empty)
                && retrans.iter().all(|r| *r == 0);
            if empty && !shared.owners.contains_key(&owner) {
                continue;
            }
            let o = shared.owners.entry(owner).or_default();
            o.sched.add(&sched);
            for i in 0..MAX_DST {
                o.rtt[i].add(&rtt[i]);
                o.retrans_segs[i] += retrans[i];
            }
        }
        if let Some((bytes, drops, limits)) = tc_deltas {
            for (owner, dir, n) in bytes {
                if n > 0 || shared.owners.contains_key(&owner) {
                    *shared
                        .owners
                        .entry(owner)
                        .or_default()
                        .tc_bytes
                        .entry(dir)
                        .or_default() += n;
                }
            }
            for (owner, dir, reason, n) in drops {
                *shared
                    .owners
                    .entry(owner)
                    .or_default()
                    .tc_drops
                    .entry((dir, reason))
                    .or_default() += n;
            }
            if let Some(l) = limits {
                shared.bandwidth = l;
            }
        }
        // Liveness and the grace period: an owner whose cgroups are all gone, or
        // whose pod the API deleted, keeps its series for `grace`, then goes.
        let grace = self.grace;
        let pods = &self.pods;
        shared.owners.retain(|owner, o| {
            o.live_cgroups = live.get(owner).copied().unwrap_or(0);
            let deleted = match owner {
                Owner::Pod { uid, .. } => pods.get(uid).is_some_and(|m| m.deleted_at.is_some()),
                Owner::Slice(_) => false,
                Owner::Unattributed => return true,
            };
            if o.live_cgroups == 0 || deleted {
                let since = *o.gone_since.get_or_insert(now);
                now.duration_since(since) < grace
            } else {
                o.gone_since = None;
                true
            }
        });
        self.pods.prune(grace);
        let (mut owners_pod, mut owners_slice) = (0, 0);
        for o in shared.owners.keys() {
            match o {
                Owner::Pod { .. } => owners_pod += 1,
                Owner::Slice(_) | Owner::Unattributed => owners_slice += 1,
            }
        }
        let ticks = shared.stats.ticks + 1;
        shared.stats = SelfStats {
            cgroups: self.tree.cgroups.len(),
            sched_entries,
            tcp_entries,
            owners_pod,
            owners_slice,
            last_tick_seconds: started.elapsed().as_secs_f64(),
            ticks,
            sched_negative_deltas: neg,
            sched_alloc_failures: alloc,
            tcp_lost: self.tcp.as_ref().map(|t| t.lost()).unwrap_or(0),
            tc_interfaces: self.tc.as_ref().map(|t| t.by_host.len()).unwrap_or(0),
            tc_drop_overflow: self.tc.as_ref().map(|t| t.probe.overflow()).unwrap_or(0),
        };
        Ok(())
    }

    /// Pod of a live (or just removed) cgroup id, as the tc probe needs it.
    fn pod_uid_of_cgroup(&self, id: u64) -> Option<Owner> {
        self.state.get(&id).map(|s| match &s.owner {
            Owner::Pod { uid, .. } => Owner::Pod {
                uid: uid.clone(),
                container_id: None,
            },
            other => other.clone(),
        })
    }

    /// The pids of each pod, from the cgroup.procs of its cgroups.
    fn pod_pids(&self) -> HashMap<String, Vec<i32>> {
        let mut out: HashMap<String, Vec<i32>> = HashMap::new();
        for (id, st) in &self.state {
            let Owner::Pod { uid, .. } = &st.owner else {
                continue;
            };
            let Some(cg) = self.tree.cgroups.get(id) else {
                continue;
            };
            let procs = self.tree.path_of(cg).join("cgroup.procs");
            let Ok(text) = std::fs::read_to_string(procs) else {
                continue;
            };
            out.entry(uid.clone())
                .or_default()
                .extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        out
    }

    /// Interfaces, byte deltas, drops and (when rediscovering) bandwidth caps.
    #[allow(clippy::type_complexity)]
    fn tc_tick(
        &mut self,
        cgroups_changed: bool,
    ) -> Option<(
        Vec<(Owner, Direction, u64)>,
        Vec<(Owner, Option<Direction>, String, u64)>,
        Option<Vec<BandwidthLimit>>,
    )> {
        let rediscover = {
            let tc = self.tc.as_ref()?;
            cgroups_changed || tc.last_discovery.is_none_or(|t| t.elapsed() >= REDISCOVER)
        };
        let mut bytes = Vec::new();
        let mut limits = None;
        if rediscover {
            let pids = self.pod_pids();
            let spec = self.tc.as_ref()?.node_spec.clone();
            let found = ifaces::discover(&pids, &spec);
            let tc = self.tc.as_mut()?;
            tc.last_discovery = Some(Instant::now());
            let found = match found {
                Ok(f) => f,
                Err(e) => {
                    // keep counting what we have; look again next time
                    tracing::warn!("listing pod interfaces failed: {e}");
                    return None;
                }
            };
            let new: HashMap<u32, PodIface> = found
                .pods
                .into_iter()
                .map(|f| (f.host_ifindex, f))
                .collect();
            // An interface stops being counted when its veth is gone or another
            // pod owns it now, not because one look missed its pod.
            let gone: Vec<u32> = tc
                .by_host
                .iter()
                .filter(|(i, p)| {
                    !found.host_veths.contains(i) || new.get(i).is_some_and(|n| n.uid != p.uid)
                })
                .map(|(i, _)| *i)
                .collect();
            for i in gone {
                if let (Some(pi), Some(b)) = (tc.by_host.get(&i), tc.probe.read(i)) {
                    let prev = tc.last.remove(&i).unwrap_or_default();
                    push_bytes(&mut bytes, &pi.uid, &b, &prev);
                }
                tc.probe.detach(i);
                tc.by_host.remove(&i);
                tc.last.remove(&i);
            }
            for (i, pi) in &new {
                if tc.by_host.contains_key(i) {
                    continue;
                }
                match tc.probe.attach(*i) {
                    Ok(()) => {
                        tracing::debug!(ifindex = i, pod = %pi.uid, "counting pod interface");
                        tc.by_host.insert(*i, pi.clone());
                    }
                    Err(e) => {
                        tracing::warn!(ifindex = i, pod = %pi.uid, "cannot attach tc programs: {e}")
                    }
                }
            }
            tc.by_pod_side = tc
                .by_host
                .values()
                .map(|p| ((p.pod_netns, p.pod_ifindex), p.uid.clone()))
                .collect();
            let node_now: HashSet<u32> = found.node_devices.iter().map(|(i, _)| *i).collect();
            for gone in tc
                .node_devices
                .difference(&node_now)
                .copied()
                .collect::<Vec<_>>()
            {
                tc.probe.detach(gone);
                tc.node_devices.remove(&gone);
            }
            for (i, name) in &found.node_devices {
                if tc.node_devices.contains(i) {
                    continue;
                }
                match tc.probe.attach_node(*i) {
                    Ok(()) => {
                        tracing::info!(device = %name, "counting hostNetwork pods' bytes on node device");
                        tc.node_devices.insert(*i);
                    }
                    Err(e) => tracing::warn!(device = %name, "cannot attach tc programs: {e}"),
                }
            }
            limits = Some(self.bandwidth_limits());
        }
        let tc = self.tc.as_mut()?;
        for (i, pi) in &tc.by_host {
            let Some(b) = tc.probe.read(*i) else { continue };
            let prev = tc.last.insert(*i, b).unwrap_or_default();
            push_bytes(&mut bytes, &pi.uid, &b, &prev);
        }
        // hostNetwork pods: node-device bytes per socket-owner cgroup
        let per_cgroup = tc.probe.read_cgroups();
        let mut node_bytes = Vec::new();
        for (id, b) in per_cgroup {
            let prev = tc.last_cg.insert(id, b).unwrap_or_default();
            node_bytes.push((id, b, prev));
        }
        let drained = tc.probe.drain_drops();
        let mut drops = Vec::with_capacity(drained.len());
        for (k, n) in drained {
            let (owner, dir) = self.attribute_drop(&k);
            let reason = self.tc.as_ref()?.probe.reason_name(k.reason);
            drops.push((owner, dir, reason, n));
        }
        for (id, b, prev) in node_bytes {
            match self.pod_uid_of_cgroup(id) {
                Some(Owner::Pod { uid, .. }) => push_bytes(&mut bytes, &uid, &b, &prev),
                Some(_) => {} // a non-pod process on the node: not this series' business
                None => {
                    // the cgroup is gone: its last bytes were read above
                    let tc = self.tc.as_mut()?;
                    tc.probe.forget_cgroup(id);
                    tc.last_cg.remove(&id);
                }
            }
        }
        Some((bytes, drops, limits))
    }

    /// Who a drop belongs to, in the order: the socket's owner, else
    /// the device's pod, else the pod whose IP the packet carries.
    fn attribute_drop(&self, k: &DropKey) -> (Owner, Option<Direction>) {
        let Some(tc) = self.tc.as_ref() else {
            return (Owner::Unattributed, None);
        };
        let ingress_hook = self
            .tc
            .as_ref()
            .map(|t| t.probe.reason_name(k.reason))
            .is_some_and(|r| r == "tc_ingress");
        // the device says the direction when it is a pod's: host side carries
        // the pod's ingress on egress, and the other way round
        let dev_side = if k.netns == tc.own_netns {
            tc.by_host.get(&k.ifindex).map(|p| {
                (
                    p.uid.clone(),
                    if ingress_hook {
                        Direction::Egress
                    } else {
                        Direction::Ingress
                    },
                )
            })
        } else {
            tc.by_pod_side.get(&(k.netns, k.ifindex)).map(|u| {
                (
                    u.clone(),
                    if ingress_hook {
                        Direction::Ingress
                    } else {
                        Direction::Egress
                    },
                )
            })
        };
        let by_ip = |ip: Option<IpAddr>| ip.and_then(|ip| self.pods.by_ip(ip)).map(|m| m.uid);
        let ip_dir = |uid: &str| -> Option<Direction> {
            if by_ip(k.saddr).as_deref() == Some(uid) {
                Some(Direction::Egress)
            } else if by_ip(k.daddr).as_deref() == Some(uid) {
                Some(Direction::Ingress)
            } else {
                None
            }
        };
        if k.cgroup_id != 0 {
            if let Some(owner) = self.pod_uid_of_cgroup(k.cgroup_id) {
                let dir = match &owner {
                    Owner::Pod { uid, .. } => dev_side
                        .as_ref()
                        .filter(|(u, _)| u == uid)
                        .map(|(_, d)| *d)
                        .or_else(|| ip_dir(uid))
                        // a pod's own socket on a device not its own: it was sending
                        .or(Some(Direction::Egress)),
                    _ => None,
                };
                return (owner, dir);
            }
        }
        if let Some((uid, dir)) = dev_side {
            return (
                Owner::Pod {
                    uid,
                    container_id: None,
                },
                Some(dir),
            );
        }
        if let Some(uid) = by_ip(k.saddr).or_else(|| by_ip(k.daddr)) {
            let dir = ip_dir(&uid);
            return (
                Owner::Pod {
                    uid,
                    container_id: None,
                },
                dir,
            );
        }
        (Owner::Unattributed, None)
    }

    /// Caps from annotations; an unparsable value is warned about once.
    fn bandwidth_limits(&mut self) -> Vec<BandwidthLimit> {
        let mut out = Vec::new();
        for uid in self.pods.uids() {
            let Some(meta) = self.pods.get(&uid) else {
                continue;
            };
            if meta.deleted_at.is_some() {
                continue;
            }
            for (key, dir) in [
                (bandwidth::EGRESS, Direction::Egress),
                (bandwidth::INGRESS, Direction::Ingress),
            ] {
                let Some(v) = meta.annotations.get(key) else {
                    continue;
                };
                match bandwidth::parse_quantity(v) {
                    Ok(bps) => out.push(BandwidthLimit {
                        uid: uid.clone(),
                        direction: dir,
                        bits_per_second: bps,
                    }),
                    Err(e) => {
                        if self.warned.insert((uid.clone(), format!("{key}={v}"))) {
                            tracing::warn!(
                                "pod {}/{}: annotation {key}={v:?} is not a valid quantity ({e}); no bandwidth limit exported",
                                meta.namespace,
                                meta.name
                            );
                        }
                    }
                }
            }
        }
        out
    }
}

fn push_bytes(out: &mut Vec<(Owner, Direction, u64)>, uid: &str, now: &IfBytes, prev: &IfBytes) {
    let owner = Owner::Pod {
        uid: uid.to_string(),
        container_id: None,
    };
    // counters only grow while the entry exists; a smaller value is a new entry
    let d = |n: u64, p: u64| if n >= p { n - p } else { n };
    out.push((
        owner.clone(),
        Direction::Egress,
        d(now.egress_bytes, prev.egress_bytes),
    ));
    out.push((
        owner,
        Direction::Ingress,
        d(now.ingress_bytes, prev.ingress_bytes),
    ));
}
