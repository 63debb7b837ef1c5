//! The collector's windows as one window per (pod, signal), stamped in guest realtime:
//! containers of a pod and destinations of a signal are merged (counts and sums add, p50 is
//! count-weighted, p99 and max are the largest, rates add), since a spike of any part is a
//! spike of the pod; slices are not pods and are left out.

use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::collect::Owner;
#[cfg(test)]
use crate::correlate::SignalWindow;
use crate::correlate::{PodKey, SignalShape, WindowRef};
use crate::pods::PodStore;
use crate::probes::signal::{self, WindowValue};

/// The pod as the correlator names it: by the pod store's names, or by its UID while the API
/// has not named it (as in /metrics).
fn pod_key(uid: &str, pods: &PodStore) -> PodKey {
    pods.with(uid, |m| PodKey::new(&m.namespace, &m.name, uid))
        .unwrap_or_else(|| PodKey::new("", uid, uid))
}

/// Whether `key` still names its pod as the pod store does (see [`pod_key`]).
fn key_current(key: &PodKey, pods: &PodStore) -> bool {
    pods.with(&key.uid, |m| {
        *m.namespace == *key.namespace && *m.name == *key.pod
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
pub struct Merge {
    pods: FxHashMap<std::sync::Arc<str>, PodSlot>,
    /// Number of the current tick.
    tick: u64,
    /// Guest realtime of the previous tick (the GPU window's start).
    pub last_tick_ns: Option<i64>,
}

impl Merge {
    /// Merges one tick's windows (the previous tick's are dropped).
    pub fn add(
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
            let slot = match self.pods.get_mut(uid) {
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

    /// Pods with a slot.
    pub fn pods(&self) -> usize {
        self.pods.len()
    }

    /// Keeps the slots of the pods `live` has (a pod the collector no longer has takes its
    /// slot with it).
    pub fn keep_pods(&mut self, live: &rustc_hash::FxHashSet<std::sync::Arc<str>>) {
        self.pods.retain(|uid, _| live.contains(uid));
    }

    /// The windows of the last [`Merge::add`], borrowed.
    pub fn windows(&self) -> impl Iterator<Item = WindowRef<'_>> {
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
    use std::time::Duration;

    use super::*;

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
            .find(|w| &*w.pod.uid == "u1" && w.signal == "run_queue_wait")
            .unwrap();
        assert_eq!(rq.count, 40);
        assert_eq!(rq.sum, 30.0 * 10.0 + 10.0 * 50.0);
        assert_eq!(rq.p50, (30.0 * 10.0 + 10.0 * 50.0) / 40.0);
        assert_eq!(rq.p99, 900.0);
        assert_eq!(rq.max, 1000.0);
        // unknown to the API: the pod is named by its UID, as in /metrics
        assert_eq!(&*rq.pod.pod, "u1");
        assert_eq!(&*rq.pod.namespace, "");
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
        pods.upsert(crate::pods::PodMeta::named("u1", "ml", "vllm-0"));
        let out = merged(&mut merge, &second, &pods, 3);
        assert_eq!(out[0].pod, PodKey::new("ml", "vllm-0", "u1"));
        assert_eq!(merge.windows().count(), 1);
        assert_eq!(merge.windows().next().map(|w| &*w.pod.pod), Some("vllm-0"));
    }
}
