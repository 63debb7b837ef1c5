//! Latency and rate signals: what a correlator reads per tick and owner.
//!
//! A unit names which of its families are signals. After each tick the
//! collector turns that tick's deltas of those families into one window per
//! (owner, signal, labels): for a histogram the count, sum and quantiles
//! estimated from the bucket delta of the tick, for a counter its rate; and a
//! gauge family's values as the unit set them in the tick into a level.

use std::time::{Duration, Instant};

use super::hist::{Hist, BUCKETS, MIN_SHIFT};
use crate::owner::Owner;

/// What kind of window a signal gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalKind {
    /// A latency histogram: count, sum, p50, p99, max.
    Latency,
    /// A counter: its rate per second.
    Rate,
    /// A gauge the unit sets each tick (a throughput it samples), one reading a window,
    /// whose trouble is a fall below its baseline (the correlator reads it for dips).
    Level,
}

/// A signal a unit declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalSpec {
    /// Name the correlator uses, e.g. `run_queue_wait`.
    pub name: &'static str,
    /// The unit's family whose deltas make the windows.
    pub family: &'static str,
    pub kind: SignalKind,
}

/// One tick's worth of a signal for one owner and label set. The labels are not carried: the
/// join merges an owner's windows of one signal whatever their labels (destinations, GPUs,
/// directions), and a label set cloned into every window was an allocation per window and tick.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalWindow {
    pub owner: Owner,
    pub signal: &'static str,
    /// When the tick that produced it ran.
    pub at: Instant,
    /// Time since the previous tick: the window's length.
    pub window: Duration,
    pub value: WindowValue,
}

#[derive(Debug, Clone, PartialEq)]
pub enum WindowValue {
    /// Microseconds; quantiles and max are estimates from log2 buckets (within
    /// a factor of two of the truth), count and sum are exact.
    Latency {
        count: u64,
        sum_us: f64,
        p50_us: f64,
        p99_us: f64,
        max_us: f64,
    },
    Rate {
        count: u64,
        per_second: f64,
    },
    /// A level the unit read in the tick (of a [`SignalKind::Level`] signal).
    Level {
        value: f64,
    },
}

/// Lower and upper bound of slot `i` in ns; the overflow slot has no upper bound.
fn slot_bounds_ns(i: usize) -> (f64, Option<f64>) {
    let lower = if i == 0 {
        0.0
    } else {
        (1u64 << (MIN_SHIFT as usize + i - 1)) as f64
    };
    let upper = (i < BUCKETS).then(|| (1u64 << (MIN_SHIFT as usize + i)) as f64);
    (lower, upper)
}

/// The q-quantile (0..=1) of a histogram delta in ns, interpolated linearly
/// inside the bucket where the rank falls, as Prometheus' `histogram_quantile`
/// does. Values in the overflow slot read as its lower bound (2^34 ns).
/// None for an empty histogram.
pub fn quantile_ns(h: &Hist, q: f64) -> Option<f64> {
    if h.count == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * h.count as f64;
    let mut below = 0u64;
    for (i, &n) in h.buckets.iter().enumerate() {
        if n == 0 {
            continue;
        }
        if (below + n) as f64 >= rank {
            let (lo, hi) = slot_bounds_ns(i);
            let Some(hi) = hi else { return Some(lo) };
            let frac = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
            return Some(lo + (hi - lo) * frac);
        }
        below += n;
    }
    // counts wrapped (they are u64 sums of the buckets): the top non-empty slot
    h.buckets
        .iter()
        .rposition(|&n| n > 0)
        .map(|i| slot_bounds_ns(i).0)
}

/// Largest value in a histogram delta, in ns: the upper bound of the highest
/// non-empty bucket, but never more than the sum (no sample exceeds the sum of
/// all), which makes it exact for a window with one sample.
pub fn max_ns(h: &Hist) -> Option<f64> {
    let i = h.buckets.iter().rposition(|&n| n > 0)?;
    let sum = h.sum_ns as f64;
    Some(match slot_bounds_ns(i).1 {
        Some(hi) => hi.min(sum),
        None => sum,
    })
}

/// The window of one histogram delta. Quantiles are capped by the max, which
/// the sum can bound more tightly than the bucket does.
pub fn latency_window(h: &Hist) -> Option<WindowValue> {
    let us = |ns: f64| ns / 1000.0;
    let max = max_ns(h)?;
    Some(WindowValue::Latency {
        count: h.count,
        sum_us: us(h.sum_ns as f64),
        p50_us: us(quantile_ns(h, 0.5)?.min(max)),
        p99_us: us(quantile_ns(h, 0.99)?.min(max)),
        max_us: us(max),
    })
}

/// The window of one gauge value: one observation, its value as the rate.
pub fn level_window(value: f64) -> WindowValue {
    WindowValue::Level { value }
}

/// The window of one counter delta over `window`.
pub fn rate_window(count: u64, window: Duration) -> WindowValue {
    let secs = window.as_secs_f64();
    WindowValue::Rate {
        count,
        per_second: if secs > 0.0 { count as f64 / secs } else { 0.0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::hist::{index, SLOTS};

    fn hist_of(values_ns: &[u64]) -> Hist {
        let mut h = Hist::default();
        for &v in values_ns {
            h.buckets[index(v)] += 1;
            h.sum_ns += v;
            h.count += 1;
        }
        h
    }

    fn exact_quantile(values: &[u64], q: f64) -> f64 {
        let mut v = values.to_vec();
        v.sort_unstable();
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1] as f64
    }

    #[test]
    fn empty_window_has_no_quantiles() {
        let h = Hist::default();
        assert_eq!(quantile_ns(&h, 0.5), None);
        assert_eq!(max_ns(&h), None);
        assert_eq!(latency_window(&h), None);
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket() {
        // 100 samples in bucket 3 = [4096, 8192) ns: p50 is halfway, p99 near the top
        let mut h = Hist::default();
        h.buckets[3] = 100;
        h.count = 100;
        h.sum_ns = 100 * 6000;
        assert_eq!(quantile_ns(&h, 0.5), Some(4096.0 + 4096.0 * 0.5));
        assert_eq!(quantile_ns(&h, 0.99), Some(4096.0 + 4096.0 * 0.99));
        assert_eq!(max_ns(&h), Some(8192.0));
        // 90 fast samples in bucket 0, 10 slow ones in bucket 10: p50 is fast, p99 slow
        let mut h = Hist::default();
        h.buckets[0] = 90;
        h.buckets[10] = 10;
        h.count = 100;
        h.sum_ns = 90 * 500 + 10 * 700_000;
        let p50 = quantile_ns(&h, 0.5).unwrap();
        assert!(p50 < 1024.0, "{p50}");
        let p99 = quantile_ns(&h, 0.99).unwrap();
        let (lo, hi) = slot_bounds_ns(10);
        assert_eq!(p99, lo + (hi.unwrap() - lo) * 0.9);
    }

    #[test]
    fn estimates_are_within_a_bucket_of_the_exact_values() {
        // a spread of waits from 1 us to 50 ms, deterministic
        let values: Vec<u64> = (0..5000u64)
            .map(|i| 1_000 + (i * i * 7919) % 50_000_000)
            .collect();
        let h = hist_of(&values);
        for q in [0.5, 0.9, 0.99] {
            let est = quantile_ns(&h, q).unwrap();
            let exact = exact_quantile(&values, q);
            // both lie in the same log2 bucket: within a factor of two
            assert!(
                est <= exact * 2.0 && est >= exact / 2.0,
                "q{q}: estimate {est} vs exact {exact}"
            );
        }
        let max = max_ns(&h).unwrap();
        let exact_max = *values.iter().max().unwrap() as f64;
        assert!(
            max >= exact_max && max <= exact_max * 2.0,
            "{max} vs {exact_max}"
        );
        let Some(WindowValue::Latency {
            count,
            sum_us,
            p99_us,
            max_us,
            ..
        }) = latency_window(&h)
        else {
            panic!("a latency window")
        };
        assert_eq!(count, 5000);
        assert_eq!(sum_us, values.iter().sum::<u64>() as f64 / 1000.0);
        assert!(p99_us <= max_us);
    }

    #[test]
    fn one_sample_gives_its_exact_max_and_overflow_reads_its_lower_bound() {
        let h = hist_of(&[123_456]);
        assert_eq!(max_ns(&h), Some(123_456.0));
        // the bucket alone would put p99 near 131 us, above the one sample
        let Some(WindowValue::Latency {
            p50_us,
            p99_us,
            max_us,
            ..
        }) = latency_window(&h)
        else {
            panic!("a latency window")
        };
        let exact = 123_456.0 / 1000.0;
        assert_eq!((p99_us, max_us), (exact, exact));
        // p50 is halfway through the bucket [65.536, 131.072) us: below the max, kept
        assert_eq!(p50_us, 98.304);
        let h = hist_of(&[1 << 40]);
        assert_eq!(h.buckets[SLOTS - 1], 1);
        assert_eq!(quantile_ns(&h, 0.99), Some((1u64 << 34) as f64));
        assert_eq!(max_ns(&h), Some((1u64 << 40) as f64));
    }

    #[test]
    fn quantiles_of_a_tick_delta_ignore_earlier_samples() {
        // cumulative: many fast samples; this tick: only slow ones
        let before = hist_of(&[2_000; 1000]);
        let mut now = before.clone();
        now.add(&hist_of(&[5_000_000; 10]));
        let d = now.delta_since(&before);
        assert_eq!(d.count, 10);
        let p50 = quantile_ns(&d, 0.5).unwrap();
        assert!(p50 > 4_000_000.0 && p50 < 8_400_000.0, "{p50}");
    }

    #[test]
    fn rates_divide_by_the_window() {
        assert_eq!(
            rate_window(30, Duration::from_millis(500)),
            WindowValue::Rate {
                count: 30,
                per_second: 60.0
            }
        );
        assert_eq!(
            rate_window(3, Duration::ZERO),
            WindowValue::Rate {
                count: 3,
                per_second: 0.0
            }
        );
    }
}
