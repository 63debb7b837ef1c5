//! The correlator: joins host events (link changes, AER bursts, Thunderbolt hotplug, VM
//! stop/resume) to latency spikes of the pods in this VM.
//!
//! Sans-IO: it reads no clock and does no IO; every call that depends on time takes `now`
//! (guest `CLOCK_REALTIME`, ns), so tests drive it through any timeline.
//!
//! * [`Correlator::observe`]: every tick, one [`SignalWindow`] per (pod, signal); each feeds
//!   that signal's [`detector`] and a detected spike is joined to the host events in reach.
//! * [`Correlator::host_event`]: a host event with the clock offset the hub measured; it is
//!   classified ([`events`]), counted, listed and joined to the spikes in reach ([`pairing`]).
//! * [`Correlator::gpu_window`]: every tick, whether the GPU worked ([`gpu`]); a link's speed
//!   change at full width is read against what the GPU did after it (power management or a
//!   degradation), and waits for those windows if they are not in yet.
//! * [`Correlator::forget_pod`]: the pod is gone; its state and series go with it.
//! * Outputs in [`views`]: the `gpufeed_*` correlation series and the recent events as JSON.
//!
//! The design, defaults and measured precision are in docs/correlation.md.

pub mod baseline;
pub mod detector;
pub mod events;
pub mod gpu;
pub mod pairing;
#[cfg(test)]
mod scenarios;
#[cfg(test)]
mod tests;
pub mod views;
pub mod window;

use std::collections::{BTreeMap, HashMap};

use rustc_hash::FxHashMap;
use std::time::Duration;

pub use detector::{Band, DetectorConfig, SignalPolicy};
pub use events::{EventKind, HostInput};
pub use gpu::{link_condition, Activity, GpuWindow, LinkCondition};
pub use window::{PodKey, SignalShape, SignalWindow, WindowRef};

use detector::{Detector, Reading, Verdict};

/// What the detector made of one window: the value it tested (a distribution's mean, a rate
/// signal's rate) and the band it tested it against (none while it warms up).
#[derive(Debug, Clone, Copy)]
pub struct Observed {
    pub band: Option<Band>,
    pub tested: f64,
}
use events::Payload;
use gpu::GpuLog;
use gpufeed_shared::event::HostEvent;
use pairing::{JoinConfig, Joiner, NewJoin};

/// Settings of the correlator. [`Config::default`] gives the documented defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub detector: DetectorConfig,
    /// Per-signal reading; a signal not listed is read by its window's shape
    /// ([`Config::policy_of_shape`]).
    pub signals: HashMap<String, SignalPolicy>,
    /// A spike up to this long before a host event can belong to it.
    pub before: Duration,
    /// ... and up to this long after it.
    pub after: Duration,
    /// How late a host event may arrive before a spike without one counts as unexplained
    /// (a later event still explains it while the spike is retained).
    pub lateness: Duration,
    /// Same-kind events from one host this close together are one burst.
    pub coalesce: Duration,
    /// ... and power-managed link changes within this of a listed one (an idle GPU's link
    /// changes speed many times a minute: one entry with a count, not a flood).
    pub power_coalesce: Duration,
    /// A link's speed drop at full width is read against the GPU's activity from
    /// `gpu_before` before it to `gpu_settle` after it: working throughout, on the slower
    /// link, is a degradation; a drop that follows the end of work, or a brief wake-up of an
    /// idle card just before work starts, is power management.
    pub gpu_before: Duration,
    pub gpu_settle: Duration,
    /// Spikes are retained this long; the explained ratio covers this period.
    pub retention: Duration,
    /// A pod with no window for this long is forgotten (if `forget_pod` was never called).
    pub idle_pod: Duration,
    pub max_spikes: usize,
    pub max_events: usize,
    pub max_hits_per_event: usize,
}

impl Default for Config {
    fn default() -> Self {
        let dist = |abs_floor, min_per_second| SignalPolicy {
            rate: false,
            abs_floor,
            min_per_second,
            falls: false,
        };
        let rate = SignalPolicy {
            rate: true,
            abs_floor: 1.0, // per second
            min_per_second: 0.0,
            falls: false,
        };

        let signals = [
            // µs: run-queue waits under 50 µs more than usual do not starve a GPU feeder.
            // One observation per switch-in: one busy thread under contention is switched
            // in hundreds of times a second, a thread waking 10 times a second reaches it.
            ("run_queue_wait", dist(50.0, 10.0)),
            // µs: a 200 µs rise in RTT is below what a link fault does to a request. One
            // observation per busy millisecond of a socket: one connection busy 1% of the
            // time reaches it.
            ("tcp_rtt", dist(200.0, 10.0)),
            // One per ioctl or synchronisation of a GPU process: one process calling the
            // driver or synchronising 5 times a second reaches it.
            ("gpu_ioctl", dist(0.0, 5.0)),
            ("gpu_sync_wait", dist(0.0, 5.0)),
            ("tcp_retransmit_rate", rate),
            ("tc_drop_rate", rate),
        ]
        .into_iter()
        .map(|(s, p)| (s.to_string(), p))
        .collect();
        Config {
            detector: DetectorConfig::default(),
            signals,
            before: Duration::from_secs(2),
            after: Duration::from_secs(5),
            lateness: Duration::from_secs(10),
            coalesce: Duration::from_secs(1),
            power_coalesce: Duration::from_secs(60),
            gpu_before: Duration::from_secs(1),
            gpu_settle: Duration::from_secs(2),
            retention: Duration::from_secs(15 * 60),
            idle_pod: Duration::from_secs(10 * 60),
            max_spikes: 8192,
            max_events: 128,
            max_hits_per_event: 256,
        }
    }
}

impl Config {
    /// How a signal the configuration does not name is read, by its windows' shape: a
    /// distribution's mean with no absolute floor and [`DEFAULT_MIN_PER_SECOND`]; a rate with
    /// a floor of one event per second; a level (one reading a tick, a throughput) for dips,
    /// a fall of at least 1 MB/s (in bytes per second; an idle link's zero has none to lose).
    pub fn policy_of_shape(shape: SignalShape) -> SignalPolicy {
        match shape {
            SignalShape::Distribution => SignalPolicy {
                rate: false,
                abs_floor: 0.0,
                min_per_second: DEFAULT_MIN_PER_SECOND,
                falls: false,
            },
            SignalShape::Rate => SignalPolicy {
                rate: true,
                abs_floor: 1.0,
                min_per_second: 0.0,
                falls: false,
            },
            SignalShape::Level => SignalPolicy {
                rate: true,
                abs_floor: 1e6,
                min_per_second: 0.0,
                falls: true,
            },
        }
    }
}

fn ns(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

struct SignalState {
    detector: Detector,
    /// How this signal is read (from the configuration, looked up once).
    policy: SignalPolicy,
    /// The spike of the episode in progress.
    episode: Option<u64>,
}

struct PodState {
    /// The pod's names as its latest window gave them (they can arrive after its UID).
    key: PodKey,
    /// The numbers of its signals' names ([`Correlator::names`]), in the order of `signals`:
    /// a short list a window scans, where a map of its own per pod cost a cache miss or two
    /// per window at node scale (the pods share a few names).
    signal_ids: Vec<u32>,
    signals: Vec<SignalState>,
    last_window: i64,
}

/// Counter values kept per pod UID; rendered per (namespace, pod) of the pod's current key.
#[derive(Debug, Default, Clone)]
struct Counters {
    /// (pod uid, signal)
    spikes: BTreeMap<(String, String), u64>,
    /// (pod uid, signal, event kind)
    correlated: BTreeMap<(String, String, EventKind), u64>,
    /// (host, event label)
    host_events: BTreeMap<(String, &'static str), u64>,
}

/// A link change waiting for the GPU windows after it.
struct PendingLink {
    host: String,
    host_realtime_ns: i64,
    clock_offset_ns: i64,
    event: HostEvent,
}

impl PendingLink {
    fn input(&self) -> HostInput<'_> {
        HostInput {
            host: &self.host,
            host_realtime_ns: self.host_realtime_ns,
            clock_offset_ns: self.clock_offset_ns,
            payload: Payload::Known(&self.event),
        }
    }
}

/// The per-second minimum count of a distribution signal `Config::signals` does not name.
pub const DEFAULT_MIN_PER_SECOND: f64 = 10.0;

/// Link changes waiting at most: beyond, they are read with what is known.
const MAX_PENDING_LINKS: usize = 1024;

pub struct Correlator {
    cfg: Config,
    /// By UID: a pod is its UID. Its names may arrive after its first windows (the API
    /// watch answers later than the first tick); that renames it, and keeps its baselines.
    pods: FxHashMap<std::sync::Arc<str>, PodState>,
    /// Each signal name seen, numbered (the probes' few names).
    names: FxHashMap<Box<str>, u32>,
    joiner: Joiner,
    counters: Counters,
    gpu: GpuLog,
    /// Arrival order.
    pending: Vec<PendingLink>,
}

impl Correlator {
    pub fn new(cfg: Config) -> Self {
        let joiner = Joiner::new(JoinConfig {
            before: ns(cfg.before),
            after: ns(cfg.after),
            coalesce: ns(cfg.coalesce),
            power_coalesce: ns(cfg.power_coalesce),
            retention: ns(cfg.retention),
            max_spikes: cfg.max_spikes,
            max_events: cfg.max_events,
            max_hits_per_event: cfg.max_hits_per_event,
        });
        // a window per tick (100 ms at the shortest) over the retention
        let gpu = GpuLog::new(ns(cfg.retention), 10 * cfg.retention.as_secs() as usize + 1);
        Correlator {
            cfg,
            pods: FxHashMap::default(),
            names: FxHashMap::default(),
            joiner,
            counters: Counters::default(),
            gpu,
            pending: Vec::new(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// One tick of windows. A pod seen for the first time starts warming up.
    pub fn observe<'a>(&mut self, windows: impl IntoIterator<Item = &'a SignalWindow>, now: i64) {
        for w in windows {
            let _ = self.observe_window(w.view());
        }
        self.end_tick(now);
    }

    /// [`Correlator::observe`] one window at a time: each window of the tick, then
    /// [`Correlator::end_tick`]. Returns the band the window was tested against (for the
    /// incident page's pictures); none while the signal's detector warms up.
    pub fn observe_window(&mut self, w: WindowRef<'_>) -> Observed {
        let name = match self.names.get(w.signal) {
            Some(&n) => n,
            None => {
                let n = self.names.len() as u32;
                self.names.insert(w.signal.into(), n);
                n
            }
        };
        let pod = match self.pods.get_mut(&w.pod.uid) {
            Some(p) => p,
            None => self.pods.entry(w.pod.uid.clone()).or_insert(PodState {
                key: w.pod.clone(),
                signal_ids: Vec::new(),
                signals: Vec::new(),
                last_window: w.at,
            }),
        };
        if pod.key != *w.pod {
            // Named (or renamed) by the API: same pod, same baselines and counters.
            pod.key = w.pod.clone();
        }
        pod.last_window = pod.last_window.max(w.at);
        let i = match pod.signal_ids.iter().position(|&n| n == name) {
            Some(i) => i,
            None => {
                pod.signal_ids.push(name);
                pod.signals.push(SignalState {
                    detector: Detector::new(&self.cfg.detector),
                    policy: self
                        .cfg
                        .signals
                        .get(w.signal)
                        .copied()
                        .unwrap_or(Config::policy_of_shape(w.shape)),
                    episode: None,
                });
                pod.signals.len() - 1
            }
        };
        let st = &mut pod.signals[i];
        let policy = st.policy;
        let reading = Reading {
            tested: if policy.rate { w.p99 } else { w.mean },
            shown: w.p99,
        };
        let verdict = st
            .detector
            .observe(&self.cfg.detector, policy, w.at, w.count, reading);
        let band = st.detector.band();
        match verdict {
            Verdict::Nothing => {}
            Verdict::Spike {
                at,
                value,
                baseline,
            } => {
                let (id, joins) =
                    self.joiner
                        .add_spike(w.pod, w.signal, at, value, baseline.median);
                st.episode = Some(id);
                *self
                    .counters
                    .spikes
                    .entry((w.pod.uid.to_string(), w.signal.to_string()))
                    .or_default() += 1;
                self.count_joins(joins);
            }
            Verdict::Continues { at, value } => {
                if let Some(id) = st.episode {
                    self.joiner.episode_window(id, at, value, policy.falls);
                }
            }
            Verdict::Ended => st.episode = None,
        }
        Observed {
            band,
            tested: reading.tested,
        }
    }

    /// The tick's windows are in: link changes whose GPU windows are in now are read, state
    /// of pods idle too long and old spikes and events go.
    pub fn end_tick(&mut self, now: i64) {
        self.resolve_pending(now);
        self.expire(now);
    }

    /// One tick of GPU activity (see [`gpu`]), before [`Correlator::end_tick`].
    pub fn gpu_window(&mut self, w: GpuWindow) {
        self.gpu.record(w);
    }

    /// What the GPU did in the latest tick.
    pub fn gpu_now(&self) -> Activity {
        self.gpu.now()
    }

    /// What the GPU did over `[at − gpu_before, at + gpu_settle]`.
    fn gpu_around(&self, at: i64) -> Activity {
        self.gpu.over(
            at.saturating_sub(ns(self.cfg.gpu_before)),
            at.saturating_add(ns(self.cfg.gpu_settle)),
        )
    }

    /// A host event. `now` is only used to expire old state. A link change whose reading
    /// depends on the GPU's activity around it waits for the windows after it (at most
    /// `lateness`).
    pub fn host_event(&mut self, input: HostInput<'_>, now: i64) {
        let mut gpu = Activity::Unknown;
        if events::needs_gpu_activity(input.payload) {
            gpu = self.gpu_around(input.guest_ns());
            if gpu == Activity::NotYet && self.pending.len() < MAX_PENDING_LINKS {
                if let Payload::Known(ev) = input.payload {
                    self.pending.push(PendingLink {
                        host: input.host.to_string(),
                        host_realtime_ns: input.host_realtime_ns,
                        clock_offset_ns: input.clock_offset_ns,
                        event: ev.clone(),
                    });
                    return;
                }
            }
        }
        self.classified_event(input, gpu);
        self.expire(now);
    }

    fn classified_event(&mut self, input: HostInput<'_>, gpu: Activity) {
        let c = events::classify(input.payload, gpu);
        *self
            .counters
            .host_events
            .entry((input.host.to_string(), c.kind.as_str()))
            .or_default() += 1;
        let joins = self.joiner.add_event(&input, c);
        self.count_joins(joins);
    }

    /// Reads the waiting link changes whose GPU windows are in, and those that waited
    /// `lateness` past their range with what is known.
    fn resolve_pending(&mut self, now: i64) {
        if self.pending.is_empty() {
            return;
        }
        let wait = ns(self.cfg.gpu_settle).saturating_add(ns(self.cfg.lateness));
        let pending = std::mem::take(&mut self.pending);
        for p in pending {
            let at = p.input().guest_ns();
            match self.gpu_around(at) {
                Activity::NotYet if now < at.saturating_add(wait) => self.pending.push(p),
                Activity::NotYet => self.classified_event(p.input(), Activity::Unknown),
                gpu => self.classified_event(p.input(), gpu),
            }
        }
    }

    /// The pod (its UID, whatever names `pod` carries) is gone: its baselines and series go;
    /// its spikes stay in the events they joined (history), and a late event still lists
    /// them, without re-creating series.
    pub fn forget_pod(&mut self, pod: &PodKey) {
        self.forget_uid(&pod.uid);
    }

    /// [`Correlator::forget_pod`] by the pod's UID.
    pub fn forget_uid(&mut self, uid: &str) {
        self.pods.remove(uid);
        self.counters.spikes.retain(|(p, _), _| p != uid);
        self.counters.correlated.retain(|(p, _, _), _| p != uid);
    }

    /// The current key of a live pod.
    fn live_key(&self, uid: &str) -> Option<&PodKey> {
        self.pods.get(uid).map(|p| &p.key)
    }

    fn count_joins(&mut self, joins: Vec<NewJoin>) {
        for j in joins {
            // Series exist only for live pods (a late event must not resurrect a gone one).
            if self.pods.contains_key(&j.pod.uid) {
                *self
                    .counters
                    .correlated
                    .entry((j.pod.uid.to_string(), j.signal, j.kind))
                    .or_default() += 1;
            }
        }
    }

    fn expire(&mut self, now: i64) {
        self.joiner.expire(now);
        let horizon = now.saturating_sub(ns(self.cfg.idle_pod));
        let idle: Vec<std::sync::Arc<str>> = self
            .pods
            .iter()
            .filter(|(_, p)| p.last_window < horizon)
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            self.forget_uid(&k);
        }
    }

    /// Number of pods with state (for tests and self-metrics).
    pub fn pods(&self) -> usize {
        self.pods.len()
    }
}
