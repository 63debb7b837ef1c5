//! Liveness of the watcher loops, for the systemd watchdog. A loop that wakes on a period
//! (every poller, discovery, the bridge sampler's thread) beats each time it comes round; the
//! watchdog pinger stops pinging once one of them has not come round for several periods, so
//! that systemd restarts an agent whose process is up but whose watcher is wedged (a read
//! that never returns, a QMP socket that never answers, a task that ended).
//!
//! Readers that block on the kernel until something happens (`/dev/kmsg`, `trace_pipe`,
//! uevents) have no period and no beat: silence is their normal state.

use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use gpufeed_shared::stream::client::Beat;

/// A loop is wedged once it has not come round for this many periods (and at least the
/// floor given to [`Heartbeats::check`]): one slow poll is no wedge.
pub const PERIODS: u32 = 4;

#[derive(Default)]
pub struct Heartbeats {
    beats: Mutex<Vec<(&'static str, Duration, Arc<Beat>)>>,
}

impl Heartbeats {
    /// A beat for the loop `name` that comes round every `period`; it starts now.
    pub fn register(&self, name: &'static str, period: Duration) -> Arc<Beat> {
        let beat = Arc::new(Beat::default());
        beat.now();
        self.add(name, period, beat.clone());
        beat
    }

    /// Watches a beat that already runs (a loop that is known to run only once it started).
    pub fn add(&self, name: &'static str, period: Duration, beat: Arc<Beat>) {
        self.beats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((name, period, beat));
    }

    /// `Err` naming the first loop that has not come round for [`PERIODS`] periods, nor
    /// within `floor`.
    pub fn check(&self, floor: Duration) -> Result<(), String> {
        let beats = self.beats.lock().unwrap_or_else(|p| p.into_inner());
        for (name, period, beat) in beats.iter() {
            let age = beat.age();
            if age > floor.max(*period * PERIODS) {
                return Err(format!(
                    "the {name} watcher made no progress for {age:.1?} (it comes round every {period:?})"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_that_stops_beating_is_named() {
        let h = Heartbeats::default();
        let fast = h.register("fast", Duration::from_millis(10));
        let _slow = h.register("slow", Duration::from_secs(60));
        h.check(Duration::from_millis(30)).unwrap();
        std::thread::sleep(Duration::from_millis(60));
        let e = h.check(Duration::from_millis(30)).unwrap_err();
        assert!(e.contains("the fast watcher made no progress"), "{e}");
        fast.now();
        h.check(Duration::from_millis(30)).unwrap();
    }
}
