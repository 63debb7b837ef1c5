//! When the host tries its guest again, sans-IO: every decision of the stream client's
//! reconnect loop (how long to wait, how long an attempt may take) is [`Reconnect`]'s, from the
//! outcomes the driver reports and the monotonic time it passes in; the driver only sleeps and
//! connects.
//!
//! * After a failed attempt the wait grows: an exponential backoff with jitter ([`Backoff`]).
//! * For [`FAST_RECONNECT_FOR`] after an established connection was lost, attempts are at most
//!   [`FAST_RECONNECT_MAX`] apart and each lasts at most [`FAST_CONNECT_TIMEOUT`]: a guest that
//!   restarts (an agent update, a crash) is back within seconds, and waiting out a grown backoff
//!   would leave its events queued for that long.
//! * A guest that refuses (busy: all its handshake places taken, a flood) refuses before any
//!   state, so trying again soon costs it nothing, and a grown backoff would outlast the flood:
//!   for [`FAST_RECONNECT_FOR`] after a refusal the wait is at most [`FAST_RECONNECT_MAX`] too.

use std::time::Duration;

/// How long after a lost connection or a refusal attempts stay close together.
pub const FAST_RECONNECT_FOR: Duration = Duration::from_secs(60);
/// The longest wait between attempts meanwhile.
pub const FAST_RECONNECT_MAX: Duration = Duration::from_millis(500);
/// The longest attempt after a lost connection (the guest is a VM of this host).
pub const FAST_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Exponential backoff with jitter: the n-th delay is uniform in `[d/2, d]` with
/// `d = min(max, min * 2^n)`.
#[derive(Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min: min.max(Duration::from_millis(1)),
            max: max.max(min),
            attempt: 0,
        }
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn next_delay(&mut self) -> Duration {
        let d = self
            .min
            .saturating_mul(1u32 << self.attempt.min(20))
            .min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = d / 2;
        half + Duration::from_nanos(fastrand::u64(0..=half.as_nanos() as u64))
    }
}

/// How an attempt ended, as the driver saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The handshake succeeded and the connection later ended.
    Lost,
    /// The guest refused before any state (busy).
    Refused,
    /// Anything else: no route, a timeout, a TLS failure, a rejected `Hello`.
    Failed,
}

/// The reconnect policy of one guest's connection (see the module docs). Times are monotonic
/// nanoseconds, as the driver reads them.
#[derive(Debug)]
pub struct Reconnect {
    backoff: Backoff,
    connect_timeout: Duration,
    /// When an established connection was last lost.
    lost_at: Option<u64>,
    /// Until when a refusal keeps attempts close together.
    refused_until: Option<u64>,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Reconnect {
    /// `min`..`max`: the backoff's range; `connect_timeout`: an attempt's limit in general.
    pub fn new(min: Duration, max: Duration, connect_timeout: Duration) -> Self {
        Reconnect {
            backoff: Backoff::new(min, max),
            connect_timeout,
            lost_at: None,
            refused_until: None,
        }
    }

    fn fast(&self, now: u64) -> bool {
        self.lost_at
            .is_some_and(|t| now.saturating_sub(t) < ns(FAST_RECONNECT_FOR))
    }

    /// How long the attempt starting at `now` may take.
    pub fn connect_timeout(&self, now: u64) -> Duration {
        if self.fast(now) {
            self.connect_timeout.min(FAST_CONNECT_TIMEOUT)
        } else {
            self.connect_timeout
        }
    }

    /// The attempt ended at `now` as `how`: how long to wait before the next one.
    pub fn ended(&mut self, how: Attempt, now: u64) -> Duration {
        match how {
            Attempt::Lost => {
                self.backoff.reset();
                self.lost_at = Some(now);
            }
            Attempt::Refused => {
                self.refused_until = Some(now.saturating_add(ns(FAST_RECONNECT_FOR)));
            }
            Attempt::Failed => {}
        }
        let delay = self.backoff.next_delay();
        if self.fast(now) || self.refused_until.is_some_and(|t| now < t) {
            delay.min(FAST_RECONNECT_MAX)
        } else {
            delay
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn backoff_grows_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(1000));
        let d: Vec<_> = (0..6).map(|_| b.next_delay()).collect();
        let bounds = [100, 200, 400, 800, 1000, 1000];
        for (d, hi) in d.iter().zip(bounds) {
            assert!(
                *d >= Duration::from_millis(hi / 2) && *d <= Duration::from_millis(hi),
                "{d:?} vs {hi}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    /// Failures grow the wait to the maximum; a lost connection brings attempts close for a
    /// minute (short waits, short attempts), then the backoff grows again.
    #[test]
    fn a_lost_connection_retries_fast_for_a_minute() {
        let (min, max) = (Duration::from_millis(200), Duration::from_secs(30));
        let mut r = Reconnect::new(min, max, Duration::from_secs(10));
        assert_eq!(r.connect_timeout(0), Duration::from_secs(10));
        let waits: Vec<Duration> = (0..12).map(|i| r.ended(Attempt::Failed, i * S)).collect();
        assert!(waits[11] >= max / 2, "{waits:?}");
        let at = 100 * S;
        assert!(r.ended(Attempt::Lost, at) <= FAST_RECONNECT_MAX);
        assert_eq!(r.connect_timeout(at), FAST_CONNECT_TIMEOUT);
        for i in 1..40 {
            let w = r.ended(Attempt::Failed, at + i * S);
            assert!(w <= FAST_RECONNECT_MAX, "{i}: {w:?}");
        }
        let later = at + ns(FAST_RECONNECT_FOR) + S;
        assert_eq!(r.connect_timeout(later), Duration::from_secs(10));
        // the backoff kept growing meanwhile: past the fast minute the wait is long again
        assert!(r.ended(Attempt::Failed, later) >= max / 2);
    }

    /// A refusal (a busy guest) keeps the waits short for a minute, whatever the backoff.
    #[test]
    fn a_refusal_keeps_attempts_close_for_a_minute() {
        let mut r = Reconnect::new(
            Duration::from_secs(1),
            Duration::from_secs(60),
            Duration::from_secs(10),
        );
        for i in 0..10 {
            r.ended(Attempt::Failed, i * S);
        }
        let at = 20 * S;
        for i in 0..30 {
            assert!(r.ended(Attempt::Refused, at + i * S) <= FAST_RECONNECT_MAX);
        }
        // a refusal does not shorten the attempts: the guest answers at once anyway
        assert_eq!(r.connect_timeout(at), Duration::from_secs(10));
        assert!(
            r.ended(Attempt::Failed, at + 29 * S + ns(FAST_RECONNECT_FOR))
                >= Duration::from_secs(30)
        );
    }
}
