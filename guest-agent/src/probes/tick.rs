//! What a unit's tick may ask the collector: the cgroup tree, the owners,
//! the pods, what the kernel says changed, and each pod's processes (read
//! from `cgroup.procs` no more often than the kernel's changes require).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

use rustc_hash::FxHashMap;

use crate::cgroups::{CgroupTree, ProcessChanges};
use crate::owner::Owner;
use crate::pods::PodStore;

/// What the collector knows that a unit may need in its tick.
pub struct TickContext<'a> {
    pub tree: &'a CgroupTree,
    /// Owner of every live (or just removed) cgroup, by cgroup id.
    pub owners: &'a FxHashMap<u64, Owner>,
    pub pods: &'a PodStore,
    /// Whether cgroups came or went since the previous tick.
    pub cgroups_changed: bool,
    /// Whether `owners` differs from the previous tick's: cgroups came (their owners are in
    /// from this tick), or the previous tick removed some (their owners left at its end).
    pub owners_changed: bool,
    /// What the kernel says changed in processes (None: it does not say).
    pub processes: Option<&'a ProcessChanges>,
    /// The cgroups in which any task ran since the previous tick, from a
    /// unit that marks every run (None without one: every list is re-read),
    /// and the tick's number.
    pub active: Option<&'a HashSet<u64>>,
    pub tick: u64,
    pub pids: &'a RefCell<PidCache>,
    /// Each owner's GPU driver time and CUDA busy time read this tick (ns), for units that
    /// split one process's GPU time among others (an MPS server's among its clients).
    pub gpu_activity: &'a HashMap<Owner, u64>,
}

/// Without the kernel's process changes: ticks over which every pod cgroup's
/// process list is re-read once, whatever its activity (a process that exits
/// while running leaves no trace in the activity sets).
const PIDS_ROTATION: u64 = 30;

/// Every process of the pods' cgroups, with its cgroup: the per-cgroup lists turned around.
#[derive(Default)]
pub struct PodProcesses(FxHashMap<u32, u64>);

impl PodProcesses {
    pub fn contains(&self, tgid: i32) -> bool {
        self.0.contains_key(&(tgid as u32))
    }

    /// The cgroup the process was in when its cgroup's list was last read.
    pub fn cgroup_of(&self, pid: u32) -> Option<u64> {
        self.0.get(&pid).copied()
    }

    pub fn iter(&self) -> impl Iterator<Item = i32> + '_ {
        self.0.keys().map(|&pid| pid as i32)
    }
}

/// From (tgid, cgroup id) pairs.
impl FromIterator<(i32, u64)> for PodProcesses {
    fn from_iter<I: IntoIterator<Item = (i32, u64)>>(pairs: I) -> PodProcesses {
        PodProcesses(pairs.into_iter().map(|(t, id)| (t as u32, id)).collect())
    }
}

/// Each pod cgroup's processes (cgroup.procs), kept between ticks, and the
/// per-pod lists built from them.
#[derive(Default)]
pub struct PidCache {
    by_cgroup: HashMap<u64, Vec<i32>>,
    by_pod: HashMap<String, Vec<i32>>,
    /// every pod process, and a number bumped whenever that set is rebuilt
    all: PodProcesses,
    generation: u64,
    /// the tick `by_pod` was brought up to date in
    built: Option<u64>,
}

impl TickContext<'_> {
    /// The pod of a cgroup (container dropped), or its slice; None for an
    /// unknown cgroup.
    pub fn pod_of_cgroup(&self, id: u64) -> Option<Owner> {
        self.owners.get(&id).map(Owner::pod_level)
    }

    /// Processes the kernel says exec'd or mapped something since the
    /// previous tick (see `probes::lookout`); None when it does not say.
    pub fn processes_changed(&self) -> Option<&HashSet<i32>> {
        self.processes.map(|p| &p.processes)
    }

    /// The pids of each pod, from the cgroup.procs of its cgroups. A cgroup's
    /// list is re-read when the cgroup is new, or when the kernel says it
    /// gained or lost a process (fork, exit, a task moved in). A process moved
    /// *out* of a cgroup is not reported for the cgroup it left, so its pid
    /// stays in that list until the list changes otherwise; kubelet moves
    /// processes into containers, never out.
    ///
    /// Without the kernel's process changes, a list is re-read when a task of
    /// the cgroup ran since the previous tick (a process that starts runs, so
    /// the scheduler probe marks its cgroup; without that probe every list is
    /// re-read each tick), or its turn in a rotation over `PIDS_ROTATION`
    /// ticks came. Otherwise the list read before stands: an idle node's tick
    /// reads none, and with the kernel's changes a busy but steady one neither.
    pub fn pod_pids(&self) -> HashMap<String, Vec<i32>> {
        self.refresh_pids();
        self.pids.borrow().by_pod.clone()
    }

    /// Every process of the pods' cgroups, with its cgroup (the lists of
    /// [`TickContext::pod_pids`] together), and a number that stays the same
    /// as long as the set does: a unit that looked at every process of a
    /// generation need only look at those the kernel names while it lasts.
    pub fn pod_processes(&self) -> (u64, std::cell::Ref<'_, PodProcesses>) {
        self.refresh_pids();
        let cache = self.pids.borrow();
        let generation = cache.generation;
        (generation, std::cell::Ref::map(cache, |c| &c.all))
    }

    /// For a unit that looks at pod processes (and looked at every one of
    /// generation `seen`): Some(the pod processes the kernel named since)
    /// while the set of pod processes is the one of `seen`, None when it must
    /// look at all of them again ([`TickContext::pod_processes`]). Sets `seen`
    /// to the current generation.
    pub fn pod_pids_named(&self, seen: &mut Option<u64>) -> Option<Vec<i32>> {
        let (generation, pids) = self.pod_processes();
        let steady = seen.replace(generation) == Some(generation);
        let named = self.processes_changed().filter(|_| steady)?;
        Some(
            named
                .iter()
                .copied()
                .filter(|&t| pids.contains(t))
                .collect(),
        )
    }

    /// Brings the process lists up to date for this tick (see `pod_pids`).
    fn refresh_pids(&self) {
        let mut cache = self.pids.borrow_mut();
        if cache.built == Some(self.tick) {
            return;
        }
        let mut changed = false;
        // Owners and the tree change only with cgroups: without such a change since the lists
        // were brought up to date (at the previous tick), and with the kernel naming the
        // cgroups whose processes changed, only those are looked at, so a steady node's tick
        // costs nothing per pod.
        let steady = !self.cgroups_changed && cache.built.is_some_and(|t| t + 1 == self.tick);
        // (the cgroups to look at, whether each of them is to be read again)
        let (candidates, all_stale): (Vec<u64>, bool) = match self.processes {
            Some(p) if steady => (p.cgroups.iter().copied().collect(), true),
            _ => {
                let before = cache.by_cgroup.len();
                cache.by_cgroup.retain(|id, _| {
                    self.owners.contains_key(id) && self.tree.cgroups.contains_key(id)
                });
                changed = self.cgroups_changed || cache.by_cgroup.len() != before;
                (self.owners.keys().copied().collect(), false)
            }
        };
        for id in candidates {
            let (Some(Owner::Pod { .. }), Some(cg)) =
                (self.owners.get(&id), self.tree.cgroups.get(&id))
            else {
                continue;
            };
            let stale = all_stale
                || !cache.by_cgroup.contains_key(&id)
                || match self.processes {
                    Some(p) => p.cgroups.contains(&id),
                    None => {
                        self.active.is_none_or(|a| a.contains(&id))
                            || id % PIDS_ROTATION == self.tick % PIDS_ROTATION
                    }
                };
            if !stale {
                continue;
            }
            let procs = self.tree.path_of(cg).join("cgroup.procs");
            let pids: Vec<i32> = std::fs::read_to_string(procs)
                .map(|text| {
                    text.lines()
                        .filter_map(|l| l.trim().parse::<i32>().ok())
                        .collect()
                })
                .unwrap_or_default();
            if cache.by_cgroup.get(&id) != Some(&pids) {
                cache.by_cgroup.insert(id, pids);
                changed = true;
            }
        }
        if changed || cache.built.is_none() {
            let mut by_pod: HashMap<String, Vec<i32>> = HashMap::new();
            for (id, pids) in &cache.by_cgroup {
                if let Some(Owner::Pod { uid, .. }) = self.owners.get(id) {
                    by_pod.entry(uid.to_string()).or_default().extend(pids);
                }
            }
            let cache = &mut *cache;
            cache.by_pod = by_pod;
            // turned around only when a list changed: a unit that looks up the node's GPU
            // processes at every tick costs no more per tick for the pods' other processes
            cache.all = PodProcesses(
                cache
                    .by_cgroup
                    .iter()
                    .filter(|(id, _)| matches!(self.owners.get(id), Some(Owner::Pod { .. })))
                    .flat_map(|(id, pids)| pids.iter().map(move |&pid| (pid as u32, *id)))
                    .collect(),
            );
            cache.generation += 1;
        }
        cache.built = Some(self.tick);
    }
}
