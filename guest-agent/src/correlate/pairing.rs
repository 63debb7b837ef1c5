//! The join of spikes and host events, both in guest realtime.
//!
//! A spike at `s` and a host event at `t` join when `t − before ≤ s ≤ t + after`: the
//! effect may show a little before the event's timestamp (clock error, the host's poll
//! interval, the window's length) and some seconds after it (queues fill, retries back off).
//!
//! * Either side may arrive first. A spike is checked against the events already known when
//!   it is detected; an event, late or out of order, against the spikes already recorded. So
//!   a spike that was unexplained becomes explained when the event reaches the guest later,
//!   as long as the spike is still retained.
//! * A spike joins every event in reach (the per-event view lists all pods that spiked near
//!   it), and is counted once per event kind: two events of different kinds in reach both
//!   get it, two of the same kind count it once.
//! * Events of the same kind from the same host within `coalesce` of a listed one are one
//!   burst (an AER burst is many counter events): the listed event's `count` grows.
//! * A spike's value is the highest p99 of its episode within `after` of its start; the
//!   magnitude is that ÷ the baseline median before the spike.

use std::collections::VecDeque;

use super::events::{Classified, EventKind, HostInput};
use super::window::PodKey;

/// A spike of one (pod, signal), retained for the explained ratio and late joins.
#[derive(Debug, Clone, PartialEq)]
pub struct SpikeRecord {
    pub id: u64,
    pub pod: PodKey,
    pub signal: String,
    /// Guest realtime of the first window above the threshold, ns.
    pub at: i64,
    /// Highest p99 within `after` of `at`.
    pub value: f64,
    /// Baseline median before the spike.
    pub baseline: f64,
    /// Ids of the events it joined.
    pub events: Vec<u64>,
    /// Kinds it was counted for.
    pub kinds: Vec<EventKind>,
}

impl SpikeRecord {
    pub fn magnitude(&self) -> Option<f64> {
        magnitude(self.value, self.baseline)
    }
}

/// `value ÷ baseline`; none for a zero baseline (a signal that was zero has no ratio).
pub fn magnitude(value: f64, baseline: f64) -> Option<f64> {
    (baseline > 0.0).then(|| value / baseline)
}

/// One pod signal that spiked near an event.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    pub spike: u64,
    pub pod: PodKey,
    pub signal: String,
    /// Spike time minus event time, ns (negative: the spike showed first).
    pub lag_ns: i64,
    pub value: f64,
    pub baseline: f64,
}

/// A host event in the recent list.
#[derive(Debug, Clone, PartialEq)]
pub struct EventRecord {
    pub id: u64,
    pub host: String,
    pub kind: EventKind,
    pub host_kind: &'static str,
    pub summary: String,
    /// Guest realtime of the event, ns.
    pub at: i64,
    pub host_realtime_ns: i64,
    pub clock_offset_ns: i64,
    /// Events coalesced into this one (1 for a single event).
    pub count: u64,
    pub hits: Vec<Hit>,
    /// Hits beyond the per-event cap, counted only.
    pub hits_dropped: u64,
}

/// Bounds and reach of the join, in ns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JoinConfig {
    pub before: i64,
    pub after: i64,
    pub coalesce: i64,
    /// `coalesce` for power-managed link changes.
    pub power_coalesce: i64,
    pub retention: i64,
    pub max_spikes: usize,
    pub max_events: usize,
    pub max_hits_per_event: usize,
}

/// A (spike, kind) pair counted for the first time by a join.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJoin {
    pub pod: PodKey,
    pub signal: String,
    pub kind: EventKind,
}

#[derive(Debug, Clone)]
pub struct Joiner {
    cfg: JoinConfig,
    /// Ordered by id (detection order).
    spikes: VecDeque<SpikeRecord>,
    /// Ordered by id (arrival order), not by time: events may arrive out of order.
    events: VecDeque<EventRecord>,
    next_spike: u64,
    next_event: u64,
}

impl Joiner {
    pub fn new(cfg: JoinConfig) -> Self {
        Joiner {
            cfg,
            spikes: VecDeque::new(),
            events: VecDeque::new(),
            next_spike: 0,
            next_event: 0,
        }
    }

    pub fn spikes(&self) -> impl Iterator<Item = &SpikeRecord> {
        self.spikes.iter()
    }

    /// Changes whenever a spike or an event is recorded or expires: the ids at both ends.
    pub fn stamp(&self) -> [Option<u64>; 4] {
        [
            self.spikes.front().map(|s| s.id),
            self.spikes.back().map(|s| s.id),
            self.events.front().map(|e| e.id),
            self.events.back().map(|e| e.id),
        ]
    }

    pub fn events(&self) -> impl Iterator<Item = &EventRecord> {
        self.events.iter()
    }

    fn in_reach(&self, spike_at: i64, event_at: i64) -> bool {
        spike_at >= event_at.saturating_sub(self.cfg.before)
            && spike_at <= event_at.saturating_add(self.cfg.after)
    }

    /// Records a spike, joins it to the events in reach; returns its id and the new joins.
    pub fn add_spike(
        &mut self,
        pod: &PodKey,
        signal: &str,
        at: i64,
        value: f64,
        baseline: f64,
    ) -> (u64, Vec<NewJoin>) {
        let id = self.next_spike;
        self.next_spike += 1;
        let mut spike = SpikeRecord {
            id,
            pod: pod.clone(),
            signal: signal.to_string(),
            at,
            value,
            baseline,
            events: Vec::new(),
            kinds: Vec::new(),
        };
        let mut joins = Vec::new();
        for i in 0..self.events.len() {
            let e = &self.events[i];
            if e.kind.joins() && self.in_reach(at, e.at) {
                let cap = self.cfg.max_hits_per_event;
                joins.extend(link(&mut spike, &mut self.events[i], cap));
            }
        }
        if self.spikes.len() >= self.cfg.max_spikes.max(1) {
            self.spikes.pop_front();
        }
        self.spikes.push_back(spike);
        (id, joins)
    }

    /// Records a host event (or coalesces it into a listed burst) and joins it to the
    /// retained spikes in reach. Context events are not recorded; they return no joins.
    pub fn add_event(&mut self, input: &HostInput<'_>, c: Classified) -> Vec<NewJoin> {
        if !c.kind.listed() {
            return Vec::new();
        }
        let at = input.guest_ns();
        let window = if c.kind == EventKind::LinkPowerManaged {
            self.cfg.power_coalesce
        } else {
            self.cfg.coalesce
        };
        if let Some(e) = self.events.iter_mut().find(|e| {
            e.kind == c.kind && e.host == input.host && e.at.abs_diff(at) <= window.unsigned_abs()
        }) {
            e.count += 1;
            // A power-managed entry stands for many changes of one link: it reads what the
            // link did last (up or down, the GPU busy or idle), with the count.
            if c.kind == EventKind::LinkPowerManaged {
                e.summary = c.summary;
            }
            return Vec::new();
        }
        let mut event = EventRecord {
            id: self.next_event,
            host: input.host.to_string(),
            kind: c.kind,
            host_kind: c.host_kind,
            summary: c.summary,
            at,
            host_realtime_ns: input.host_realtime_ns,
            clock_offset_ns: input.clock_offset_ns,
            count: 1,
            hits: Vec::new(),
            hits_dropped: 0,
        };
        self.next_event += 1;
        let mut joins = Vec::new();
        if event.kind.joins() {
            for i in 0..self.spikes.len() {
                if self.in_reach(self.spikes[i].at, at) {
                    let cap = self.cfg.max_hits_per_event;
                    joins.extend(link(&mut self.spikes[i], &mut event, cap));
                }
            }
        }
        self.events.push_back(event);
        if self.events.len() > self.cfg.max_events.max(1) {
            self.evict_event();
        }
        joins
    }

    /// Drops the oldest event that is not the latest of its kind (the impact gauge shows the
    /// latest of each kind, however many newer events of other kinds came after it), one that
    /// joins nothing (power-managed link changes, unknown kinds) first: they must not push
    /// incidents out of the list.
    fn evict_event(&mut self) {
        let superseded = |i: usize| {
            let e = &self.events[i];
            self.events
                .iter()
                .any(|o| o.kind == e.kind && (o.at, o.id) > (e.at, e.id))
        };
        let victim = (0..self.events.len())
            .find(|&i| !self.events[i].kind.joins() && superseded(i))
            .or_else(|| (0..self.events.len()).find(|&i| superseded(i)));
        // If every event is the latest of its kind (more kinds than room), drop the oldest.
        self.events.remove(victim.unwrap_or(0));
    }

    /// A later window of the spike's episode: makes its value the worse of the two while
    /// within `after` (the higher; the lower for a signal that `falls`, a dip).
    pub fn episode_window(&mut self, spike: u64, at: i64, value: f64, falls: bool) {
        let Some(s) = find(&mut self.spikes, spike, |s| s.id) else {
            return;
        };
        let worse = if falls {
            value < s.value
        } else {
            value > s.value
        };
        if at > s.at.saturating_add(self.cfg.after) || !worse {
            return;
        }
        s.value = value;
        for &eid in &s.events {
            if let Some(e) = find(&mut self.events, eid, |e| e.id) {
                for h in e.hits.iter_mut().filter(|h| h.spike == spike) {
                    h.value = value;
                }
            }
        }
    }

    /// Forgets spikes older than the retention.
    pub fn expire(&mut self, now: i64) {
        let horizon = now.saturating_sub(self.cfg.retention);
        self.spikes.retain(|s| s.at >= horizon);
    }

    /// A spike is settled once no event in reach is expected any more: `lateness` after the
    /// end of its reach. Before that an unjoined spike is pending.
    pub fn is_unexplained(&self, s: &SpikeRecord, now: i64, lateness: i64) -> bool {
        s.events.is_empty()
            && now
                >= s.at
                    .saturating_add(self.cfg.before)
                    .saturating_add(lateness)
    }
}

/// Joins `spike` and `event`: the event gets a hit (up to `cap`), the spike the event id;
/// returns the join if it is the first of this kind for the spike.
fn link(spike: &mut SpikeRecord, event: &mut EventRecord, cap: usize) -> Option<NewJoin> {
    spike.events.push(event.id);
    if event.hits.len() < cap {
        event.hits.push(Hit {
            spike: spike.id,
            pod: spike.pod.clone(),
            signal: spike.signal.clone(),
            lag_ns: spike.at.saturating_sub(event.at),
            value: spike.value,
            baseline: spike.baseline,
        });
    } else {
        event.hits_dropped += 1;
    }
    if spike.kinds.contains(&event.kind) {
        return None;
    }
    spike.kinds.push(event.kind);
    Some(NewJoin {
        pod: spike.pod.clone(),
        signal: spike.signal.clone(),
        kind: event.kind,
    })
}

/// Binary search by id in a deque ordered by id.
fn find<T>(v: &mut VecDeque<T>, id: u64, key: impl Fn(&T) -> u64) -> Option<&mut T> {
    let i = v.binary_search_by_key(&id, key).ok()?;
    v.get_mut(i)
}

#[cfg(test)]
mod tests {
    use super::super::events::tests::aer;
    use super::super::events::{classify, Payload};
    use super::super::gpu::Activity;
    use super::*;
    use gpufeed_shared::event::AerSeverity;

    const S: i64 = 1_000_000_000;

    fn joiner() -> Joiner {
        Joiner::new(JoinConfig {
            before: 2 * S,
            after: 5 * S,
            coalesce: S,
            power_coalesce: 60 * S,
            retention: 900 * S,
            max_spikes: 100,
            max_events: 100,
            max_hits_per_event: 2,
        })
    }

    fn event(j: &mut Joiner, at: i64) -> Vec<NewJoin> {
        let ev = aer(AerSeverity::Fatal);
        let input = HostInput {
            host: "h",
            host_realtime_ns: at,
            clock_offset_ns: 0,
            payload: Payload::Known(&ev),
        };
        j.add_event(&input, classify(input.payload, Activity::Unknown))
    }

    #[test]
    fn reach_is_inclusive_at_both_ends() {
        let mut j = joiner();
        let pod = PodKey::new("ns", "p", "u");
        let t = 100 * S;
        for (i, at) in [t - 2 * S - 1, t - 2 * S, t + 5 * S, t + 5 * S + 1]
            .iter()
            .enumerate()
        {
            j.add_spike(&pod, &format!("s{i}"), *at, 10.0, 1.0);
        }
        let joined: Vec<String> = event(&mut j, t).into_iter().map(|n| n.signal).collect();
        assert_eq!(joined, vec!["s1", "s2"]);
    }

    #[test]
    fn hits_beyond_the_cap_are_counted_and_peaks_reach_the_event() {
        let mut j = joiner();
        let pod = PodKey::new("ns", "p", "u");
        event(&mut j, 100 * S);
        let ids: Vec<u64> = (0..3)
            .map(|i| j.add_spike(&pod, &format!("s{i}"), 101 * S, 10.0, 2.0).0)
            .collect();
        let e = j.events().next().unwrap();
        assert_eq!((e.hits.len(), e.hits_dropped), (2, 1));
        j.episode_window(ids[0], 103 * S, 40.0, false);
        j.episode_window(ids[0], 107 * S, 90.0, false); // past `after`: not the effect's peak
        let e = j.events().next().unwrap();
        assert_eq!(e.hits[0].value, 40.0);
        assert_eq!(magnitude(e.hits[0].value, e.hits[0].baseline), Some(20.0));
    }

    #[test]
    fn bursts_coalesce_only_close_together_and_never_across_extremes() {
        let mut j = joiner();
        event(&mut j, 100 * S);
        event(&mut j, 100 * S + S / 2);
        event(&mut j, 103 * S);
        event(&mut j, i64::MIN);
        event(&mut j, i64::MAX);
        let counts: Vec<u64> = j.events().map(|e| e.count).collect();
        assert_eq!(counts, vec![2, 1, 1, 1]);
    }
}
