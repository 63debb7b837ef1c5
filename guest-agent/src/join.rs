//! The join in the running agent: the probe units' signal windows and the hub's host events
//! go into the [`Correlator`] (and the incident page's [`Timeline`]); its series go to
//! /metrics and its views to `/events`, `/api/state` and the page at `/` (served by
//! [`crate::web`]).
//!
//! The correlator is sans-IO; this module owns the clocks and the plumbing:
//! * every tick, the collector's windows (per owner, signal and label set) become one window
//!   per (pod, signal): containers of a pod and destinations of a signal are merged (counts and
//!   sums add, p50 is count-weighted, p99 and max are the largest), since a spike of any part
//!   is a spike of the pod; slices are not pods and are left out;
//! * a pod the collector no longer has (its grace period ended) is forgotten;
//! * host events arrive from the hub with the clock offset it measured at receipt; events of
//!   a kind this guest cannot decode arrive as what their frames say, and are counted and
//!   listed as `unknown`;
//! * every tick, whether the GPU worked ([`gpu_busy`]), for the link changes a GPU's power
//!   management makes.
//!
//! The collector's tick returns a [`TickReport`] (its windows, the gauges it set, the live
//! pods) which the tick thread hands to the join by value ([`hand_off`]): the join holds no
//! lock of the collector's, so a scrape, which locks the exporter's [`Store`] to render the
//! owners' series, never waits for the correlator or the page's timeline.

use std::collections::HashSet;

use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use prometheus::core::{Collector as PromCollector, Desc};
use prometheus::proto::MetricFamily;

use crate::collect::{Owner, Store, TickReport};
use crate::correlate::events::{self, Payload};
use crate::correlate::export::EventView;
#[cfg(test)]
use crate::correlate::SignalWindow;
use crate::correlate::{
    link_condition, Config, Correlator, GpuWindow, HostInput, PodKey, SignalShape, WindowRef,
};
use crate::hub::{Delivery, Hub, ReceivedEvent, UnknownEvent};
use crate::incident::profile::Target;
use crate::incident::{
    self, annotations, HostView, PageState, ProfileTemplate, Timeline, TimelineConfig, Unexplained,
};
use crate::pods::PodStore;
use crate::probes::signal::{self, WindowValue};

/// Guest realtime now, ns.
fn realtime_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// The correlator and what the agent knows around it.
pub struct Join {
    corr: Mutex<Correlator>,
    pods: PodStore,
    node: String,
    /// Hosts the operator declared simulated (`--simulated-host`): labelled so on the page.
    simulated: Vec<String>,
    hub: Mutex<Option<Hub>>,
    /// UIDs of the pods the collector had at the last tick.
    live: Mutex<HashSet<String>>,
    /// The merge of the collector's windows, kept between ticks (no copies per tick).
    merge: Mutex<Merge>,
    /// (host, kind) of unknown kinds already logged: one line each, not one per event.
    unknown_logged: Mutex<HashSet<(String, u16)>>,
    /// The incident page's pictures. Locked after `corr` where both are held.
    timeline: Mutex<Timeline>,
    /// `--profile-url`: links from affected pods and spikes to their profiles.
    profile: std::sync::OnceLock<ProfileTemplate>,
    /// A GPU probe that sees GPU work (driver time, CUDA) is up: its silence means idle.
    gpu_probes: AtomicBool,
}

/// The probes whose signal windows are GPU work: time in the GPU driver (`gpu_driver`), CUDA
/// synchronisation (`cuda`). NVML tells by its own gauge.
pub const GPU_PROBES: &[(&str, &str)] = &[
    (crate::probes::gpu_driver::NAME, "gpu_ioctl"),
    (crate::probes::cuda::NAME, "gpu_sync_wait"),
];

/// Whether the GPU worked in the tick `report` tells of, from what the agent has: NVML's
/// per-process SM utilisation (its gauge family is set every tick while NVML is loaded), time
/// in the GPU driver and CUDA synchronisation (windows of their signals, when `gpu_probes` are
/// up). `None` when none of them is on: nothing here can tell. This is the one place that says
/// what counts as GPU work; a better source plugs in here.
pub fn gpu_busy(report: &TickReport, gpu_probes: bool) -> Option<bool> {
    let nvml_busy = report
        .gauges
        .iter()
        .find(|(family, _)| *family == crate::probes::nvml::SM)
        .map(|(_, values)| values.iter().any(|v| v.value > 0.0));
    let probe_busy = gpu_probes
        && report.windows.iter().any(|w| {
            GPU_PROBES.iter().any(|(_, s)| *s == w.signal)
                && matches!(w.value, WindowValue::Latency { count, .. } if count > 0)
        });
    (nvml_busy.is_some() || gpu_probes).then_some(nvml_busy.unwrap_or(false) || probe_busy)
}

/// After a collector tick: the join takes the tick's report, and FinOps books the GPU owners'
/// totals, read out of the store under its lock and booked after it is released (the tick
/// thread's step after `Collector::tick`).
pub fn hand_off(
    report: &TickReport,
    store: &Mutex<Store>,
    join: &Join,
    finops: &crate::finops::FinOps,
) {
    let totals = crate::finops::Totals::of(&store.lock().unwrap_or_else(|e| e.into_inner()));
    join.tick(report);
    finops.book(totals, Instant::now());
}

impl Join {
    pub fn new(cfg: Config, pods: PodStore, node: String, simulated: Vec<String>) -> Arc<Join> {
        let timeline = Timeline::new(TimelineConfig::new(cfg.before, cfg.after));
        Arc::new(Join {
            timeline: Mutex::new(timeline),
            profile: std::sync::OnceLock::new(),
            corr: Mutex::new(Correlator::new(cfg)),
            pods,
            node,
            simulated,
            hub: Mutex::new(None),
            live: Mutex::new(HashSet::new()),
            merge: Mutex::new(Merge::default()),
            unknown_logged: Mutex::new(HashSet::new()),
            gpu_probes: AtomicBool::new(false),
        })
    }

    /// Which probes came up at start: whether one of [`GPU_PROBES`] is among them.
    pub fn set_probes_up<'a>(&self, up: impl IntoIterator<Item = &'a str>) {
        let gpu = up
            .into_iter()
            .any(|n| GPU_PROBES.iter().any(|(p, _)| *p == n));
        self.gpu_probes.store(gpu, Ordering::Relaxed);
    }

    fn corr(&self) -> std::sync::MutexGuard<'_, Correlator> {
        self.corr.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn timeline(&self) -> std::sync::MutexGuard<'_, Timeline> {
        self.timeline.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Links to profiles (`--profile-url`) from now on; a second call changes nothing.
    pub fn set_profile(&self, template: ProfileTemplate) {
        let _ = self.profile.set(template);
    }

    /// The profile link for a pod's spike at `spike_ms`, when a template is set.
    pub fn profile_url(&self, namespace: &str, pod: &str, spike_ms: i64) -> Option<String> {
        let t = self.profile.get()?;
        t.render(&Target::spike(namespace, pod, &self.node, spike_ms))
    }

    /// The host's PCIe links as its last state has them.
    fn links_now(hub: Option<&Hub>, host: &str) -> Vec<incident::LinkView> {
        hub.and_then(|h| h.host_state(host))
            .map(|s| incident::links_of(&s))
            .unwrap_or_default()
    }

    /// One host event into the page's timeline (after the correlator has it).
    fn timeline_event(&self, input: &HostInput<'_>) {
        let known = match input.payload {
            Payload::Known(ev) => Some(ev),
            Payload::UnknownKind { .. } => None,
        };
        // the picture's title: with the GPU's activity now (the correlator's own verdict on a
        // speed change waits for the GPU's window after it; the event list carries that)
        let gpu = self.corr().gpu_now();
        let c = events::classify(input.payload, gpu);
        self.timeline()
            .host_event(input.host, input.guest_ns(), known, &c);
    }

    /// The hub whose host events and state this join reads; starts the event task, which takes
    /// every event the hub accepts, in order, from the hub's intake queue (the hub waits while it
    /// is full: a burst is joined in full, late rather than lost). An event is joined, counted
    /// and listed as it arrives, not at the next tick.
    pub fn attach_hub(self: &Arc<Self>, hub: Hub) {
        let rx = hub.intake();
        *self.hub.lock().unwrap_or_else(|e| e.into_inner()) = Some(hub);
        let Some(mut rx) = rx else {
            tracing::error!(
                "the hub's events are taken by another reader; host events are not joined"
            );
            return;
        };
        let me = self.clone();
        tokio::spawn(async move {
            while let Some(d) = rx.recv().await {
                match d {
                    Delivery::Event(ev) => me.host_event(&ev),
                    Delivery::Unknown(ev) => me.unknown_event(&ev),
                }
            }
        });
    }

    /// One received event of a kind this guest cannot decode.
    pub fn unknown_event(&self, ev: &UnknownEvent) {
        let first = self
            .unknown_logged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((ev.host.clone(), ev.kind));
        if first {
            tracing::info!(
                host = %ev.host,
                kind = ev.kind,
                seq = ev.seq,
                bytes = ev.payload_len,
                "host sends events of a kind this guest does not know (a newer host agent?); counted and listed as unknown"
            );
        }
        let input = HostInput {
            host: &ev.host,
            host_realtime_ns: ev.host_realtime_ns,
            clock_offset_ns: ev.clock_offset_ns.unwrap_or(0),
            payload: Payload::UnknownKind {
                kind: ev.kind,
                seq: ev.seq,
                payload_len: ev.payload_len,
            },
        };
        self.corr().host_event(input, realtime_ns());
        self.timeline_event(&input);
    }

    /// One received host event.
    pub fn host_event(&self, ev: &ReceivedEvent) {
        let simulated = self.simulated.contains(&ev.host);
        if simulated {
            tracing::info!(host = %ev.host, kind = ev.kind, "simulated host event received");
        }
        let input = HostInput {
            host: &ev.host,
            host_realtime_ns: ev.host_realtime_ns,
            clock_offset_ns: ev.clock_offset_ns.unwrap_or(0),
            payload: Payload::Known(&ev.event),
        };
        self.corr().host_event(input, realtime_ns());
        self.timeline_event(&input);
    }

    /// After a tick: the collector's windows into the correlator, gone pods forgotten.
    pub fn tick(&self, input: &TickReport) {
        let now_i = Instant::now();
        let now_ns = realtime_ns();
        let mut merge = self.merge.lock().unwrap_or_else(|e| e.into_inner());
        merge.add(&input.windows, &self.pods, now_i, now_ns);
        let live = &input.live;
        tracing::trace!(
            windows = input.windows.len(),
            pods = merge.pods.len(),
            "signal windows into the correlator"
        );
        let mut corr = self.corr();
        let mut timeline = self.timeline();
        for w in merge.windows() {
            tracing::trace!(pod = %w.pod.pod, signal = %w.signal, count = w.count, p99 = w.p99, "window");
            let seen = corr.observe_window(w);
            timeline.window(&w, seen);
        }
        // the first tick has no window (nothing to divide by), and no GPU window either
        if let Some(prev) = merge.last_tick_ns.replace(now_ns) {
            corr.gpu_window(GpuWindow {
                at: now_ns,
                len: now_ns - prev,
                busy: gpu_busy(input, self.gpu_probes.load(Ordering::Relaxed)),
            });
        }
        corr.end_tick(now_ns);
        timeline.end_tick(now_ns, corr.spike_records());
        if timeline.freeze_due(now_ns, corr.event_records()) {
            let hub = self.hub.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let links = |host: &str| Self::links_now(hub.as_ref(), host);
            let listed: Vec<_> = corr.event_records().collect();
            timeline.freeze(now_ns, &listed, &links);
        }
        drop(timeline);
        let mut prev = self.live.lock().unwrap_or_else(|e| e.into_inner());
        prev.retain(|uid| {
            let here = live.contains(uid.as_str());
            if !here {
                corr.forget_uid(uid);
            }
            here
        });
        // a pod the collector no longer has takes its slot with it
        merge.pods.retain(|uid, _| live.contains(uid.as_str()));
        // what is left is in `live`: equal sizes, equal sets (UIDs are copied only when new)
        if prev.len() != live.len() {
            prev.extend(live.iter().cloned());
        }
    }

    /// `/events`: recent host events with the pods they hit, newest first.
    pub fn events(&self) -> Vec<EventView> {
        let mut v = self.corr().recent_events();
        for e in &mut v {
            if self.simulated.contains(&e.host) {
                e.tags.push("simulated".into());
            }
        }
        v
    }

    /// `/api/state`.
    pub fn page_state(&self) -> PageState {
        let hub = self.hub.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let gpu = self.corr().gpu_now();
        let links = |state: &gpufeed_shared::hoststate::HostState| {
            let mut links = incident::links_of(state);
            for l in &mut links {
                l.condition =
                    link_condition(l.speed_gts, l.width, l.max_speed_gts, l.max_width, gpu);
            }
            links
        };
        let hosts = hub
            .as_ref()
            .map(|h| {
                h.hosts()
                    .into_iter()
                    .map(|(host, connected)| HostView {
                        links: h.host_state(&host).map(|s| links(&s)).unwrap_or_default(),
                        simulated: self.simulated.contains(&host),
                        connected,
                        host,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let now = realtime_ns();
        let corr = self.corr();
        let unexplained = corr
            .unexplained_spikes(now)
            .into_iter()
            .map(|spike| Unexplained {
                profile_url: self.profile_url(&spike.namespace, &spike.pod, spike.time),
                spike,
            })
            .collect();
        let timeline = self.timeline();
        let links = |host: &str| Self::links_now(hub.as_ref(), host);
        // the newest events' pictures; the others are drawn when asked for (`picture`)
        let mut listed: Vec<_> = corr.event_records().collect();
        listed.sort_by_key(|e| std::cmp::Reverse((e.at, e.id)));
        let pictures_not_shown = listed.len().saturating_sub(incident::PICTURES_IN_STATE) as u64;
        listed.truncate(incident::PICTURES_IN_STATE);
        let mut timelines = timeline.pictures(now, listed.into_iter(), &links);
        let strip = timeline.strip(now);
        drop(timeline);
        drop(corr);
        for p in &mut timelines {
            self.link_profiles(p);
        }
        PageState {
            node: self.node.clone(),
            hosts,
            unexplained,
            timelines,
            pictures_not_shown,
            strip,
            profiles: self.profile.get().is_some(),
        }
    }

    /// `/api/picture`: the picture of the listed event of `host` of kind `event` at guest time
    /// `time_ms` (as `/events` names it), for the events whose pictures `/api/state` leaves out.
    pub fn picture(&self, host: &str, event: &str, time_ms: i64) -> Option<incident::Picture> {
        let hub = self.hub.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let now = realtime_ns();
        let corr = self.corr();
        let record = corr.event_records().find(|e| {
            e.host == host && e.kind.as_str() == event && e.at.div_euclid(1_000_000) == time_ms
        })?;
        let links = |host: &str| Self::links_now(hub.as_ref(), host);
        let mut p = self
            .timeline()
            .pictures(now, std::iter::once(record), &links)
            .pop()?;
        drop(corr);
        self.link_profiles(&mut p);
        Some(p)
    }

    /// The profile links of a picture's pods.
    fn link_profiles(&self, p: &mut incident::Picture) {
        for t in &mut p.pods {
            t.profile_url = self.profile_url(&t.namespace, &t.pod, p.time + t.lag_ms);
        }
    }
}

/// The correlation series for a registry.
pub struct JoinCollector {
    join: Arc<Join>,
    descs: Vec<Desc>,
}

impl JoinCollector {
    pub fn new(join: Arc<Join>) -> JoinCollector {
        let descs = [
            (
                crate::correlate::export::LATENCY_SPIKES,
                "Latency spikes detected per pod and signal",
            ),
            (annotations::HOST_EVENT_TIMESTAMP, annotations::HELP),
        ]
        .into_iter()
        .filter_map(|(n, h)| Desc::new(n.into(), h.into(), vec![], Default::default()).ok())
        .collect();
        JoinCollector { join, descs }
    }
}

impl PromCollector for JoinCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let corr = self.join.corr();
        let mut families = corr.metric_families(realtime_ns());
        families.push(annotations::family(corr.event_records()));
        families
    }
}

/// The pod as the correlator names it: by the pod store's names, or by its UID while the API
/// has not named it (as in /metrics).
fn pod_key(uid: &str, pods: &PodStore) -> PodKey {
    pods.with(uid, |m| PodKey::new(&m.namespace, &m.name, uid))
        .unwrap_or_else(|| PodKey::new("", uid, uid))
}

/// Whether `key` still names its pod as the pod store does (see [`pod_key`]).
fn key_current(key: &PodKey, pods: &PodStore) -> bool {
    pods.with(&key.uid, |m| {
        m.namespace == key.namespace && m.name == key.pod
    })
    .unwrap_or(key.namespace.is_empty() && key.pod == key.uid)
}

/// One (pod, signal) window while it is merged from the collector's windows.
#[derive(Default)]
struct Acc {
    /// What the parts are: rates and levels add up; distributions merge.
    shape: SignalShape,
    count: u64,
    sum: f64,
    /// Σ p50 × count (distribution) or Σ rate.
    p50: f64,
    p99: f64,
    max: f64,
    at: i64,
}

impl Acc {
    fn add(&mut self, value: &WindowValue, at: i64) {
        match *value {
            WindowValue::Latency {
                count,
                sum_us,
                p50_us,
                p99_us,
                max_us,
            } => {
                self.count += count;
                self.sum += sum_us;
                self.p50 += p50_us * count as f64;
                self.p99 = self.p99.max(p99_us);
                self.max = self.max.max(max_us);
            }
            // A rate is its own quantiles (the correlator reads p99 for rate signals), and
            // the rates of the parts add up.
            WindowValue::Rate { count, per_second } => {
                self.shape = SignalShape::Rate;
                self.count += count;
                self.add_rate(per_second);
            }
            // A level too (the throughput of each of a pod's GPUs: the pod's GPUs move the
            // sum), one reading per part.
            WindowValue::Level { value } => {
                self.shape = SignalShape::Level;
                self.count += 1;
                self.add_rate(value);
            }
        }
        self.at = self.at.max(at);
    }

    fn add_rate(&mut self, per_second: f64) {
        self.sum += per_second;
        self.p50 += per_second;
        self.p99 += per_second;
        self.max += per_second;
    }

    /// The merged window of `pod`'s `signal`.
    #[cfg(test)]
    fn window(&self, pod: &PodKey, signal: &str) -> SignalWindow {
        SignalWindow {
            pod: pod.clone(),
            signal: signal.to_string(),
            at: self.at,
            count: self.count,
            sum: self.sum,
            p50: if self.shape != SignalShape::Distribution || self.count == 0 {
                self.p50
            } else {
                self.p50 / self.count as f64
            },
            p99: self.p99,
            max: self.max,
            shape: self.shape,
        }
    }
}

/// One pod's merged windows.
struct PodSlot {
    key: PodKey,
    /// The pod store's version `key` was checked against.
    names: u64,
    /// The pod's signals and what the tick `tick` merged into each.
    signals: Vec<(&'static str, Acc)>,
    tick: u64,
}

/// The collector's windows as one window per (pod, signal), stamped in guest realtime:
/// containers of a pod and destinations of a signal merged (counts and sums add, p50 is
/// count-weighted, p99 and max are the largest; rates add). The pods' slots are kept between
/// ticks, so a tick copies nothing: a pod's key is checked against the pod store and rebuilt
/// only when its names changed, and its few signals are found by a short scan.
#[derive(Default)]
struct Merge {
    pods: FxHashMap<String, PodSlot>,
    /// Number of the current tick.
    tick: u64,
    /// Guest realtime of the previous tick (the GPU window's start).
    last_tick_ns: Option<i64>,
}

impl Merge {
    /// Merges one tick's windows (the previous tick's are dropped).
    fn add(
        &mut self,
        windows: &[signal::SignalWindow],
        pods: &PodStore,
        now_i: Instant,
        now_ns: i64,
    ) {
        self.tick += 1;
        // a key is checked against the store only when the store changed
        let version = pods.version();
        for w in windows {
            let Owner::Pod { uid, .. } = &w.owner else {
                continue; // slices are not pods
            };
            let at = now_ns - now_i.saturating_duration_since(w.at).as_nanos() as i64;
            let slot = match self.pods.get_mut(uid.as_str()) {
                Some(s) => s,
                None => self.pods.entry(uid.clone()).or_insert_with(|| PodSlot {
                    key: pod_key(uid, pods),
                    names: version,
                    signals: Vec::new(),
                    tick: 0,
                }),
            };
            if slot.tick != self.tick {
                slot.tick = self.tick;
                slot.signals.clear();
                if slot.names != version {
                    slot.names = version;
                    if !key_current(&slot.key, pods) {
                        slot.key = pod_key(uid, pods);
                    }
                }
            }
            let i = match slot.signals.iter().position(|(s, _)| *s == w.signal) {
                Some(i) => i,
                None => {
                    let acc = Acc {
                        at,
                        ..Acc::default()
                    };
                    slot.signals.push((w.signal, acc));
                    slot.signals.len() - 1
                }
            };
            slot.signals[i].1.add(&w.value, at);
        }
    }

    /// The windows of the last [`Merge::add`], borrowed.
    fn windows(&self) -> impl Iterator<Item = WindowRef<'_>> {
        let tick = self.tick;
        self.pods
            .values()
            .filter(move |s| s.tick == tick)
            .flat_map(|s| {
                s.signals.iter().map(|(signal, a)| WindowRef {
                    pod: &s.key,
                    signal,
                    at: a.at,
                    count: a.count,
                    mean: a.sum / a.count as f64,
                    p99: a.p99,
                    shape: a.shape,
                })
            })
    }
}

#[cfg(test)]
mod tests {
    use rustc_hash::FxHashSet;

    use super::*;
    use crate::probes::unit::Labels;
    use std::time::Duration;

    /// The exporter's store is free while the join runs: with the correlator held (a slow
    /// join), the hand-off waits on it, and the lock a scrape takes is not held meanwhile;
    /// once the correlator is free, the report's window reaches the join.
    #[test]
    fn a_scrape_does_not_wait_for_the_join() {
        let pods = PodStore::default();
        let join = Join::new(Config::default(), pods.clone(), "node".into(), vec![]);
        let finops = crate::finops::FinOps::new(
            crate::finops::Settings::default().validate().unwrap(),
            pods,
        );
        let store = Arc::new(Mutex::new(Store::default()));
        let report = TickReport {
            windows: vec![window(
                "u1",
                "c1",
                "run_queue_wait",
                WindowValue::Latency {
                    count: 3,
                    sum_us: 30.0,
                    p50_us: 10.0,
                    p99_us: 10.0,
                    max_us: 10.0,
                },
            )],
            live: FxHashSet::from_iter(["u1".to_string()]),
            ..TickReport::default()
        };
        let held = join.corr();
        let ticking = {
            let (store, join) = (store.clone(), join.clone());
            std::thread::spawn(move || hand_off(&report, &store, &join, &finops))
        };
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until {
            assert!(
                store.try_lock().is_ok(),
                "the store's lock is free while the join runs"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            !ticking.is_finished(),
            "the join waits on the held correlator"
        );
        drop(held);
        ticking.join().unwrap();
        let merge = join.merge.lock().unwrap();
        assert_eq!(merge.pods.len(), 1, "the report's window reached the join");
    }

    /// GPU work: NVML's gauge decides where it is set (a process on the SMs), else the GPU
    /// probes' windows; with neither, nothing can tell.
    #[test]
    fn gpu_busy_reads_nvml_then_the_gpu_probes() {
        let sm = |value: f64| {
            (
                crate::probes::nvml::SM,
                vec![crate::probes::unit::GaugeValue {
                    owner: Owner::Unattributed,
                    labels: Labels::new(),
                    value,
                }],
            )
        };
        let ioctl = window(
            "u1",
            "c1",
            "gpu_ioctl",
            WindowValue::Latency {
                count: 1,
                sum_us: 5.0,
                p50_us: 5.0,
                p99_us: 5.0,
                max_us: 5.0,
            },
        );
        let report = |gauges, windows| TickReport {
            windows,
            gauges,
            live: FxHashSet::default(),
        };
        assert_eq!(gpu_busy(&report(vec![], vec![]), false), None);
        assert_eq!(gpu_busy(&report(vec![], vec![]), true), Some(false));
        assert_eq!(
            gpu_busy(&report(vec![], vec![ioctl.clone()]), true),
            Some(true)
        );
        assert_eq!(gpu_busy(&report(vec![sm(0.0)], vec![]), false), Some(false));
        assert_eq!(gpu_busy(&report(vec![sm(90.0)], vec![]), false), Some(true));
        assert_eq!(
            gpu_busy(&report(vec![sm(0.0)], vec![ioctl]), true),
            Some(true)
        );
    }

    /// One tick of `ws` through `merge`, as owned windows.
    fn merged(
        merge: &mut Merge,
        ws: &[signal::SignalWindow],
        pods: &PodStore,
        now_ns: i64,
    ) -> Vec<SignalWindow> {
        merge.add(ws, pods, Instant::now(), now_ns);
        let tick = merge.tick;
        merge
            .pods
            .values()
            .filter(|s| s.tick == tick)
            .flat_map(|s| s.signals.iter().map(|(sig, a)| a.window(&s.key, sig)))
            .collect()
    }

    fn window(
        uid: &str,
        container: &str,
        signal: &'static str,
        value: WindowValue,
    ) -> signal::SignalWindow {
        signal::SignalWindow {
            owner: Owner::Pod {
                uid: uid.into(),
                container_id: Some(container.into()),
            },
            signal,
            labels: Labels::new(),
            at: Instant::now(),
            window: Duration::from_secs(1),
            value,
        }
    }

    #[test]
    fn containers_and_destinations_merge_into_one_window_per_pod_and_signal() {
        let lat = |count, p50, p99, max| WindowValue::Latency {
            count,
            sum_us: p50 * count as f64,
            p50_us: p50,
            p99_us: p99,
            max_us: max,
        };
        let ws = vec![
            window("u1", "c1", "run_queue_wait", lat(30, 10.0, 40.0, 50.0)),
            window("u1", "c2", "run_queue_wait", lat(10, 50.0, 900.0, 1000.0)),
            window(
                "u1",
                "c1",
                "tcp_retransmit_rate",
                WindowValue::Rate {
                    count: 3,
                    per_second: 3.0,
                },
            ),
            window(
                "u1",
                "c2",
                "tcp_retransmit_rate",
                WindowValue::Rate {
                    count: 1,
                    per_second: 1.0,
                },
            ),
            window("u2", "c3", "run_queue_wait", lat(5, 2.0, 3.0, 4.0)),
            signal::SignalWindow {
                owner: Owner::Slice("system.slice".into()),
                ..window("x", "y", "run_queue_wait", lat(100, 1.0, 1.0, 1.0))
            },
        ];
        let pods = PodStore::default();
        let mut merge = Merge::default();
        let out = merged(&mut merge, &ws, &pods, 1_000_000_000);
        assert_eq!(out.len(), 3, "{out:?}");
        let rq = out
            .iter()
            .find(|w| w.pod.uid == "u1" && w.signal == "run_queue_wait")
            .unwrap();
        assert_eq!(rq.count, 40);
        assert_eq!(rq.sum, 30.0 * 10.0 + 10.0 * 50.0);
        assert_eq!(rq.p50, (30.0 * 10.0 + 10.0 * 50.0) / 40.0);
        assert_eq!(rq.p99, 900.0);
        assert_eq!(rq.max, 1000.0);
        // unknown to the API: the pod is named by its UID, as in /metrics
        assert_eq!(rq.pod.pod, "u1");
        assert_eq!(rq.pod.namespace, "");
        let rt = out
            .iter()
            .find(|w| w.signal == "tcp_retransmit_rate")
            .unwrap();
        assert_eq!((rt.count, rt.p99), (4, 4.0));
        assert!(rq.at <= 1_000_000_000 && rq.at > 1_000_000_000 - 1_000_000_000);
    }

    /// Slots live on between ticks: a tick holds only its own windows, and a pod the API
    /// names later is renamed, with no copies of unchanged keys.
    #[test]
    fn the_merge_keeps_slots_between_ticks_and_follows_names() {
        let lat = |count, p99: f64| WindowValue::Latency {
            count,
            sum_us: p99 * count as f64,
            p50_us: p99,
            p99_us: p99,
            max_us: p99,
        };
        let pods = PodStore::default();
        let mut merge = Merge::default();
        let first = vec![
            window("u1", "c1", "run_queue_wait", lat(30, 10.0)),
            window("u1", "c1", "tcp_rtt", lat(30, 500.0)),
            window("u2", "c2", "run_queue_wait", lat(30, 20.0)),
        ];
        assert_eq!(merged(&mut merge, &first, &pods, 1).len(), 3);
        // the next tick: u1's RTT window and u2 are missing; nothing of the first tick is left
        let second = vec![window("u1", "c1", "run_queue_wait", lat(10, 70.0))];
        let out = merged(&mut merge, &second, &pods, 2);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!((out[0].count, out[0].p99), (10, 70.0));
        assert_eq!(out[0].pod, PodKey::new("", "u1", "u1"));
        // named by the API
        pods.upsert(crate::pods::PodMeta {
            uid: "u1".into(),
            namespace: "ml".into(),
            name: "vllm-0".into(),
            labels: Default::default(),
            annotations: Default::default(),
            containers: Default::default(),
            ips: vec![],
            host_network: false,
            deleted_at: None,
        });
        let out = merged(&mut merge, &second, &pods, 3);
        assert_eq!(out[0].pod, PodKey::new("ml", "vllm-0", "u1"));
        assert_eq!(merge.windows().count(), 1);
        assert_eq!(
            merge.windows().next().map(|w| w.pod.pod.as_str()),
            Some("vllm-0")
        );
    }
}
