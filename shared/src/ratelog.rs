//! Warnings that a peer, the kernel or a full disk can repeat at will are logged at most once
//! per interval per kind, with the number not logged: a flood of garbage frames, refused
//! connections or failing writes costs a few lines, and the count says what was suppressed.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Warnings about things a hostile peer can repeat at will: the first of each kind is logged at
/// once, then at most one line per `interval` per kind, saying how many were not logged.
pub struct RateLimitedLog<K = &'static str> {
    interval: Duration,
    kinds: Mutex<HashMap<K, Tally>>,
}

struct Tally {
    last: Instant,
    unlogged: u64,
}

impl<K: std::hash::Hash + Eq + Clone> RateLimitedLog<K> {
    pub fn new(interval: Duration) -> Self {
        RateLimitedLog {
            interval,
            kinds: Mutex::default(),
        }
    }

    /// Notes one occurrence of `kind`. Returns `Some(n)` when a line is due now: `n` occurrences
    /// (besides this one) went unlogged since the last line.
    pub fn note(&self, kind: K, now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|p| p.into_inner());
        match kinds.get_mut(&kind) {
            None => {
                kinds.insert(
                    kind,
                    Tally {
                        last: now,
                        unlogged: 0,
                    },
                );
                Some(0)
            }
            Some(t) if now.duration_since(t.last) >= self.interval => {
                t.last = now;
                Some(std::mem::take(&mut t.unlogged))
            }
            Some(t) => {
                t.unlogged += 1;
                None
            }
        }
    }

    /// Kinds with unlogged occurrences whose interval has passed, with their counts (taken).
    pub fn due(&self, now: Instant) -> Vec<(K, u64)> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for (k, t) in kinds.iter_mut() {
            if t.unlogged > 0 && now.duration_since(t.last) >= self.interval {
                t.last = now;
                out.push((k.clone(), std::mem::take(&mut t.unlogged)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_are_limited_per_kind_and_count_the_rest() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.note("busy", t0), Some(0));
        assert_eq!(log.note("other", t0), Some(0));
        for i in 1..=999 {
            assert_eq!(log.note("busy", t0 + Duration::from_millis(i)), None);
        }
        assert!(log.due(t0 + Duration::from_secs(5)).is_empty());
        assert_eq!(log.due(t0 + Duration::from_secs(10)), vec![("busy", 999)]);
        assert!(log.due(t0 + Duration::from_secs(30)).is_empty());
        assert_eq!(log.note("busy", t0 + Duration::from_secs(31)), Some(0));
    }
}
