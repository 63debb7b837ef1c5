//! MPS advice, sans IO: from a pod's duty cycle sustained over a period, the share of the GPU's
//! SMs to give it under CUDA MPS (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, 1..100).
//!
//! * Every sample of the last `sustain` below `low_duty` (15%): the pod needs a small slice:
//!   twice its peak duty cycle in the period, rounded up to a multiple of 10, at least 10.
//! * Every sample of the last `sustain` above `high_duty` (80%) and the pod's tasks queueing in
//!   the driver (on average more than `queueing` of them inside it while any is): the whole
//!   GPU, 100.
//! * Otherwise the previous advice holds (hysteresis: advice that flips with every burst cannot
//!   be applied, since an MPS client's percentage is fixed when it starts). Before the first
//!   decision the advice is 100, CUDA's default.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MpsConfig {
    /// How long a condition must hold.
    pub sustain: Duration,
    pub low_duty: f64,
    pub high_duty: f64,
    /// Mean number of the pod's tasks inside the driver while any is, above which they queue.
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
    /// Duty cycle, 0..1.
    pub duty: f64,
    /// Time the pod's tasks spent in driver calls, summed over the tasks (overlaps count once
    /// per task), since the previous sample.
    pub call_seconds: f64,
    /// Time at least one of them was in a driver call, since the previous sample.
    pub busy_seconds: f64,
}

impl Sample {
    /// A tick's sample from the GPU series: the duty cycle gauge, and the driver call time and
    /// driver (busy) time added in the tick of length `dt`.
    ///
    /// The probe books a busy interval when the pod's last task leaves the driver (an interval
    /// still open is not readable consistently). Tasks whose calls overlap without a break
    /// therefore add call time but no busy time, and the duty cycle does not see them until
    /// they pause. A tick in which calls returned while the interval stayed open had a task
    /// inside the driver throughout (up to the tick in which the interval began): it counts
    /// as busy for its whole length.
    pub fn of_tick(duty: f64, call_seconds: f64, busy_seconds: f64, dt: Duration) -> Sample {
        if call_seconds > 0.0 && busy_seconds == 0.0 {
            return Sample {
                duty: 1.0,
                call_seconds,
                busy_seconds: dt.as_secs_f64(),
            };
        }
        Sample {
            duty,
            call_seconds,
            busy_seconds,
        }
    }
}

/// The percentage CUDA's default gives a client: the whole GPU.
pub const WHOLE_GPU: u32 = 100;
const MIN_SLICE: u32 = 10;

#[derive(Debug, Default)]
struct History {
    samples: VecDeque<(Instant, Sample)>,
    advice: Option<u32>,
}

/// Advice per pod (keyed by `K`).
#[derive(Debug)]
pub struct MpsAdvisor<K> {
    cfg: MpsConfig,
    pods: BTreeMap<K, History>,
}

impl<K: Ord + Clone> MpsAdvisor<K> {
    pub fn new(cfg: MpsConfig) -> Self {
        MpsAdvisor {
            cfg,
            pods: BTreeMap::new(),
        }
    }

    /// Records one tick's samples; pods without a sample are forgotten (gone, or no longer
    /// with a duty cycle).
    pub fn observe(&mut self, now: Instant, samples: impl IntoIterator<Item = (K, Sample)>) {
        let mut seen = BTreeMap::new();
        for (k, s) in samples {
            seen.insert(k, s);
        }
        self.pods.retain(|k, _| seen.contains_key(k));
        for (k, s) in seen {
            let h = self.pods.entry(k).or_default();
            h.samples.push_back((now, s));
            // keep the newest sample at or before the period's start: it proves the span
            while h.samples.len() > 1
                && h.samples
                    .get(1)
                    .is_some_and(|(t, _)| now.duration_since(*t) >= self.cfg.sustain)
            {
                h.samples.pop_front();
            }
            if let Some(a) = decide(&self.cfg, now, &h.samples) {
                h.advice = Some(a);
            }
        }
    }

    /// Every known pod's advice.
    pub fn advice(&self) -> impl Iterator<Item = (&K, u32)> + '_ {
        self.pods
            .iter()
            .map(|(k, h)| (k, h.advice.unwrap_or(WHOLE_GPU)))
    }
}

/// A decision when the samples span the sustain period and one rule holds throughout.
fn decide(cfg: &MpsConfig, now: Instant, samples: &VecDeque<(Instant, Sample)>) -> Option<u32> {
    let (first, _) = samples.front()?;
    if now.duration_since(*first) < cfg.sustain {
        return None;
    }
    // the oldest sample only marks the start; its duty belongs to the time before
    let period = samples.iter().skip(1).map(|(_, s)| s);
    let (mut peak, mut low, mut high, mut calls, mut busy) = (0.0f64, true, true, 0.0, 0.0);
    for s in period {
        peak = peak.max(s.duty);
        low &= s.duty < cfg.low_duty;
        high &= s.duty > cfg.high_duty;
        calls += s.call_seconds;
        busy += s.busy_seconds;
    }
    if low {
        let pct = (peak * 200.0).ceil() as u32;
        return Some(
            pct.div_ceil(10)
                .saturating_mul(10)
                .clamp(MIN_SLICE, WHOLE_GPU),
        );
    }
    if high && busy > 0.0 && calls / busy > cfg.queueing {
        return Some(WHOLE_GPU);
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

    fn s(duty: f64, calls: f64, busy: f64) -> Sample {
        Sample {
            duty,
            call_seconds: calls,
            busy_seconds: busy,
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
        a.observe(t, [("quiet", s(0.05, 0.05, 0.05))]);
        run(&mut a, &mut t, 59, &[("quiet", s(0.05, 0.05, 0.05))]);
        assert_eq!(advice(&a, "quiet"), Some(100), "not sustained yet");
        run(&mut a, &mut t, 1, &[("quiet", s(0.05, 0.05, 0.05))]);
        // peak 5% → 10% (twice, rounded up to 10, at least 10)
        assert_eq!(advice(&a, "quiet"), Some(10));
        // a slightly busier quiet pod: peak 14% → 28 → 30
        let mut b = MpsAdvisor::new(cfg());
        b.observe(t, [("q", s(0.02, 0.0, 0.0))]);
        run(&mut b, &mut t, 30, &[("q", s(0.02, 0.0, 0.0))]);
        run(&mut b, &mut t, 1, &[("q", s(0.14, 0.0, 0.0))]);
        run(&mut b, &mut t, 30, &[("q", s(0.02, 0.0, 0.0))]);
        assert_eq!(advice(&b, "q"), Some(30));
    }

    #[test]
    fn a_busy_queueing_pod_gets_the_whole_gpu_and_advice_holds_in_between() {
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        a.observe(t, [("p", s(0.05, 0.0, 0.0))]);
        run(&mut a, &mut t, 60, &[("p", s(0.05, 0.05, 0.05))]);
        assert_eq!(advice(&a, "p"), Some(10));
        // medium use: no rule holds, the advice stays
        run(&mut a, &mut t, 120, &[("p", s(0.5, 0.5, 0.5))]);
        assert_eq!(advice(&a, "p"), Some(10));
        // busy without queueing (one task at a time): still no change
        run(&mut a, &mut t, 120, &[("p", s(0.95, 0.95, 0.95))]);
        assert_eq!(advice(&a, "p"), Some(10));
        // a moment of medium use, then busy with two tasks in the driver at once: the whole
        // GPU, once that is sustained
        run(&mut a, &mut t, 1, &[("p", s(0.5, 0.5, 0.5))]);
        run(&mut a, &mut t, 59, &[("p", s(0.95, 1.9, 0.95))]);
        assert_eq!(advice(&a, "p"), Some(10), "59 s is not 60");
        run(&mut a, &mut t, 1, &[("p", s(0.95, 1.9, 0.95))]);
        assert_eq!(advice(&a, "p"), Some(100));
        // one burst below 80% breaks the run
        run(&mut a, &mut t, 1, &[("p", s(0.05, 0.0, 0.0))]);
        assert_eq!(advice(&a, "p"), Some(100), "held");
    }

    #[test]
    fn one_busy_sample_in_the_period_prevents_a_small_slice() {
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        a.observe(t, [("p", s(0.0, 0.0, 0.0))]);
        run(&mut a, &mut t, 30, &[("p", s(0.0, 0.0, 0.0))]);
        run(&mut a, &mut t, 1, &[("p", s(0.5, 0.5, 0.5))]);
        run(&mut a, &mut t, 59, &[("p", s(0.0, 0.0, 0.0))]);
        assert_eq!(advice(&a, "p"), Some(100));
        run(&mut a, &mut t, 1, &[("p", s(0.0, 0.0, 0.0))]);
        assert_eq!(advice(&a, "p"), Some(10), "the burst left the period");
    }

    #[test]
    fn calls_inside_a_busy_interval_still_open_count_as_busy_throughout() {
        let dt = Duration::from_millis(200);
        // two tasks queued back to back: 0.4 s of calls in 0.2 s, the interval never closes
        let s = Sample::of_tick(0.0, 0.4, 0.0, dt);
        assert_eq!((s.duty, s.busy_seconds), (1.0, 0.2));
        // an idle tick, and a tick whose interval closed, are as measured
        assert_eq!(Sample::of_tick(0.0, 0.0, 0.0, dt).duty, 0.0);
        assert_eq!(Sample::of_tick(0.5, 0.1, 0.1, dt).duty, 0.5);
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        run(
            &mut a,
            &mut t,
            61,
            &[("q", Sample::of_tick(0.0, 2.0, 0.0, Duration::from_secs(1)))],
        );
        assert_eq!(advice(&a, "q"), Some(100));
    }

    #[test]
    fn pods_without_a_sample_are_forgotten() {
        let mut a = MpsAdvisor::new(cfg());
        let mut t = Instant::now();
        run(
            &mut a,
            &mut t,
            2,
            &[("a", s(0.1, 0.0, 0.0)), ("b", s(0.1, 0.0, 0.0))],
        );
        run(&mut a, &mut t, 1, &[("a", s(0.1, 0.0, 0.0))]);
        assert_eq!(a.advice().count(), 1);
        assert_eq!(advice(&a, "b"), None);
    }
}
