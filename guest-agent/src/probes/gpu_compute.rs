//! GPU compute time per container, from the best source the node has.
//!
//! `ebpf_gpu_compute_time_seconds_total` is the GPU compute (SM) time attributed to a
//! container, and `ebpf_gpu_active_compute_duty_cycle` that time's share of a window. Three
//! units can measure it, with falling accuracy ([`ComputeSource`]): NVML's per-process SM
//! utilisation (`nvml`), the launch-to-completion busy estimate of the CUDA uprobes (`cuda`
//! with `--cuda-launches`), and time inside the GPU driver (`gpu_driver`), which stays near 0
//! while a server launches asynchronously and polls. After loading, `registry::elect_compute` asks each unit
//! which source it can be and tells the best one to publish both series (and
//! `gpufeed_gpu_compute_source`, the info series naming it); the others keep only their own
//! series. [`ComputeSeries`] is what the elected unit holds: it turns the unit's compute time
//! into the counter's deltas and the duty cycle gauges.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHashSet};

use super::model::{
    Delta, FamilySpec, GaugeValue, Kind, Labels, NodeFamily, Scope, SharedLabels, Value,
};
use super::tick::TickContext;
use crate::owner::Owner;

pub const COMPUTE: &str = "ebpf_gpu_compute_time_seconds_total";
pub const DUTY: &str = "ebpf_gpu_active_compute_duty_cycle";
pub const SOURCE_INFO: &str = "gpufeed_gpu_compute_source";

/// The family of the compute time, for the elected unit's family list.
pub const COMPUTE_FAMILY: FamilySpec = FamilySpec {
    name: COMPUTE,
    help: "GPU compute (SM) time attributed to the container, per GPU where the source knows it (gpufeed_gpu_compute_source says which source the node uses)",
    kind: Kind::SecondsCounter,
    scope: Scope::Container,
    pod_labels: true,
};

/// The family of the duty cycle, for the elected unit's family list.
pub const DUTY_FAMILY: FamilySpec = FamilySpec {
    name: DUTY,
    help: "Share of the last window (--gpu-duty-window) that the container's compute time fills, 0..1 per GPU",
    kind: Kind::Gauge,
    scope: Scope::Container,
    pod_labels: true,
};

/// Where a node's compute time comes from, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ComputeSource {
    /// NVML's per-process SM utilisation × time, per GPU.
    Nvml,
    /// CUDA launch to completion seen by a synchronisation or query, merged per container:
    /// an upper bound (work queued behind other work counts as busy).
    LaunchEstimate,
    /// Time with a task of the container inside a GPU driver call: memory management,
    /// control calls, blocking waits; kernel launches never enter the driver.
    DriverTime,
}

impl ComputeSource {
    /// The `source` label of `gpufeed_gpu_compute_source`.
    pub fn label(self) -> &'static str {
        match self {
            ComputeSource::Nvml => "nvml",
            ComputeSource::LaunchEstimate => "launch_estimate",
            ComputeSource::DriverTime => "driver_time",
        }
    }
}

/// The compute series of the elected unit: what it adds each tick, turned into counter
/// deltas and duty cycle gauges.
pub struct ComputeSeries {
    source: ComputeSource,
    duty: DutyWindow,
    /// Compute time read this tick, per cgroup (resolved to owners at the tick) or per owner,
    /// with the labels the unit gives it (`gpu`).
    by_cgroup: Vec<(u64, Labels, u64)>,
    by_owner: Vec<(Owner, Labels, u64)>,
    /// Cgroups whose compute time could not be read this tick though they computed
    /// throughout (see [`ComputeSeries::busy_throughout`]).
    throughout: HashSet<u64>,
    last_tick: Option<Instant>,
    /// Every live owner, made again only when the owners changed
    /// ([`TickContext::owners_changed`]); None: to be made at the next tick with gauges.
    live: Option<FxHashSet<Owner>>,
}

impl ComputeSeries {
    pub fn new(source: ComputeSource, window: Duration) -> ComputeSeries {
        ComputeSeries {
            source,
            duty: DutyWindow::new(window),
            by_cgroup: Vec::new(),
            by_owner: Vec::new(),
            throughout: HashSet::new(),
            last_tick: None,
            live: None,
        }
    }

    pub fn source(&self) -> ComputeSource {
        self.source
    }

    /// The counter's delta for `ns` of compute time read from cgroup `id`, which also goes
    /// into the duty cycle at the tick.
    pub fn cgroup_delta(&mut self, id: u64, labels: Labels, ns: u64) -> Delta {
        self.by_cgroup.push((id, labels.clone(), ns));
        Delta {
            family: COMPUTE,
            labels,
            value: Value::Count(ns),
        }
    }

    /// The counter's delta for `ns` of compute time of `owner` (a unit that attributes by
    /// process rather than by cgroup), which also goes into the duty cycle at the tick.
    pub fn owner_delta(&mut self, owner: Owner, labels: Labels, ns: u64) -> (Owner, Delta) {
        self.by_owner.push((owner.clone(), labels.clone(), ns));
        let d = Delta {
            family: COMPUTE,
            labels,
            value: Value::Count(ns),
        };
        (owner, d)
    }

    /// Cgroup `id` was computing through the whole tick but its time is booked only when it
    /// pauses (driver time of calls that overlap without a break): its duty counts the tick
    /// as busy, its counter waits.
    pub fn busy_throughout(&mut self, id: u64) {
        self.throughout.insert(id);
    }

    /// The tick's duty cycle gauges (every live owner with compute time in the window).
    pub fn duty_gauges(&mut self, ctx: &TickContext<'_>) -> (&'static str, Vec<GaugeValue>) {
        let now = Instant::now();
        let tick = self
            .last_tick
            .replace(now)
            .map_or(0, |t| now.duration_since(t).as_nanos() as u64);
        let mut busy: FxHashMap<(Owner, Labels), u64> = FxHashMap::default();
        for (id, labels, ns) in self.by_cgroup.drain(..) {
            if let Some(owner) = ctx.owners.get(&id) {
                *busy.entry((owner.clone(), labels)).or_default() += ns;
            }
        }
        for (owner, labels, ns) in self.by_owner.drain(..) {
            *busy.entry((owner, labels)).or_default() += ns;
        }
        for id in self.throughout.drain() {
            if let Some(owner) = ctx.owners.get(&id) {
                let e = busy.entry((owner.clone(), Labels::new())).or_default();
                *e = (*e).max(tick);
            }
        }
        // the set of live owners is made again, and the series of gone owners dropped, only
        // when the owners changed, not at every tick (hashing each owner of the node)
        if ctx.owners_changed {
            self.live = None;
        }
        if busy.is_empty() && self.duty.is_empty() {
            // no compute time on the node: nothing to window
            return (DUTY, Vec::new());
        }
        let prune = self.live.is_none();
        let live = self
            .live
            .get_or_insert_with(|| ctx.owners.values().cloned().collect());
        (
            DUTY,
            self.duty.record(now, busy, |o| live.contains(o), prune),
        )
    }

    /// `gpufeed_gpu_compute_source{source}` 1.
    pub fn info(&self) -> NodeFamily {
        NodeFamily {
            name: SOURCE_INFO,
            help: "1 for the source of this node's GPU compute time and duty cycle: nvml (SM utilisation per process), launch_estimate (CUDA launch to completion), driver_time (time in GPU driver calls)",
            kind: super::model::Kind::Gauge,
            samples: vec![(
                Labels::from([("source", self.source.label().to_string())]),
                1.0,
            )],
        }
    }
}

/// Compute time per (owner, labels) over a sliding window: the duty cycle is the
/// nanoseconds added since the oldest sample in the window over the time since that sample.
///
/// A series' samples are its running total at every tick since it began. Most of a node's
/// series add nothing at most ticks (a process holding a GPU and not computing), so a series
/// keeps only the samples where its total changed, and the window keeps the ticks' times once
/// for all series: the total at any tick is that of the last change at or before it. An idle
/// series then costs one comparison per tick, not a sample pushed and one dropped in a ring
/// of its own.
pub struct DutyWindow {
    window: Duration,
    /// The ticks' times, oldest first: the newest one at least `window` old, and the ones
    /// after it.
    ticks: VecDeque<Instant>,
    /// Per series: its labels as handed out and its samples.
    series: FxHashMap<(Owner, Labels), Series>,
}

/// One (owner, labels) series of a duty window.
struct Series {
    /// The key's labels, made shared once: the series hands them out at every tick.
    labels: SharedLabels,
    /// (tick, running total in ns) where the total changed, oldest first; the first is the
    /// series' start or the last change at or before the window's start.
    changes: VecDeque<(Instant, u64)>,
}

impl DutyWindow {
    pub fn new(window: Duration) -> DutyWindow {
        DutyWindow {
            window,
            ticks: VecDeque::new(),
            series: FxHashMap::default(),
        }
    }

    /// Whether no series has samples.
    pub fn is_empty(&self) -> bool {
        self.series.is_empty()
    }

    /// Adds one tick's compute time per series; returns every live owner's duty cycles
    /// (0..=1). A series first seen now had its time since the previous tick (its cgroup had
    /// no entry before); at the first tick the time before is unknown, so that tick is only
    /// the baseline. Time of an owner that is not `live` is left out; with `prune` the
    /// series of owners no longer live go (the caller prunes when the owners changed).
    pub fn record(
        &mut self,
        now: Instant,
        busy: impl IntoIterator<Item = ((Owner, Labels), u64)>,
        live: impl Fn(&Owner) -> bool,
        prune: bool,
    ) -> Vec<GaugeValue> {
        let prev_tick = self.ticks.back().copied();
        if prev_tick != Some(now) {
            self.ticks.push_back(now);
        }
        while self.ticks.len() > 2 && now.duration_since(self.ticks[1]) >= self.window {
            self.ticks.pop_front();
        }
        if prune {
            self.series.retain(|(o, _), _| live(o));
        }
        for (key, ns) in busy {
            if !live(&key.0) {
                continue;
            }
            let series = self
                .series
                .entry(key)
                .or_insert_with_key(|(_, labels)| Series {
                    labels: SharedLabels::new(labels.clone()),
                    // begins at the previous tick at 0, or at the first tick as its baseline
                    changes: VecDeque::from([(prev_tick.unwrap_or(now), 0)]),
                });
            let changes = &mut series.changes;
            let total = changes.back().map_or(0, |c| c.1);
            if ns > 0 {
                changes.push_back((now, total + ns));
            }
        }
        // the window starts at the oldest tick kept, or at a series' start if later
        let window_start = self.ticks.front().copied().unwrap_or(now);
        let mut out = Vec::new();
        for ((owner, _), Series { labels, changes }) in &mut self.series {
            while changes.len() > 1 && changes[1].0 <= window_start {
                changes.pop_front();
            }
            let (Some(&(first_at, first_total)), Some(&(_, total))) =
                (changes.front(), changes.back())
            else {
                continue;
            };
            let start = first_at.max(window_start);
            let elapsed = now.duration_since(start).as_nanos() as f64;
            if elapsed <= 0.0 {
                continue;
            }
            out.push(GaugeValue {
                owner: owner.clone(),
                labels: labels.clone(),
                value: ((total - first_total) as f64 / elapsed).clamp(0.0, 1.0),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn pod(n: u8) -> Owner {
        Owner::Pod {
            uid: format!("uid-{n}").into(),
            container_id: Some(format!("c{n}").into()),
        }
    }

    fn gpu(i: u32) -> Labels {
        Labels::from([("gpu", i.to_string())])
    }

    #[test]
    fn duty_cycle_is_the_compute_share_of_the_window_per_gpu() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let (a, b) = (pod(1), pod(2));
        let live_ab = HashSet::from([&a, &b]);
        let mut w = DutyWindow::new(Duration::from_secs(4));
        // first tick: baseline only
        let g = w.record(
            t0,
            HashMap::from([((a.clone(), gpu(0)), 5 * 1_000_000_000)]),
            |o| live_ab.contains(o),
            true,
        );
        assert!(g.is_empty(), "no window yet: {g:?}");
        let value = |g: &[GaugeValue], o: &Owner, l: &Labels| {
            g.iter()
                .find(|v| &v.owner == o && *v.labels == *l)
                .map(|v| v.value)
        };
        // a computes half of every second on GPU 0 and all of it on GPU 1; b the whole
        // first second on GPU 0
        let half = 500_000_000;
        let g = w.record(
            t0 + s,
            HashMap::from([
                ((a.clone(), gpu(0)), half),
                ((a.clone(), gpu(1)), 1_000_000_000),
                ((b.clone(), gpu(0)), 1_000_000_000),
            ]),
            |o| live_ab.contains(o),
            true,
        );
        assert_eq!(value(&g, &a, &gpu(0)), Some(0.5));
        assert_eq!(value(&g, &a, &gpu(1)), Some(1.0));
        assert_eq!(value(&g, &b, &gpu(0)), Some(1.0));
        for i in 2..=10 {
            let g = w.record(
                t0 + i * s,
                HashMap::from([((a.clone(), gpu(0)), half)]),
                |o| live_ab.contains(o),
                true,
            );
            assert_eq!(value(&g, &a, &gpu(0)), Some(0.5), "tick {i}");
            let b_now = value(&g, &b, &gpu(0)).unwrap();
            // b's busy second leaves the 4 s window after 4 more ticks
            let want = if i <= 4 { 1.0 / i as f64 } else { 0.0 };
            assert!(
                (b_now - want).abs() < 1e-9,
                "tick {i}: b {b_now} want {want}"
            );
        }
        // a gone: its series go
        let g = w.record(t0 + 11 * s, HashMap::new(), |o| *o == b, true);
        assert_eq!(value(&g, &a, &gpu(0)), None);
        assert_eq!(value(&g, &a, &gpu(1)), None);
        assert_eq!(value(&g, &b, &gpu(0)), Some(0.0));
    }

    /// A series that computes once in a long idle run: its burst counts while it is inside the
    /// window and not after, and an idle series keeps one change, not a sample per tick.
    #[test]
    fn an_idle_series_keeps_one_change_and_its_burst_leaves_with_the_window() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let a = pod(1);
        let mut w = DutyWindow::new(Duration::from_secs(10));
        let at = |w: &mut DutyWindow, i: u32, ns: u64| {
            let g = w.record(
                t0 + i * s,
                HashMap::from([((a.clone(), gpu(0)), ns)]),
                |_| true,
                false,
            );
            g.iter().find(|v| v.owner == a).map(|v| v.value)
        };
        assert_eq!(at(&mut w, 0, 0), None, "the first tick is the baseline");
        for i in 1..=30 {
            assert_eq!(at(&mut w, i, 0), Some(0.0), "tick {i}");
        }
        let changes = |w: &DutyWindow| w.series.values().map(|s| s.changes.len()).sum::<usize>();
        assert_eq!(changes(&w), 1, "30 idle ticks kept as one change");
        assert_eq!(
            w.ticks.len(),
            11,
            "the window's ticks, once for every series"
        );
        // 400 ms of compute in tick 31: 4% of the 10 s window until the window's oldest tick
        // is 31 itself (tick 41)
        assert_eq!(at(&mut w, 31, 400_000_000), Some(0.04));
        for i in 32..=40 {
            let v = at(&mut w, i, 0).unwrap();
            assert!((v - 0.04).abs() < 1e-12, "tick {i}: {v}");
        }
        assert_eq!(at(&mut w, 41, 0), Some(0.0));
        assert_eq!(changes(&w), 1);
        // a series first seen after the start counts from the tick before it
        let b = pod(2);
        let g = w.record(
            t0 + 42 * s,
            HashMap::from([((b.clone(), gpu(0)), 250_000_000)]),
            |_| true,
            false,
        );
        let v = g.iter().find(|v| v.owner == b).map(|v| v.value);
        assert_eq!(v, Some(0.25));
    }

    /// The series of an owner that left the tick's owners go in the tick the collector says
    /// the owners changed (the one after its cgroup went), though the live owners are looked
    /// at only then; an owner that is not live gets no series.
    #[test]
    fn duty_series_of_gone_owners_leave_the_tick_after_their_cgroups() {
        use std::cell::RefCell;

        use crate::cgroups::CgroupTree;
        use crate::pods::PodStore;
        use crate::probes::tick::PidCache;

        let tmp = tempfile::tempdir().unwrap();
        let tree = CgroupTree::new(tmp.path().to_path_buf());
        let pods = PodStore::new();
        let pids = RefCell::new(PidCache::default());
        let activity = HashMap::new();
        let (a, b, stranger) = (pod(1), pod(2), pod(3));
        let mut series = ComputeSeries::new(ComputeSource::Nvml, Duration::from_secs(30));
        let mut tick = |owners: &[&Owner], owners_changed: bool, n: u64| {
            let owners: FxHashMap<u64, Owner> = owners
                .iter()
                .enumerate()
                .map(|(i, o)| (i as u64 + 10, (*o).clone()))
                .collect();
            let ctx = TickContext {
                tree: &tree,
                owners: &owners,
                pods: &pods,
                cgroups_changed: owners_changed,
                owners_changed,
                processes: None,
                active: None,
                tick: n,
                pids: &pids,
                gpu_activity: &activity,
            };
            for o in [&a, &b, &stranger] {
                let _ = series.owner_delta(o.clone(), gpu(0), 1_000);
            }
            std::thread::sleep(Duration::from_millis(2));
            let (_, g) = series.duty_gauges(&ctx);
            let mut with: Vec<Owner> = g.into_iter().map(|v| v.owner).collect();
            with.sort();
            with
        };
        let (ab, just_a) = (vec![a.clone(), b.clone()], vec![a.clone()]);
        // the first tick is the window's baseline
        assert_eq!(tick(&[&a, &b], true, 1), Vec::<Owner>::new());
        assert_eq!(tick(&[&a, &b], false, 2), ab);
        assert_eq!(tick(&[&a, &b], false, 3), ab);
        // b's cgroup went this tick: its owner is still among the tick's owners
        assert_eq!(tick(&[&a, &b], false, 4), ab);
        // and gone from them at the next, which the collector says changed them
        assert_eq!(tick(&[&a], true, 5), just_a);
        assert_eq!(tick(&[&a], false, 6), just_a);
        // b back (a new cgroup of the same owner)
        assert_eq!(tick(&[&a, &b], true, 7), ab);
    }

    #[test]
    fn sources_rank_best_first() {
        assert!(ComputeSource::Nvml < ComputeSource::LaunchEstimate);
        assert!(ComputeSource::LaunchEstimate < ComputeSource::DriverTime);
        let s = ComputeSeries::new(ComputeSource::LaunchEstimate, Duration::from_secs(30));
        let info = s.info();
        assert_eq!(info.name, SOURCE_INFO);
        assert_eq!(
            info.samples,
            vec![(
                Labels::from([("source", "launch_estimate".to_string())]),
                1.0
            )]
        );
    }
}
