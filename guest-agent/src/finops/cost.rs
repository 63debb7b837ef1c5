//! The cost model, sans IO: one interval's usage per pod in, each pod's cost, the idle cost and
//! the node's cost out. Time and usage are arguments; nothing here reads a clock or a map.
//!
//! For an interval of `dt` seconds and an hourly node rate `R`, the node costs
//! `C = R × dt / 3600`. Each pod's cost is `C × (w_compute × c + w_vram × v + w_pcie × e)` with
//! its shares of the node's GPUs in that interval:
//!
//! * `c` = the mean over the node's `N` GPUs of the pod's compute time on each ÷ `dt` (at most
//!   1 per GPU): a pod computing all the time on one of two GPUs has half the node's compute;
//!   compute time whose GPU the source does not know counts as on one GPU;
//! * `v` = VRAM held at the end of the interval ÷ the GPUs' memory;
//! * `e` = bytes copied over PCIe in the interval ÷ (link bandwidth × `dt`).
//!
//! A GPU cannot be more than whole, so where the pods' shares of one GPU's compute, or of the
//! node's memory or link, add up to more than 1 they are scaled down together to add up to
//! exactly 1. What the pods leave of each dimension is the idle cost, `C − Σ pod costs`: with
//! weights that sum to 1 the pods' costs plus the idle cost are the node's cost, interval by
//! interval, hence over any period.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hash;
use std::time::Duration;

use rustc_hash::FxHashMap;

use super::error::ConfigError;

/// How the three dimensions of use weigh in a pod's cost. They sum to 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub compute: f64,
    pub vram: f64,
    pub pcie: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            compute: 0.55,
            vram: 0.35,
            pcie: 0.10,
        }
    }
}

/// Tolerance on the weights' sum: "0.33,0.33,0.34" is meant as 1.
const WEIGHT_SUM_TOLERANCE: f64 = 1e-6;

impl Weights {
    /// `COMPUTE,VRAM,PCIE`, each ≥ 0, summing to 1.
    pub fn parse(s: &str) -> Result<Weights, ConfigError> {
        let v: Vec<f64> = s
            .split(',')
            .map(|p| p.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|_| ConfigError::WeightsSyntax(s.to_string()))?;
        let [compute, vram, pcie] = v[..] else {
            return Err(ConfigError::WeightsSyntax(s.to_string()));
        };
        if v.iter().any(|w| !w.is_finite()) {
            return Err(ConfigError::WeightsSyntax(s.to_string()));
        }
        if v.iter().any(|w| *w < 0.0) {
            return Err(ConfigError::NegativeWeight(s.to_string()));
        }
        let sum = compute + vram + pcie;
        if (sum - 1.0).abs() > WEIGHT_SUM_TOLERANCE {
            return Err(ConfigError::WeightsSum {
                given: s.to_string(),
                sum,
            });
        }
        Ok(Weights {
            compute,
            vram,
            pcie,
        })
    }
}

/// The node's GPUs' size: what the shares divide by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuCapacity {
    /// Total memory of the node's GPUs (bytes).
    pub memory_bytes: u64,
    /// Host link bandwidth of the node's GPUs together, one direction (bytes/s): PCIe
    /// generation × width at their maxima, as NVML reports them.
    pub link_bytes_per_second: u64,
    /// How many GPUs the node has (NVML's count; 1 without NVML): each is an equal part of
    /// the node's compute.
    pub gpus: u32,
}

/// Compute time per GPU (NVML's index; `None`: the source does not say which).
pub type PerGpu = BTreeMap<Option<u32>, f64>;

/// One pod's usage in one interval.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// Compute time added in the interval (s), per GPU.
    pub compute_seconds: PerGpu,
    /// VRAM held at the end of the interval (bytes).
    pub vram_bytes: f64,
    /// Bytes copied between host and GPU in the interval.
    pub pcie_bytes: f64,
}

impl Usage {
    /// Usage whose compute time is on a GPU the source does not name.
    pub fn unplaced(compute_seconds: f64, vram_bytes: f64, pcie_bytes: f64) -> Usage {
        Usage {
            compute_seconds: PerGpu::from([(None, compute_seconds)]),
            vram_bytes,
            pcie_bytes,
        }
    }
}

/// What the model needs: the node's price, the weights and the GPUs' size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Price of the node per hour, in the configured currency.
    pub hourly_rate: f64,
    pub weights: Weights,
    pub capacity: GpuCapacity,
}

/// The cost of one interval. Hashed by pod: every map here is made, read and matched against
/// the ledger once per pod at every tick (ordered maps compared the pods' names down a tree
/// at each step, and were most of FinOps' booking).
#[derive(Debug, Clone)]
pub struct IntervalCost<K> {
    pub pods: FxHashMap<K, f64>,
    /// Compute seconds each pod was charged for per GPU (its share of that GPU × `dt`); a pod
    /// charged nothing has no entry.
    pub compute_seconds: FxHashMap<K, PerGpu>,
    /// What no pod used.
    pub idle: f64,
    /// The node's cost for the interval: `pods` + `idle`.
    pub node: f64,
}

impl CostModel {
    /// The cost of an interval of `dt` with each pod's `usage`.
    pub fn interval<K: Hash + Eq + Clone>(
        &self,
        dt: Duration,
        usage: &[(K, Usage)],
    ) -> IntervalCost<K> {
        let secs = dt.as_secs_f64();
        let node = self.hourly_rate * secs / 3600.0;
        let mut compute_seconds: FxHashMap<K, PerGpu> = FxHashMap::default();
        if secs <= 0.0 || usage.is_empty() {
            return IntervalCost {
                pods: usage.iter().map(|(k, _)| (k.clone(), 0.0)).collect(),
                compute_seconds,
                idle: node,
                node,
            };
        }
        let link = self.capacity.link_bytes_per_second as f64 * secs;
        let memory = self.capacity.memory_bytes as f64;
        let gpus = f64::from(self.capacity.gpus.max(1));
        // each GPU's compute shared out on its own, then a GPU is 1/N of the node's compute
        let keys: BTreeSet<Option<u32>> = usage
            .iter()
            .flat_map(|(_, u)| u.compute_seconds.keys().copied())
            .collect();
        let mut compute = vec![0.0; usage.len()];
        for key in keys {
            let of_gpu = |u: &Usage| u.compute_seconds.get(&key).copied().unwrap_or(0.0) / secs;
            for (i, s) in shares(usage, of_gpu, 1.0).into_iter().enumerate() {
                compute[i] += s / gpus;
                if s > 0.0 {
                    let charged = compute_seconds.entry(usage[i].0.clone()).or_default();
                    *charged.entry(key).or_default() += s * secs;
                }
            }
        }
        // more GPUs named than the node has (a GPU not in NVML's count) cannot make it more
        // than whole
        let total: f64 = compute.iter().sum();
        if total > 1.0 {
            compute.iter_mut().for_each(|c| *c /= total);
        }
        let vram = shares(usage, |u| u.vram_bytes / memory, f64::INFINITY);
        let pcie = shares(usage, |u| u.pcie_bytes / link, f64::INFINITY);
        let w = self.weights;
        let mut pods = FxHashMap::default();
        pods.reserve(usage.len());
        let mut used = 0.0;
        for (i, (k, _)) in usage.iter().enumerate() {
            let c = node * (w.compute * compute[i] + w.vram * vram[i] + w.pcie * pcie[i]);
            used += c;
            *pods.entry(k.clone()).or_insert(0.0) += c;
        }
        IntervalCost {
            pods,
            compute_seconds,
            // rounding can leave -1e-18 where the GPU was full
            idle: (node - used).max(0.0),
            node,
        }
    }
}

/// Each pod's share of one dimension (finite, 0..=`most`), scaled down together when they add
/// up to more than the whole.
fn shares(usage: &[(impl Sized, Usage)], share: impl Fn(&Usage) -> f64, most: f64) -> Vec<f64> {
    let mut v: Vec<f64> = usage
        .iter()
        .map(|(_, u)| {
            let s = share(u);
            if s.is_finite() {
                s.clamp(0.0, most)
            } else {
                0.0
            }
        })
        .collect();
    let total: f64 = v.iter().sum();
    if total > 1.0 {
        for s in &mut v {
            *s /= total;
        }
    }
    v
}

/// Running totals of [`IntervalCost`]s: what the cost counters export (in no order: the
/// exporter sorts them at a scrape, not at every tick).
#[derive(Debug, Clone)]
pub struct Ledger<K> {
    pub pods: FxHashMap<K, f64>,
    pub idle: f64,
    pub node: f64,
}

impl<K> Default for Ledger<K> {
    fn default() -> Self {
        Ledger {
            pods: FxHashMap::default(),
            idle: 0.0,
            node: 0.0,
        }
    }
}

impl<K: Hash + Eq + Clone> Ledger<K> {
    pub fn add(&mut self, cost: &IntervalCost<K>) {
        for (k, c) in &cost.pods {
            // the key copied only for a pod's first line
            match self.pods.get_mut(k) {
                Some(total) => *total += c,
                None => {
                    self.pods.insert(k.clone(), *c);
                }
            }
        }
        self.idle += cost.idle;
        self.node += cost.node;
    }
}

/// Compute time left uncharged is carried into the next intervals for at most this long.
pub const MAX_CARRY: Duration = Duration::from_secs(30);

/// Books intervals into a [`Ledger`], carrying compute time an interval could not hold into
/// the next ones. Sources book time late: the driver probe books a call's time when the call
/// returns (a 100 ms call that ends just after a tick puts up to twice the tick's length into
/// one interval and none into the one before), an NVML sample is booked when it is read.
/// Without the carry, the cap at one GPU would drop that time. Time beyond [`MAX_CARRY`]
/// (tasks of a pod truly in the driver at once for long) is dropped.
#[derive(Debug, Clone)]
pub struct Meter<K> {
    pub model: CostModel,
    pub ledger: Ledger<K>,
    carry: FxHashMap<K, PerGpu>,
}

impl<K: Hash + Eq + Clone> Meter<K> {
    pub fn new(model: CostModel) -> Self {
        Meter {
            model,
            ledger: Ledger::default(),
            carry: FxHashMap::default(),
        }
    }

    /// Books one interval; pods not in `usage` lose their lines and carry.
    pub fn book(&mut self, dt: Duration, mut usage: Vec<(K, Usage)>) -> IntervalCost<K> {
        for (k, u) in &mut usage {
            for (gpu, s) in self.carry.remove(k).unwrap_or_default() {
                *u.compute_seconds.entry(gpu).or_default() += s;
            }
        }
        // what is left belongs to pods that are gone
        self.carry.clear();
        let cost = self.model.interval(dt, &usage);
        self.ledger.add(&cost);
        let max = MAX_CARRY.as_secs_f64();
        for (k, u) in &usage {
            let charged = cost.compute_seconds.get(k);
            for (gpu, s) in &u.compute_seconds {
                let left = s - charged.and_then(|c| c.get(gpu)).copied().unwrap_or(0.0);
                if left.is_finite() && left > 1e-12 {
                    let carry = self.carry.entry(k.clone()).or_default();
                    carry.insert(*gpu, left.min(max));
                }
            }
        }
        // the lines of pods not in this interval go: `cost.pods` has a key for each pod of
        // `usage` (a lookup each; a scan of `usage` per line made the booking quadratic in the
        // node's GPU pods)
        self.ledger.pods.retain(|k, _| cost.pods.contains_key(k));
        cost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn model() -> CostModel {
        CostModel {
            // 3.6 an hour: 0.001 a second, easy to check by hand
            hourly_rate: 3.6,
            weights: Weights::default(),
            capacity: GpuCapacity {
                memory_bytes: 80 * GIB,
                link_bytes_per_second: 32_000_000_000,
                gpus: 1,
            },
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-9)
    }

    #[test]
    fn the_formula_on_known_inputs() {
        let m = model();
        // 10 s; pod a: 5 s of driver time, 20 GiB, 80 GB copied; pod b: 1 s, 40 GiB, nothing
        let usage = [
            ("a", Usage::unplaced(5.0, (20 * GIB) as f64, 80e9)),
            ("b", Usage::unplaced(1.0, (40 * GIB) as f64, 0.0)),
        ];
        let c = m.interval(Duration::from_secs(10), &usage);
        // node: 3.6 × 10 / 3600 = 0.01
        assert!(close(c.node, 0.01), "{}", c.node);
        // a: 0.01 × (0.55 × 0.5 + 0.35 × 0.25 + 0.10 × 80e9/320e9) = 0.01 × 0.3875
        assert!(close(c.pods["a"], 0.003875), "{}", c.pods["a"]);
        // b: 0.01 × (0.55 × 0.1 + 0.35 × 0.5) = 0.01 × 0.23
        assert!(close(c.pods["b"], 0.0023), "{}", c.pods["b"]);
        // idle: 0.01 × (0.55 × 0.4 + 0.35 × 0.25 + 0.10 × 0.75)
        assert!(close(c.idle, 0.01 * (0.22 + 0.0875 + 0.075)), "{}", c.idle);
        assert!(close(c.pods.values().sum::<f64>() + c.idle, c.node));
    }

    #[test]
    fn custom_weights_and_rate() {
        let mut m = model();
        m.hourly_rate = 7.2;
        m.weights = Weights {
            compute: 1.0,
            vram: 0.0,
            pcie: 0.0,
        };
        let u = Usage::unplaced(0.25, (80 * GIB) as f64, 1e12);
        let c = m.interval(Duration::from_secs(1), &[(1u32, u.clone())]);
        // only compute counts: 7.2 / 3600 × 0.25
        assert!(close(c.pods[&1], 0.0005), "{}", c.pods[&1]);
        assert!(close(c.idle, 0.0015));
    }

    #[test]
    fn over_full_dimensions_are_scaled_to_the_whole() {
        let m = model();
        // three pods each in the driver all the time (1 s each in 1 s), together 120 GiB of an
        // 80 GiB GPU, and copies at twice the link
        let u = Usage::unplaced(2.0, (40 * GIB) as f64, 64e9 / 3.0);
        let usage = [("a", u.clone()), ("b", u.clone()), ("c", u)];
        let c = m.interval(Duration::from_secs(1), &usage);
        for k in ["a", "b", "c"] {
            assert!(close(c.pods[k], c.node / 3.0), "{k}: {}", c.pods[k]);
        }
        assert_eq!(c.idle, 0.0);
    }

    #[test]
    fn no_pods_or_no_time_is_all_idle() {
        let m = model();
        let c = m.interval::<&str>(Duration::from_secs(36), &[]);
        assert!(close(c.node, 0.036));
        assert_eq!(c.idle, c.node);
        let c = m.interval(Duration::ZERO, &[("a", Usage::default())]);
        assert_eq!((c.node, c.idle, c.pods["a"]), (0.0, 0.0, 0.0));
    }

    #[test]
    fn hostile_numbers_cost_nothing_rather_than_poison_the_totals() {
        let m = model();
        let bad = Usage::unplaced(f64::NAN, -5.0, f64::INFINITY);
        let c = m.interval(Duration::from_secs(1), &[("a", bad)]);
        assert_eq!(c.pods["a"], 0.0);
        assert!(close(c.idle, c.node));
    }

    #[test]
    fn driver_time_booked_late_is_carried_not_lost() {
        let mut m = model();
        m.weights = Weights {
            compute: 1.0,
            vram: 0.0,
            pcie: 0.0,
        };
        let mut meter = Meter::new(m);
        let u = |s: f64| Usage::unplaced(s, 0.0, 0.0);
        // a pod busy all along whose 100 ms calls are booked in bursts: 0.2 s, 0, 0.2 s, 0
        for s in [0.2, 0.0, 0.2, 0.0, 0.1] {
            meter.book(Duration::from_millis(100), vec![("a", u(s))]);
        }
        // 0.5 s of driver time in 0.5 s: the whole node cost, none of it idle
        assert!(close(meter.ledger.pods["a"], 0.0005), "{:?}", meter.ledger);
        assert!(meter.ledger.idle.abs() < 1e-15);
        // a pod that leaves takes its line and its carry
        meter.book(Duration::from_millis(100), vec![("a", u(5.0))]);
        meter.book(Duration::from_millis(100), vec![("b", u(0.0))]);
        assert!(!meter.ledger.pods.contains_key("a"));
        meter.book(Duration::from_millis(100), vec![("a", u(0.0))]);
        assert_eq!(meter.ledger.pods["a"], 0.0);
        // carry is bounded: 100 s of driver time in 1 s leaves 30 s, not 99
        let mut meter = Meter::new(m);
        meter.book(Duration::from_secs(1), vec![("a", u(100.0))]);
        for _ in 0..40 {
            meter.book(Duration::from_secs(1), vec![("a", u(0.0))]);
        }
        assert!(
            close(meter.ledger.pods["a"], 0.001 * 31.0),
            "{:?}",
            meter.ledger
        );
    }

    #[test]
    fn a_pod_on_one_of_two_gpus_at_full_use_is_half_the_node() {
        let mut m = model();
        m.capacity.gpus = 2;
        m.weights = Weights {
            compute: 1.0,
            vram: 0.0,
            pcie: 0.0,
        };
        let on = |gpu: u32, s: f64| Usage {
            compute_seconds: PerGpu::from([(Some(gpu), s)]),
            ..Usage::default()
        };
        // 1 s: a computes all of it on GPU 0; b and c share GPU 1 at 30% and 20%
        let usage = [("a", on(0, 1.0)), ("b", on(1, 0.3)), ("c", on(1, 0.2))];
        let c = m.interval(Duration::from_secs(1), &usage);
        assert!(close(c.pods["a"], c.node * 0.5), "{c:?}");
        assert!(close(c.pods["b"], c.node * 0.15), "{c:?}");
        assert!(close(c.pods["c"], c.node * 0.10), "{c:?}");
        assert!(close(c.idle, c.node * 0.25), "{c:?}");
        // two pods reporting more than GPU 1 can do share it out; GPU 0's user keeps its half
        let usage = [("a", on(0, 1.0)), ("b", on(1, 0.9)), ("c", on(1, 0.9))];
        let c = m.interval(Duration::from_secs(1), &usage);
        assert!(close(c.pods["b"], c.node * 0.25), "{c:?}");
        assert!(close(c.pods["a"], c.node * 0.5), "{c:?}");
        assert!(c.idle.abs() < 1e-15);
        // a pod on both GPUs at full use is the whole node
        let both = Usage {
            compute_seconds: PerGpu::from([(Some(0), 1.0), (Some(1), 1.0)]),
            ..Usage::default()
        };
        let c = m.interval(Duration::from_secs(1), &[("a", both)]);
        assert!(close(c.pods["a"], c.node));
    }

    /// An hour of one-second intervals with a varying mix: the pods plus idle are the node's
    /// cost, and the node's cost is the rate.
    #[test]
    fn over_an_hour_pods_and_idle_add_up_to_the_node() {
        let m = model();
        let mut ledger = Ledger::default();
        for s in 0..3600u32 {
            let t = f64::from(s);
            let usage = [
                (
                    "a",
                    Usage::unplaced(
                        (t / 600.0).sin().abs(),
                        (30 * GIB) as f64,
                        1e9 * f64::from(s % 7),
                    ),
                ),
                (
                    "b",
                    Usage::unplaced(if s % 2 == 0 { 0.9 } else { 0.0 }, (60 * GIB) as f64, 40e9),
                ),
            ];
            ledger.add(&m.interval(Duration::from_secs(1), &usage));
        }
        assert!(close(ledger.node, 3.6), "{}", ledger.node);
        let sum = ledger.pods.values().sum::<f64>() + ledger.idle;
        assert!((sum - ledger.node).abs() < 1e-9, "{sum} vs {}", ledger.node);
        assert!(ledger.idle > 0.0);
    }
}
