//! Robust baseline of a signal: median and MAD (median absolute deviation) of its recent
//! quiet windows.
//!
//! Median and MAD ignore up to half of the samples being wild, so one past outlier or a
//! short burst does not move the baseline; a mean and standard deviation would be dragged
//! by exactly the spikes we want to find. `1.4826 × MAD` estimates the standard deviation
//! of normally distributed noise, which makes `k` read as "k sigmas".
//!
//! The window is kept sorted as well as in arrival order, so each tick costs an insert and a
//! removal in a short sorted array and a few binary searches, not two selections. A steady
//! signal costs less: a full window of one value that gets that value again is unchanged, and
//! the median and MAD are computed once per change of the window, not once per read (an idle
//! GPU's link throughput reads 0 at every tick in every pod on it).

use std::cell::Cell;
use std::collections::VecDeque;

/// Scale factor that turns a MAD into a standard-deviation estimate for normal noise.
pub const MAD_TO_SIGMA: f64 = 1.4826;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Baseline {
    pub median: f64,
    /// Median absolute deviation from `median`.
    pub mad: f64,
}

impl Baseline {
    /// Robust spread in the signal's unit (`1.4826 × MAD`).
    pub fn sigma(&self) -> f64 {
        MAD_TO_SIGMA * self.mad
    }
}

/// The last `cap` values (finite numbers), with their median and MAD.
#[derive(Debug, Clone)]
pub struct Rolling {
    arrival: VecDeque<f64>,
    sorted: Vec<f64>,
    cap: usize,
    /// The baseline of the window as it is, once asked for (None: not computed since the
    /// window last changed).
    computed: Cell<Option<Option<Baseline>>>,
}

impl Rolling {
    pub fn new(cap: usize) -> Self {
        let cap = cap.max(1);
        Rolling {
            arrival: VecDeque::with_capacity(cap),
            sorted: Vec::with_capacity(cap),
            cap,
            computed: Cell::new(None),
        }
    }

    pub fn len(&self) -> usize {
        self.arrival.len()
    }

    pub fn is_empty(&self) -> bool {
        self.arrival.is_empty()
    }

    pub fn clear(&mut self) {
        self.arrival.clear();
        self.sorted.clear();
        self.computed.set(None);
    }

    /// Adds a value, dropping the oldest when full. Non-finite values are refused (they
    /// would make the order meaningless).
    pub fn push(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if self.arrival.len() == self.cap && self.all_are(v) {
            // the oldest `v` goes, a new `v` comes: the same window
            return;
        }
        self.computed.set(None);
        if self.arrival.len() == self.cap {
            if let Some(old) = self.arrival.pop_front() {
                if let Ok(i) = self.sorted.binary_search_by(|x| x.total_cmp(&old)) {
                    self.sorted.remove(i);
                }
            }
        }
        self.arrival.push_back(v);
        let i = self.sorted.partition_point(|x| x.total_cmp(&v).is_lt());
        self.sorted.insert(i, v);
    }

    /// Whether every value held is `v` (the same bits: the sorted ends are).
    fn all_are(&self, v: f64) -> bool {
        let same = |x: Option<&f64>| x.is_some_and(|x| x.to_bits() == v.to_bits());
        same(self.sorted.first()) && same(self.sorted.last())
    }

    /// Median and MAD; `None` when empty.
    pub fn baseline(&self) -> Option<Baseline> {
        if let Some(b) = self.computed.get() {
            return b;
        }
        let b = self.compute();
        self.computed.set(Some(b));
        b
    }

    fn compute(&self) -> Option<Baseline> {
        let s = &self.sorted;
        let n = s.len();
        if n == 0 {
            return None;
        }
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        // Deviations grow walking left from the median (`a`) and walking right from it
        // (`b`): the MAD is the middle rank of the two ascending sequences together.
        let split = s.partition_point(|&x| x < median);
        let a = |i: usize| median - s[split - 1 - i];
        let b = |j: usize| s[split + j] - median;
        let (la, lb) = (split, n - split);
        let mad = if n % 2 == 1 {
            kth_of_two(a, la, b, lb, n / 2)
        } else {
            (kth_of_two(a, la, b, lb, n / 2 - 1) + kth_of_two(a, la, b, lb, n / 2)) / 2.0
        };
        Some(Baseline { median, mad })
    }
}

/// The `k`-th smallest (from 0) of two ascending sequences `a[..la]` and `b[..lb]` together,
/// by binary search on how many of the `k + 1` smallest come from `a` (O(log n), where a
/// merge walk mispredicts a branch at every step). NaN if the sequences are not ascending
/// (only with infinities from hostile values).
fn kth_of_two(
    a: impl Fn(usize) -> f64,
    la: usize,
    b: impl Fn(usize) -> f64,
    lb: usize,
    k: usize,
) -> f64 {
    let (mut lo, mut hi) = ((k + 1).saturating_sub(lb), (k + 1).min(la));
    while lo <= hi {
        let i = (lo + hi) / 2;
        let j = k + 1 - i;
        if i < la && j > 0 && a(i) < b(j - 1) {
            lo = i + 1; // too few from a
        } else if i > 0 && j < lb && a(i - 1) > b(j) {
            hi = i - 1; // too many from a
        } else {
            let last_a = if i > 0 { a(i - 1) } else { f64::NEG_INFINITY };
            let last_b = if j > 0 { b(j - 1) } else { f64::NEG_INFINITY };
            return last_a.max(last_b);
        }
    }
    f64::NAN
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(v: &[f64]) -> Option<Baseline> {
        let mut r = Rolling::new(v.len());
        v.iter().for_each(|&x| r.push(x));
        r.baseline()
    }

    /// Median and MAD by sorting, the textbook way.
    fn naive(v: &[f64]) -> Baseline {
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let n = v.len();
            if n % 2 == 1 {
                v[n / 2]
            } else {
                (v[n / 2 - 1] + v[n / 2]) / 2.0
            }
        };
        let median = med(&mut v.to_vec());
        let mad = med(&mut v.iter().map(|x| (x - median).abs()).collect());
        Baseline { median, mad }
    }

    #[test]
    fn median_and_mad_of_odd_and_even_counts() {
        let b = of(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!(b.median, 3.0);
        assert_eq!(b.mad, 2.0);
        let b = of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(b.median, 2.5);
        // deviations 1.5, 1.5, 0.5, 0.5 -> 1.0
        assert_eq!(b.mad, 1.0);
    }

    #[test]
    fn one_wild_value_moves_neither_median_nor_mad_much() {
        let quiet = [40.0, 41.0, 39.0, 40.0, 42.0, 38.0, 40.0];
        let mut wild = quiet.to_vec();
        wild.push(9000.0);
        let a = of(&quiet).unwrap();
        let b = of(&wild).unwrap();
        assert_eq!(a.median, 40.0);
        assert_eq!(b.median, 40.0);
        assert!((b.mad - a.mad).abs() <= 0.5, "{a:?} {b:?}");
        assert!((a.sigma() - 1.4826).abs() < 1e-9);
    }

    #[test]
    fn empty_has_no_baseline_and_constant_has_zero_mad() {
        assert_eq!(of(&[]), None);
        assert_eq!(
            of(&[0.0; 9]),
            Some(Baseline {
                median: 0.0,
                mad: 0.0
            })
        );
    }

    /// Runs of one value (an idle signal's reading at every tick), -0.0 beside 0.0 among
    /// them: the window, in both orders, and its baseline are what pushing every value does,
    /// whether or not the baseline was asked for between pushes.
    #[test]
    fn steady_runs_leave_the_window_as_pushing_would() {
        let mut rng = fastrand::Rng::with_seed(29);
        for cap in [1, 3, 8] {
            let mut r = Rolling::new(cap);
            let mut all = Vec::new();
            let mut skipped = 0;
            for _ in 0..200 {
                let v: f64 = [0.0, -0.0, 1.0, 2.5][rng.usize(0..4)];
                for _ in 0..rng.usize(1..3 * cap + 2) {
                    let full_of_v =
                        r.len() == cap && r.arrival.iter().all(|x| x.to_bits() == v.to_bits());
                    skipped += usize::from(full_of_v);
                    r.push(v);
                    all.push(v);
                    let window = &all[all.len().saturating_sub(cap)..];
                    let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(r.arrival.make_contiguous()), bits(window), "cap {cap}");
                    if rng.bool() {
                        assert_eq!(r.baseline(), Some(naive(window)), "cap {cap} {window:?}");
                    }
                }
            }
            assert!(
                skipped > 100,
                "cap {cap}: the steady case was taken {skipped} times"
            );
        }
    }

    #[test]
    fn rolling_window_agrees_with_sorting_and_forgets_the_oldest() {
        let mut rng = fastrand::Rng::with_seed(11);
        for cap in [1, 2, 5, 60] {
            let mut r = Rolling::new(cap);
            let mut all = Vec::new();
            for _ in 0..500 {
                // Repeated values and ties on both sides of the median included.
                let v = (rng.u32(0..20) as f64) * if rng.bool() { 1.0 } else { 0.5 };
                r.push(v);
                all.push(v);
                let window = &all[all.len().saturating_sub(cap)..];
                assert_eq!(r.baseline(), Some(naive(window)), "cap {cap} {window:?}");
                let mut sorted = window.to_vec();
                sorted.sort_by(f64::total_cmp);
                assert_eq!(r.sorted, sorted, "cap {cap}");
            }
            assert_eq!(r.len(), cap);
        }
        let huge = of(&[-1e308, 1e308, 1e308]).unwrap();
        assert_eq!(
            huge.median, 1e308,
            "deviations overflow to infinity without a panic"
        );
        let mut r = Rolling::new(3);
        r.push(f64::NAN);
        r.push(f64::INFINITY);
        assert_eq!(r.len(), 0, "non-finite values are refused");
        r.push(1.0);
        r.clear();
        assert_eq!(r.baseline(), None);
    }
}
