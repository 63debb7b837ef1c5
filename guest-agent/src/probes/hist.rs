//! The user side of `bpf/hist.h`: log2 buckets over nanoseconds, exported as
//! Prometheus buckets in microseconds.
//!
//! The layout itself comes from the skeletons' generated `types::hist` (each
//! unit converts with `Hist::from_parts`, whose array type fails to compile if
//! the slot count differs); the constants below are asserted against it in the
//! tests and give the bucket bounds.

/// Smallest bucket bound is 2^MIN_SHIFT ns (1.024 us).
pub const MIN_SHIFT: u32 = 10;
/// Finite buckets: 2^10 .. 2^34 ns (about 1 us .. 17 s).
pub const BUCKETS: usize = 25;
/// Slots in the kernel array: finite buckets plus the overflow slot.
pub const SLOTS: usize = BUCKETS + 1;
/// Size of `struct hist` in bytes (buckets and sum; the count is their total).
pub const HIST_BYTES: usize = (SLOTS + 1) * 8;

/// Upper bound of finite bucket `i` in microseconds (the Prometheus `le`).
pub fn upper_bound_us(i: usize) -> f64 {
    (1u64 << (MIN_SHIFT as usize + i)) as f64 / 1000.0
}

/// The kernel's bucket index for a value in ns (same arithmetic as hist_index()).
#[cfg(test)]
pub fn index(ns: u64) -> usize {
    if ns < (1 << MIN_SHIFT) {
        return 0;
    }
    let idx = (63 - ns.leading_zeros()) as usize + 1 - MIN_SHIFT as usize;
    idx.min(BUCKETS)
}

/// A histogram as read from a map, or accumulated from deltas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hist {
    pub buckets: [u64; SLOTS],
    pub sum_ns: u64,
    pub count: u64,
}

impl Default for Hist {
    fn default() -> Self {
        Hist {
            buckets: [0; SLOTS],
            sum_ns: 0,
            count: 0,
        }
    }
}

impl Hist {
    /// A histogram from the kernel's `struct hist` fields (the skeleton's
    /// generated type); the count is the buckets' total.
    pub fn from_parts(buckets: &[u64; SLOTS], sum_ns: u64) -> Hist {
        Hist {
            buckets: *buckets,
            sum_ns,
            count: buckets.iter().fold(0u64, |a, b| a.wrapping_add(*b)),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// `self - earlier`, per field. The kernel's counts only grow while the
    /// cgroup lives, so a bucket that went backwards means a new storage
    /// instance: then the whole current value is the delta. The sum may wrap
    /// (a weighted histogram adds value × weight): with buckets that only
    /// grew, its difference is taken modulo 2^64.
    pub fn delta_since(&self, earlier: &Hist) -> Hist {
        if (0..SLOTS).any(|i| self.buckets[i] < earlier.buckets[i]) {
            return self.clone();
        }
        let mut d = Hist::default();
        for i in 0..SLOTS {
            d.buckets[i] = self.buckets[i] - earlier.buckets[i];
        }
        d.sum_ns = self.sum_ns.wrapping_sub(earlier.sum_ns);
        d.count = self.count - earlier.count;
        d
    }

    pub fn add(&mut self, other: &Hist) {
        for i in 0..SLOTS {
            self.buckets[i] = self.buckets[i].wrapping_add(other.buckets[i]);
        }
        self.sum_ns = self.sum_ns.wrapping_add(other.sum_ns);
        self.count = self.count.wrapping_add(other.count);
    }

    /// Cumulative counts per finite bucket, as Prometheus wants them.
    pub fn cumulative(&self) -> [u64; BUCKETS] {
        let mut out = [0; BUCKETS];
        let mut acc = 0u64;
        for (i, o) in out.iter_mut().enumerate() {
            acc = acc.wrapping_add(self.buckets[i]);
            *o = acc;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_matches_bucket_bounds() {
        assert_eq!(index(0), 0);
        assert_eq!(index(1023), 0);
        assert_eq!(index(1024), 1);
        assert_eq!(index(2047), 1);
        assert_eq!(index(2048), 2);
        assert_eq!(index(u64::MAX), BUCKETS);
        assert_eq!(index((1 << 34) - 1), BUCKETS - 1);
        assert_eq!(index(1 << 34), BUCKETS);
        // every value lies below its bucket's upper bound and at/above the previous one
        for ns in [1u64, 999, 1000, 1500, 123_456, 9_999_999, 16_000_000_000] {
            let i = index(ns);
            if i < BUCKETS {
                assert!((ns as f64) / 1000.0 < upper_bound_us(i), "{ns} in {i}");
            }
            if i > 0 {
                assert!((ns as f64) / 1000.0 >= upper_bound_us(i - 1), "{ns} in {i}");
            }
        }
        assert!((upper_bound_us(0) - 1.024).abs() < 1e-9);
        assert!(
            upper_bound_us(BUCKETS - 1) > 16e6,
            "top bucket covers ~16 s"
        );
    }

    #[test]
    fn constants_match_the_skeleton_type() {
        use crate::probes::{sched, tcp};
        assert_eq!(std::mem::size_of::<sched::skel::types::hist>(), HIST_BYTES);
        assert_eq!(std::mem::size_of::<tcp::skel::types::hist>(), HIST_BYTES);
        assert_eq!(sched::skel::types::hist::default().buckets.len(), SLOTS);
    }

    #[test]
    fn decode_delta_and_cumulate() {
        let mut bytes = Vec::new();
        for i in 0..SLOTS as u64 {
            bytes.extend_from_slice(&(i % 3).to_ne_bytes());
        }
        bytes.extend_from_slice(&5000u64.to_ne_bytes());
        let decode = |b: &[u8]| {
            crate::probes::decode::<crate::probes::sched::skel::types::hist>(b)
                .map(|h| Hist::from_parts(&h.buckets, h.sum_ns))
        };
        let h = decode(&bytes).unwrap();
        assert_eq!(h.buckets[2], 2);
        assert_eq!(h.sum_ns, 5000);
        assert_eq!(h.count, (0..SLOTS as u64).map(|i| i % 3).sum::<u64>());
        assert!(decode(&bytes[..HIST_BYTES - 1]).is_none());

        let mut later = h.clone();
        later.buckets[4] += 7;
        later.count += 7;
        later.sum_ns += 70_000;
        let d = later.delta_since(&h);
        assert_eq!(d.count, 7);
        assert_eq!(d.sum_ns, 70_000);
        assert_eq!(d.buckets[4], 7);
        assert_eq!(d.buckets[3], 0);
        // a reset (new storage) yields the whole new value
        assert_eq!(h.delta_since(&later), h);
        // a sum that wrapped while the buckets grew is still a difference
        let mut wrapped = later.clone();
        wrapped.buckets[4] += 1;
        wrapped.count += 1;
        wrapped.sum_ns = 10;
        let mut high = later.clone();
        high.sum_ns = u64::MAX - 5;
        let d = wrapped.delta_since(&high);
        assert_eq!((d.count, d.buckets[4], d.sum_ns), (1, 1, 16));
        let c = later.cumulative();
        assert_eq!(c[BUCKETS - 1], later.buckets[..BUCKETS].iter().sum::<u64>());
    }
}
