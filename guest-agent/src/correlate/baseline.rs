//! Robust baseline of a signal: median and MAD (median absolute deviation) of its recent
//! quiet windows.
//!
//! Median and MAD ignore up to half of the samples being wild, so one past outlier or a
//! short burst does not move the baseline; a mean and standard deviation would be dragged
//! by exactly the spikes we want to find. `1.4826 × MAD` estimates the standard deviation
//! of normally distributed noise, which makes `k` read as "k sigmas".

/// Scale factor that turns a MAD into a standard-deviation estimate for normal noise.
pub const MAD_TO_SIGMA: f64 = 1.4826;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Baseline {
    pub median: f64,
    /// Median absolute deviation from `median`.
    pub mad: f64,
}

impl Baseline {
    /// Median and MAD of `values` (finite numbers). `scratch` is reused between calls so a
    /// tick over a thousand signals does not allocate. `None` for no values.
    pub fn of(values: impl Iterator<Item = f64>, scratch: &mut Vec<f64>) -> Option<Baseline> {
        scratch.clear();
        scratch.extend(values);
        let median = median_in_place(scratch)?;
        for v in scratch.iter_mut() {
            *v = (*v - median).abs();
        }
        let mad = median_in_place(scratch)?;
        Some(Baseline { median, mad })
    }

    /// Robust spread in the signal's unit (`1.4826 × MAD`).
    pub fn sigma(&self) -> f64 {
        MAD_TO_SIGMA * self.mad
    }
}

/// Median by selection (O(n)); reorders `v`. The mean of the two middle values for even n.
fn median_in_place(v: &mut [f64]) -> Option<f64> {
    let n = v.len();
    if n == 0 {
        return None;
    }
    let mid = n / 2;
    let (lower, m, _) = v.select_nth_unstable_by(mid, f64::total_cmp);
    let upper = *m;
    if n % 2 == 1 {
        return Some(upper);
    }
    // For even n the other middle value is the largest of the lower half.
    let below = lower.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Some((below + upper) / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(v: &[f64]) -> Option<Baseline> {
        Baseline::of(v.iter().copied(), &mut Vec::new())
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
}
