//! The pollers' timers: one `timerfd` each, all on the agent's common phase, so that every
//! poller due at the same instant is woken by the same kernel timer interrupt and the same
//! return of the runtime's `epoll_wait`: one wake-up of the agent for all of them.
//!
//! Why not `tokio::time::interval`: tokio's timer wheel keeps a deadline more than 64 ms away
//! in a coarse slot and parks until that slot begins, then parks again for the rest, so every
//! tick of a 200 ms or 1 s poller woke the agent twice (measured with strace: `epoll_wait(190)`
//! then `epoll_wait(8)` before each poll). A `timerfd` with an absolute, periodic expiry fires
//! once, exactly on the phase. Where a `timerfd` cannot be had (it always can on Linux; a
//! seccomp filter could refuse it), the tokio interval is used.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use tokio::io::unix::AsyncFd;

/// The common phase: `CLOCK_MONOTONIC` ns and the same instant as tokio knows it.
#[derive(Debug, Clone, Copy)]
pub struct Phase {
    mono_ns: u64,
    tokio: tokio::time::Instant,
}

impl Phase {
    pub fn now() -> Phase {
        Phase {
            tokio: tokio::time::Instant::now(),
            mono_ns: gpufeed_shared::clock::monotonic_ns(),
        }
    }
}

/// A periodic timer on a [`Phase`]: the first [`Ticks::tick`] completes at once, the next
/// ones on the phase's multiples of the period. A tick that was missed (the loop was busy
/// past it) is skipped, not made up for, which keeps the timers of all pollers together.
pub struct Ticks(Kind);

enum Kind {
    Fd { fd: AsyncFd<OwnedFd>, first: bool },
    Tokio(tokio::time::Interval),
}

impl Ticks {
    /// Must be called inside a tokio runtime (it registers with its reactor).
    pub fn new(phase: Phase, period: Duration) -> Ticks {
        let period = period.max(Duration::from_millis(1));
        match timerfd(phase, period).and_then(register) {
            Ok(fd) => Ticks(Kind::Fd { fd, first: true }),
            Err(e) => {
                tracing::debug!("timerfd: {e}; the poller uses tokio's timer");
                let mut iv = tokio::time::interval_at(phase.tokio, period);
                iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                Ticks(Kind::Tokio(iv))
            }
        }
    }

    /// Whether this timer is a `timerfd` (for tests).
    pub fn is_timerfd(&self) -> bool {
        matches!(self.0, Kind::Fd { .. })
    }

    pub async fn tick(&mut self) {
        match &mut self.0 {
            Kind::Tokio(iv) => {
                iv.tick().await;
            }
            Kind::Fd { fd, first } => {
                if std::mem::take(first) {
                    return;
                }
                loop {
                    let Ok(mut ready) = fd.readable().await else {
                        // The reactor is gone (runtime shutting down): never tick again.
                        return std::future::pending().await;
                    };
                    let mut n = [0u8; 8];
                    let read = ready.try_io(|f| {
                        // SAFETY: reads 8 bytes into a buffer of 8 from a descriptor we own.
                        let r = unsafe { libc::read(f.as_raw_fd(), n.as_mut_ptr().cast(), 8) };
                        if r < 0 {
                            Err(std::io::Error::last_os_error())
                        } else {
                            Ok(())
                        }
                    });
                    // Err(_): not readable after all (would block); wait again. The count of
                    // expirations is not needed: missed ticks are skipped.
                    if let Ok(Ok(())) = read {
                        return;
                    }
                }
            }
        }
    }
}

/// `fd` in the runtime's reactor, for reading.
fn register(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd takes the descriptor over: it stays open and the same until the
    // AsyncFd is dropped, and nothing else closes it.
    unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
}

/// A non-blocking `timerfd` firing every `period` on the multiples of `phase` after now.
fn timerfd(phase: Phase, period: Duration) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; the descriptor is owned right below.
    let raw = unsafe {
        libc::timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
        )
    };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let p = period.as_nanos() as u64;
    let now = gpufeed_shared::clock::monotonic_ns();
    let next = phase.mono_ns + (now.saturating_sub(phase.mono_ns) / p + 1) * p;
    let ts = |ns: u64| libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    };
    let spec = libc::itimerspec {
        it_interval: ts(p),
        it_value: ts(next),
    };
    // SAFETY: valid descriptor and itimerspec; the old value is not asked for.
    let r = unsafe {
        libc::timerfd_settime(
            fd.as_raw_fd(),
            libc::TFD_TIMER_ABSTIME,
            &spec,
            std::ptr::null_mut(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ticks come on the phase's multiples (not a period after whenever the timer was made),
    /// the first at once, and two timers of periods that divide each other tick together.
    #[tokio::test(flavor = "current_thread")]
    async fn ticks_fall_on_the_common_phase() {
        let phase = Phase::now();
        tokio::time::sleep(Duration::from_millis(35)).await;
        let mut fast = Ticks::new(phase, Duration::from_millis(50));
        let mut slow = Ticks::new(phase, Duration::from_millis(100));
        assert!(fast.is_timerfd() && slow.is_timerfd());
        let t0 = std::time::Instant::now();
        fast.tick().await;
        slow.tick().await;
        assert!(
            t0.elapsed() < Duration::from_millis(5),
            "first tick at once"
        );
        let since_phase = || gpufeed_shared::clock::monotonic_ns() - phase.mono_ns;
        for _ in 0..4 {
            fast.tick().await;
            let off = since_phase() % 50_000_000;
            // woken just after a multiple of 50 ms from the phase (slack for a busy machine)
            assert!(
                off < 15_000_000,
                "{} ms past the phase's multiple",
                off / 1_000_000
            );
        }
        // the 100 ms timer ticks on the same multiples
        slow.tick().await;
        let a = since_phase();
        assert!(
            a % 100_000_000 < 15_000_000,
            "slow at {a} ns after the phase"
        );
    }

    /// A loop busy past several ticks gets one tick, then the next on the phase again.
    #[tokio::test(flavor = "current_thread")]
    async fn missed_ticks_are_skipped() {
        let phase = Phase::now();
        let mut t = Ticks::new(phase, Duration::from_millis(20));
        t.tick().await;
        std::thread::sleep(Duration::from_millis(75)); // blocks the runtime: 3 ticks missed
        let t0 = std::time::Instant::now();
        t.tick().await;
        assert!(
            t0.elapsed() < Duration::from_millis(5),
            "the missed tick is there"
        );
        t.tick().await;
        let off = (gpufeed_shared::clock::monotonic_ns() - phase.mono_ns) % 20_000_000;
        assert!(off < 8_000_000, "{off} ns past the phase's multiple");
    }

    /// Voluntary context switches of this thread so far.
    fn switches() -> u64 {
        std::fs::read_to_string("/proc/thread-self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    }

    /// Pollers of 100 ms, 200 ms and 1 s share their wake-ups: over a second the runtime's
    /// thread sleeps and wakes about ten times, once per 100 ms tick with the others riding
    /// along (tokio's interval woke twice per tick, twenty or more).
    #[tokio::test(flavor = "current_thread")]
    async fn pollers_on_one_phase_share_one_wake_up() {
        let phase = Phase::now();
        let ms = Duration::from_millis;
        let mut timers = [
            Ticks::new(phase, ms(100)),
            Ticks::new(phase, ms(200)),
            Ticks::new(phase, ms(1000)),
        ];
        for t in &mut timers {
            t.tick().await; // the immediate first ticks
        }
        let [a, b, c] = &mut timers;
        let (mut na, mut nb, mut nc) = (0, 0, 0);
        let s0 = switches();
        let until = tokio::time::Instant::now() + ms(1000);
        while tokio::time::Instant::now() < until {
            tokio::select! {
                _ = a.tick() => na += 1,
                _ = b.tick() => nb += 1,
                _ = c.tick() => nc += 1,
            }
        }
        let woke = switches() - s0;
        assert!(na >= 8 && nb >= 4, "ticks: {na} {nb} {nc}");
        assert!(
            woke <= na + 3,
            "{woke} wake-ups for {na} ticks of the fastest timer ({nb}, {nc} of the others)"
        );
    }
}
