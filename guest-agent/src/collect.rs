//! The tick: read every live cgroup's kernel aggregates, turn them into deltas
//! and add them to per-owner accumulators (a pod's container, a pod, or a
//! top-level slice for everything that is not a pod).
//!
//! Accumulating by owner rather than by cgroup keeps counters monotonic when a
//! container restarts into a new cgroup, sums all non-pod cgroups into one
//! series per slice, and lets the exporter relabel an owner (pod UID → name)
//! without restarting its counters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cgroups::CgroupTree;
use crate::dst::MAX_DST;
use crate::pods::{classify_cgroup, CgroupClass, PodStore};
use crate::probes::hist::Hist;
use crate::probes::sched::SchedProbe;
use crate::probes::tcp::{TcpCgroup, TcpProbe};

/// Who a cgroup's numbers belong to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    Pod { uid: String, container_id: Option<String> },
    Slice(String),
}

impl Owner {
    fn of(class: CgroupClass) -> Owner {
        match class {
            CgroupClass::Pod { uid, container_id, .. } => Owner::Pod { uid, container_id },
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
}

/// What the exporter reads.
#[derive(Default)]
pub struct Shared {
    pub owners: HashMap<Owner, OwnerStats>,
    pub stats: SelfStats,
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

pub struct Collector {
    tree: CgroupTree,
    sched: Option<SchedProbe>,
    tcp: Option<TcpProbe>,
    state: HashMap<u64, CgroupState>,
    pods: PodStore,
    grace: Duration,
    pub shared: Arc<Mutex<Shared>>,
}

impl Collector {
    pub fn new(
        tree: CgroupTree,
        sched: Option<SchedProbe>,
        tcp: Option<TcpProbe>,
        pods: PodStore,
        grace: Duration,
    ) -> Collector {
        Collector { tree, sched, tcp, state: HashMap::new(), pods, grace, shared: Arc::default() }
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
                None => changes.removed.get(&id).map(|c| c.path.as_str()).unwrap_or("/"),
            };
            let st = self.state.entry(id).or_insert_with(|| CgroupState {
                owner: Owner::of(classify_cgroup(path)),
                sched: None,
                tcp: None,
            });
            if self.tree.cgroups.contains_key(&id) {
                *live.entry(st.owner.clone()).or_default() += 1;
            }
            let d = deltas
                .entry(st.owner.clone())
                .or_insert_with(|| (Hist::default(), vec![Hist::default(); MAX_DST], vec![0; MAX_DST]));
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
                    d.2[i] += if t.retrans_segs[i] >= before { t.retrans_segs[i] - before } else { t.retrans_segs[i] };
                }
                st.tcp = Some(t);
            }
        }
        for id in changes.removed.keys() {
            self.state.remove(id);
        }

        let (neg, alloc) = self.sched.as_ref().map(|s| s.kernel_stats()).unwrap_or((0, 0));
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        for (owner, (sched, rtt, retrans)) in deltas {
            // No series before the first sample: idle cgroups cost nothing, and a
            // retired owner is not revived by zero deltas.
            let empty = sched.is_empty() && rtt.iter().all(Hist::is_empty) && retrans.iter().all(|r| *r == 0);
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
        // Liveness and the grace period: an owner whose cgroups are all gone, or
        // whose pod the API deleted, keeps its series for `grace`, then goes.
        let grace = self.grace;
        let pods = &self.pods;
        shared.owners.retain(|owner, o| {
            o.live_cgroups = live.get(owner).copied().unwrap_or(0);
            let deleted = match owner {
                Owner::Pod { uid, .. } => pods.get(uid).is_some_and(|m| m.deleted_at.is_some()),
                Owner::Slice(_) => false,
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
                Owner::Slice(_) => owners_slice += 1,
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
        };
        Ok(())
    }
}
