//! Spike detector of one (pod, signal): warm-up, robust thresholds, confirmation and
//! hysteresis, so that one episode of high latency is one spike.
//!
//! Per window (value = the window's p99):
//! * Windows too thin to mean anything (a distribution signal with fewer than
//!   `min_window_count` observations) and non-finite values are ignored.
//! * Until `min_baseline_windows` quiet windows are in the baseline, nothing is tested
//!   (warm-up: a pod with three samples never alerts).
//! * The baseline is the median and MAD of the last `baseline_windows` quiet windows, never
//!   including the window under test. The margin is
//!   `max(k × 1.4826 × MAD, (min_ratio − 1) × median, abs_floor)`: the relative and absolute
//!   floors keep a flat-zero or near-constant signal (MAD 0) from alerting on a wobble.
//! * Quiet → episode when `confirm_windows` consecutive windows exceed `median + margin`
//!   (one odd window is noise), or at once when one window exceeds
//!   `median + strong_factor × margin` (a VM pause shows as one huge window).
//! * Episode → quiet after `exit_windows` consecutive windows below
//!   `median + exit_fraction × margin`. The thresholds are frozen for the episode and its
//!   windows stay out of the baseline. An episode longer than `max_episode_windows` is a new
//!   level: the detector forgets its baseline and warms up again.

use super::baseline::{Baseline, Rolling};

/// Settings shared by all detectors; see the module doc for how each is used.
#[derive(Debug, Clone, PartialEq)]
pub struct DetectorConfig {
    pub baseline_windows: usize,
    pub min_baseline_windows: usize,
    pub min_window_count: u64,
    pub k: f64,
    pub min_ratio: f64,
    pub confirm_windows: u32,
    pub strong_factor: f64,
    pub exit_fraction: f64,
    pub exit_windows: u32,
    pub max_episode_windows: u32,
}

impl Default for DetectorConfig {
    fn default() -> Self {
        DetectorConfig {
            baseline_windows: 60,
            min_baseline_windows: 10,
            min_window_count: 20,
            k: 6.0,
            min_ratio: 1.5,
            confirm_windows: 2,
            strong_factor: 10.0,
            exit_fraction: 0.5,
            exit_windows: 2,
            max_episode_windows: 120,
        }
    }
}

/// How a signal's windows are read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SignalPolicy {
    /// A rate (events per second): a window with no events is a valid zero, so the
    /// per-window count minimum does not apply.
    pub rate: bool,
    /// Smallest rise over the median that can be a spike, in the signal's unit.
    pub abs_floor: f64,
}

/// What one window did to the detector.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Ignored (thin, non-finite) or quiet.
    Nothing,
    /// A new episode starts. `at` is the first window above the threshold (for a confirmed
    /// spike that is the earlier window), `value` the highest p99 so far.
    Spike {
        at: i64,
        value: f64,
        baseline: Baseline,
    },
    /// The current episode goes on with this window.
    Continues { at: i64, value: f64 },
    /// The episode ended (quiet again, or it became the new level).
    Ended,
}

#[derive(Debug, Clone, Copy)]
struct Thresholds {
    baseline: Baseline,
    enter: f64,
    strong: f64,
    exit: f64,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// `above` consecutive windows over the enter threshold, the first at `first_at`.
    Quiet {
        above: u32,
        first_at: i64,
        peak: f64,
    },
    Episode {
        t: Thresholds,
        below: u32,
        windows: u32,
    },
}

#[derive(Debug, Clone)]
pub struct Detector {
    quiet: Rolling,
    phase: Phase,
}

const QUIET: Phase = Phase::Quiet {
    above: 0,
    first_at: 0,
    peak: 0.0,
};

impl Detector {
    pub fn new(cfg: &DetectorConfig) -> Self {
        Detector {
            quiet: Rolling::new(cfg.baseline_windows),
            phase: QUIET,
        }
    }

    pub fn in_episode(&self) -> bool {
        matches!(self.phase, Phase::Episode { .. })
    }

    /// Feeds one window.
    pub fn observe(
        &mut self,
        cfg: &DetectorConfig,
        policy: SignalPolicy,
        at: i64,
        count: u64,
        value: f64,
    ) -> Verdict {
        if !value.is_finite() || (!policy.rate && count < cfg.min_window_count) {
            return Verdict::Nothing;
        }
        match self.phase {
            Phase::Episode { t, below, windows } => {
                let windows = windows + 1;
                let below = if value < t.exit { below + 1 } else { 0 };
                if below >= cfg.exit_windows {
                    self.phase = QUIET;
                    self.quiet.push(value);
                    return Verdict::Ended;
                }
                if windows > cfg.max_episode_windows {
                    // Not a spike any more but the new normal: learn it from scratch.
                    self.phase = QUIET;
                    self.quiet.clear();
                    return Verdict::Ended;
                }
                self.phase = Phase::Episode { t, below, windows };
                Verdict::Continues { at, value }
            }
            Phase::Quiet {
                above,
                first_at,
                peak,
            } => {
                if self.quiet.len() < cfg.min_baseline_windows {
                    self.quiet.push(value);
                    return Verdict::Nothing;
                }
                let Some(t) = self.thresholds(cfg, policy) else {
                    self.quiet.push(value);
                    return Verdict::Nothing;
                };
                if value <= t.enter {
                    self.phase = QUIET;
                    self.quiet.push(value);
                    return Verdict::Nothing;
                }
                let (above, first_at, peak) = if above == 0 {
                    (1, at, value)
                } else {
                    (above + 1, first_at, peak.max(value))
                };
                if value > t.strong || above >= cfg.confirm_windows {
                    self.phase = Phase::Episode {
                        t,
                        below: 0,
                        windows: above,
                    };
                    return Verdict::Spike {
                        at: first_at,
                        value: peak,
                        baseline: t.baseline,
                    };
                }
                // Above, not yet confirmed: kept out of the baseline either way.
                self.phase = Phase::Quiet {
                    above,
                    first_at,
                    peak,
                };
                Verdict::Nothing
            }
        }
    }

    fn thresholds(&self, cfg: &DetectorConfig, policy: SignalPolicy) -> Option<Thresholds> {
        let baseline = self.quiet.baseline()?;
        let margin = (cfg.k * baseline.sigma())
            .max((cfg.min_ratio - 1.0) * baseline.median.abs())
            .max(policy.abs_floor);
        // Flat zero with no floor configured: nothing can stand out meaningfully. Infinite or
        // NaN (only from absurd values) is no baseline either.
        let usable = margin.is_finite() && margin > 0.0 && baseline.median.is_finite();
        if !usable {
            return None;
        }
        Some(Thresholds {
            baseline,
            enter: baseline.median + margin,
            strong: baseline.median + cfg.strong_factor * margin,
            exit: baseline.median + cfg.exit_fraction * margin,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIST: SignalPolicy = SignalPolicy {
        rate: false,
        abs_floor: 0.0,
    };
    const RATE: SignalPolicy = SignalPolicy {
        rate: true,
        abs_floor: 1.0,
    };

    /// Feeds values one per second (count 100) and returns the verdicts that are not Nothing,
    /// with their window index.
    fn run(policy: SignalPolicy, values: &[f64]) -> Vec<(usize, Verdict)> {
        let cfg = DetectorConfig::default();
        let mut d = Detector::new(&cfg);
        values
            .iter()
            .enumerate()
            .filter_map(|(i, &v)| {
                let at = i as i64 * 1_000_000_000;
                match d.observe(&cfg, policy, at, 100, v) {
                    Verdict::Nothing => None,
                    x => Some((i, x)),
                }
            })
            .collect()
    }

    fn noisy(n: usize) -> Vec<f64> {
        (0..n).map(|i| 40.0 + (i % 5) as f64).collect()
    }

    #[test]
    fn a_sustained_rise_is_one_spike_dated_at_its_first_window() {
        let mut v = noisy(30);
        v.extend([100.0, 110.0, 120.0, 105.0]);
        v.extend(noisy(10));
        let out = run(DIST, &v);
        let Verdict::Spike {
            at,
            value,
            baseline,
        } = out[0].1
        else {
            panic!("{out:?}")
        };
        assert_eq!(out[0].0, 31, "confirmed by the second window");
        assert_eq!(at, 30_000_000_000, "dated at the first window above");
        assert_eq!(value, 110.0);
        assert_eq!(baseline.median, 42.0);
        let spikes = out
            .iter()
            .filter(|(_, v)| matches!(v, Verdict::Spike { .. }))
            .count();
        assert_eq!(spikes, 1, "{out:?}");
        assert!(matches!(out.last().unwrap().1, Verdict::Ended), "{out:?}");
    }

    #[test]
    fn a_single_odd_window_is_not_a_spike_but_a_huge_one_is() {
        let mut v = noisy(30);
        v.push(120.0); // above threshold, below strong, alone
        v.extend(noisy(5));
        assert!(run(DIST, &v).is_empty());
        let mut v = noisy(30);
        v.push(5000.0);
        v.extend(noisy(5));
        let out = run(DIST, &v);
        assert!(matches!(out[0], (30, Verdict::Spike { .. })), "{out:?}");
    }

    #[test]
    fn warming_up_and_three_samples_never_alert() {
        // A pod that starts hot and settles, and one that lives three windows.
        let mut v = vec![900.0, 700.0, 500.0, 300.0, 100.0];
        v.extend(noisy(40));
        assert!(run(DIST, &v).is_empty(), "{:?}", run(DIST, &v));
        assert!(run(DIST, &[1.0, 5000.0, 9000.0]).is_empty());
    }

    #[test]
    fn flat_zero_and_constant_signals_do_not_alert_on_wobbles() {
        let mut zero = vec![0.0; 30];
        zero.extend([0.5, 0.5, 0.0, 0.9, 0.9]);
        assert!(run(RATE, &zero).is_empty(), "below the absolute floor");
        assert!(run(DIST, &vec![0.0; 50]).is_empty());
        let mut flat = vec![50.0; 30];
        flat.extend([60.0, 70.0, 74.0, 50.0]); // < 1.5 × median
        assert!(run(DIST, &flat).is_empty());
        // ... but a real rise out of zero is a spike.
        let mut rise = vec![0.0; 30];
        rise.extend([30.0, 40.0]);
        assert!(matches!(run(RATE, &rise)[0].1, Verdict::Spike { .. }));
    }

    #[test]
    fn thin_windows_are_ignored_for_distributions_only() {
        let cfg = DetectorConfig::default();
        let mut d = Detector::new(&cfg);
        for i in 0..30 {
            d.observe(&cfg, DIST, i, 100, 40.0);
        }
        for i in 30..40 {
            let v = d.observe(&cfg, DIST, i, 3, 9000.0);
            assert_eq!(v, Verdict::Nothing);
        }
        let v = d.observe(&cfg, DIST, 41, 100, f64::NAN);
        assert_eq!(v, Verdict::Nothing);
        let mut r = Detector::new(&cfg);
        for i in 0..30 {
            r.observe(&cfg, RATE, i, 0, 0.0);
        }
        let v = r.observe(&cfg, RATE, 30, 0, 50.0);
        assert!(matches!(v, Verdict::Spike { .. }), "{v:?}");
    }

    #[test]
    fn a_level_shift_is_one_spike_then_the_new_normal() {
        let mut v = noisy(30);
        v.extend(vec![400.0; 400]);
        v.extend([2000.0, 2100.0]);
        let out = run(DIST, &v);
        let spikes: Vec<usize> = out
            .iter()
            .filter(|(_, v)| matches!(v, Verdict::Spike { .. }))
            .map(|(i, _)| *i)
            .collect();
        // One at the shift (strong: at once), one at the later rise over the new level
        // (confirmed by its second window).
        assert_eq!(spikes, vec![30, 431], "{out:?}");
    }

    #[test]
    fn hysteresis_holds_the_episode_through_a_dip_above_exit() {
        let mut v = noisy(30);
        // Enter around 68; exit at half the margin (~55). 60 is a dip but not an exit.
        v.extend([200.0, 200.0, 60.0, 200.0, 60.0, 200.0, 41.0, 41.0]);
        let out = run(DIST, &v);
        let spikes = out
            .iter()
            .filter(|(_, v)| matches!(v, Verdict::Spike { .. }))
            .count();
        assert_eq!(spikes, 1, "{out:?}");
        assert_eq!(out.last().unwrap(), &(37, Verdict::Ended));
    }
}
