//! MPS advice, sans IO: from a pod's duty cycle sustained over a period, the share of the GPU's
//! SMs to give it under CUDA MPS (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, 1..100).
//!
//! * Every sample of the last `sustain` below `low_duty` (15%): the pod needs a small slice:
//!   twice its peak duty cycle in the period, rounded up to a multiple of 10, at least 10.
//! * Every sample of the last `sustain` above `high_duty` (80%) and the pod's threads queueing
//!   for the GPU (on average more than `queueing` of them waiting, in driver calls or in CUDA
//!   synchronisation): no slice, the whole GPU, 100; such a pod needs more replicas (the KEDA
//!   scaler's job), not a share of one GPU.
//! * Otherwise the previous advice holds (hysteresis: advice that flips with every burst cannot
//!   be applied, since an MPS client's percentage is fixed when it starts). Before the first
//!   decision the advice is 100, CUDA's default.

use std::collections::VecDeque;
use std::hash::Hash;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MpsConfig {
    /// How long a condition must hold.
    pub sustain: Duration,
    pub low_duty: f64,
    pub high_duty: f64,
    /// Mean number of the pod's threads waiting for the GPU above which they queue.
    pub queueing: f64,
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig {
            sustain: Duration::from_secs(60),
            low_duty: 0.15,
            high_duty: 0.80,
            queueing: 1.5,
        }
    }
}

/// One pod's observation at one tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Duty cycle, 0..1 (its busiest GPU).
    pub duty: f64,
    /// Time the pod's threads spent waiting for the GPU in the tick, summed over the threads
    /// (two threads waiting for a second: 2 s): the larger of their time in driver calls and
    /// their time blocked in CUDA synchronisation, each a lower bound.
    pub waiting_seconds: f64,
    /// The tick's length.
    pub seconds: f64,
}

/// The percentage CUDA's default gives a client: the whole GPU.
pub const WHOLE_GPU: u32 = 100;
const MIN_SLICE: u32 = 10;

#[derive(Debug, Default)]
struct History {
    samples: VecDeque<(Instant, Sample)>,
    /// How many of `samples` break each rule, kept as samples come and go: a pod whose
    /// samples break both rules, or keep the low one at the smallest slice (an idle pod), is
    /// decided without reading them.
    breaks: Breaks,
    advice: Option<u32>,
    /// The last `observe` that gave this pod a sample.
    seen: u64,
}

/// Advice per pod (keyed by `K`).
#[derive(Debug)]
pub struct MpsAdvisor<K> {
    cfg: MpsConfig,
    // a hash map: each tick looks up every GPU pod, and hashing a name once is cheaper than
    // comparing names down a tree (or sorting them); the order is made when advice is read
    pods: FxHashMap<K, History>,
    observed: u64,
}

impl<K: Ord + Hash + Clone> MpsAdvisor<K> {
    pub fn new(cfg: MpsConfig) -> Self {
        MpsAdvisor {
            cfg,
            pods: FxHashMap::default(),
            observed: 0,
        }
    }

    /// Records one tick's samples; pods without a sample are forgotten (gone, or no longer
    /// with a duty cycle). Of two samples of one pod, the later counts.
    pub fn observe(&mut self, now: Instant, samples: impl IntoIterator<Item = (K, Sample)>) {
        self.observed += 1;
        let tick = self.observed;
        for (k, s) in samples {
            let h = match self.pods.get_mut(&k) {
                Some(h) => h,
                None => self.pods.entry(k).or_default(),
            };
            if h.seen == tick {
                // given twice: the later replaces the earlier
                if let Some((_, old)) = h.samples.pop_back() {
                    h.breaks.take(Breaks::of(&self.cfg, &old));
                }
            }
            h.seen = tick;
            h.breaks.add(Breaks::of(&self.cfg, &s));
            h.samples.push_back((now, s));
        }
        let cfg = &self.cfg;
        self.pods.retain(|_, h| {
            if h.seen != tick {
                return false;
            }
            // keep the newest sample at or before the period's start: it proves the span
            while h.samples.len() > 1
                && h.samples
                    .get(1)
                    .is_some_and(|(t, _)| now.duration_since(*t) >= cfg.sustain)
            {
                if let Some((_, old)) = h.samples.pop_front() {
                    h.breaks.take(Breaks::of(cfg, &old));
                }
            }
            if let Some(a) = decide(cfg, now, &h.samples, h.breaks) {
                h.advice = Some(a);
            }
            true
        });
    }

    /// Every known pod's advice, in the order of their keys.
    pub fn advice(&self) -> impl Iterator<Item = (&K, u32)> + '_ {
        let mut out: Vec<(&K, u32)> = self
            .pods
            .iter()
            .map(|(k, h)| (k, h.advice.unwrap_or(WHOLE_GPU)))
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(b.0));
        out.into_iter()
    }
}

/// How many samples break each rule.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Breaks {
    /// Not below `low_duty`.
    low: usize,
    /// Not above `high_duty`.
    high: usize,
    /// Busy enough to need more than the smallest slice.
    slice: usize,
}

impl Breaks {
    fn of(cfg: &MpsConfig, s: &Sample) -> Breaks {
        // a NaN duty fails both rules, so it breaks both
        let (low, high) = (s.duty < cfg.low_duty, s.duty > cfg.high_duty);
        Breaks {
            low: usize::from(!low),
            high: usize::from(!high),
            slice: usize::from(slice_of(s.duty) > MIN_SLICE),
        }
    }

    fn add(&mut self, o: Breaks) {
        self.low += o.low;
        self.high += o.high;
        self.slice += o.slice;
    }

    fn take(&mut self, o: Breaks) {
        self.low -= o.low;
        self.high -= o.high;
        self.slice -= o.slice;
    }
}

/// The small slice for a peak duty cycle: twice it, rounded up to a multiple of 10, at least
/// 10 (it never falls as the peak grows, so the slice of the peak is the largest sample's).
fn slice_of(peak: f64) -> u32 {
    let pct = (peak * 200.0).ceil() as u32;
    pct.div_ceil(10)
        .saturating_mul(10)
        .clamp(MIN_SLICE, WHOLE_GPU)
}

/// A decision when the samples span the sustain period and one rule holds throughout.
/// `breaks` counts the samples (all of them) that break each rule: the period's samples are
/// read only when a rule holds and its number needs them.
fn decide(
    cfg: &MpsConfig,
    now: Instant,
    samples: &VecDeque<(Instant, Sample)>,
    mut breaks: Breaks,
) -> Option<u32> {
    let (first, front) = samples.front()?;
    if now.duration_since(*first) < cfg.sustain {
        return None;
    }
    // the oldest sample only marks the start; its duty belongs to the time before
    breaks.take(Breaks::of(cfg, front));
    let period = || samples.iter().skip(1).map(|(_, s)| s);
    if breaks.low == 0 {
        if breaks.slice == 0 {
            return Some(MIN_SLICE);
        }
        return Some(slice_of(period().fold(0.0f64, |peak, s| peak.max(s.duty))));
    }
    if breaks.high == 0 {
        let (waiting, length) = period().fold((0.0, 0.0), |(w, l), s| {
            (w + s.waiting_seconds, l + s.seconds)
        });
        if length > 0.0 && waiting / length > cfg.queueing {
            return Some(WHOLE_GPU);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MpsConfig {
        MpsConfig {
            sustain: Duration::from_secs(60),
            ..MpsConfig::default()
        }
    }

    /// A one-second tick with `waiting` thread-seconds of waiting.
    fn s(duty: f64, waiting: f64) -> Sample {
        Sample {
            duty,
            waiting_seconds: waiting,
            seconds: 1.0,
        }
    }

    /// Feeds one sample a second for `secs` seconds from `*t`.
    fn run(
        a: &mut MpsAdvisor<&'static str>,
        t: &mut Instant,
        secs: u32,
        pods: &[(&'static str, Sample)],
    ) {
        for _ in 0..secs {
            *t += Duration::from_secs(1);
            a.observe(*t, pods.iter().copied());
        }
    }

    fn advice(a: &MpsAdvisor<&'static str>, k: &str) -> Option<u32> {
        a.advice().find(|(p, _)| **p == k).map(|(_, v)| v)
    }

    #[test]
    fn a_quiet_pod_gets_a_small_slice_after_the_sustain_period() {
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        a.observe(t, [("quiet", s(0.05, 0.05))]);
        run(&mut a, &mut t, 59, &[("quiet", s(0.05, 0.05))]);
        assert_eq!(advice(&a, "quiet"), Some(100), "not sustained yet");
        run(&mut a, &mut t, 1, &[("quiet", s(0.05, 0.05))]);
        // peak 5% → 10% (twice, rounded up to 10, at least 10)
        assert_eq!(advice(&a, "quiet"), Some(10));
        // a slightly busier quiet pod: peak 14% → 28 → 30
        let mut b = MpsAdvisor::new(cfg());
        b.observe(t, [("q", s(0.02, 0.0))]);
        run(&mut b, &mut t, 30, &[("q", s(0.02, 0.0))]);
        run(&mut b, &mut t, 1, &[("q", s(0.14, 0.0))]);
        run(&mut b, &mut t, 30, &[("q", s(0.02, 0.0))]);
        assert_eq!(advice(&b, "q"), Some(30));
    }

    #[test]
    fn a_busy_queueing_pod_gets_the_whole_gpu_and_advice_holds_in_between() {
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        a.observe(t, [("p", s(0.05, 0.0))]);
        run(&mut a, &mut t, 60, &[("p", s(0.05, 0.05))]);
        assert_eq!(advice(&a, "p"), Some(10));
        // medium use: no rule holds, the advice stays
        run(&mut a, &mut t, 120, &[("p", s(0.5, 0.5))]);
        assert_eq!(advice(&a, "p"), Some(10));
        // busy without queueing (one thread waiting at a time): still no change
        run(&mut a, &mut t, 120, &[("p", s(0.95, 0.95))]);
        assert_eq!(advice(&a, "p"), Some(10));
        // a moment of medium use, then busy with two threads waiting at once: the whole
        // GPU, once that is sustained
        run(&mut a, &mut t, 1, &[("p", s(0.5, 0.5))]);
        run(&mut a, &mut t, 59, &[("p", s(0.95, 1.9))]);
        assert_eq!(advice(&a, "p"), Some(10), "59 s is not 60");
        run(&mut a, &mut t, 1, &[("p", s(0.95, 1.9))]);
        assert_eq!(advice(&a, "p"), Some(100));
        // one burst below 80% breaks the run
        run(&mut a, &mut t, 1, &[("p", s(0.05, 0.0))]);
        assert_eq!(advice(&a, "p"), Some(100), "held");
    }

    #[test]
    fn one_busy_sample_in_the_period_prevents_a_small_slice() {
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        a.observe(t, [("p", s(0.0, 0.0))]);
        run(&mut a, &mut t, 30, &[("p", s(0.0, 0.0))]);
        run(&mut a, &mut t, 1, &[("p", s(0.5, 0.5))]);
        run(&mut a, &mut t, 59, &[("p", s(0.0, 0.0))]);
        assert_eq!(advice(&a, "p"), Some(100));
        run(&mut a, &mut t, 1, &[("p", s(0.0, 0.0))]);
        assert_eq!(advice(&a, "p"), Some(10), "the burst left the period");
    }

    /// The rules read from every sample of the period (as the module's documentation states
    /// them), against the advisor's counts, over a pod whose duty wanders across all three
    /// bands, with NaN samples and a sample given twice now and then.
    #[test]
    fn counted_breaks_decide_as_reading_every_sample_does() {
        let cfg = MpsConfig {
            sustain: Duration::from_secs(8),
            ..MpsConfig::default()
        };
        let rules = |period: &[Sample]| -> Option<u32> {
            if period.iter().all(|s| s.duty < cfg.low_duty) {
                let peak = period.iter().map(|s| s.duty).fold(0.0, f64::max);
                let pct = ((peak * 200.0).ceil() as u32).div_ceil(10) * 10;
                return Some(pct.clamp(MIN_SLICE, WHOLE_GPU));
            }
            let waiting: f64 = period.iter().map(|s| s.waiting_seconds).sum();
            let length: f64 = period.iter().map(|s| s.seconds).sum();
            let busy = period.iter().all(|s| s.duty > cfg.high_duty);
            (busy && waiting / length > cfg.queueing).then_some(WHOLE_GPU)
        };
        let mut a = MpsAdvisor::new(cfg);
        let t0 = Instant::now();
        let mut kept: Vec<(u32, Sample)> = Vec::new();
        let mut want = None;
        let mut x: u32 = 7;
        let mut decided = [0; 3];
        for i in 0..3000u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let band = (i / 40) % 3;
            let jitter = f64::from((x >> 16) % 100) / 1000.0;
            let duty = match (band, (x >> 8) % 97) {
                (_, 0) => f64::NAN,
                // quiet, now and then a little busier than the smallest slice allows
                (0, _) if (x >> 20).is_multiple_of(10) => 0.06 + jitter / 4.0,
                (0, _) => jitter / 4.0,
                (1, _) => 0.4 + jitter,
                _ => 0.85 + jitter,
            };
            let sample = s(duty, if (x >> 4).is_multiple_of(5) { 1.0 } else { 2.0 });
            let t = t0 + Duration::from_secs(u64::from(i));
            if (x >> 12).is_multiple_of(13) {
                // the same tick's earlier sample, replaced by this one
                a.observe(t, [("p", s(0.5, 0.0)), ("p", sample)]);
            } else {
                a.observe(t, [("p", sample)]);
            }
            kept.push((i, sample));
            // the newest sample at least `sustain` old starts the period
            while kept.len() > 1 && i - kept[1].0 >= 8 {
                kept.remove(0);
            }
            if i - kept[0].0 >= 8 {
                let period: Vec<Sample> = kept[1..].iter().map(|(_, s)| *s).collect();
                if let Some(v) = rules(&period) {
                    decided[usize::from(v == WHOLE_GPU) + usize::from(v > MIN_SLICE)] += 1;
                    want = Some(v);
                }
            }
            assert_eq!(advice(&a, "p"), Some(want.unwrap_or(WHOLE_GPU)), "tick {i}");
        }
        // each kind of decision was taken: the smallest slice, a larger one, the whole GPU
        assert!(decided.iter().all(|n| *n > 10), "{decided:?}");
    }

    #[test]
    fn pods_without_a_sample_are_forgotten() {
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        run(&mut a, &mut t, 2, &[("a", s(0.1, 0.0)), ("b", s(0.1, 0.0))]);
        run(&mut a, &mut t, 1, &[("a", s(0.1, 0.0))]);
        assert_eq!(a.advice().count(), 1);
        assert_eq!(advice(&a, "b"), None);
    }

    #[test]
    fn each_pod_keeps_its_history_as_others_come_and_go() {
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        a.observe(
            t,
            [("b", s(0.05, 0.0)), ("a", s(0.5, 0.5)), ("d", s(0.05, 0.0))],
        );
        // from the next tick on: a gone, c new, b and d quiet throughout (given out of order)
        let now = [
            ("d", s(0.05, 0.0)),
            ("c", s(0.05, 0.0)),
            ("b", s(0.05, 0.0)),
        ];
        run(&mut a, &mut t, 60, &now);
        assert_eq!(advice(&a, "a"), None, "a pod without a sample is forgotten");
        assert_eq!(advice(&a, "b"), Some(10));
        assert_eq!(advice(&a, "d"), Some(10));
        assert_eq!(advice(&a, "c"), Some(100), "c's samples span 59 s");
        // of two samples of one pod in a tick, the later counts: quiet, so c's small slice
        t += Duration::from_secs(1);
        a.observe(
            t,
            [("c", s(0.9, 0.0)), ("b", s(0.05, 0.0)), ("c", s(0.05, 0.0))],
        );
        assert_eq!(advice(&a, "c"), Some(10));
        assert_eq!(advice(&a, "d"), None);
        assert_eq!(a.advice().count(), 2);
    }
}
