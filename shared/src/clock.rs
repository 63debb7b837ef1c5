//! Host/guest clock alignment. Host `CLOCK_REALTIME` is the reference clock.
//!
//! The guest sends a probe stamped `t1` (guest realtime), the host stamps receipt `t2` and reply
//! `t3` (host realtime), the guest stamps receipt `t4`. Then
//! `offset = ((t2 - t1) + (t3 - t4)) / 2` (host minus guest) and
//! `round trip = (t4 - t1) - (t3 - t2)`. The error of one sample is bounded by half its round
//! trip, so [`ClockFilter`] keeps a window of recent samples and averages only the ones with the
//! lowest round trips (queueing behind events inflates the others).
//!
//! Where the guest runs on KVM with `ptp_kvm`, [`KvmPtp`] reads the hypervisor's realtime
//! directly (`/dev/ptpN` with clock name `KVM virtual PTP`), which cross-checks the estimate.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};

/// `CLOCK_REALTIME` in ns since the Unix epoch.
pub fn realtime_ns() -> i64 {
    clock_ns(libc::CLOCK_REALTIME)
}

/// `CLOCK_MONOTONIC` in ns.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC) as u64
}

#[allow(clippy::unnecessary_cast)] // time_t is not i64 everywhere
fn clock_ns(id: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; the standard clocks always exist on Linux.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as i64 * 1_000_000_000 + ts.tv_nsec as i64
}

/// The host's reference clock as reported on the wire. The host agent stamps events and clock
/// replies through it; production uses [`SystemClock`] (the host's `CLOCK_REALTIME` as is), and
/// tests substitute a shifted clock to check the guest's offset estimate against a known skew.
pub trait ReferenceClock: Send + Sync + std::fmt::Debug {
    /// What to report for a host realtime reading `realtime_ns` (from [`realtime_ns`]).
    fn report(&self, realtime_ns: i64) -> i64;

    /// The reported time now.
    fn now_ns(&self) -> i64 {
        self.report(realtime_ns())
    }
}

/// The host's `CLOCK_REALTIME`, unchanged.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl ReferenceClock for SystemClock {
    fn report(&self, realtime_ns: i64) -> i64 {
        realtime_ns
    }
}

/// One four-timestamp measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSample {
    /// Host minus guest, ns.
    pub offset_ns: i64,
    /// Network round trip without the host's processing time, ns.
    pub rtt_ns: i64,
}

impl ClockSample {
    pub fn from_timestamps(t1: i64, t2: i64, t3: i64, t4: i64) -> Self {
        let offset = ((t2 as i128 - t1 as i128) + (t3 as i128 - t4 as i128)) / 2;
        let rtt = (t4 as i128 - t1 as i128) - (t3 as i128 - t2 as i128);
        ClockSample {
            offset_ns: offset.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
            rtt_ns: rtt.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
        }
    }
}

/// The current estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockEstimate {
    /// Host minus guest, ns: `host_time = guest_time + offset_ns`.
    pub offset_ns: i64,
    /// Largest round trip among the samples used; the offset error is at most half of it.
    pub rtt_ns: i64,
    /// Samples in the window.
    pub samples: usize,
}

/// Keeps the last `window` samples and estimates from the `best` of them with the lowest round
/// trip (mean of their offsets).
#[derive(Debug, Clone)]
pub struct ClockFilter {
    window: VecDeque<ClockSample>,
    cap: usize,
    best: usize,
}

impl Default for ClockFilter {
    fn default() -> Self {
        Self::new(32, 4)
    }
}

impl ClockFilter {
    pub fn new(window: usize, best: usize) -> Self {
        let cap = window.max(1);
        ClockFilter {
            window: VecDeque::with_capacity(cap),
            cap,
            best: best.clamp(1, cap),
        }
    }

    /// Adds a sample; samples with a negative round trip (clock stepped) are discarded.
    pub fn add(&mut self, s: ClockSample) {
        if s.rtt_ns < 0 {
            return;
        }
        if self.window.len() == self.cap {
            self.window.pop_front();
        }
        self.window.push_back(s);
    }

    pub fn estimate(&self) -> Option<ClockEstimate> {
        if self.window.is_empty() {
            return None;
        }
        let mut v: Vec<ClockSample> = self.window.iter().copied().collect();
        v.sort_by_key(|s| s.rtt_ns);
        let used = &v[..self.best.min(v.len())];
        let sum: i128 = used.iter().map(|s| s.offset_ns as i128).sum();
        Some(ClockEstimate {
            offset_ns: (sum / used.len() as i128) as i64,
            rtt_ns: used.last().map(|s| s.rtt_ns).unwrap_or(0),
            samples: v.len(),
        })
    }
}

/// Clock name of the KVM paravirtual PTP clock in `/sys/class/ptp/ptpN/clock_name`.
pub const KVM_PTP_CLOCK_NAME: &str = "KVM virtual PTP";

/// The `/dev/ptpN` device of a KVM virtual PTP clock below `sysfs_root` (normally `/sys`).
pub fn find_kvm_ptp(sysfs_root: &Path) -> Option<PathBuf> {
    let dir = std::fs::read_dir(sysfs_root.join("class/ptp")).ok()?;
    let mut names: Vec<_> = dir.flatten().map(|e| e.file_name()).collect();
    names.sort();
    names.into_iter().find_map(|n| {
        let name =
            std::fs::read_to_string(sysfs_root.join("class/ptp").join(&n).join("clock_name"))
                .ok()?;
        (name.trim() == KVM_PTP_CLOCK_NAME).then(|| Path::new("/dev").join(&n))
    })
}

/// An open KVM PTP clock: its time is the hypervisor's `CLOCK_REALTIME`.
#[derive(Debug)]
pub struct KvmPtp {
    file: std::fs::File,
    path: PathBuf,
}

impl KvmPtp {
    /// Finds and opens the clock; `None` when the guest has none (or it cannot be opened).
    pub fn open(sysfs_root: &Path) -> std::io::Result<Option<Self>> {
        let Some(path) = find_kvm_ptp(sysfs_root) else {
            return Ok(None);
        };
        let file = std::fs::File::open(&path)?;
        Ok(Some(KvmPtp { file, path }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Hypervisor realtime minus guest realtime, ns: `clock_gettime` on the dynamic clock id of
    /// the PTP device, bracketed by two guest realtime reads (the best of 5 tries, by bracket
    /// width).
    #[allow(clippy::unnecessary_cast)] // time_t is not i64 everywhere
    pub fn offset_ns(&self) -> std::io::Result<i64> {
        use std::os::fd::AsRawFd;
        let fd = self.file.as_raw_fd();
        // FD_TO_CLOCKID from the kernel's posix-timers ABI.
        let clk: libc::clockid_t = ((!fd) << 3) | 3;
        let mut best: Option<(i64, i64)> = None;
        for _ in 0..5 {
            let a = realtime_ns();
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: valid timespec pointer; an invalid clock id only yields EINVAL.
            if unsafe { libc::clock_gettime(clk, &mut ts) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let b = realtime_ns();
            let p = ts.tv_sec as i64 * 1_000_000_000 + ts.tv_nsec as i64;
            let width = b - a;
            let off = p - (a + width / 2);
            if best.is_none_or(|(w, _)| width < w) {
                best = Some((width, off));
            }
        }
        Ok(best.map(|(_, o)| o).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_math() {
        // Host 250 ms ahead, 40 µs out, 60 µs back, 10 µs processing.
        let t1 = 1_000_000_000;
        let t2 = t1 + 40_000 + 250_000_000;
        let t3 = t2 + 10_000;
        let t4 = t1 + 40_000 + 10_000 + 60_000;
        let s = ClockSample::from_timestamps(t1, t2, t3, t4);
        assert_eq!(s.rtt_ns, 100_000);
        // Asymmetry of 20 µs shows up as half of it.
        assert_eq!(s.offset_ns, 250_000_000 - 10_000);
    }

    #[test]
    fn filter_prefers_low_round_trips() {
        let mut f = ClockFilter::new(8, 2);
        assert_eq!(f.estimate(), None);
        for i in 0..6 {
            // Congested samples: large rtt, offset off by rtt/2.
            f.add(ClockSample {
                offset_ns: 5_000 + 500_000 + i,
                rtt_ns: 1_000_000,
            });
        }
        f.add(ClockSample {
            offset_ns: 5_010,
            rtt_ns: 20_000,
        });
        f.add(ClockSample {
            offset_ns: 4_990,
            rtt_ns: 30_000,
        });
        f.add(ClockSample {
            offset_ns: 0,
            rtt_ns: -1,
        });
        let e = f.estimate().unwrap();
        assert_eq!(e.offset_ns, 5_000);
        assert_eq!(e.rtt_ns, 30_000);
        assert_eq!(e.samples, 8);
        // The window slides: old good samples leave.
        for _ in 0..8 {
            f.add(ClockSample {
                offset_ns: 7,
                rtt_ns: 500,
            });
        }
        assert_eq!(f.estimate().unwrap().offset_ns, 7);
    }

    #[test]
    fn finds_kvm_ptp_in_sysfs_tree() {
        let d = std::env::temp_dir().join(format!("gpufeed-ptp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for (n, name) in [("ptp0", "some nic\n"), ("ptp1", "KVM virtual PTP\n")] {
            std::fs::create_dir_all(d.join("class/ptp").join(n)).unwrap();
            std::fs::write(d.join("class/ptp").join(n).join("clock_name"), name).unwrap();
        }
        assert_eq!(find_kvm_ptp(&d), Some(PathBuf::from("/dev/ptp1")));
        std::fs::remove_dir_all(&d).unwrap();
        assert_eq!(find_kvm_ptp(&d), None);
    }

    #[test]
    fn clocks_are_sane() {
        let a = realtime_ns();
        assert!(a > 1_600_000_000_000_000_000);
        let m1 = monotonic_ns();
        let m2 = monotonic_ns();
        assert!(m2 >= m1);
    }
}
