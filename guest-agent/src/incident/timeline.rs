//! The incident page's pictures, kept beside the correlator. Sans-IO: every call that depends on
//! time takes the guest's realtime `now` (ns), so tests drive it through any timeline.
//!
//! What it keeps:
//! * per (pod, signal), the windows of the last minutes: each window's p99, its count, and the
//!   band the detector tested it against (the baseline median and the level above which a window
//!   counts towards a spike);
//! * per host link, its speed and width changes, from the host's link-change events;
//! * the last hour's host events and spikes, for the strip at the top of the page.
//!
//! A host event's picture spans `before` to `after` around it. While that span is still running
//! the picture is drawn from the rings at each request; once it is over the picture is frozen,
//! so an event keeps its picture as long as the correlator lists it, although the rings reach
//! back only minutes. An event that reaches the guest later than the rings reach back (a host
//! cut off that replays its spool) gets what the rings still held: `held_from` says where its
//! pod windows begin.
//!
//! At intervals under a second, the windows of one second are one point (their largest p99,
//! their counts added, the band of the last), so a two-minute picture has at most about 120
//! points per pod whatever the interval.

use std::collections::VecDeque;
use std::time::Duration;

use rustc_hash::FxHashMap;
use serde::Serialize;

use gpufeed_shared::event::{HostEvent, PcieLinkChange};

use super::link::LinkView;
use crate::correlate::events::Classified;
use crate::correlate::pairing::{EventRecord, SpikeRecord};
use crate::correlate::{Observed, PodKey, WindowRef};

/// Link changes kept per link (an idle GPU that flaps between speeds makes many).
const MAX_STEPS: usize = 4096;
/// Steps a picture draws per link: beyond it, the changes of each of [`STEP_BUCKETS`] stretches
/// of the picture are drawn as at most two steps (the lowest the link went to in the stretch,
/// and where it ended), so that a picture's size does not grow with a flapping link's history.
const STEP_BUCKETS: i64 = 120;
/// Links a picture draws (the host's links that changed in its span); the rest are counted.
const MAX_PICTURE_LINKS: usize = 8;
/// Links kept (hosts × devices); the least recently changed goes first.
const MAX_LINKS: usize = 256;
/// Host events and spikes kept for the strip.
const MAX_EVENT_MARKS: usize = 2048;
const MAX_SPIKE_MARKS: usize = 4096;
/// Same-kind events of one host this close together are one mark, as the correlator lists them.
const COALESCE_MS: i64 = 1000;
/// Rings of pods without windows are dropped this often.
const PRUNE_EVERY_MS: i64 = 10_000;

/// Spans of the pictures and of the strip.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimelineConfig {
    /// A picture starts this long before its event...
    pub before: Duration,
    /// ... and ends this long after it.
    pub after: Duration,
    /// The join's reach around an event (marked on the picture).
    pub reach_before: Duration,
    pub reach_after: Duration,
    /// The strip covers this much of the past.
    pub strip: Duration,
    /// Affected pods drawn per picture; the rest are counted.
    pub max_pods: usize,
}

impl TimelineConfig {
    /// The page's defaults (a minute either side, the last hour, 8 pods) around the join's reach.
    pub fn new(reach_before: Duration, reach_after: Duration) -> Self {
        TimelineConfig {
            before: Duration::from_secs(60),
            after: Duration::from_secs(60),
            reach_before,
            reach_after,
            strip: Duration::from_secs(3600),
            max_pods: 8,
        }
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn ns_to_ms(t: i64) -> i64 {
    t.div_euclid(1_000_000)
}

/// One window as kept (NaN: no band while the detector warms up).
#[derive(Debug, Clone, Copy)]
struct Sample {
    at_ms: i64,
    count: u64,
    p99: f32,
    /// what the detector tested against the band (the mean; a rate signal's rate)
    tested: f32,
    median: f32,
    upper: f32,
}

struct SignalRing {
    signal: String,
    samples: VecDeque<Sample>,
}

struct PodRings {
    key: PodKey,
    signals: Vec<SignalRing>,
    /// Time of the newest window of any of its signals.
    last_ms: i64,
}

/// One change of a link: what it was and what it became.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LinkChange {
    at_ms: i64,
    old: (f64, f64),
    new: (f64, f64),
}

struct LinkLog {
    changes: VecDeque<LinkChange>,
    max: (f64, f64),
}

impl LinkLog {
    /// (speed GT/s, width) at `t`: after the last change before it, or before the first after it.
    fn at(&self, t: i64) -> Option<(f64, f64)> {
        let i = self.changes.partition_point(|c| c.at_ms <= t);
        match i.checked_sub(1) {
            Some(last) => Some(self.changes[last].new),
            None => self.changes.front().map(|c| c.old),
        }
    }

    /// The changes in `from..=to` (the log is in time order).
    fn span(&self, from: i64, to: i64) -> impl Iterator<Item = &LinkChange> {
        let first = self.changes.partition_point(|c| c.at_ms < from);
        self.changes
            .range(first..)
            .take_while(move |c| c.at_ms <= to)
    }

    fn changed_in(&self, from: i64, to: i64) -> bool {
        self.span(from, to).next().is_some()
    }

    /// The steps a picture of `from..=to` draws: the value at `from`, then each change; when
    /// there are more than two per stretch ([`STEP_BUCKETS`] stretches), each stretch's
    /// changes as the lowest value the link went to and the value it ended at. Returns the
    /// steps and the number of changes not drawn as their own.
    fn steps(&self, from: i64, to: i64) -> (Vec<Step>, u64) {
        let step = |t, (speed_gts, width): (f64, f64)| Step {
            t,
            speed_gts,
            width,
        };
        let mut steps: Vec<Step> = self.at(from).map(|v| step(from, v)).into_iter().collect();
        let n = self.span(from, to).count();
        if n as i64 <= 2 * STEP_BUCKETS {
            steps.extend(self.span(from, to).map(|c| step(c.at_ms, c.new)));
            return (steps, 0);
        }
        // lower speed first, then narrower: the worse of two link states
        let worse = |a: (f64, f64), b: (f64, f64)| (a.0, a.1) < (b.0, b.1);
        let width = ((to - from) / STEP_BUCKETS).max(1);
        let mut bucket: Vec<&LinkChange> = Vec::new();
        let flush = |bucket: &mut Vec<&LinkChange>, steps: &mut Vec<Step>| {
            let (Some(first), Some(last)) = (bucket.first(), bucket.last()) else {
                return;
            };
            let low = bucket
                .iter()
                .fold(*first, |lo, c| if worse(c.new, lo.new) { c } else { lo });
            if low.at_ms < last.at_ms && worse(low.new, last.new) {
                steps.push(step(low.at_ms, low.new));
            }
            steps.push(step(last.at_ms, last.new));
            bucket.clear();
        };
        for c in self.span(from, to) {
            if bucket
                .first()
                .is_some_and(|f| (f.at_ms - from) / width != (c.at_ms - from) / width)
            {
                flush(&mut bucket, &mut steps);
            }
            bucket.push(c);
        }
        flush(&mut bucket, &mut steps);
        let drawn = steps.len() - usize::from(self.at(from).is_some());
        (steps, (n - drawn) as u64)
    }
}

/// A host event on the strip.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StripEvent {
    /// Guest realtime, ms.
    pub t: i64,
    pub host: String,
    pub event: &'static str,
    /// Whether events of this kind are joined to spikes (an incident, not context).
    pub joins: bool,
    /// Events coalesced into this mark.
    pub count: u64,
    pub summary: String,
}

/// A spike on the strip.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StripSpike {
    #[serde(skip)]
    id: u64,
    pub t: i64,
    pub namespace: String,
    pub pod: String,
    pub signal: String,
    /// Joined to a host event.
    pub explained: bool,
    pub p99: f64,
    pub baseline: f64,
    /// p99 ÷ baseline; null for a zero baseline.
    pub magnitude: Option<f64>,
}

/// The strip: the last hour's host events and spikes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Strip {
    pub from: i64,
    pub to: i64,
    pub events: Vec<StripEvent>,
    pub spikes: Vec<StripSpike>,
}

/// A link's speed and width across a picture: the value at its start, then each change (or,
/// for a link that changed more often than a picture draws, the lowest and the last value of
/// each stretch of the picture: see [`STEP_BUCKETS`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkTrace {
    pub bdf: String,
    pub max_speed_gts: f64,
    pub max_width: f64,
    pub steps: Vec<Step>,
    /// Changes in the span not drawn as a step of their own (coalesced into their stretch's).
    pub coalesced: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Step {
    /// Guest realtime, ms.
    pub t: i64,
    pub speed_gts: f64,
    pub width: f64,
}

/// One window of a pod's signal (or the windows of one second merged).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    /// End of the window, guest realtime, ms.
    pub t: i64,
    pub p99: f64,
    /// The value the detector tested against the band: the window's mean (a rate signal's
    /// rate). The band is in its units, not the p99's.
    pub tested: f64,
    pub count: u64,
    /// The band the detector tested the window against; null while it warmed up.
    pub median: Option<f64>,
    pub upper: Option<f64>,
}

/// An affected pod's signal across a picture.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PodTrace {
    pub namespace: String,
    pub pod: String,
    pub signal: String,
    /// The spike's start minus the event's time.
    pub lag_ms: i64,
    /// The spike's p99 and the baseline median before it, as `/events` gives them.
    pub p99: f64,
    pub baseline: f64,
    /// Time of the first point held (later than `from` when the rings no longer reached back).
    pub held_from: Option<i64>,
    pub points: Vec<Point>,
    /// Where the pod's profiles of the spike are, with `--profile-url`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile_url: Option<String>,
}

/// The picture of one host event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Picture {
    pub host: String,
    pub event: &'static str,
    /// The event, guest realtime, ms (as `/events` gives it).
    pub time: i64,
    pub from: i64,
    pub to: i64,
    /// The join's reach: spikes starting in it belong to the event.
    pub reach_from: i64,
    pub reach_to: i64,
    /// The span after the event is over (else the picture ends now).
    pub complete: bool,
    pub links: Vec<LinkTrace>,
    /// The host's links that changed in the span beyond the ones drawn.
    pub links_not_shown: u64,
    pub pods: Vec<PodTrace>,
    /// Affected pod signals beyond `max_pods` (and beyond the correlator's per-event cap).
    pub pods_not_shown: u64,
}

/// The pictures' memory. See the module doc.
pub struct Timeline {
    cfg: TimelineConfig,
    rings: FxHashMap<std::sync::Arc<str>, PodRings>,
    links: FxHashMap<(String, String), LinkLog>,
    events: VecDeque<StripEvent>,
    spikes: VecDeque<StripSpike>,
    frozen: FxHashMap<u64, Picture>,
    /// Largest gap between two ticks seen lately: the rings keep a span and this much more, so
    /// that the tick that freezes a picture still has its start.
    tick_gap_ms: i64,
    last_tick_ms: Option<i64>,
    last_prune_ms: i64,
}

impl Timeline {
    pub fn new(cfg: TimelineConfig) -> Self {
        Timeline {
            cfg,
            rings: FxHashMap::default(),
            links: FxHashMap::default(),
            events: VecDeque::new(),
            spikes: VecDeque::new(),
            frozen: FxHashMap::default(),
            tick_gap_ms: 1000,
            last_tick_ms: None,
            last_prune_ms: 0,
        }
    }

    /// How far back the rings reach.
    fn keep_ms(&self) -> i64 {
        ms(self.cfg.before) + ms(self.cfg.after) + 2 * self.tick_gap_ms.max(1000)
    }

    /// One window of a pod's signal, with the band the correlator tested it against.
    pub fn window(&mut self, w: &WindowRef<'_>, seen: Observed) {
        let band = seen.band;
        let at_ms = ns_to_ms(w.at);
        let keep = self.keep_ms();
        let pod = match self.rings.get_mut(&w.pod.uid) {
            Some(p) => p,
            None => self.rings.entry(w.pod.uid.clone()).or_insert(PodRings {
                key: w.pod.clone(),
                signals: Vec::new(),
                last_ms: at_ms,
            }),
        };
        if pod.key != *w.pod {
            pod.key = w.pod.clone();
        }
        pod.last_ms = pod.last_ms.max(at_ms);
        let ring = match pod.signals.iter().position(|r| r.signal == w.signal) {
            Some(i) => &mut pod.signals[i],
            None => {
                // one point a second over the kept span: the ring never grows after this
                let points = (keep / 1000 + 2).clamp(2, 4096) as usize;
                pod.signals.push(SignalRing {
                    signal: w.signal.to_string(),
                    samples: VecDeque::with_capacity(points),
                });
                let last = pod.signals.len() - 1;
                &mut pod.signals[last]
            }
        };
        let (median, upper) =
            band.map_or((f32::NAN, f32::NAN), |b| (b.median as f32, b.upper as f32));
        let s = Sample {
            at_ms,
            count: w.count,
            p99: w.p99 as f32,
            tested: seen.tested as f32,
            median,
            upper,
        };
        match ring.samples.back_mut() {
            // the windows of one second are one point
            Some(last) if last.at_ms.div_euclid(1000) == at_ms.div_euclid(1000) => {
                last.at_ms = at_ms;
                last.count += s.count;
                if s.p99 > last.p99 || last.p99.is_nan() {
                    last.p99 = s.p99;
                }
                if s.tested > last.tested || last.tested.is_nan() {
                    last.tested = s.tested;
                }
                last.median = s.median;
                last.upper = s.upper;
            }
            _ => ring.samples.push_back(s),
        }
        while ring.samples.front().is_some_and(|f| f.at_ms < at_ms - keep) {
            ring.samples.pop_front();
        }
    }

    /// A host event (`event` is `None` for a kind this guest cannot decode) at guest time `at`.
    pub fn host_event(
        &mut self,
        host: &str,
        at: i64,
        event: Option<&HostEvent>,
        classified: &Classified,
    ) {
        let at_ms = ns_to_ms(at);
        if let Some(HostEvent::PcieLinkChange(c)) = event {
            self.link_change(host, at_ms, c);
        }
        if !classified.kind.listed() {
            return;
        }
        let kind = classified.kind.as_str();
        if let Some(m) = self
            .events
            .iter_mut()
            .rev()
            .take(16)
            .find(|m| m.host == host && m.event == kind && (m.t - at_ms).abs() <= COALESCE_MS)
        {
            m.count += 1;
            return;
        }
        // events arrive in about their order; a late one goes where its time says
        let i = self.events.partition_point(|m| m.t <= at_ms);
        self.events.insert(
            i,
            StripEvent {
                t: at_ms,
                host: host.to_string(),
                event: kind,
                joins: classified.kind.joins(),
                count: 1,
                summary: classified.summary.clone(),
            },
        );
        if self.events.len() > MAX_EVENT_MARKS {
            self.events.pop_front();
        }
    }

    fn link_change(&mut self, host: &str, at_ms: i64, c: &PcieLinkChange) {
        let gts = |mts: Option<u32>| mts.map_or(0.0, |m| m as f64 / 1000.0);
        let key = (host.to_string(), c.bdf.clone());
        if !self.links.contains_key(&key) && self.links.len() >= MAX_LINKS {
            let oldest = self
                .links
                .iter()
                .min_by_key(|(_, l)| l.changes.back().map_or(i64::MIN, |c| c.at_ms))
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.links.remove(&k);
            }
        }
        let log = self.links.entry(key).or_insert_with(|| LinkLog {
            changes: VecDeque::new(),
            max: (0.0, 0.0),
        });
        log.max = (gts(c.max_speed_mts), c.max_width as f64);
        let change = LinkChange {
            at_ms,
            old: (gts(c.old_speed_mts), c.old_width as f64),
            new: (gts(c.new_speed_mts), c.new_width as f64),
        };
        let i = log.changes.partition_point(|x| x.at_ms <= at_ms);
        log.changes.insert(i, change);
        if log.changes.len() > MAX_STEPS {
            log.changes.pop_front();
        }
    }

    /// The tick is over: the strip takes the correlator's new spikes (and learns which were
    /// explained since), old marks and idle rings go.
    pub fn end_tick<'a>(&mut self, now: i64, spikes: impl Iterator<Item = &'a SpikeRecord>) {
        let now_ms = ns_to_ms(now);
        if let Some(last) = self.last_tick_ms {
            // the largest recent gap, decaying so that one stall does not keep the rings long
            let gap = now_ms - last;
            self.tick_gap_ms = gap.max(self.tick_gap_ms - self.tick_gap_ms / 64);
        }
        self.last_tick_ms = Some(now_ms);
        self.sync_spikes(spikes);
        let horizon = now_ms - ms(self.cfg.strip);
        while self.events.front().is_some_and(|e| e.t < horizon) {
            self.events.pop_front();
        }
        while self.spikes.front().is_some_and(|s| s.t < horizon) {
            self.spikes.pop_front();
        }
        if now_ms - self.last_prune_ms >= PRUNE_EVERY_MS {
            self.last_prune_ms = now_ms;
            let idle = now_ms - self.keep_ms();
            self.rings.retain(|_, p| p.last_ms >= idle);
        }
    }

    /// The correlator's retained spikes (ascending ids) into the strip: new ones are added,
    /// known ones take what changed (a late host event explains them, their episode peaks).
    fn sync_spikes<'a>(&mut self, spikes: impl Iterator<Item = &'a SpikeRecord>) {
        let mut cursor = 0;
        for s in spikes {
            while cursor < self.spikes.len() && self.spikes[cursor].id < s.id {
                cursor += 1;
            }
            let explained = !s.events.is_empty();
            match self.spikes.get_mut(cursor) {
                Some(m) if m.id == s.id => {
                    m.explained = explained;
                    m.p99 = s.value;
                    m.magnitude = s.magnitude();
                }
                Some(_) => {} // older than the strip's newest: it was dropped from the strip
                None => {
                    if self.spikes.back().is_some_and(|m| m.id >= s.id) {
                        continue;
                    }
                    self.spikes.push_back(StripSpike {
                        id: s.id,
                        t: ns_to_ms(s.at),
                        namespace: s.pod.namespace.to_string(),
                        pod: s.pod.pod.to_string(),
                        signal: s.signal.clone(),
                        explained,
                        p99: s.value,
                        baseline: s.baseline,
                        magnitude: s.magnitude(),
                    });
                    if self.spikes.len() > MAX_SPIKE_MARKS {
                        self.spikes.pop_front();
                        cursor = cursor.saturating_sub(1);
                    }
                }
            }
        }
    }

    /// Whether some listed event's span is over and its picture not frozen yet.
    pub fn freeze_due<'a>(&self, now: i64, events: impl Iterator<Item = &'a EventRecord>) -> bool {
        let now_ms = ns_to_ms(now);
        let after = ms(self.cfg.after);
        events
            .into_iter()
            .any(|e| !self.frozen.contains_key(&e.id) && ns_to_ms(e.at) + after <= now_ms)
    }

    /// Freezes the pictures whose span is over; `links_now` gives a host's links as its state
    /// has them now (drawn flat when none of its links changed in the span). Pictures of events
    /// no longer listed go.
    pub fn freeze(
        &mut self,
        now: i64,
        events: &[&EventRecord],
        links_now: &dyn Fn(&str) -> Vec<LinkView>,
    ) {
        let now_ms = ns_to_ms(now);
        let after = ms(self.cfg.after);
        for e in events {
            if !self.frozen.contains_key(&e.id) && ns_to_ms(e.at) + after <= now_ms {
                let p = self.draw(e, now_ms, &links_now(&e.host));
                self.frozen.insert(e.id, p);
            }
        }
        if self.frozen.len() > events.len() {
            self.frozen
                .retain(|id, _| events.iter().any(|e| e.id == *id));
        }
    }

    /// The pictures of the listed events, newest first: frozen ones as they were, the others
    /// drawn now.
    pub fn pictures<'a>(
        &self,
        now: i64,
        events: impl Iterator<Item = &'a EventRecord>,
        links_now: &dyn Fn(&str) -> Vec<LinkView>,
    ) -> Vec<Picture> {
        let now_ms = ns_to_ms(now);
        let mut listed: Vec<&EventRecord> = events.collect();
        listed.sort_by_key(|e| std::cmp::Reverse((e.at, e.id)));
        listed
            .into_iter()
            .map(|e| match self.frozen.get(&e.id) {
                Some(p) => p.clone(),
                None => self.draw(e, now_ms, &links_now(&e.host)),
            })
            .collect()
    }

    /// The strip as of `now`.
    pub fn strip(&self, now: i64) -> Strip {
        let to = ns_to_ms(now);
        let from = to - ms(self.cfg.strip);
        Strip {
            from,
            to,
            events: self
                .events
                .iter()
                .filter(|e| e.t >= from)
                .cloned()
                .collect(),
            spikes: self
                .spikes
                .iter()
                .filter(|s| s.t >= from)
                .cloned()
                .collect(),
        }
    }

    fn draw(&self, e: &EventRecord, now_ms: i64, links_now: &[LinkView]) -> Picture {
        let time = ns_to_ms(e.at);
        let from = time - ms(self.cfg.before);
        let to = time + ms(self.cfg.after);
        let end = to.min(now_ms);
        let pods: Vec<PodTrace> = e
            .hits
            .iter()
            .take(self.cfg.max_pods)
            .map(|h| {
                let points = self.points(&h.pod, &h.signal, from, end);
                PodTrace {
                    namespace: h.pod.namespace.to_string(),
                    pod: h.pod.pod.to_string(),
                    signal: h.signal.clone(),
                    lag_ms: ns_to_ms(h.lag_ns),
                    p99: h.value,
                    baseline: h.baseline,
                    held_from: points.first().map(|p| p.t),
                    points,
                    profile_url: None,
                }
            })
            .collect();
        let not_shown = (e.hits.len() - pods.len()) as u64 + e.hits_dropped;
        let (links, links_not_shown) = self.link_traces(&e.host, from, end, links_now);
        Picture {
            host: e.host.clone(),
            event: e.kind.as_str(),
            time,
            from,
            to,
            reach_from: time - ms(self.cfg.reach_before),
            reach_to: time + ms(self.cfg.reach_after),
            complete: now_ms >= to,
            links,
            links_not_shown,
            pods,
            pods_not_shown: not_shown,
        }
    }

    fn points(&self, pod: &PodKey, signal: &str, from: i64, to: i64) -> Vec<Point> {
        let Some(ring) = self
            .rings
            .get(&pod.uid)
            .and_then(|p| p.signals.iter().find(|r| r.signal == signal))
        else {
            return Vec::new();
        };
        let num = |v: f32| (!v.is_nan()).then_some(v as f64);
        ring.samples
            .iter()
            .filter(|s| s.at_ms >= from && s.at_ms <= to)
            .map(|s| Point {
                t: s.at_ms,
                p99: s.p99 as f64,
                tested: s.tested as f64,
                count: s.count,
                median: num(s.median),
                upper: num(s.upper),
            })
            .collect()
    }

    /// The host's links that changed in `from..=to` (at most [`MAX_PICTURE_LINKS`] of them, and
    /// how many more), with their steps; when none did, its links now (the passed-through
    /// device's when the host names one), drawn flat.
    fn link_traces(
        &self,
        host: &str,
        from: i64,
        to: i64,
        now: &[LinkView],
    ) -> (Vec<LinkTrace>, u64) {
        let mut changed: Vec<(&String, &LinkLog)> = self
            .links
            .iter()
            .filter(|((h, _), log)| h == host && log.changed_in(from, to))
            .map(|((_, bdf), log)| (bdf, log))
            .collect();
        changed.sort_by(|a, b| a.0.cmp(b.0));
        let not_shown = changed.len().saturating_sub(MAX_PICTURE_LINKS) as u64;
        let out: Vec<LinkTrace> = changed
            .into_iter()
            .take(MAX_PICTURE_LINKS)
            .map(|(bdf, log)| {
                let (steps, coalesced) = log.steps(from, to);
                LinkTrace {
                    bdf: bdf.clone(),
                    max_speed_gts: log.max.0,
                    max_width: log.max.1,
                    steps,
                    coalesced,
                }
            })
            .collect();
        if !out.is_empty() {
            return (out, not_shown);
        }
        let passed: Vec<&LinkView> = now.iter().filter(|l| !l.vmid.is_empty()).collect();
        let flat = if passed.is_empty() {
            now.iter().take(1).collect()
        } else {
            passed
        };
        let flat = flat
            .into_iter()
            .take(MAX_PICTURE_LINKS)
            .map(|l| LinkTrace {
                bdf: l.bdf.clone(),
                max_speed_gts: l.max_speed_gts,
                max_width: l.max_width,
                steps: vec![Step {
                    t: from,
                    speed_gts: l.speed_gts,
                    width: l.width,
                }],
                coalesced: 0,
            })
            .collect();
        (flat, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::correlate::events::tests::{aer, link};
    use crate::correlate::events::{classify, Payload};
    use crate::correlate::{Config, Correlator, HostInput};
    use gpufeed_shared::event::{AerSeverity, LinkChangeClass};

    const S: i64 = 1_000_000_000;
    /// An epoch-like origin so that times are realistic.
    const T0: i64 = 1_800_000_000 * S;

    /// The correlator and the timeline side by side, as the agent's join drives them.
    struct Rig {
        corr: Correlator,
        tl: Timeline,
        pod: PodKey,
    }

    impl Rig {
        fn new() -> Rig {
            let cfg = Config::default();
            let tl = Timeline::new(TimelineConfig::new(cfg.before, cfg.after));
            Rig {
                corr: Correlator::new(cfg),
                tl,
                pod: PodKey::new("ml", "vllm-0", "u1"),
            }
        }

        /// One tick at `at` with the pod's run-queue window of `p99`.
        fn tick(&mut self, at: i64, p99: f64) {
            let w = WindowRef {
                pod: &self.pod,
                signal: "run_queue_wait",
                at,
                count: 900,
                mean: p99,
                p99,
                shape: crate::correlate::SignalShape::Distribution,
            };
            let seen = self.corr.observe_window(w);
            self.tl.window(&w, seen);
            self.corr.end_tick(at);
            self.tl.end_tick(at, self.corr.spike_records());
            if self.tl.freeze_due(at, self.corr.event_records()) {
                let listed: Vec<_> = self.corr.event_records().collect();
                self.tl.freeze(at, &listed, &|_| Vec::new());
            }
        }

        fn event(&mut self, at: i64, ev: &gpufeed_shared::event::HostEvent) {
            let input = HostInput {
                host: "pve1",
                host_realtime_ns: at,
                clock_offset_ns: 0,
                payload: Payload::Known(ev),
            };
            self.corr.host_event(input, at);
            self.tl.host_event(
                "pve1",
                at,
                Some(ev),
                &classify(input.payload, crate::correlate::gpu::Activity::Unknown),
            );
        }

        fn pictures(&self, now: i64) -> Vec<Picture> {
            self.tl
                .pictures(now, self.corr.event_records(), &|_| Vec::new())
        }
    }

    /// 50 µs with a little noise, the pod's quiet level.
    fn quiet(i: i64) -> f64 {
        50.0 + (i % 3) as f64
    }

    fn drop_and_restore() -> [gpufeed_shared::event::HostEvent; 2] {
        [
            link(
                LinkChangeClass::WidthReduction,
                (Some(16000), 4),
                (Some(2500), 1),
            ),
            link(
                LinkChangeClass::WidthIncrease,
                (Some(2500), 1),
                (Some(16000), 4),
            ),
        ]
    }

    /// The scenario of the page: 100 quiet seconds, the link drops at 100 s and the pod's p99
    /// jumps to 30000 µs for 30 s, the link comes back at 130 s. Its picture holds exactly the
    /// windows fed from 40 s to 160 s, each with the band it was tested against, and the link's
    /// three states.
    #[test]
    fn the_picture_of_an_event_is_the_windows_and_link_states_around_it() {
        let mut r = Rig::new();
        let [down, up] = drop_and_restore();
        let mut fed = Vec::new();
        for i in 0..=200 {
            let at = T0 + i * S;
            if i == 100 {
                r.event(at, &down);
            }
            if i == 130 {
                r.event(at, &up);
            }
            let v = if (100..130).contains(&i) {
                30000.0
            } else {
                quiet(i)
            };
            fed.push((at / 1_000_000, v));
            r.tick(at, v);
            if i == 120 {
                // while the minute after is running, the picture ends now
                let p = &r.pictures(at)[0];
                assert!(!p.complete);
                assert_eq!(p.pods[0].points.last().map(|x| x.t), Some(at / 1_000_000));
            }
        }
        let pics = r.pictures(T0 + 200 * S);
        assert_eq!(pics.len(), 2, "the drop and the restore");
        let p = pics.iter().find(|p| p.event == "link_degraded").unwrap();
        let t = (T0 + 100 * S) / 1_000_000;
        assert_eq!((p.time, p.from, p.to), (t, t - 60_000, t + 60_000));
        assert_eq!((p.reach_from, p.reach_to), (t - 2000, t + 5000));
        assert!(p.complete);
        assert_eq!(p.pods.len(), 1, "{p:?}");
        let trace = &p.pods[0];
        assert_eq!(
            (trace.pod.as_str(), trace.signal.as_str()),
            ("vllm-0", "run_queue_wait")
        );
        let want: Vec<(i64, f64)> = fed
            .iter()
            .filter(|(at, _)| *at >= t - 60_000 && *at <= t + 60_000)
            .copied()
            .collect();
        let got: Vec<(i64, f64)> = trace.points.iter().map(|x| (x.t, x.p99)).collect();
        assert_eq!(got, want);
        assert_eq!(trace.held_from, Some(t - 60_000));
        // before the event every window was held against the quiet band: median 51, and a
        // level a spike must pass; during the drop the band is the one the episode froze
        let before = trace.points.iter().find(|x| x.t == t - 1000).unwrap();
        assert_eq!(before.median, Some(51.0));
        // margin: the signal's absolute floor (50 µs) is more than 6 σ and half the median
        assert_eq!(before.upper, Some(101.0));
        let during = trace.points.iter().find(|x| x.t == t + 10_000).unwrap();
        assert_eq!((during.median, during.upper), (before.median, before.upper));
        let link = &p.links[0];
        assert_eq!(link.bdf, "0000:09:00.0");
        assert_eq!((link.max_speed_gts, link.max_width), (16.0, 4.0));
        let steps: Vec<(i64, f64, f64)> = link
            .steps
            .iter()
            .map(|s| (s.t, s.speed_gts, s.width))
            .collect();
        assert_eq!(
            steps,
            [
                (t - 60_000, 16.0, 4.0),
                (t, 2.5, 1.0),
                (t + 30_000, 16.0, 4.0)
            ]
        );
    }

    /// A link that flaps faster than a picture draws: its steps stay bounded, the lowest state
    /// of each stretch is drawn (a drop to x1 inside a flapping second is not hidden), and each
    /// change is drawn or counted; a link that changed a few times is drawn change by change.
    #[test]
    fn a_flapping_link_is_drawn_in_bounded_steps() {
        let mut log = LinkLog {
            changes: VecDeque::new(),
            max: (16.0, 4.0),
        };
        let mut prev = (16.0, 4.0);
        let mut push = |log: &mut LinkLog, at_ms: i64, new: (f64, f64)| {
            log.changes.push_back(LinkChange {
                at_ms,
                old: prev,
                new,
            });
            prev = new;
        };
        // every 20 ms between 16 and 2.5 GT/s for three minutes; once down to x1 for 4 ms
        for i in 0..9000 {
            let at = i * 20;
            push(
                &mut log,
                at,
                if i % 2 == 0 { (2.5, 4.0) } else { (16.0, 4.0) },
            );
            if at == 61_220 {
                push(&mut log, 61_234, (2.5, 1.0));
                push(&mut log, 61_238, (16.0, 4.0));
            }
        }
        let (from, to) = (60_000, 180_000);
        let in_span = log
            .changes
            .iter()
            .filter(|c| c.at_ms >= from && c.at_ms <= to)
            .count();
        let (steps, coalesced) = log.steps(from, to);
        assert!(
            steps.len() <= 1 + 2 * STEP_BUCKETS as usize,
            "{}",
            steps.len()
        );
        assert_eq!(steps.len() - 1 + coalesced as usize, in_span);
        // the change at 60 s itself (the 3000th, to 2.5 GT/s) is the value the picture starts at
        assert_eq!(
            steps[0],
            Step {
                t: from,
                speed_gts: 2.5,
                width: 4.0
            }
        );
        assert!(steps.windows(2).all(|w| w[0].t <= w[1].t), "in time order");
        assert!(
            steps.contains(&Step {
                t: 61_234,
                speed_gts: 2.5,
                width: 1.0
            }),
            "the drop to x1 is drawn"
        );
        // the last step is where the link ended
        assert_eq!(steps.last().map(|s| (s.speed_gts, s.width)), log.at(to));
        // a few changes: each its own step, nothing coalesced
        let (steps, coalesced) = log.steps(1_000, 1_100);
        assert_eq!((steps.len(), coalesced), (1 + 6, 0));
    }

    /// A frozen picture stays as it was while the rings move on; it goes when its event is no
    /// longer listed.
    #[test]
    fn pictures_freeze_when_their_span_is_over() {
        let mut r = Rig::new();
        let ev = aer(AerSeverity::Correctable);
        for i in 0..400 {
            let at = T0 + i * S;
            if i == 20 {
                r.event(at, &ev);
            }
            r.tick(at, quiet(i));
        }
        // the rings hold a few minutes only: the picture of the event at 20 s was frozen at 80 s
        let p = &r.pictures(T0 + 400 * S)[0];
        assert!(p.complete);
        let t = (T0 + 20 * S) / 1_000_000;
        assert_eq!(p.time, t);
        assert!(p.pods.is_empty(), "no pod spiked");
        assert!(r.tl.rings["u1"].signals[0].samples.front().unwrap().at_ms > t + 60_000);
        // no link changed: none is drawn when the host state has none either
        assert!(p.links.is_empty());
        // a flat link from the state when the host gives one
        let now_links = vec![LinkView {
            bdf: "0000:0a:00.0".into(),
            vmid: "100".into(),
            speed_gts: 16.0,
            width: 4.0,
            max_speed_gts: 16.0,
            max_width: 4.0,
            condition: Default::default(),
        }];
        let listed: Vec<_> = r.corr.event_records().collect();
        let mut fresh = Timeline::new(TimelineConfig::new(
            Duration::from_secs(2),
            Duration::from_secs(5),
        ));
        fresh.freeze(T0 + 400 * S, &listed, &|_| now_links.clone());
        let flat = &fresh.pictures(T0 + 400 * S, listed.into_iter(), &|_| Vec::new())[0];
        assert_eq!(
            flat.links[0].steps,
            [Step {
                t: t - 60_000,
                speed_gts: 16.0,
                width: 4.0
            }]
        );
        // evicted from the correlator's list (128 newer events of another kind): gone here too
        let mut r2 = r;
        let ev2 = aer(AerSeverity::NonFatal);
        for i in 0..200 {
            let at = T0 + (400 + 2 * i) * S;
            r2.event(at, &ev2);
            r2.tick(at, quiet(i));
        }
        let pics = r2.pictures(T0 + 800 * S);
        assert!(
            pics.iter()
                .all(|p| p.time != t || p.event != "aer_correctable")
                || pics.len() <= 128
        );
        assert!(r2.tl.frozen.len() <= r2.corr.event_records().count());
    }

    /// At 100 ms, ten windows are one point: the largest p99, the counts added.
    #[test]
    fn windows_of_one_second_are_one_point() {
        let mut r = Rig::new();
        let pod = r.pod.clone();
        for i in 0..30 {
            let w = WindowRef {
                pod: &pod,
                signal: "tcp_rtt",
                at: T0 + i * S / 10,
                count: 3,
                mean: 100.0 + i as f64,
                p99: 100.0 + i as f64,
                shape: crate::correlate::SignalShape::Distribution,
            };
            r.tl.window(
                &w,
                Observed {
                    band: None,
                    tested: w.mean,
                },
            );
        }
        let ring = &r.tl.rings["u1"].signals[0].samples;
        assert_eq!(ring.len(), 3);
        assert_eq!((ring[0].count, ring[0].p99), (30, 109.0));
        assert_eq!((ring[2].count, ring[2].p99), (30, 129.0));
        assert!(ring[0].median.is_nan(), "no band while warming up");
    }

    /// The strip: host events (a burst is one mark), and spikes, which become explained when a
    /// late host event reaches them; an hour later they are gone.
    #[test]
    fn the_strip_has_the_last_hours_events_and_spikes() {
        let mut r = Rig::new();
        for i in 0..60 {
            r.tick(T0 + i * S, quiet(i));
        }
        // a spike at 60 s with no event yet
        for i in 60..70 {
            r.tick(T0 + i * S, 30000.0);
        }
        let strip = r.tl.strip(T0 + 70 * S);
        assert_eq!(strip.spikes.len(), 1);
        assert!(!strip.spikes[0].explained);
        assert_eq!(strip.spikes[0].t, (T0 + 60 * S) / 1_000_000);
        // the host's event for it arrives late (spooled), dated 1 s before the spike
        let ev = aer(AerSeverity::NonFatal);
        r.event(T0 + 59 * S, &ev);
        r.event(T0 + 59 * S + S / 2, &ev);
        r.tick(T0 + 71 * S, quiet(71));
        let strip = r.tl.strip(T0 + 71 * S);
        assert!(strip.spikes[0].explained, "{strip:?}");
        assert_eq!(strip.events.len(), 1);
        assert_eq!(strip.events[0].count, 2);
        assert_eq!(strip.events[0].event, "aer_nonfatal");
        assert!(strip.events[0].joins);
        // an hour on, the strip is empty
        r.tick(T0 + 3700 * S, quiet(0));
        let strip = r.tl.strip(T0 + 3700 * S);
        assert!(
            strip.events.is_empty() && strip.spikes.is_empty(),
            "{strip:?}"
        );
    }

    /// An event that reaches the guest long after it happened gets what the rings still held.
    #[test]
    fn a_late_event_gets_what_the_rings_held() {
        let mut r = Rig::new();
        for i in 0..300 {
            r.tick(T0 + i * S, quiet(i));
        }
        let [down, _] = drop_and_restore();
        r.event(T0 + 100 * S, &down);
        r.tick(T0 + 300 * S, quiet(0));
        let p = &r.pictures(T0 + 300 * S)[0];
        assert!(p.complete);
        assert_eq!(
            p.links[0].steps.len(),
            2,
            "the link's states come from the event itself"
        );
    }
}
