//! SM time from NVML's per-process utilisation samples, sans IO.
//!
//! `nvmlDeviceGetProcessUtilization` hands out, per GPU, samples of processes that had
//! non-zero SM utilisation: each a process id, the CPU time (µs, realtime) at which the driver
//! took it, and the SM utilisation (percent) of the sample period that ended then. Asked with
//! the newest timestamp of the previous call, it returns only newer samples, one per process
//! (its latest); a process idle since then is not in the answer. The driver's sample period
//! is 1/6 s to 1 s depending on the GPU.
//!
//! [`SmClock::advance`] turns each new sample into SM time: the sample's utilisation times
//! the time it stands for, which is the time since the process's previous sample, at most
//! [`MAX_COVER`] or one and a half read intervals, whichever is longer (a longer gap held
//! samples of 0 that NVML does not return, or is a read that came late). A process's first
//! sample stands for the time since the previous read of its GPU; the first read of a GPU
//! only sets the baseline. So:
//!
//! * a process busy without a break is counted exactly when every sample is read, and with
//!   the sampling error of its load otherwise (a read interval longer than the sample period
//!   sees every few samples, each standing for the gap);
//! * a process that starts computing after an idle spell can be counted up to one cover
//!   limit minus one sample period too much, once per spell;
//! * SM time lags the GPU by up to one sample period (the sample is booked when read).

use rustc_hash::{FxHashMap, FxHashSet};

/// The longest time one sample stands for at read intervals up to 2/3 s: NVML's longest
/// sample period.
pub const MAX_COVER_US: u64 = 1_000_000;

/// One utilisation sample as NVML returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UtilSample {
    pub pid: u32,
    /// CPU time of the sample, µs since the epoch.
    pub timestamp_us: u64,
    /// SM utilisation of the sample period, percent (NVML: 0..=100).
    pub sm_percent: u32,
}

/// What one read of one GPU returned.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuReading {
    /// NVML's device index.
    pub gpu: u32,
    /// Realtime of the read, µs since the epoch (the clock NVML stamps samples with).
    pub read_at_us: u64,
    /// Compute processes on the GPU with their memory in use (None: NVML cannot tell).
    pub processes: Vec<(u32, Option<u64>)>,
    /// Samples newer than the previous read's newest.
    pub samples: Vec<UtilSample>,
    /// On a GPU in MIG mode, each process's MIG instance (NVML gives no per-process
    /// utilisation there, so `samples` is empty); None when the GPU is not in MIG mode.
    pub mig: Option<Vec<MigProcess>>,
    /// On a MIG GPU with GPM, each instance's SM time since the previous read (its
    /// processes share it); None where nothing gives a MIG GPU's compute.
    pub mig_sm: Option<Vec<super::gpm::InstanceSm>>,
}

/// A process on a MIG instance: the GPU instance and compute instance it runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigProcess {
    pub pid: u32,
    pub gpu_instance: u32,
    pub compute_instance: u32,
    pub memory_bytes: Option<u64>,
}

/// A process's SM time on one GPU in one read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessSm {
    pub pid: u32,
    pub gpu: u32,
    /// SM time booked by this read, ns (1 s = one GPU's SMs busy for a second).
    pub sm_ns: u64,
    /// The utilisation (0..=1) of its newest sample while that is recent (within the cover
    /// limit of this read), else 0: what NVML says the process uses now.
    pub utilization: f64,
}

#[derive(Debug, Clone, Copy)]
struct Last {
    timestamp_us: u64,
    ratio: f64,
}

#[derive(Debug, Default)]
struct GpuClock {
    last_read_us: Option<u64>,
    processes: FxHashMap<u32, Last>,
}

/// Per GPU and process, the newest sample seen: turns reads into SM time.
#[derive(Debug, Default)]
pub struct SmClock {
    gpus: FxHashMap<u32, GpuClock>,
    invalid: u64,
}

impl SmClock {
    /// Forgets process `pid` on every GPU: its pid now names another process (reused between
    /// two reads), whose first sample must not stand for time since the old one's last.
    pub fn forget(&mut self, pid: u32) {
        for g in self.gpus.values_mut() {
            g.processes.remove(&pid);
        }
    }

    /// Samples whose utilisation was above 100% (a driver fault seen in the field), counted
    /// as 0.
    pub fn invalid_samples(&self) -> u64 {
        self.invalid
    }

    /// Books one read of every GPU: each process that is on a GPU or had a sample, with the
    /// SM time its new samples stand for.
    pub fn advance(&mut self, readings: &[GpuReading]) -> Vec<ProcessSm> {
        let mut out = Vec::new();
        for r in readings {
            let clock = self.gpus.entry(r.gpu).or_default();
            let since_read = clock
                .last_read_us
                .map(|l| r.read_at_us.saturating_sub(l))
                .map(|gap| gap + gap / 2);
            let cover = since_read.unwrap_or(0).max(MAX_COVER_US);
            let mut booked: FxHashMap<u32, u64> = FxHashMap::default();
            let mut samples = r.samples.clone();
            samples.sort_by_key(|s| (s.pid, s.timestamp_us));
            for s in samples {
                let previous = clock.processes.get(&s.pid).map(|l| l.timestamp_us);
                if previous.is_some_and(|p| s.timestamp_us <= p) {
                    continue; // seen already
                }
                let ratio = if s.sm_percent > 100 {
                    self.invalid += 1;
                    0.0
                } else {
                    f64::from(s.sm_percent) / 100.0
                };
                // since the process's previous sample, else since the previous read; the
                // first read of a GPU is its baseline
                let start = previous.or(clock.last_read_us);
                if let Some(start) = start {
                    let start = start.max(s.timestamp_us.saturating_sub(cover));
                    let us = s.timestamp_us.saturating_sub(start);
                    *booked.entry(s.pid).or_default() += (ratio * us as f64 * 1000.0) as u64;
                }
                clock.processes.insert(
                    s.pid,
                    Last {
                        timestamp_us: s.timestamp_us,
                        ratio,
                    },
                );
            }
            clock.last_read_us = Some(r.read_at_us);
            // processes neither on the GPU nor sampled in this read are gone
            let on_gpu: FxHashSet<u32> = r.processes.iter().map(|(p, _)| *p).collect();
            clock
                .processes
                .retain(|pid, _| on_gpu.contains(pid) || booked.contains_key(pid));
            let mut pids: Vec<u32> = on_gpu.iter().copied().collect();
            pids.extend(booked.keys().filter(|p| !on_gpu.contains(p)));
            for pid in pids {
                let utilization = clock
                    .processes
                    .get(&pid)
                    .filter(|l| r.read_at_us.saturating_sub(l.timestamp_us) <= cover)
                    .map_or(0.0, |l| l.ratio);
                out.push(ProcessSm {
                    pid,
                    gpu: r.gpu,
                    sm_ns: booked.get(&pid).copied().unwrap_or(0),
                    utilization,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;

    fn read(gpu: u32, at_ms: u64, procs: &[u32], samples: &[(u32, u64, u32)]) -> GpuReading {
        GpuReading {
            gpu,
            read_at_us: at_ms * MS,
            processes: procs.iter().map(|p| (*p, Some(1))).collect(),
            mig: None,
            mig_sm: None,
            samples: samples
                .iter()
                .map(|&(pid, t_ms, pct)| UtilSample {
                    pid,
                    timestamp_us: t_ms * MS,
                    sm_percent: pct,
                })
                .collect(),
        }
    }

    fn ns_of(out: &[ProcessSm], pid: u32, gpu: u32) -> u64 {
        out.iter()
            .filter(|p| p.pid == pid && p.gpu == gpu)
            .map(|p| p.sm_ns)
            .sum()
    }

    #[test]
    fn every_sample_read_counts_exactly() {
        let mut c = SmClock::default();
        // baseline read: the sample before it stands for time before the agent looked
        let out = c.advance(&[read(0, 1000, &[7], &[(7, 990, 90)])]);
        assert_eq!(ns_of(&out, 7, 0), 0);
        assert_eq!(out[0].utilization, 0.9);
        // samples every 100 ms, read every 100 ms: 90% of each period
        let mut total = 0;
        for k in 1..=20u64 {
            let out = c.advance(&[read(0, 1000 + 100 * k, &[7], &[(7, 990 + 100 * k, 90)])]);
            total += ns_of(&out, 7, 0);
        }
        // 20 periods of 100 ms at 90%
        assert_eq!(total, 20 * 90 * 1_000_000);
    }

    #[test]
    fn a_slower_read_sees_the_latest_sample_for_the_whole_gap() {
        let mut c = SmClock::default();
        c.advance(&[read(0, 1000, &[7], &[(7, 1000, 50)])]);
        // NVML returns only the latest sample per process: read every 300 ms, samples 100 ms
        let out = c.advance(&[read(0, 1300, &[7], &[(7, 1300, 50)])]);
        assert_eq!(ns_of(&out, 7, 0), 150_000_000);
        // several samples of one process in one read: each for its own period
        let out = c.advance(&[read(0, 1600, &[7], &[(7, 1500, 100), (7, 1400, 20)])]);
        assert_eq!(ns_of(&out, 7, 0), 20_000_000 + 100_000_000);
    }

    #[test]
    fn gaps_are_capped_and_first_samples_start_at_the_previous_read() {
        let mut c = SmClock::default();
        c.advance(&[read(0, 0, &[1], &[])]);
        // process 1 starts computing: its first sample stands for the time since the read
        let out = c.advance(&[read(0, 200, &[1], &[(1, 150, 80)])]);
        assert_eq!(ns_of(&out, 1, 0), 120_000_000);
        // idle for 5 s (no samples), then busy: at most the cover limit
        for t in (400..5200).step_by(200) {
            let out = c.advance(&[read(0, t, &[1], &[])]);
            assert_eq!(ns_of(&out, 1, 0), 0);
            if t > 1200 {
                assert_eq!(out[0].utilization, 0.0, "{t}: an old sample is not now");
            }
        }
        let out = c.advance(&[read(0, 5200, &[1], &[(1, 5150, 100)])]);
        assert_eq!(ns_of(&out, 1, 0), MAX_COVER_US * 1000);
        // a late read (2 s): the cover grows with it
        let out = c.advance(&[read(0, 7200, &[1], &[(1, 7150, 100)])]);
        assert_eq!(ns_of(&out, 1, 0), 2_000_000_000);
    }

    #[test]
    fn a_reused_pid_starts_anew_once_forgotten() {
        let mut c = SmClock::default();
        c.advance(&[read(0, 0, &[7], &[(7, 0, 50)])]);
        c.advance(&[read(0, 1000, &[7], &[(7, 100, 50)])]);
        // pid 7 exits and another process gets pid 7 before the next read: its first sample
        // stands for the time since the previous read (cover-limited), not since the old
        // process's sample at 100 ms
        c.forget(7);
        let out = c.advance(&[read(0, 1200, &[7], &[(7, 1150, 100)])]);
        assert_eq!(ns_of(&out, 7, 0), 150_000_000);
    }

    #[test]
    fn gpus_are_apart_and_bad_samples_count_nothing() {
        let mut c = SmClock::default();
        c.advance(&[read(0, 0, &[1], &[]), read(1, 0, &[1, 2], &[])]);
        let out = c.advance(&[
            read(0, 100, &[1], &[(1, 100, 40)]),
            read(
                1,
                100,
                &[1, 2],
                &[(1, 100, 10), (2, 100, 250), (2, 100, 250)],
            ),
        ]);
        assert_eq!(ns_of(&out, 1, 0), 40_000_000);
        assert_eq!(ns_of(&out, 1, 1), 10_000_000);
        assert_eq!(ns_of(&out, 2, 1), 0);
        assert_eq!(c.invalid_samples(), 1, "the duplicate is skipped");
        // a repeated sample (same timestamp) is not booked twice
        let out = c.advance(&[read(0, 200, &[1], &[(1, 100, 40)])]);
        assert_eq!(ns_of(&out, 1, 0), 0);
        // gone processes are forgotten; a sample of a process not in the list still counts
        let out = c.advance(&[read(1, 200, &[], &[(3, 200, 50)])]);
        assert_eq!(ns_of(&out, 3, 1), 50_000_000);
        assert!(out.iter().all(|p| p.pid == 3), "{out:?}");
    }
}
