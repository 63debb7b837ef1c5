//! GPU driver time per cgroup: ioctl() on GPU device files (`bpf/gpu_driver.bpf.c`).
//!
//! The kernel side learns which file descriptors are GPU device files when
//! they are opened. Processes that opened theirs before the agent started are
//! seeded from here: [`GpuDriverProbe::seed`] stats `/proc/<pid>/fd/*` against
//! the character-device majors of the configured drivers (read from
//! `/proc/devices`) and writes the process's bitmap through a pidfd.
//!
//! How the kernel side sees the calls depends on [`Hook`]. By default
//! ([`Hook::Uprobes`]) no syscall hook is attached at all: each pod process
//! that holds a GPU file gets uprobes on its C library's `ioctl()`,
//! `close()`, `dup2()`, `dup3()` and `close_range()`, filtered to that
//! process (found every tick: [`GpuProcessUnit::scan`]), so every other
//! process keeps its syscalls on the kernel's fast path.

mod skel {
    include!(concat!(env!("OUT_DIR"), "/gpu_driver.skel.rs"));
}

use std::collections::{HashMap, HashSet};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle, OpenObject};

use super::cgroup_storage::Storage;
use super::cuda::{attach_uprobe, find_libs, reachable};
use super::gpu_compute::{self, ComputeSeries, ComputeSource};
use super::gpu_process::{self, ComputeSlot, GpuProcessUnit, GpuProcesses};
use super::hist::{Hist, HIST_BYTES};
use super::options::OptionsSpec;
use super::per_cgroup::{CgroupSeries, Prepared};
use super::signal::{SignalKind, SignalSpec};
use super::status::ProbeStatus;
use super::tick::PodProcesses;
use super::unit::{
    Delta, FamilySpec, Kind, Labels, LoadContext, Loaded, Scope, SelfSeries, UnitSpec, Value,
};
use crate::ebpf::link_reaper::LinkReaper;
use crate::ebpf::{attach_all, decode, err, handle, percpu_sum, KernelBtf, ProbeError};

pub const NAME: &str = "gpu_driver";
pub const IOCTL: &str = "ebpf_gpu_ioctl_latency_microseconds";
/// Driver time: the compute time of the node's last-resort source (see `gpu_compute`).
pub const DRIVER_TIME: &str = "ebpf_gpu_driver_time_seconds_total";

pub const UNIT: UnitSpec = UnitSpec {
    names: &[NAME],
    reports: &[NAME],
    options: OptionsSpec::flags::<Config>(),
    load: load_unit,
};

/// Which hooks time the driver calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Hook {
    /// Uprobes.
    Auto,
    /// Uprobes on the C library's ioctl(), close(), dup2(), dup3() and
    /// close_range(), attached per process to the pod processes that hold a
    /// GPU file (found in /proc every tick): no cost to any other process or
    /// syscall. A GPU file is timed from the tick after it was opened.
    Uprobes,
    /// `syscalls:sys_{enter,exit}_ioctl` and the open/close ones: run only for
    /// those syscalls, attached by their tracefs ids.
    Syscalls,
    /// The BTF tracepoints `sys_enter`/`sys_exit`: no tracefs needed (it is
    /// gone under lockdown=confidentiality), but they run for every syscall.
    RawSyscalls,
}

/// What the unit takes from the command line.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "gpu_driver options")]
pub struct Config {
    #[command(flatten)]
    pub devices: GpuDevices,
    /// Hooks that time GPU driver calls: uprobes on the C library of the
    /// processes holding a GPU file (auto; no cost to other processes),
    /// per-syscall tracepoints (need tracefs), or the raw sys_enter/sys_exit
    /// BTF tracepoints (work under lockdown); both syscall hooks put every
    /// syscall of every task on the kernel's slow path.
    #[arg(
        long = "gpu-driver-hook",
        value_name = "GPU_DRIVER_HOOK",
        value_enum,
        default_value = "auto"
    )]
    pub hook: Hook,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            devices: GpuDevices::default(),
            hook: Hook::Auto,
        }
    }
}

const IOCTL_FAMILY: FamilySpec = FamilySpec {
    name: IOCTL,
    help: "Time in ioctl() on GPU device files (the driver), by request class",
    kind: Kind::Histogram,
    scope: Scope::Container,
    pod_labels: true,
};
const DRIVER_TIME_FAMILY: FamilySpec = FamilySpec {
    name: DRIVER_TIME,
    help: "Wall time during which at least one task of the container was inside a GPU driver ioctl",
    kind: Kind::SecondsCounter,
    scope: Scope::Container,
    pod_labels: true,
};

fn load_unit(ctx: &LoadContext<'_>, _names: &[&'static str]) -> Result<Loaded, ProbeError> {
    let cfg = ctx.options.get::<Config>();
    let loaded = GpuDriverProbe::load(&cfg.devices, cfg.hook, ctx.btf)?;
    Ok(Loaded::single(NAME, loaded))
}

/// Mapped file names that hold the C library's functions (glibc, musl); a
/// process that maps none is linked statically and has them in its executable.
const LIBC_NAMES: [&str; 3] = ["libc.so", "libc-", "ld-musl-"];

/// The limits and request classes of bpf/gpu_driver.h, generated from it by build.rs.
mod limits {
    #![allow(dead_code)] // every define of the header, used or not
    include!(concat!(env!("OUT_DIR"), "/gpu_driver.consts.rs"));
}
use limits::{
    CMD_SLOTS, GPU_FD_BITS, MAX_PREFIXES, PREFIX_LEN, STATS, STAT_CGROUP_MOVED, STAT_FD_LEARNED,
    STAT_FD_UNTRACKED, STAT_NO_STORAGE,
};
const GPU_FD_WORDS: usize = GPU_FD_BITS / 64;
/// The kernel's (the BPF side has its own copy: vmlinux.h carries no macros).
const O_CLOEXEC: u32 = 0o2000000;

/// The `cmd` label of each request class, in the kernel's slot order.
pub const CMD_CLASSES: [&str; CMD_SLOTS] = [
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
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
#[group(id = "gpu devices")]
pub struct GpuDevices {
    /// Path prefixes that make a file a GPU device file when it is opened
    /// (comma-separated; at most 4, each under 64 bytes).
    #[arg(
        long = "gpu-device-prefix",
        value_name = "PATH",
        value_delimiter = ',',
        default_values = ["/dev/nvidia"]
    )]
    pub path_prefixes: Vec<String>,
    /// Character-device drivers (comma-separated names in /proc/devices) whose
    /// files, already open when the agent starts, are GPU device files.
    #[arg(
        long = "gpu-driver-name",
        value_name = "NAME",
        value_delimiter = ',',
        default_values = ["nvidia-frontend", "nvidia-uvm", "nvidia-caps"]
    )]
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
    /// GPU ioctl, booked each time a task of the cgroup leaves one (so a
    /// pod whose calls overlap without a gap still shows its time). A busy interval
    /// still open is left out: userspace cannot read its start and the count
    /// of tasks inside as one consistent pair (a read between a first
    /// entrant's increment and its stamp would see the previous interval's
    /// start), and an overestimate now would have to be taken back later.
    pub busy_ns: u64,
}

// three counters and the activity epoch (bpf/cgroup_active.h)
const CGROUP_BYTES: usize = CMD_CLASSES.len() * HIST_BYTES + 4 * 8;

unsafe impl plain::Plain for skel::types::gpu_cgroup {}
const _: () = assert!(std::mem::size_of::<skel::types::gpu_cgroup>() == CGROUP_BYTES);
const _: () = assert!(std::mem::size_of::<skel::types::hist>() == HIST_BYTES);

impl GpuDriverCgroup {
    /// `self - earlier`: per-class histogram deltas and the busy time added.
    pub fn delta_since(&self, earlier: &GpuDriverCgroup) -> GpuDriverCgroup {
        GpuDriverCgroup {
            ioctl: self
                .ioctl
                .iter()
                .zip(&earlier.ioctl)
                .map(|(now, before)| now.delta_since(before))
                .collect(),
            // only ever added to while the cgroup lives
            busy_ns: self.busy_ns.saturating_sub(earlier.busy_ns),
        }
    }

    /// Decodes `struct gpu_cgroup`.
    pub fn from_bytes(b: &[u8]) -> Option<GpuDriverCgroup> {
        let c = decode::<skel::types::gpu_cgroup>(b)?;
        Some(GpuDriverCgroup {
            ioctl: c
                .ioctl
                .iter()
                .map(|h| Hist::from_parts(&h.buckets, h.sum_ns))
                .collect(),
            busy_ns: c.busy_ns,
        })
    }
}

/// A cgroup's driver time and ioctl latencies, and its compute time where
/// driver time is the node's compute source. A cgroup whose calls returned
/// while it stayed inside the driver (calls overlapping without a break: no
/// busy interval closed) computed throughout.
#[derive(Default)]
pub struct DriverSeries {
    compute: Option<ComputeSeries>,
}

impl ComputeSlot for DriverSeries {
    fn compute(&self) -> Option<&ComputeSeries> {
        self.compute.as_ref()
    }

    fn compute_mut(&mut self) -> &mut Option<ComputeSeries> {
        &mut self.compute
    }
}

impl CgroupSeries for DriverSeries {
    type Value = GpuDriverCgroup;

    fn decode(bytes: &[u8]) -> Option<GpuDriverCgroup> {
        GpuDriverCgroup::from_bytes(bytes)
    }

    fn delta(now: &GpuDriverCgroup, prev: &GpuDriverCgroup) -> GpuDriverCgroup {
        now.delta_since(prev)
    }

    fn deltas(
        &mut self,
        id: u64,
        _now: &GpuDriverCgroup,
        d: GpuDriverCgroup,
        out: &mut Vec<Delta>,
    ) {
        let returned = d.ioctl.iter().any(|h| !h.is_empty());
        if let Some(c) = self.compute.as_mut() {
            if returned && d.busy_ns == 0 {
                c.busy_throughout(id);
            }
            out.push(c.cgroup_delta(id, Labels::new(), d.busy_ns));
        }
        for (class, h) in CMD_CLASSES.iter().zip(d.ioctl) {
            if !h.is_empty() {
                out.push(Delta {
                    family: IOCTL,
                    labels: Labels::from([("cmd", class.to_string())]),
                    value: Value::Hist(h),
                });
            }
        }
        out.push(Delta {
            family: DRIVER_TIME,
            labels: Labels::new(),
            value: Value::Count(d.busy_ns),
        });
    }
}

pub struct GpuDriverProbe {
    // Uprobe mode attaches programs after load, per process: the skeleton
    // lives as long as the agent (one probe per agent; tests load a few).
    skel: &'static skel::GpuDriverSkel<'static>,
    mode: Mode,
    parts: GpuProcesses<DriverSeries>,
    fds: MapHandle,
    stats: MapHandle,
    majors: Vec<u32>,
    /// Processes seeded (in uprobe mode /proc/<pid>/fd is read again when the
    /// process may have mapped something: opening a GPU device comes with
    /// mapping it).
    seeded: HashSet<i32>,
    /// Uprobe mode: the links on each probed process's C library.
    probed: HashMap<i32, Vec<Link>>,
    /// Closes the links of processes that are gone, and all of them at the end.
    reaper: LinkReaper,
    _links: Vec<Link>,
}

impl Drop for GpuDriverProbe {
    fn drop(&mut self) {
        // together, rather than one after another as the map would drop them; the reaper,
        // dropped after this, waits for them
        self.reaper
            .release(self.probed.drain().flat_map(|(_, l)| l).collect());
    }
}

/// The hooks a loaded probe uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Uprobes,
    Syscalls,
    RawSyscalls,
}

impl Mode {
    /// The hooks of this mode, for `gpufeed_probe_info{hook}`.
    pub fn hooks(self) -> &'static str {
        match self {
            Mode::Uprobes => "uprobe libc ioctl/close/dup (per GPU process)",
            Mode::Syscalls => "tracepoint syscalls:sys_{enter,exit}_ioctl,openat,close",
            Mode::RawSyscalls => "tp_btf/sys_enter,sys_exit",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Uprobes => "uprobes",
            Mode::Syscalls => "syscalls",
            Mode::RawSyscalls => "raw_syscalls",
        }
    }
}

/// Whether tracefs has the event `syscalls/<name>` (libbpf attaches per-syscall
/// tracepoints by the id it finds there).
fn syscall_event(name: &str) -> bool {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .any(|t| Path::new(&format!("{t}/events/syscalls/{name}/id")).exists())
}

/// The C library functions probed per process: (symbol, program, return
/// probe, required).
const PROCESS_SYMBOLS: [(&str, ProcessProg, bool, bool); 6] = [
    ("ioctl", ProcessProg::Ioctl, false, true),
    ("ioctl", ProcessProg::IoctlRet, true, true),
    ("close", ProcessProg::Close, false, true),
    ("dup2", ProcessProg::Dup2, false, false),
    ("dup3", ProcessProg::Dup2, false, false),
    ("close_range", ProcessProg::CloseRange, false, false),
];

#[derive(Clone, Copy)]
enum ProcessProg {
    Ioctl,
    IoctlRet,
    Close,
    Dup2,
    CloseRange,
}

impl GpuDriverProbe {
    /// Loads and attaches; `Ok(Err(status))` when the kernel lacks a hook.
    pub fn load(
        devices: &GpuDevices,
        hook: Hook,
        btf: &KernelBtf,
    ) -> Result<Result<GpuDriverProbe, ProbeStatus>, ProbeError> {
        if devices.path_prefixes.len() > MAX_PREFIXES
            || devices
                .path_prefixes
                .iter()
                .any(|p| p.is_empty() || p.len() >= PREFIX_LEN)
        {
            return Ok(Err(ProbeStatus::down(
                NAME,
                format!(
                    "at most {MAX_PREFIXES} device path prefixes, each 1..{} bytes",
                    PREFIX_LEN - 1
                ),
            )));
        }
        let has_events = ["sys_enter_ioctl", "sys_exit_ioctl", "sys_enter_openat"]
            .iter()
            .all(|e| syscall_event(e));
        let has_raw = btf.has_tracepoint("sys_enter") && btf.has_tracepoint("sys_exit");
        let mode = match hook {
            Hook::Auto | Hook::Uprobes => Mode::Uprobes,
            Hook::Syscalls if has_events => Mode::Syscalls,
            Hook::RawSyscalls if has_raw => Mode::RawSyscalls,
            Hook::Syscalls => {
                return Ok(Err(ProbeStatus::down(
                    NAME,
                    "no tracefs events syscalls/sys_{enter,exit}_ioctl (tracefs not mounted, or removed by lockdown)",
                )))
            }
            Hook::RawSyscalls => {
                return Ok(Err(ProbeStatus::down(
                    NAME,
                    "no BTF tracepoints sys_enter/sys_exit",
                )))
            }
        };
        let majors = std::fs::read_to_string("/proc/devices")
            .map(|t| char_majors(&t, &devices.driver_names))
            .unwrap_or_default();

        let probe = gpu_process::load_first(mode.hooks(), |storage| {
            GpuDriverProbe::load_with(devices, mode, btf, majors.clone(), storage)
        })?;
        Ok(Ok(probe))
    }

    fn load_with(
        devices: &GpuDevices,
        mode: Mode,
        btf: &KernelBtf,
        majors: Vec<u32>,
        storage: Storage,
    ) -> Result<GpuDriverProbe, ProbeError> {
        let mem: &'static mut MaybeUninit<OpenObject> = Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = skel::GpuDriverSkelBuilder::default()
            .open(mem)
            .map_err(err(NAME, "open"))?;
        let rmdir = btf.has_tracepoint("cgroup_rmdir");
        let values = Prepared::new(NAME, "gpu_cgroup", storage, rmdir, open.open_object_mut())?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.cgroup_storage_by_id = storage.by_id();
            ro.n_prefixes = devices.path_prefixes.len() as u32;
            for (i, p) in devices.path_prefixes.iter().enumerate() {
                ro.prefix_len[i] = p.len() as u32;
                for (j, b) in p.bytes().enumerate() {
                    ro.prefixes[i][j] = b as _;
                }
            }
        }
        let per_syscall = mode == Mode::Syscalls;
        let uprobes = mode == Mode::Uprobes;
        // open(2) and openat2(2) are optional (arm64 has no open; openat2 is 5.6+)
        let has_open = per_syscall && syscall_event("sys_enter_open");
        let has_openat2 = per_syscall && syscall_event("sys_enter_openat2");
        let p = &mut open.progs;
        for prog in [
            &mut p.gpu_ioctl_enter,
            &mut p.gpu_ioctl_exit,
            &mut p.gpu_openat_enter,
            &mut p.gpu_openat_exit,
            &mut p.gpu_close_enter,
            &mut p.gpu_close_range_enter,
        ] {
            prog.set_autoload(per_syscall);
        }
        p.gpu_open_enter.set_autoload(has_open);
        p.gpu_open_exit.set_autoload(has_open);
        p.gpu_openat2_enter.set_autoload(has_openat2);
        p.gpu_openat2_exit.set_autoload(has_openat2);
        p.gpu_sys_enter.set_autoload(mode == Mode::RawSyscalls);
        p.gpu_sys_exit.set_autoload(mode == Mode::RawSyscalls);
        for prog in [
            &mut p.gpu_uprobe_ioctl,
            &mut p.gpu_uretprobe_ioctl,
            &mut p.gpu_uprobe_close,
            &mut p.gpu_uprobe_dup2,
            &mut p.gpu_uprobe_close_range,
            &mut p.gpu_thread_exit,
        ] {
            prog.set_autoload(uprobes);
        }
        let skel = crate::ebpf::object::load(NAME, open)?;
        let skel: &'static skel::GpuDriverSkel<'static> = Box::leak(Box::new(skel));
        let p = &skel.progs;
        let mut progs = vec![
            (&p.gpu_exec, "sched_process_exec"),
            (&p.gpu_fork, "sched_process_fork"),
        ];
        match mode {
            Mode::Uprobes => progs.push((&p.gpu_thread_exit, "sched_process_exit")),
            Mode::Syscalls => {
                progs.extend([
                    (&p.gpu_ioctl_enter, "sys_enter_ioctl"),
                    (&p.gpu_ioctl_exit, "sys_exit_ioctl"),
                    (&p.gpu_openat_enter, "sys_enter_openat"),
                    (&p.gpu_openat_exit, "sys_exit_openat"),
                    (&p.gpu_close_enter, "sys_enter_close"),
                    (&p.gpu_close_range_enter, "sys_enter_close_range"),
                ]);
                if has_open {
                    progs.extend([
                        (&p.gpu_open_enter, "sys_enter_open"),
                        (&p.gpu_open_exit, "sys_exit_open"),
                    ]);
                }
                if has_openat2 {
                    progs.extend([
                        (&p.gpu_openat2_enter, "sys_enter_openat2"),
                        (&p.gpu_openat2_exit, "sys_exit_openat2"),
                    ]);
                }
            }
            Mode::RawSyscalls => progs.extend([
                (&p.gpu_sys_enter, "sys_enter"),
                (&p.gpu_sys_exit, "sys_exit"),
            ]),
        }
        let links = attach_all(NAME, progs)?;
        tracing::info!(
            hook = mode.name(),
            ?majors,
            prefixes = ?devices.path_prefixes,
            "GPU driver time"
        );
        Ok(GpuDriverProbe {
            skel,
            mode,
            parts: GpuProcesses::new(NAME, values.reader(skel.object(), DriverSeries::default())?),
            fds: handle(NAME, &skel.maps.gpu_fds)?,
            stats: handle(NAME, &skel.maps.gpu_stats)?,
            majors,
            seeded: HashSet::new(),
            probed: HashMap::new(),
            reaper: LinkReaper::new("gpu-driver-links"),
            _links: links,
        })
    }

    /// The hooks in use.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Processes whose C library carries the uprobes now (uprobe mode).
    pub fn probed(&self) -> usize {
        self.probed.len()
    }

    /// Attaches the per-process uprobes to the C library functions process
    /// `tgid` calls: its C library's, or its executable's when it is linked
    /// statically.
    fn probe_process(&self, tgid: i32) -> Result<Vec<Link>, String> {
        let maps = std::fs::read_to_string(format!("/proc/{tgid}/maps"))
            .map_err(|e| format!("maps: {e}"))?;
        let libc = LIBC_NAMES
            .iter()
            .find_map(|name| find_libs(&maps, name).into_iter().next());
        let path = match libc {
            Some(lib) => {
                reachable(tgid, &lib)
                    .ok_or_else(|| format!("{} not reachable through /proc/<pid>/root", lib.path))?
                    .0
            }
            None => PathBuf::from(format!("/proc/{tgid}/exe")),
        };
        let progs = &self.skel.progs;
        let mut links = Vec::new();
        for (sym, prog, ret, required) in PROCESS_SYMBOLS {
            let prog = match prog {
                ProcessProg::Ioctl => &progs.gpu_uprobe_ioctl,
                ProcessProg::IoctlRet => &progs.gpu_uretprobe_ioctl,
                ProcessProg::Close => &progs.gpu_uprobe_close,
                ProcessProg::Dup2 => &progs.gpu_uprobe_dup2,
                ProcessProg::CloseRange => &progs.gpu_uprobe_close_range,
            };
            match attach_uprobe(prog, tgid, &path, sym, ret) {
                Ok(l) => links.push(l),
                Err(e) if required => return Err(format!("{}: {e}", path.display())),
                // a static executable links only what it calls
                Err(_) => {}
            }
        }
        tracing::debug!(tgid, path = %path.display(), "GPU driver time: process probed");
        Ok(links)
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
    pub fn kernel_stats(&self) -> [u64; STATS] {
        [
            STAT_NO_STORAGE,
            STAT_FD_LEARNED,
            STAT_FD_UNTRACKED,
            STAT_CGROUP_MOVED,
        ]
        .map(|i| percpu_sum(&self.stats, i as u32))
    }
}

impl GpuProcessUnit for GpuDriverProbe {
    type Series = DriverSeries;
    const NAME: &'static str = NAME;
    const FAMILIES: &'static [FamilySpec] = &[IOCTL_FAMILY, DRIVER_TIME_FAMILY];
    /// When driver time is the node's compute time (no better source).
    const FAMILIES_COMPUTE: &'static [FamilySpec] = &[
        IOCTL_FAMILY,
        DRIVER_TIME_FAMILY,
        gpu_compute::COMPUTE_FAMILY,
        gpu_compute::DUTY_FAMILY,
    ];
    const SIGNAL: SignalSpec = SignalSpec {
        name: "gpu_ioctl",
        family: IOCTL,
        kind: SignalKind::Latency,
    };

    fn parts(&self) -> &GpuProcesses<DriverSeries> {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut GpuProcesses<DriverSeries> {
        &mut self.parts
    }

    fn source(&self) -> Option<ComputeSource> {
        Some(ComputeSource::DriverTime)
    }

    fn forget(&mut self, tgids: &PodProcesses) {
        self.seeded.retain(|&t| tgids.contains(t));
        let mut links = Vec::new();
        self.probed.retain(|&t, l| {
            let running = tgids.contains(t);
            if !running {
                links.append(l);
            }
            running
        });
        self.reaper.release(links);
    }

    /// Seeds the processes not seen before. In uprobe mode a process is
    /// looked at again whenever it may have mapped something, and one found
    /// holding a GPU file gets the uprobes on its C library. Returns how many
    /// GPU fds were found.
    fn look_at(
        &mut self,
        tgids: impl Iterator<Item = i32>,
        changed: Option<&HashSet<i32>>,
    ) -> usize {
        let mut found = 0;
        for tgid in tgids {
            let new = self.seeded.insert(tgid);
            if self.mode != Mode::Uprobes {
                if new {
                    found += self.seed(tgid).unwrap_or(0);
                }
                continue;
            }
            if !self.parts.lookout.look(tgid, changed) {
                continue;
            }
            let n = self.seed(tgid).unwrap_or(0);
            found += n;
            if n > 0 && !self.probed.contains_key(&tgid) {
                match self.probe_process(tgid) {
                    Ok(links) => {
                        self.probed.insert(tgid, links);
                    }
                    Err(e) => tracing::warn!(tgid, "GPU driver time: {e}"),
                }
            }
        }
        found
    }

    fn self_series(&self) -> (u64, Vec<SelfSeries>) {
        let [failures, learned, untracked, moved] = self.kernel_stats();
        (failures, vec![
            SelfSeries::counter("gpufeed_gpu_fds_learned_total", "GPU device files the kernel saw being opened", learned),
            SelfSeries::counter("gpufeed_gpu_fds_untracked_total", "GPU device files opened at an fd number too high to track (not timed)", untracked),
            SelfSeries::gauge("gpufeed_gpu_ioctl_processes_probed", "Processes whose C library carries the GPU driver time uprobes (uprobe mode)", self.probed.len() as f64),
            SelfSeries::counter("gpufeed_gpu_ioctl_cgroup_moves_total", "GPU ioctls that ended in another cgroup than they began (timed, not counted busy)", moved),
        ])
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
    fn the_command_line_defaults_are_the_default_devices_and_lists_split_at_commas() {
        use clap::{Args, FromArgMatches};
        let parse = |args: &[&str]| {
            let cmd = GpuDevices::augment_args(clap::Command::new("t").no_binary_name(true));
            GpuDevices::from_arg_matches(&cmd.try_get_matches_from(args).unwrap()).unwrap()
        };
        assert_eq!(parse(&[]), GpuDevices::default());
        let given = parse(&["--gpu-driver-name", "a,b", "--gpu-device-prefix", "/dev/x"]);
        assert_eq!(given.driver_names, ["a", "b"]);
        assert_eq!(given.path_prefixes, ["/dev/x"]);
    }

    #[test]
    fn majors_from_proc_devices() {
        let names = GpuDevices::default().driver_names;
        assert_eq!(char_majors(PROC_DEVICES, &names), vec![195, 234, 237]);
        assert_eq!(char_majors(PROC_DEVICES, &["ttyS".into()]), vec![4]);
        assert!(char_majors("garbage\n\0\n", &names).is_empty());
        assert!(char_majors("", &names).is_empty());
    }

    #[test]
    fn decode_cgroup_and_busy_deltas() {
        let mut b = vec![0u8; CGROUP_BYTES];
        // one call of 3 us in rm_control
        let at = HIST_BYTES + 2 * 8;
        b[at..at + 8].copy_from_slice(&1u64.to_ne_bytes());
        let base = CMD_CLASSES.len() * HIST_BYTES;
        b[base..base + 8].copy_from_slice(&5_000u64.to_ne_bytes());
        b[base + 8..base + 16].copy_from_slice(&1_000u64.to_ne_bytes());
        let c = GpuDriverCgroup::from_bytes(&b).unwrap();
        assert_eq!(c.ioctl[1].count, 1);
        assert_eq!(c.busy_ns, 5_000);
        // a call in flight adds nothing until it ends
        b[base + 16..base + 24].copy_from_slice(&1i64.to_ne_bytes());
        let open = GpuDriverCgroup::from_bytes(&b).unwrap();
        assert_eq!(open.busy_ns, 5_000);
        assert_eq!(open.delta_since(&c).busy_ns, 0);
        b[base..base + 8].copy_from_slice(&12_000u64.to_ne_bytes());
        let closed = GpuDriverCgroup::from_bytes(&b).unwrap();
        let d = closed.delta_since(&open);
        assert_eq!(d.busy_ns, 7_000);
        assert_eq!(d.ioctl[1].count, 0, "no new call in the delta");
        assert!(GpuDriverCgroup::from_bytes(&b[..CGROUP_BYTES - 1]).is_none());
    }
}
