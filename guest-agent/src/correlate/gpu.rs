//! Whether this VM's GPUs were working around a time: what a PCIe link's speed change at full
//! width is read against.
//!
//! GPUs lower their link speed when idle and raise it when work starts (NVIDIA cards drop from
//! Gen4 to Gen1 at idle; hundreds of transitions a minute on an idle card), width unchanged.
//! That is power management, not a cause of anything. A link below its maximum speed while the
//! GPU works is a degradation. The host sees only the link; the guest knows whether its GPU was
//! busy, so the join decides.
//!
//! The agent records one [`GpuWindow`] per tick: whether anything that can tell (NVML's
//! utilisation, time in the GPU driver, CUDA synchronisation) saw the GPU work in the tick, or
//! `None` when nothing in the agent can tell. A speed drop at `t` is read against the windows
//! that cover `[t − before, t + settle]` (1 s and 2 s): the GPU working throughout, on the
//! slower link, is a degradation; a drop that follows the end of work (idle after it) or a
//! brief wake-up of an idle card just before work starts (idle before it) is power
//! management. The time after the change is what decides most: the reading waits for it.

use std::collections::VecDeque;

/// One tick of GPU activity, guest realtime ns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuWindow {
    /// End of the window.
    pub at: i64,
    /// Its length.
    pub len: i64,
    /// Work seen in the window; `None`: no source can tell.
    pub busy: Option<bool>,
}

/// What the windows say about a time range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    /// The GPU worked for more than half of the range.
    Busy,
    Idle,
    /// No source can tell (no NVML, no GPU probe), or the range is older than the log.
    Unknown,
    /// The windows do not reach the end of the range yet.
    NotYet,
}

impl Activity {
    pub fn as_str(&self) -> &'static str {
        match self {
            Activity::Busy => "busy",
            Activity::Idle => "idle",
            Activity::Unknown => "activity unknown",
            Activity::NotYet => "activity not known yet",
        }
    }
}

/// How a link's state reads now, beside what the GPU does now (the page, `explain`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkCondition {
    /// At its maximum speed and width.
    #[default]
    Full,
    /// Below its maximum speed at full width while the GPU idles (or nothing can tell):
    /// the GPU's power management.
    PowerSaving,
    /// Lanes missing, or below its maximum speed while the GPU works.
    Degraded,
    Down,
}

/// The condition of a link at `speed`/`width` of `max_speed`/`max_width` (GT/s, lanes) while
/// the GPU is `gpu`.
pub fn link_condition(
    speed: f64,
    width: f64,
    max_speed: f64,
    max_width: f64,
    gpu: Activity,
) -> LinkCondition {
    if width <= 0.0 || speed <= 0.0 {
        LinkCondition::Down
    } else if width < max_width || (speed < max_speed && gpu == Activity::Busy) {
        LinkCondition::Degraded
    } else if speed < max_speed {
        LinkCondition::PowerSaving
    } else {
        LinkCondition::Full
    }
}

/// The recent windows, oldest first, bounded by time and count.
#[derive(Debug, Clone)]
pub struct GpuLog {
    windows: VecDeque<GpuWindow>,
    retention: i64,
    max_windows: usize,
}

impl GpuLog {
    pub fn new(retention: i64, max_windows: usize) -> GpuLog {
        GpuLog {
            windows: VecDeque::new(),
            retention,
            max_windows: max_windows.max(1),
        }
    }

    /// Appends a tick's window. Windows come in tick order; one that ends before the latest
    /// (a clock step back) replaces what it overlaps rather than reordering history.
    pub fn record(&mut self, w: GpuWindow) {
        if w.len <= 0 {
            return;
        }
        while self.windows.back().is_some_and(|b| b.at >= w.at) {
            self.windows.pop_back();
        }
        if self.windows.len() >= self.max_windows {
            self.windows.pop_front();
        }
        self.windows.push_back(w);
    }

    /// Forgets windows older than the retention.
    pub fn expire(&mut self, now: i64) {
        let horizon = now.saturating_sub(self.retention);
        while self.windows.front().is_some_and(|w| w.at < horizon) {
            self.windows.pop_front();
        }
    }

    /// The GPU's activity over `[from, to]`, time-weighted over the windows that overlap it:
    /// busy when the known windows saw work for more than half of their overlap.
    pub fn over(&self, from: i64, to: i64) -> Activity {
        match self.windows.back() {
            None => return Activity::NotYet,
            Some(last) if last.at < to => return Activity::NotYet,
            _ => {}
        }
        if self
            .windows
            .front()
            .is_some_and(|w| w.at.saturating_sub(w.len) > from)
        {
            return Activity::Unknown; // older than the log
        }
        let (mut busy, mut known) = (0i128, 0i128);
        for w in &self.windows {
            let start = w.at.saturating_sub(w.len).max(from);
            let end = w.at.min(to);
            if end <= start {
                continue;
            }
            let overlap = (end - start) as i128;
            match w.busy {
                Some(true) => {
                    busy += overlap;
                    known += overlap;
                }
                Some(false) => known += overlap,
                None => {}
            }
        }
        if known == 0 {
            Activity::Unknown
        } else if 2 * busy > known {
            Activity::Busy
        } else {
            Activity::Idle
        }
    }

    /// What the latest window says.
    pub fn now(&self) -> Activity {
        match self.windows.back() {
            Some(w) => self.over(w.at.saturating_sub(w.len), w.at),
            None => Activity::Unknown,
        }
    }

    pub fn len(&self) -> usize {
        self.windows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    fn log(busy: &[Option<bool>]) -> GpuLog {
        let mut l = GpuLog::new(900 * S, 10_000);
        for (i, b) in busy.iter().enumerate() {
            l.record(GpuWindow {
                at: (i as i64 + 1) * S,
                len: S,
                busy: *b,
            });
        }
        l
    }

    #[test]
    fn the_range_after_a_change_decides() {
        let (b, i) = (Some(true), Some(false));
        // work ends in the window of the change (1.5 s), idle after: power management
        let l = log(&[b, b, i, i, i]);
        assert_eq!(l.over(S + S / 2, 3 * S + S / 2), Activity::Idle);
        // work all along: busy
        let l = log(&[b, b, b, b, b]);
        assert_eq!(l.over(S + S / 2, 3 * S + S / 2), Activity::Busy);
        // half and half is not more than half
        let l = log(&[b, b, i, i]);
        assert_eq!(l.over(S, 3 * S), Activity::Idle);
        // unknown windows do not count; only unknown ones: unknown
        let l = log(&[b, b, None, b, None]);
        assert_eq!(l.over(S, 5 * S), Activity::Busy);
        assert_eq!(log(&[None, None, None]).over(0, 2 * S), Activity::Unknown);
    }

    #[test]
    fn not_yet_until_the_windows_reach_the_end_and_unknown_before_the_log() {
        let l = log(&[Some(true), Some(true)]);
        assert_eq!(l.over(S, 3 * S), Activity::NotYet);
        assert_eq!(GpuLog::new(S, 1).over(0, 0), Activity::NotYet);
        let mut l = log(&[Some(true); 20]);
        l.retention = 5 * S;
        l.expire(20 * S);
        assert!(l.len() < 20);
        assert_eq!(l.over(0, 2 * S), Activity::Unknown);
        assert_eq!(l.over(18 * S, 19 * S), Activity::Busy);
    }

    #[test]
    fn a_link_below_its_maximum_speed_is_power_saving_unless_the_gpu_works() {
        use LinkCondition::*;
        let c = |speed, width, gpu| link_condition(speed, width, 16.0, 16.0, gpu);
        assert_eq!(c(16.0, 16.0, Activity::Busy), Full);
        assert_eq!(c(2.5, 16.0, Activity::Idle), PowerSaving);
        assert_eq!(c(2.5, 16.0, Activity::Unknown), PowerSaving);
        assert_eq!(c(2.5, 16.0, Activity::Busy), Degraded);
        assert_eq!(c(16.0, 8.0, Activity::Idle), Degraded);
        assert_eq!(c(0.0, 0.0, Activity::Idle), Down);
        assert_eq!(log(&[Some(false), Some(true)]).now(), Activity::Busy);
        assert_eq!(GpuLog::new(S, 4).now(), Activity::Unknown);
    }

    #[test]
    fn bounded_and_robust_to_odd_windows() {
        let mut l = GpuLog::new(i64::MAX, 3);
        for i in 1..=10 {
            l.record(GpuWindow {
                at: i * S,
                len: S,
                busy: Some(i % 2 == 0),
            });
        }
        assert_eq!(l.len(), 3);
        // a window from before the latest replaces the newer ones it contradicts
        l.record(GpuWindow {
            at: 9 * S,
            len: S,
            busy: Some(true),
        });
        assert_eq!(l.len(), 2);
        // empty or negative windows are ignored; extreme times do not overflow
        l.record(GpuWindow {
            at: 11 * S,
            len: 0,
            busy: Some(true),
        });
        assert_eq!(l.len(), 2);
        let _ = l.over(i64::MIN, i64::MAX);
        let _ = l.over(i64::MAX, i64::MIN);
    }
}
