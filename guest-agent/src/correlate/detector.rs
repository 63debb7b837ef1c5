//! Spike detector of one (pod, signal): warm-up, robust thresholds, confirmation and
//! hysteresis, so that one episode of high latency is one spike.
//!
//! Per window. A window is tested on its mean for a distribution (exact: the kernel keeps the
//! sum; and steady whether it holds ten observations or ten thousand, where a p99 of a few
//! observations is their maximum and a log2 histogram's p99 moves by its bucket) and on its
//! rate for a rate signal; it is reported by its p99 against the median p99 of the same quiet
//! windows (what a person reads: "p99 ×21").
//! * Windows too thin to mean anything (a distribution signal with fewer observations than
//!   its [`SignalPolicy::min_count`], its per-second minimum times the window's length) and
//!   non-finite values are ignored.
//! * Until `min_baseline_windows` quiet windows are in the baseline, nothing is tested
//!   (warm-up: a pod with three samples never alerts).
//! * The baseline is the median and MAD of the last `baseline_windows` quiet windows, never
//!   including the window under test. The margin is
//!   `max(k × 1.4826 × MAD, (min_ratio − 1) × median, abs_floor)`: the relative and absolute
//!   floors keep a flat-zero or near-constant signal (MAD 0) from alerting on a wobble.
//! * A signal whose trouble is a fall ([`SignalPolicy::falls`]: a GPU link's throughput, which
//!   a link fault lowers) is read the other way: the thresholds sit below the median, the
//!   relative floor is a fall to `median / min_ratio`, and a window that falls to a tenth of the
//!   median (or `strong_factor` margins, whichever is nearer) is strong. What counts as
//!   "beyond" a threshold is below it; the episode's value is its lowest window.
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
    /// Length of a window (the agent's tick), s: what a signal's per-second minimum count is
    /// multiplied by.
    pub window_secs: f64,
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
            window_secs: 1.0,
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
    /// Fewest observations per second of window that a distribution's window needs to be
    /// tested: low enough that the smallest pod that matters (one busy thread, one busy
    /// connection, one GPU process) reaches it, see `Config::default`.
    pub min_per_second: f64,
    /// Trouble is a fall below the baseline, not a rise (a throughput a link fault lowers).
    pub falls: bool,
}

impl SignalPolicy {
    /// Observations a window of `window_secs` needs: at least one.
    pub fn min_count(&self, window_secs: f64) -> u64 {
        if self.rate {
            return 0;
        }
        let n = (self.min_per_second * window_secs - 1e-9).ceil();
        if n.is_finite() && n > 1.0 {
            n.min(u64::MAX as f64) as u64
        } else {
            1
        }
    }
}

/// One window as the detector reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// What is tested: the mean of a distribution, the rate of a rate signal.
    pub tested: f64,
    /// What is reported: the p99 (the rate).
    pub shown: f64,
}

/// What one window did to the detector.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Ignored (thin, non-finite) or quiet.
    Nothing,
    /// A new episode starts. `at` is the first window beyond the threshold (for a confirmed
    /// spike that is the earlier window), `value` the highest p99 (shown value) so far (the
    /// lowest for a signal that falls),
    /// `baseline` that of the shown values.
    Spike {
        at: i64,
        value: f64,
        baseline: Baseline,
    },
    /// The current episode goes on with this window (its shown value).
    Continues { at: i64, value: f64 },
    /// The episode ended (quiet again, or it became the new level).
    Ended,
}

/// What a window was tested against: the baseline median and the level beyond which a window
/// counts towards a spike (`median + margin`, or `median − margin` for a signal that falls:
/// then `upper` is below `median`; frozen for an episode).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Band {
    pub median: f64,
    pub upper: f64,
}

#[derive(Debug, Clone, Copy)]
struct Thresholds {
    baseline: Baseline,
    enter: f64,
    strong: f64,
    exit: f64,
    falls: bool,
}

impl Thresholds {
    fn band(&self) -> Band {
        Band {
            median: self.baseline.median,
            upper: self.enter,
        }
    }

    /// `v` is beyond `level` in the direction of trouble.
    fn beyond(&self, v: f64, level: f64) -> bool {
        if self.falls {
            v < level
        } else {
            v > level
        }
    }

    /// The worse of two shown values: the higher, or the lower for a signal that falls.
    fn worse(&self, a: f64, b: f64) -> f64 {
        if self.falls {
            a.min(b)
        } else {
            a.max(b)
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// `above` consecutive windows over the enter threshold, the first at `first_at`.
    Quiet {
        above: u32,
        first_at: i64,
        /// Highest shown value of the windows above.
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
    /// Tested values of the quiet windows.
    quiet: Rolling,
    /// Shown values of the same windows (the reported baseline).
    shown: Rolling,
    phase: Phase,
    /// The band the last tested window was held against (none while warming up).
    band: Option<Band>,
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
            shown: Rolling::new(cfg.baseline_windows),
            phase: QUIET,
            band: None,
        }
    }

    /// The band the last window that was not ignored was tested against; `None` while the
    /// detector warms up (or has no usable baseline).
    pub fn band(&self) -> Option<Band> {
        self.band
    }

    fn push_quiet(&mut self, r: Reading) {
        self.quiet.push(r.tested);
        self.shown.push(r.shown);
    }

    pub fn in_episode(&self) -> bool {
        matches!(self.phase, Phase::Episode { .. })
    }

    /// Feeds one window of `count` observations.
    pub fn observe(
        &mut self,
        cfg: &DetectorConfig,
        policy: SignalPolicy,
        at: i64,
        count: u64,
        r: Reading,
    ) -> Verdict {
        let finite = r.tested.is_finite() && r.shown.is_finite();
        if !finite || count < policy.min_count(cfg.window_secs) {
            return Verdict::Nothing;
        }
        let value = r.tested;
        match self.phase {
            Phase::Episode { t, below, windows } => {
                self.band = Some(t.band());
                let windows = windows + 1;
                let below = if t.beyond(value, t.exit) {
                    0
                } else {
                    below + 1
                };
                if below >= cfg.exit_windows {
                    self.phase = QUIET;
                    self.push_quiet(r);
                    return Verdict::Ended;
                }
                if windows > cfg.max_episode_windows {
                    // Not a spike any more but the new normal: learn it from scratch.
                    self.phase = QUIET;
                    self.quiet.clear();
                    self.shown.clear();
                    return Verdict::Ended;
                }
                self.phase = Phase::Episode { t, below, windows };
                Verdict::Continues { at, value: r.shown }
            }
            Phase::Quiet {
                above,
                first_at,
                peak,
            } => {
                if self.quiet.len() < cfg.min_baseline_windows {
                    self.band = None;
                    self.push_quiet(r);
                    return Verdict::Nothing;
                }
                let Some(t) = self.thresholds(cfg, policy) else {
                    self.band = None;
                    self.push_quiet(r);
                    return Verdict::Nothing;
                };
                self.band = Some(t.band());
                if !t.beyond(value, t.enter) {
                    self.phase = QUIET;
                    self.push_quiet(r);
                    return Verdict::Nothing;
                }
                let (above, first_at, peak) = if above == 0 {
                    (1, at, r.shown)
                } else {
                    (above + 1, first_at, t.worse(peak, r.shown))
                };
                if t.beyond(value, t.strong) || above >= cfg.confirm_windows {
                    self.phase = Phase::Episode {
                        t,
                        below: 0,
                        windows: above,
                    };
                    return Verdict::Spike {
                        at: first_at,
                        value: peak,
                        baseline: self.shown.baseline().unwrap_or(t.baseline),
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
        let median = baseline.median;
        // A rise to `min_ratio × median`, or a fall to `median / min_ratio`.
        let relative = if policy.falls {
            (1.0 - 1.0 / cfg.min_ratio.max(1.0)) * median.abs()
        } else {
            (cfg.min_ratio - 1.0) * median.abs()
        };
        let margin = (cfg.k * baseline.sigma())
            .max(relative)
            .max(policy.abs_floor);
        // Flat zero with no floor configured: nothing can stand out meaningfully. Infinite or
        // NaN (only from absurd values) is no baseline either.
        let usable = margin.is_finite() && margin > 0.0 && median.is_finite();
        if !usable {
            return None;
        }
        if policy.falls {
            // A fall past zero cannot happen: a baseline that low has nothing to lose.
            if median - margin <= 0.0 {
                return None;
            }
            // Strong: `strong_factor` margins down, but never past a tenth of the median.
            let strong = (cfg.strong_factor * margin).min(0.9 * median).max(margin);
            return Some(Thresholds {
                baseline,
                enter: median - margin,
                strong: median - strong,
                exit: median - cfg.exit_fraction * margin,
                falls: true,
            });
        }
        Some(Thresholds {
            baseline,
            enter: median + margin,
            strong: median + cfg.strong_factor * margin,
            exit: median + cfg.exit_fraction * margin,
            falls: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window whose tested and shown values are `v`.
    fn same(v: f64) -> Reading {
        Reading {
            tested: v,
            shown: v,
        }
    }

    const DIST: SignalPolicy = SignalPolicy {
        rate: false,
        abs_floor: 0.0,
        min_per_second: 20.0,
        falls: false,
    };
    const RATE: SignalPolicy = SignalPolicy {
        rate: true,
        abs_floor: 1.0,
        min_per_second: 0.0,
        falls: false,
    };
    /// A throughput in bytes per second whose trouble is a dip.
    const DIP: SignalPolicy = SignalPolicy {
        rate: true,
        abs_floor: 1e6,
        min_per_second: 0.0,
        falls: true,
    };

    /// A link's throughput steady at 8 GB/s (±1%), then a renegotiation takes it to 30% for
    /// three windows: one episode from the first low window, its value the lowest window,
    /// against the 8 GB/s median. A rise of the same size and a 20% wobble are nothing, and
    /// neither is the same dip of a signal read for rises.
    #[test]
    fn a_signal_that_falls_spikes_on_a_dip_and_not_on_a_rise() {
        let steady: Vec<f64> = (0..20)
            .map(|i| 8e9 * (1.0 + 0.01 * (i % 3) as f64))
            .collect();
        let mut dip = steady.clone();
        dip.extend([2.4e9, 2.5e9, 2.3e9, 8e9, 8e9, 8e9]);
        let v: Vec<_> = run(DIP, &dip)
            .into_iter()
            .filter(|(_, x)| !matches!(x, Verdict::Continues { .. }))
            .collect();
        assert_eq!(v.len(), 2, "{v:?}");
        match v[0] {
            (
                21,
                Verdict::Spike {
                    at,
                    value,
                    baseline,
                },
            ) => {
                assert_eq!(at, 20_000_000_000);
                assert_eq!(value, 2.4e9, "the first low window confirmed by the second");
                assert!((baseline.median - 8.08e9).abs() < 1e8, "{baseline:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(v[1], (24, Verdict::Ended)), "{v:?}");

        let mut rise = steady.clone();
        rise.extend([24e9, 24e9, 24e9]);
        assert_eq!(run(DIP, &rise), vec![], "a rise is not a dip");
        let mut wobble = steady.clone();
        wobble.extend([6.5e9, 6.6e9, 6.4e9]);
        assert_eq!(run(DIP, &wobble), vec![], "20% down is within the band");
        let rises = SignalPolicy {
            falls: false,
            ..DIP
        };
        assert_eq!(run(rises, &dip), vec![]);
    }

    /// One window at a twentieth of the baseline is strong: no confirmation needed (a link
    /// down and back within a tick). An idle GPU's zero throughput has no baseline to fall
    /// from: nothing, whatever follows.
    #[test]
    fn a_deep_dip_is_strong_and_an_idle_link_has_nothing_to_lose() {
        let mut v: Vec<f64> = (0..20).map(|_| 8e9).collect();
        v.extend([0.4e9, 8e9, 8e9, 8e9]);
        let got = run(DIP, &v);
        assert!(
            matches!(got[..], [(20, Verdict::Spike { value, .. }), (21, Verdict::Continues { .. }), (22, Verdict::Ended)] if value == 0.4e9),
            "{got:?}"
        );
        let mut idle: Vec<f64> = (0..20).map(|_| 0.0).collect();
        idle.extend([0.0, 0.0, 5e5, 0.0]);
        assert_eq!(run(DIP, &idle), vec![]);
        let cfg = DetectorConfig::default();
        let mut d = Detector::new(&cfg);
        for i in 0..20 {
            d.observe(&cfg, DIP, i, 1, same(8e9));
        }
        let band = d.band().expect("a band once warm");
        assert!(band.upper < band.median, "{band:?}");
        assert!((band.upper - 8e9 / 1.5).abs() < 1.0, "{band:?}");
    }

    #[test]
    fn the_minimum_count_follows_the_window_length() {
        let p = SignalPolicy {
            min_per_second: 10.0,
            ..DIST
        };
        assert_eq!(p.min_count(1.0), 10);
        assert_eq!(p.min_count(0.25), 3);
        assert_eq!(p.min_count(0.1), 1);
        assert_eq!(p.min_count(60.0), 600);
        assert_eq!(p.min_count(f64::NAN), 1);
        assert_eq!(RATE.min_count(1.0), 0);
        let cfg = DetectorConfig::default();
        let mut d = Detector::new(&cfg);
        assert_eq!(d.observe(&cfg, p, 0, 9, same(5.0)), Verdict::Nothing);
        assert_eq!(d.quiet.len(), 0, "a thin window is not in the baseline");
        d.observe(&cfg, p, 0, 10, same(5.0));
        assert_eq!(d.quiet.len(), 1);
    }

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
                match d.observe(&cfg, policy, at, 100, same(v)) {
                    Verdict::Nothing => None,
                    x => Some((i, x)),
                }
            })
            .collect()
    }

    fn noisy(n: usize) -> Vec<f64> {
        (0..n).map(|i| 40.0 + (i % 5) as f64).collect()
    }

    /// The mean decides, the p99 is what is reported: a p99 that jumps by its bucket while
    /// the mean holds is no spike; a mean that rises is one, reported by its p99 against the
    /// quiet windows' p99.
    #[test]
    fn the_mean_is_tested_and_the_p99_reported() {
        let cfg = DetectorConfig::default();
        let mut d = Detector::new(&cfg);
        let r = |tested, shown| Reading { tested, shown };
        for i in 0..30 {
            let shown = if i % 3 == 0 { 256.0 } else { 128.0 };
            assert_eq!(
                d.observe(&cfg, DIST, i, 100, r(40.0, shown)),
                Verdict::Nothing
            );
        }
        for i in 30..33 {
            assert_eq!(
                d.observe(&cfg, DIST, i, 100, r(41.0, 512.0)),
                Verdict::Nothing
            );
        }
        d.observe(&cfg, DIST, 33, 100, r(200.0, 1024.0));
        let v = d.observe(&cfg, DIST, 34, 100, r(210.0, 2048.0));
        let Verdict::Spike {
            at,
            value,
            baseline,
        } = v
        else {
            panic!("{v:?}")
        };
        assert_eq!((at, value, baseline.median), (33, 2048.0, 128.0));
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

    /// The band a window is drawn against is the one it was tested with: none in warm-up,
    /// the median and the enter level of the quiet windows before it, frozen for an episode.
    #[test]
    fn the_band_is_what_each_window_was_tested_against() {
        let cfg = DetectorConfig::default();
        let mut d = Detector::new(&cfg);
        let mut feed = |i: i64, v: f64| {
            d.observe(&cfg, DIST, i * 1_000_000_000, 100, same(v));
            d.band()
        };
        // ten quiet windows 40..44: warm-up, nothing to draw
        let v = noisy(10);
        for (i, x) in v.iter().enumerate() {
            assert_eq!(feed(i as i64, *x), None, "window {i}");
        }
        // values 40,41,42,43,44 twice: median 42, MAD 1; margin max(6·1.4826, 0.5·42) = 21
        let quiet = feed(10, 40.0).unwrap();
        assert_eq!(quiet.median, 42.0);
        assert!((quiet.upper - 63.0).abs() < 1e-9, "{quiet:?}");
        // an episode: the band it started with stays while its windows are high
        let start = feed(11, 500.0).unwrap();
        let during = feed(12, 9000.0).unwrap();
        assert_eq!(start, during);
        // a thin window is ignored and leaves the band as it was
        d.observe(&cfg, DIST, 13_000_000_000, 3, same(1.0));
        assert_eq!(d.band(), Some(during));
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
            d.observe(&cfg, DIST, i, 100, same(40.0));
        }
        for i in 30..40 {
            let v = d.observe(&cfg, DIST, i, 3, same(9000.0));
            assert_eq!(v, Verdict::Nothing);
        }
        let v = d.observe(&cfg, DIST, 41, 100, same(f64::NAN));
        assert_eq!(v, Verdict::Nothing);
        let mut r = Detector::new(&cfg);
        for i in 0..30 {
            r.observe(&cfg, RATE, i, 0, same(0.0));
        }
        let v = r.observe(&cfg, RATE, 30, 0, same(50.0));
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
