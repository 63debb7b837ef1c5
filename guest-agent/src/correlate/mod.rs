//! The correlator: joins host events (link changes, AER bursts, Thunderbolt hotplug, VM
//! stop/resume) to latency spikes of the pods in this VM.
//!
//! Sans-IO: it reads no clock and does no IO; every call that depends on time takes `now`
//! (guest `CLOCK_REALTIME`, ns), so tests drive it through any timeline.
//!
//! * [`Correlator::observe`]: every tick, one [`SignalWindow`] per (pod, signal); each feeds
//!   that signal's [`detector`] and a detected spike is joined to the host events in reach.
//! * [`Correlator::host_event`]: a host event with the clock offset the hub measured; it is
//!   classified ([`events`]), counted, listed and joined to the spikes in reach ([`join`]).
//! * [`Correlator::forget_pod`]: the pod is gone; its state and series go with it.
//! * Outputs in [`export`]: the `gpufeed_*` correlation series and the recent events as JSON.
//!
//! The design, defaults and measured precision are in docs/correlation.md.

pub mod baseline;
pub mod detector;
pub mod events;
pub mod export;
pub mod join;
#[cfg(test)]
mod scenarios;
#[cfg(test)]
mod tests;
pub mod window;

use std::collections::{BTreeMap, HashMap};

use rustc_hash::FxHashMap;
use std::time::Duration;

pub use detector::{DetectorConfig, SignalPolicy};
pub use events::{EventKind, HostInput};
pub use window::{PodKey, SignalWindow, WindowRef};

use detector::{Detector, Verdict};
use join::{JoinConfig, Joiner, NewJoin};

/// Settings of the correlator. [`Config::default`] gives the documented defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub detector: DetectorConfig,
    /// Per-signal reading; signals not listed are distributions with no absolute floor.
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
        let policy = |rate, abs_floor| SignalPolicy { rate, abs_floor };
        let signals = [
            // µs: run-queue waits under 50 µs more than usual do not starve a GPU feeder.
            ("run_queue_wait", policy(false, 50.0)),
            // µs: a 200 µs rise in RTT is below what a link fault does to a request.
            ("tcp_rtt", policy(false, 200.0)),
            // per second
            ("tcp_retransmit_rate", policy(true, 1.0)),
            ("tc_drop_rate", policy(true, 1.0)),
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
            retention: Duration::from_secs(15 * 60),
            idle_pod: Duration::from_secs(10 * 60),
            max_spikes: 8192,
            max_events: 128,
            max_hits_per_event: 256,
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
    signals: FxHashMap<String, SignalState>,
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

pub struct Correlator {
    cfg: Config,
    /// By UID: a pod is its UID. Its names may arrive after its first windows (the API
    /// watch answers later than the first tick); that renames it, and keeps its baselines.
    pods: FxHashMap<String, PodState>,
    joiner: Joiner,
    counters: Counters,
}

impl Correlator {
    pub fn new(cfg: Config) -> Self {
        let joiner = Joiner::new(JoinConfig {
            before: ns(cfg.before),
            after: ns(cfg.after),
            coalesce: ns(cfg.coalesce),
            retention: ns(cfg.retention),
            max_spikes: cfg.max_spikes,
            max_events: cfg.max_events,
            max_hits_per_event: cfg.max_hits_per_event,
        });
        Correlator {
            cfg,
            pods: FxHashMap::default(),
            joiner,
            counters: Counters::default(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// One tick of windows. A pod seen for the first time starts warming up.
    pub fn observe<'a>(&mut self, windows: impl IntoIterator<Item = &'a SignalWindow>, now: i64) {
        for w in windows {
            self.observe_window(w.view());
        }
        self.end_tick(now);
    }

    /// [`Correlator::observe`] one window at a time: each window of the tick, then
    /// [`Correlator::end_tick`].
    pub fn observe_window(&mut self, w: WindowRef<'_>) {
        let pod = match self.pods.get_mut(&w.pod.uid) {
            Some(p) => p,
            None => self.pods.entry(w.pod.uid.clone()).or_insert(PodState {
                key: w.pod.clone(),
                signals: FxHashMap::default(),
                last_window: w.at,
            }),
        };
        if pod.key != *w.pod {
            // Named (or renamed) by the API: same pod, same baselines and counters.
            pod.key = w.pod.clone();
        }
        pod.last_window = pod.last_window.max(w.at);
        let st =
            match pod.signals.get_mut(w.signal) {
                Some(s) => s,
                None => {
                    pod.signals
                        .entry(w.signal.to_string())
                        .or_insert(SignalState {
                            detector: Detector::new(&self.cfg.detector),
                            policy: self.cfg.signals.get(w.signal).copied().unwrap_or(
                                SignalPolicy {
                                    rate: false,
                                    abs_floor: 0.0,
                                },
                            ),
                            episode: None,
                        })
                }
            };
        let policy = st.policy;
        let verdict = st
            .detector
            .observe(&self.cfg.detector, policy, w.at, w.count, w.p99);
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
                    .entry((w.pod.uid.clone(), w.signal.to_string()))
                    .or_default() += 1;
                self.count_joins(joins);
            }
            Verdict::Continues { at, value } => {
                if let Some(id) = st.episode {
                    self.joiner.episode_window(id, at, value);
                }
            }
            Verdict::Ended => st.episode = None,
        }
    }

    /// The tick's windows are in: state of pods idle too long and old spikes and events go.
    pub fn end_tick(&mut self, now: i64) {
        self.expire(now);
    }

    /// A host event. `now` is only used to expire old state.
    pub fn host_event(&mut self, input: HostInput<'_>, now: i64) {
        let c = events::classify(input.payload);
        *self
            .counters
            .host_events
            .entry((input.host.to_string(), c.kind.as_str()))
            .or_default() += 1;
        let joins = self.joiner.add_event(&input, c);
        self.count_joins(joins);
        self.expire(now);
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
                    .entry((j.pod.uid, j.signal, j.kind))
                    .or_default() += 1;
            }
        }
    }

    fn expire(&mut self, now: i64) {
        self.joiner.expire(now);
        let horizon = now.saturating_sub(ns(self.cfg.idle_pod));
        let idle: Vec<String> = self
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
