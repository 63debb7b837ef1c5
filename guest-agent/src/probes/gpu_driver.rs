//! GPU driver time per cgroup: ioctl() on GPU device files (`bpf/gpu_driver.bpf.c`).
//!
//! The kernel side learns which file descriptors are GPU device files when
//! they are opened. Processes that opened theirs before the agent started are
//! seeded from here: [`GpuDriverProbe::seed`] stats `/proc/<pid>/fd/*` against
//! the character-device majors of the configured drivers (read from
//! `/proc/devices`) and writes the process's bitmap through a pidfd.

mod skel {
    include!(concat!(env!("OUT_DIR"), "/gpu_driver.skel.rs"));
}

use std::collections::HashSet;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle};

use super::hist::{Hist, HIST_BYTES};
use super::{err, handle, lookup_cgroup, percpu_sum, ProbeError, ProbeStatus};

pub const NAME: &str = "gpu_driver";

/// Mirrors of the constants in bpf/gpu_driver.bpf.c.
const GPU_FD_BITS: usize = 8192;
const GPU_FD_WORDS: usize = GPU_FD_BITS / 64;
const MAX_PREFIXES: usize = 4;
const PREFIX_LEN: usize = 64;
const O_CLOEXEC: u32 = 0o2000000;

/// The `cmd` label of each request class, in the kernel's slot order.
pub const CMD_CLASSES: [&str; 8] = [
    "other",
    "rm_control",
    "rm_alloc",
    "rm_free",
    "rm_map_memory",
    "rm_unmap_memory",
    "rm_vid_heap_control",
    "uvm",
];

/// Which files are GPU device files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDevices {
    /// Path prefixes matched when a file is opened (absolute paths as passed
    /// to open/openat; at most four, each shorter than 64 bytes).
    pub path_prefixes: Vec<String>,
    /// Character-device driver names in /proc/devices whose majors mark
    /// already open GPU files.
    pub driver_names: Vec<String>,
}

impl Default for GpuDevices {
    fn default() -> Self {
        GpuDevices {
            path_prefixes: vec!["/dev/nvidia".into()],
            driver_names: vec![
                "nvidia-frontend".into(),
                "nvidia-uvm".into(),
                "nvidia-caps".into(),
            ],
        }
    }
}

/// Majors of the named character-device drivers in /proc/devices text
/// ("Character devices:" section, lines "<major> <name>").
pub fn char_majors(proc_devices: &str, names: &[String]) -> Vec<u32> {
    let mut in_char = false;
    let mut out = Vec::new();
    for line in proc_devices.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            in_char = line == "Character devices:";
            continue;
        }
        if !in_char {
            continue;
        }
        if let Some((major, name)) = line.split_once(char::is_whitespace) {
            if names.iter().any(|n| n == name.trim()) {
                if let Ok(m) = major.parse::<u32>() {
                    if !out.contains(&m) {
                        out.push(m);
                    }
                }
            }
        }
    }
    out
}

/// One cgroup's driver time.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GpuDriverCgroup {
    /// ioctl durations per request class (index as [`CMD_CLASSES`]).
    pub ioctl: Vec<Hist>,
    /// Wall time during which at least one task of the cgroup was inside a
    /// GPU ioctl, including a call still in progress.
    pub busy_ns: u64,
}

const CGROUP_BYTES: usize = CMD_CLASSES.len() * HIST_BYTES + 3 * 8;

impl GpuDriverCgroup {
    /// Decodes `struct gpu_cgroup`; `now_ns` (CLOCK_MONOTONIC) closes an open
    /// busy interval at the moment of reading.
    pub fn from_bytes(b: &[u8], now_ns: u64) -> Option<GpuDriverCgroup> {
        if b.len() < CGROUP_BYTES {
            return None;
        }
        let ioctl = (0..CMD_CLASSES.len())
            .map(|i| Hist::from_bytes(&b[i * HIST_BYTES..]))
            .collect::<Option<Vec<_>>>()?;
        let word = |i: usize| {
            let at = CMD_CLASSES.len() * HIST_BYTES + i * 8;
            u64::from_ne_bytes(b[at..at + 8].try_into().unwrap())
        };
        let (closed, since, inflight) = (word(0), word(1), word(2) as i64);
        let open = if inflight > 0 {
            now_ns.saturating_sub(since)
        } else {
            0
        };
        Some(GpuDriverCgroup {
            ioctl,
            busy_ns: closed.saturating_add(open),
        })
    }
}

pub struct GpuDriverProbe {
    cgroups: MapHandle,
    fds: MapHandle,
    stats: MapHandle,
    majors: Vec<u32>,
    seeded: HashSet<i32>,
    _links: Vec<Link>,
}

/// Whether tracefs has the event `syscalls/<name>` (libbpf attaches per-syscall
/// tracepoints by the id it finds there).
fn syscall_event(name: &str) -> bool {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .any(|t| Path::new(&format!("{t}/events/syscalls/{name}/id")).exists())
}

impl GpuDriverProbe {
    /// Loads and attaches; `Ok(Err(status))` when the kernel lacks a hook.
    pub fn load(devices: &GpuDevices) -> Result<Result<GpuDriverProbe, ProbeStatus>, ProbeError> {
        let down = |reason: String| {
            Ok(Err(ProbeStatus {
                name: NAME,
                up: false,
                reason: Some(reason),
            }))
        };
        if devices.path_prefixes.len() > MAX_PREFIXES
            || devices
                .path_prefixes
                .iter()
                .any(|p| p.is_empty() || p.len() >= PREFIX_LEN)
        {
            return down(format!(
                "at most {MAX_PREFIXES} device path prefixes, each 1..{} bytes",
                PREFIX_LEN - 1
            ));
        }
        for needed in ["sys_enter_ioctl", "sys_exit_ioctl", "sys_enter_openat"] {
            if !syscall_event(needed) {
                return down(format!(
                    "no tracefs event syscalls/{needed} (tracefs not mounted or locked down)"
                ));
            }
        }
        let majors = std::fs::read_to_string("/proc/devices")
            .map(|t| char_majors(&t, &devices.driver_names))
            .unwrap_or_default();

        let mut storage = MaybeUninit::uninit();
        let mut open = skel::GpuDriverSkelBuilder::default()
            .open(&mut storage)
            .map_err(err(NAME, "open"))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.n_prefixes = devices.path_prefixes.len() as u32;
            for (i, p) in devices.path_prefixes.iter().enumerate() {
                ro.prefix_len[i] = p.len() as u32;
                for (j, b) in p.bytes().enumerate() {
                    ro.prefixes[i][j] = b as _;
                }
            }
        }
        // open(2) and openat2(2) are optional (arm64 has no open; openat2 is 5.6+)
        let has_open = syscall_event("sys_enter_open");
        let has_openat2 = syscall_event("sys_enter_openat2");
        open.progs.gpu_open_enter.set_autoload(has_open);
        open.progs.gpu_open_exit.set_autoload(has_open);
        open.progs.gpu_openat2_enter.set_autoload(has_openat2);
        open.progs.gpu_openat2_exit.set_autoload(has_openat2);
        let skel = open.load().map_err(err(NAME, "load"))?;
        let p = &skel.progs;
        let mut links = vec![
            p.gpu_ioctl_enter
                .attach()
                .map_err(err(NAME, "attach sys_enter_ioctl"))?,
            p.gpu_ioctl_exit
                .attach()
                .map_err(err(NAME, "attach sys_exit_ioctl"))?,
            p.gpu_openat_enter
                .attach()
                .map_err(err(NAME, "attach sys_enter_openat"))?,
            p.gpu_openat_exit
                .attach()
                .map_err(err(NAME, "attach sys_exit_openat"))?,
            p.gpu_close_enter
                .attach()
                .map_err(err(NAME, "attach sys_enter_close"))?,
            p.gpu_close_range_enter
                .attach()
                .map_err(err(NAME, "attach sys_enter_close_range"))?,
            p.gpu_exec
                .attach()
                .map_err(err(NAME, "attach sched_process_exec"))?,
            p.gpu_fork
                .attach()
                .map_err(err(NAME, "attach sched_process_fork"))?,
        ];
        if has_open {
            links.push(
                p.gpu_open_enter
                    .attach()
                    .map_err(err(NAME, "attach open"))?,
            );
            links.push(p.gpu_open_exit.attach().map_err(err(NAME, "attach open"))?);
        }
        if has_openat2 {
            links.push(
                p.gpu_openat2_enter
                    .attach()
                    .map_err(err(NAME, "attach openat2"))?,
            );
            links.push(
                p.gpu_openat2_exit
                    .attach()
                    .map_err(err(NAME, "attach openat2"))?,
            );
        }
        tracing::info!(?majors, prefixes = ?devices.path_prefixes, "GPU device files");
        Ok(Ok(GpuDriverProbe {
            cgroups: handle(NAME, &skel.maps.gpu_cgroup)?,
            fds: handle(NAME, &skel.maps.gpu_fds)?,
            stats: handle(NAME, &skel.maps.gpu_stats)?,
            majors,
            seeded: HashSet::new(),
            _links: links,
        }))
    }

    /// One cgroup's driver time, if any task of it ever called a GPU ioctl.
    pub fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<GpuDriverCgroup> {
        let now = monotonic_ns();
        lookup_cgroup(&self.cgroups, cgroup_dir)
            .ok()
            .flatten()
            .and_then(|b| GpuDriverCgroup::from_bytes(&b, now))
    }

    /// Seeds the processes in `tgids` not seen before, and forgets those no
    /// longer listed. Returns how many GPU fds were found.
    pub fn seed_new(&mut self, tgids: &HashSet<i32>) -> usize {
        self.seeded.retain(|t| tgids.contains(t));
        let mut found = 0;
        for &tgid in tgids {
            if self.seeded.insert(tgid) {
                found += self.seed(tgid).unwrap_or(0);
            }
        }
        found
    }

    /// Adds the GPU device files process `tgid` has open now to its bitmap in
    /// the kernel. Returns how many there are.
    pub fn seed(&self, tgid: i32) -> io::Result<usize> {
        let mut open = [0u64; GPU_FD_WORDS];
        let mut cloexec = [0u64; GPU_FD_WORDS];
        let mut n = 0;
        for e in std::fs::read_dir(format!("/proc/{tgid}/fd"))? {
            let Ok(e) = e else { continue };
            let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<usize>().ok()) else {
                continue;
            };
            // stat follows the link to the open file itself
            let Ok(md) = std::fs::metadata(e.path()) else {
                continue;
            };
            if !md.file_type().is_char_device()
                || !self.majors.contains(&libc::major(md.rdev()))
                || fd >= GPU_FD_BITS
            {
                continue;
            }
            open[fd / 64] |= 1 << (fd % 64);
            if fd_cloexec(tgid, fd) {
                cloexec[fd / 64] |= 1 << (fd % 64);
            }
            n += 1;
        }
        if n == 0 {
            return Ok(0);
        }
        let pidfd = pidfd_open(tgid)?;
        let key = pidfd.as_raw_fd().to_ne_bytes();
        // merge with what the kernel learned meanwhile
        if let Ok(Some(cur)) = self.fds.lookup(&key, MapFlags::ANY) {
            for (w, c) in cur.chunks_exact(8).enumerate() {
                let v = u64::from_ne_bytes(c.try_into().unwrap());
                if w < GPU_FD_WORDS {
                    open[w] |= v;
                } else if w < 2 * GPU_FD_WORDS {
                    cloexec[w - GPU_FD_WORDS] |= v;
                }
            }
        }
        let value: Vec<u8> = open
            .iter()
            .chain(cloexec.iter())
            .flat_map(|w| w.to_ne_bytes())
            .collect();
        self.fds
            .update(&key, &value, MapFlags::ANY)
            .map_err(|e| io::Error::other(e.to_string()))?;
        Ok(n)
    }

    /// (storage unavailable, fds learned at open, fds beyond the tracked
    /// range, calls that changed cgroup)
    pub fn kernel_stats(&self) -> [u64; 4] {
        [0, 1, 2, 3].map(|i| percpu_sum(&self.stats, i))
    }
}

/// Whether fd `fd` of `tgid` is close-on-exec (the "flags:" line of fdinfo, octal).
fn fd_cloexec(tgid: i32, fd: usize) -> bool {
    std::fs::read_to_string(format!("/proc/{tgid}/fdinfo/{fd}"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .is_some_and(|f| f & O_CLOEXEC != 0)
}

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// CLOCK_MONOTONIC in ns, the clock of bpf_ktime_get_ns().
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// /proc/devices as a host with the NVIDIA driver shows it.
    const PROC_DEVICES: &str = "Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  4 ttyS
195 nvidia-frontend
234 nvidia-uvm
237 nvidia-caps
238 nvidia-caps-imex-channels
254 gpiochip

Block devices:
  7 loop
195 nvidia-frontend
";

    #[test]
    fn majors_from_proc_devices() {
        let names = GpuDevices::default().driver_names;
        assert_eq!(char_majors(PROC_DEVICES, &names), vec![195, 234, 237]);
        assert_eq!(char_majors(PROC_DEVICES, &["ttyS".into()]), vec![4]);
        assert!(char_majors("garbage\n\0\n", &names).is_empty());
        assert!(char_majors("", &names).is_empty());
    }

    #[test]
    fn decode_cgroup_and_open_interval() {
        let mut b = vec![0u8; CGROUP_BYTES];
        // one call of 3 us in rm_control
        let at = HIST_BYTES + 2 * 8;
        b[at..at + 8].copy_from_slice(&1u64.to_ne_bytes());
        let base = CMD_CLASSES.len() * HIST_BYTES;
        b[base..base + 8].copy_from_slice(&5_000u64.to_ne_bytes());
        b[base + 8..base + 16].copy_from_slice(&1_000u64.to_ne_bytes());
        let c = GpuDriverCgroup::from_bytes(&b, 10_000).unwrap();
        assert_eq!(c.ioctl[1].count, 1);
        assert_eq!(c.busy_ns, 5_000, "no call in flight");
        b[base + 16..base + 24].copy_from_slice(&1i64.to_ne_bytes());
        let c = GpuDriverCgroup::from_bytes(&b, 10_000).unwrap();
        assert_eq!(c.busy_ns, 5_000 + 9_000, "open interval counted up to now");
        assert!(GpuDriverCgroup::from_bytes(&b[..CGROUP_BYTES - 1], 0).is_none());
    }
}
