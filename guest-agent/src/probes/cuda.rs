//! CUDA driver API per cgroup by uprobes on `libcuda.so` (`bpf/cuda.bpf.c`):
//! device memory reserved, host↔device copy bytes, time blocked in the
//! synchronisation calls, kernel launches.
//!
//! Each container brings its own copy of the library (or bind-mounts the
//! host's). [`CudaProbe::scan`] finds it in `/proc/<pid>/maps`, opens it
//! through `/proc/<pid>/root`, and attaches once per distinct file (device,
//! inode): a uprobe binds to the file, not to a process, so one attach covers
//! every process that maps it, now or later.

mod skel {
    include!(concat!(env!("OUT_DIR"), "/cuda.skel.rs"));
}

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapHandle, OpenObject, ProgramMut, UprobeOpts};

use super::cgroup_storage::Storage;
use super::gpu_compute::{self, ComputeSeries, ComputeSource};
use super::gpu_process::{self, ComputeSlot, GpuProcessUnit, GpuProcesses};
use super::hist::Hist;
use super::options::OptionsSpec;
use super::per_cgroup::{CgroupSeries, Prepared};
use super::signal::{SignalKind, SignalSpec};
use super::status::ProbeStatus;
use super::tick::PodProcesses;
use super::unit::{
    no_labels, Delta, FamilySpec, GaugeValue, Kind, Labels, LoadContext, Loaded, Scope, SelfSeries,
    TickContext, UnitSpec, Value,
};
use crate::ebpf::{decode, err, handle, percpu_sum, KernelBtf, ProbeError};
use crate::owner::Owner;

/// The counters of bpf/cuda.h, generated from it by build.rs.
mod limits {
    include!(concat!(env!("OUT_DIR"), "/cuda.consts.rs"));
}

pub const NAME: &str = "cuda";
pub const VRAM: &str = "ebpf_gpu_vram_reserved_bytes";
pub const PCIE: &str = "ebpf_gpu_pcie_bytes_total";
pub const LAUNCHES: &str = "ebpf_gpu_kernel_launches_total";
pub const BUSY: &str = "ebpf_gpu_busy_estimate_seconds_total";
pub const SYNC_WAIT: &str = "ebpf_gpu_sync_wait_microseconds";
pub const FEED_STALL: &str = "gpufeed_gpu_feed_stall_seconds_total";

/// The label of the probes' raw feed-stall parts in the store (never on /metrics).
pub const FEED_PART: &str = "part";

/// The probes' raw feed-stall account of a cgroup, as the store keeps it under [`FEED_STALL`]
/// (labelled [`FEED_PART`]); the join splits it by cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedPart {
    /// Stall while the feeding thread waited on a run queue, ns.
    Cpu,
    /// Stall of any cause, ns.
    All,
    /// Time in synchronous host-to-device copies, ns.
    CopyNs,
    /// The bytes of those copies.
    CopyBytes,
}

impl FeedPart {
    pub const ALL: [FeedPart; 4] = [
        FeedPart::Cpu,
        FeedPart::All,
        FeedPart::CopyNs,
        FeedPart::CopyBytes,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FeedPart::Cpu => "cpu",
            FeedPart::All => "all",
            FeedPart::CopyNs => "h2d_copy_ns",
            FeedPart::CopyBytes => "h2d_copy_bytes",
        }
    }
}

pub const UNIT: UnitSpec = UnitSpec {
    names: &[NAME],
    reports: &[NAME],
    options: OptionsSpec::flags::<CudaOptions>(),
    load: load_unit,
};

const VRAM_FAMILY: FamilySpec = FamilySpec {
    name: VRAM,
    help: "GPU memory the container's processes hold through the CUDA driver API (allocations and VMM physical allocations)",
    kind: Kind::Gauge,
    scope: Scope::Container,
    pod_labels: true,
};
const PCIE_FAMILY: FamilySpec = FamilySpec {
    name: PCIE,
    help: "Bytes copied between host and GPU by the pod through the CUDA driver API, by direction (h2d, d2h; unified-address copies by what the agent knows of the addresses)",
    kind: Kind::Counter,
    scope: Scope::Pod,
    pod_labels: true,
};
const LAUNCHES_FAMILY: FamilySpec = FamilySpec {
    name: LAUNCHES,
    help: "CUDA kernel and graph launches (cuLaunchKernel, cuLaunchKernelEx, cuGraphLaunch: a graph counts once; counted only with --cuda-launches)",
    kind: Kind::Counter,
    scope: Scope::Container,
    pod_labels: true,
};
const BUSY_FAMILY: FamilySpec = FamilySpec {
    name: BUSY,
    help: "Wall time during which a stream of the container's processes had launched work not yet seen complete by a synchronisation or query (an upper bound of GPU busy time; only with --cuda-launches)",
    kind: Kind::SecondsCounter,
    scope: Scope::Container,
    pod_labels: true,
};
const SYNC_WAIT_FAMILY: FamilySpec = FamilySpec {
    name: SYNC_WAIT,
    help: "Time a thread of the container blocked in cuStreamSynchronize, cuCtxSynchronize or cuEventSynchronize (waiting for the GPU)",
    kind: Kind::Histogram,
    scope: Scope::Container,
    pod_labels: true,
};
const FEED_STALL_FAMILY: FamilySpec = FamilySpec {
    name: FEED_STALL,
    help: "Seconds the pod's GPU sat idle while a thread feeding it was running or waiting to run (between a call that saw the pod's last GPU work done and that thread's next launch), by cause: cpu (the thread waited on a run queue), pcie_link (host-to-device copies slower than the degraded host link's full speed), host_event (within a host event's window: AER, link down, VM stopped), unexplained (the rest); only with --cuda-launches on kernels with sched_info (docs/metrics.md)",
    kind: Kind::SecondsCounter,
    scope: Scope::Pod,
    pod_labels: true,
};
fn load_unit(ctx: &LoadContext<'_>, _names: &[&'static str]) -> Result<Loaded, ProbeError> {
    Ok(Loaded::single(
        NAME,
        CudaProbe::load(ctx.options.get::<CudaOptions>().clone(), ctx.btf)?,
    ))
}

/// What to probe: the unit's part of the command line.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
#[group(id = "cuda options")]
pub struct CudaOptions {
    // maps shows the resolved name, e.g. `libcuda.so.550.54.15`
    /// Mapped files whose name starts with this are the CUDA driver library.
    #[arg(
        long = "cuda-library-prefix",
        value_name = "CUDA_LIBRARY_PREFIX",
        default_value = "libcuda.so"
    )]
    pub library_prefix: String,
    // Also estimates busy time from launch to completion (uprobes on
    // cuEventRecord and the stream and event queries too; the
    // synchronisation calls, timed always, then also close busy intervals).
    /// Count CUDA kernel and graph launches (uprobes on cuLaunchKernel(Ex) and cuGraphLaunch, the hot launch path).
    #[arg(long = "cuda-launches")]
    pub launches: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            library_prefix: "libcuda.so".into(),
            launches: false,
        }
    }
}

/// One cgroup's CUDA numbers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CudaCgroup {
    /// Device memory its processes hold now (signed: memory allocated before
    /// the probe attached and freed after shows as a negative contribution).
    pub vram_bytes: i64,
    /// Time blocked in the synchronisation calls, per call.
    pub sync_wait: Hist,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub launches: u64,
    /// Closed busy-estimate intervals (launch to seen complete), merged over
    /// the cgroup's streams; an interval still open is left out.
    pub busy_ns: u64,
    /// Feed stall while the feeding thread waited on a run queue.
    pub feed_cpu_ns: u64,
    /// All feed stall (the GPU idle while a thread fed it), any cause.
    pub feed_idle_ns: u64,
    /// Time in synchronous host-to-device copies (entry to return), and their bytes.
    pub h2d_copy_ns: u64,
    pub h2d_copy_bytes: u64,
}

unsafe impl plain::Plain for skel::types::cuda_cgroup {}

impl CudaCgroup {
    /// Decodes `struct cuda_cgroup`.
    pub fn from_bytes(b: &[u8]) -> Option<CudaCgroup> {
        let c = decode::<skel::types::cuda_cgroup>(b)?;
        Some(CudaCgroup {
            vram_bytes: c.vram_bytes,
            h2d_bytes: c.h2d_bytes,
            d2h_bytes: c.d2h_bytes,
            launches: c.launches,
            busy_ns: c.busy_ns,
            feed_cpu_ns: c.feed_cpu_ns,
            feed_idle_ns: c.feed_idle_ns,
            h2d_copy_ns: c.h2d_copy_ns,
            h2d_copy_bytes: c.h2d_copy_bytes,
            sync_wait: Hist::from_parts(&c.sync_wait.buckets, c.sync_wait.sum_ns),
        })
    }

    /// Counter deltas since `earlier` (a counter that went backwards is a new
    /// storage instance: all of it is new); the VRAM gauge is taken as is.
    pub fn delta_since(&self, earlier: &CudaCgroup) -> CudaCgroup {
        let d = |now: u64, before: u64| if now >= before { now - before } else { now };
        CudaCgroup {
            vram_bytes: self.vram_bytes,
            h2d_bytes: d(self.h2d_bytes, earlier.h2d_bytes),
            d2h_bytes: d(self.d2h_bytes, earlier.d2h_bytes),
            launches: d(self.launches, earlier.launches),
            busy_ns: d(self.busy_ns, earlier.busy_ns),
            feed_cpu_ns: d(self.feed_cpu_ns, earlier.feed_cpu_ns),
            feed_idle_ns: d(self.feed_idle_ns, earlier.feed_idle_ns),
            h2d_copy_ns: d(self.h2d_copy_ns, earlier.h2d_copy_ns),
            h2d_copy_bytes: d(self.h2d_copy_bytes, earlier.h2d_copy_bytes),
            sync_wait: self.sync_wait.delta_since(&earlier.sync_wait),
        }
    }
}

/// Which program handles a symbol, and whether at entry or at return.
#[derive(Clone, Copy)]
enum Prog {
    Alloc,
    AllocManaged,
    AllocAsync,
    AllocPitch,
    Create,
    Import,
    AllocRet,
    Free,
    FreeAsync,
    Release,
    Map,
    Unmap,
    HtoD,
    HtoDSync,
    CopyRet,
    DtoH,
    Memcpy,
    Launch,
    LaunchPtsz,
    LaunchEx,
    LaunchExPtsz,
    GraphLaunch,
    GraphLaunchPtsz,
    EventRecord,
    EventRecordPtsz,
    StreamSync,
    StreamSyncPtsz,
    StreamQuery,
    StreamQueryPtsz,
    CtxSync,
    EventSync,
    EventQuery,
    SyncRet,
}

/// The driver API functions probed: (symbol, entry program, the program at
/// its return if any, whether it belongs to the launch set that
/// `--cuda-launches` turns on). The synchronisation calls are outside that
/// set: a process makes a few per step, and their wait is the latency
/// signal a pod feels when the GPU is slow. Signatures are in bpf/cuda.bpf.c.
///
/// A program built with `CUDA_API_PER_THREAD_DEFAULT_STREAM` (PyTorch,
/// among others) calls the `_ptds`/`_ptsz` exports instead (cuda.h's
/// `__CUDA_API_PTDS`/`__CUDA_API_PTSZ`): the same arguments, except that
/// stream 0 is the calling thread's default stream. Where the stream does not
/// matter to a program the variant shares its base call's program; the
/// stream-keyed ones have a `_ptsz` program of their own.
const SYMBOLS: &[(&str, Prog, Option<Prog>, bool)] = &[
    ("cuMemAlloc_v2", Prog::Alloc, Some(Prog::AllocRet), false),
    (
        "cuMemAllocManaged",
        Prog::AllocManaged,
        Some(Prog::AllocRet),
        false,
    ),
    (
        "cuMemAllocAsync",
        Prog::AllocAsync,
        Some(Prog::AllocRet),
        false,
    ),
    (
        "cuMemAllocAsync_ptsz",
        Prog::AllocAsync,
        Some(Prog::AllocRet),
        false,
    ),
    // (dptr, bytesize, pool, stream): the allocation's arguments come first
    (
        "cuMemAllocFromPoolAsync",
        Prog::AllocAsync,
        Some(Prog::AllocRet),
        false,
    ),
    (
        "cuMemAllocFromPoolAsync_ptsz",
        Prog::AllocAsync,
        Some(Prog::AllocRet),
        false,
    ),
    (
        "cuMemAllocPitch_v2",
        Prog::AllocPitch,
        Some(Prog::AllocRet),
        false,
    ),
    ("cuMemCreate", Prog::Create, Some(Prog::AllocRet), false),
    (
        "cuMemImportFromShareableHandle",
        Prog::Import,
        Some(Prog::AllocRet),
        false,
    ),
    ("cuMemFree_v2", Prog::Free, None, false),
    ("cuMemFreeAsync", Prog::FreeAsync, None, false),
    ("cuMemFreeAsync_ptsz", Prog::FreeAsync, None, false),
    ("cuMemRelease", Prog::Release, None, false),
    ("cuMemMap", Prog::Map, None, false),
    ("cuMemUnmap", Prog::Unmap, None, false),
    (
        "cuMemcpyHtoD_v2",
        Prog::HtoDSync,
        Some(Prog::CopyRet),
        false,
    ),
    (
        "cuMemcpyHtoD_v2_ptds",
        Prog::HtoDSync,
        Some(Prog::CopyRet),
        false,
    ),
    ("cuMemcpyHtoDAsync_v2", Prog::HtoD, None, false),
    ("cuMemcpyHtoDAsync_v2_ptsz", Prog::HtoD, None, false),
    ("cuMemcpyDtoH_v2", Prog::DtoH, None, false),
    ("cuMemcpyDtoH_v2_ptds", Prog::DtoH, None, false),
    ("cuMemcpyDtoHAsync_v2", Prog::DtoH, None, false),
    ("cuMemcpyDtoHAsync_v2_ptsz", Prog::DtoH, None, false),
    ("cuMemcpy", Prog::Memcpy, None, false),
    ("cuMemcpy_ptds", Prog::Memcpy, None, false),
    ("cuMemcpyAsync", Prog::Memcpy, None, false),
    ("cuMemcpyAsync_ptsz", Prog::Memcpy, None, false),
    ("cuLaunchKernel", Prog::Launch, None, true),
    ("cuLaunchKernel_ptsz", Prog::LaunchPtsz, None, true),
    ("cuLaunchKernelEx", Prog::LaunchEx, None, true),
    ("cuLaunchKernelEx_ptsz", Prog::LaunchExPtsz, None, true),
    ("cuGraphLaunch", Prog::GraphLaunch, None, true),
    ("cuGraphLaunch_ptsz", Prog::GraphLaunchPtsz, None, true),
    ("cuEventRecord", Prog::EventRecord, None, true),
    ("cuEventRecord_ptsz", Prog::EventRecordPtsz, None, true),
    (
        "cuStreamSynchronize",
        Prog::StreamSync,
        Some(Prog::SyncRet),
        false,
    ),
    (
        "cuStreamSynchronize_ptsz",
        Prog::StreamSyncPtsz,
        Some(Prog::SyncRet),
        false,
    ),
    (
        "cuStreamQuery",
        Prog::StreamQuery,
        Some(Prog::SyncRet),
        true,
    ),
    (
        "cuStreamQuery_ptsz",
        Prog::StreamQueryPtsz,
        Some(Prog::SyncRet),
        true,
    ),
    (
        "cuCtxSynchronize",
        Prog::CtxSync,
        Some(Prog::SyncRet),
        false,
    ),
    (
        "cuEventSynchronize",
        Prog::EventSync,
        Some(Prog::SyncRet),
        false,
    ),
    ("cuEventQuery", Prog::EventQuery, Some(Prog::SyncRet), true),
];

/// A mapped library as /proc/<pid>/maps names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedLib {
    /// (major, minor) of the filesystem and inode, from the maps line.
    pub dev: (u32, u32),
    pub inode: u64,
    /// The path as the process sees it.
    pub path: String,
}

/// Mapped files in /proc/<pid>/maps text whose name starts with `prefix`.
/// Lines: `start-end perms offset major:minor inode path`.
pub fn find_libs(maps: &str, prefix: &str) -> Vec<MappedLib> {
    let mut out: Vec<MappedLib> = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(_), Some(_), Some(_), Some(dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let path = f.collect::<Vec<_>>().join(" ");
        let name = path.rsplit('/').next().unwrap_or("");
        if !path.starts_with('/') || !name.starts_with(prefix) || path.ends_with("(deleted)") {
            continue;
        }
        let Some((maj, min)) = dev.split_once(':') else {
            continue;
        };
        let (Ok(maj), Ok(min), Ok(inode)) = (
            u32::from_str_radix(maj, 16),
            u32::from_str_radix(min, 16),
            inode.parse::<u64>(),
        ) else {
            continue;
        };
        let lib = MappedLib {
            dev: (maj, min),
            inode,
            path,
        };
        if !out.contains(&lib) {
            out.push(lib);
        }
    }
    out
}

pub struct CudaProbe {
    // Programs must stay attachable after load, for libraries found later:
    // the skeleton is leaked once (one probe per agent).
    skel: &'static skel::CudaSkel<'static>,
    _links: Vec<Link>,
    parts: GpuProcesses<CudaSeries>,
    stats: MapHandle,
    opts: CudaOptions,
    /// Library files already attached, by (dev, inode), and their links.
    attached: HashMap<(u64, u64), Vec<Link>>,
    /// Processes whose maps held the library (not scanned again; the others'
    /// maps are read again only when they may have mapped it).
    done: HashSet<i32>,
}

impl CudaProbe {
    pub fn load(
        opts: CudaOptions,
        btf: &KernelBtf,
    ) -> Result<Result<CudaProbe, ProbeStatus>, ProbeError> {
        let probe = gpu_process::load_first("uprobe libcuda.so.1 (per library file)", |storage| {
            CudaProbe::load_with(opts.clone(), btf, storage)
        })?;
        Ok(Ok(probe))
    }

    fn load_with(
        opts: CudaOptions,
        btf: &KernelBtf,
        storage: Storage,
    ) -> Result<CudaProbe, ProbeError> {
        let mem: &'static mut MaybeUninit<OpenObject> = Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = skel::CudaSkelBuilder::default()
            .open(mem)
            .map_err(err(NAME, "open"))?;
        let rmdir = btf.has_tracepoint("cgroup_rmdir");
        let values = Prepared::new(NAME, "cuda_cgroup", storage, rmdir, open.open_object_mut())?;
        // the feed stall reads the scheduler's own per-task run-queue account
        let feed_stall = opts.launches && btf.has_member("task_struct", "sched_info");
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.busy_estimate = opts.launches;
            ro.feed_stall = feed_stall;
            ro.cgroup_storage_by_id = storage.by_id();
        }
        let skel = crate::ebpf::object::load(NAME, open)?;
        let links = crate::ebpf::attach_all(NAME, [(&skel.progs.cuda_exit, "sched_process_exit")])?;
        let skel: &'static skel::CudaSkel<'static> = Box::leak(Box::new(skel));
        let series = CudaSeries {
            launches: opts.launches,
            feed_stall,
            vram: HashMap::new(),
            compute: None,
        };
        Ok(CudaProbe {
            _links: links,
            parts: GpuProcesses::new(NAME, values.reader(skel.object(), series)?),
            stats: handle(NAME, &skel.maps.cuda_stats)?,
            skel,
            opts,
            attached: HashMap::new(),
            done: HashSet::new(),
        })
    }

    /// Attaches to one mapped library unless its file is attached already.
    fn attach_file(&mut self, tgid: i32, lib: &MappedLib) -> Result<bool, String> {
        let Some((path, key)) = reachable(tgid, lib) else {
            return Err("mapped library not reachable through /proc/<pid>/root".into());
        };
        if self.attached.contains_key(&key) {
            return Ok(false);
        }
        let mut links = Vec::new();
        for &(sym, prog, ret, launch_set) in SYMBOLS {
            if launch_set && !self.opts.launches {
                continue;
            }
            let entry = attach_uprobe(self.prog(prog), -1, &path, sym, false);
            let Ok(entry) = entry else {
                // older drivers lack some symbols
                tracing::debug!(symbol = sym, path = %path.display(), "not attached");
                continue;
            };
            links.push(entry);
            if let Some(ret) = ret {
                links.push(attach_uprobe(self.prog(ret), -1, &path, sym, true)?);
            }
        }
        tracing::info!(path = %path.display(), probes = links.len(), "cuda: attached");
        self.attached.insert(key, links);
        Ok(true)
    }

    fn prog(&self, p: Prog) -> &'static ProgramMut<'static> {
        let skel: &'static skel::CudaSkel<'static> = self.skel;
        let progs = &skel.progs;
        match p {
            Prog::Alloc => &progs.cu_mem_alloc,
            Prog::AllocManaged => &progs.cu_mem_alloc_managed,
            Prog::AllocAsync => &progs.cu_mem_alloc_async,
            Prog::AllocPitch => &progs.cu_mem_alloc_pitch,
            Prog::Create => &progs.cu_mem_create,
            Prog::Import => &progs.cu_mem_import,
            Prog::AllocRet => &progs.cu_alloc_ret,
            Prog::Free => &progs.cu_mem_free,
            Prog::FreeAsync => &progs.cu_mem_free_async,
            Prog::Release => &progs.cu_mem_release,
            Prog::Map => &progs.cu_mem_map,
            Prog::Unmap => &progs.cu_mem_unmap,
            Prog::HtoD => &progs.cu_memcpy_htod,
            Prog::HtoDSync => &progs.cu_memcpy_htod_sync,
            Prog::CopyRet => &progs.cu_copy_ret,
            Prog::DtoH => &progs.cu_memcpy_dtoh,
            Prog::Memcpy => &progs.cu_memcpy,
            Prog::Launch => &progs.cu_launch_kernel,
            Prog::LaunchPtsz => &progs.cu_launch_kernel_ptsz,
            Prog::LaunchEx => &progs.cu_launch_kernel_ex,
            Prog::LaunchExPtsz => &progs.cu_launch_kernel_ex_ptsz,
            Prog::GraphLaunch => &progs.cu_graph_launch,
            Prog::GraphLaunchPtsz => &progs.cu_graph_launch_ptsz,
            Prog::EventRecord => &progs.cu_event_record,
            Prog::EventRecordPtsz => &progs.cu_event_record_ptsz,
            Prog::StreamSync => &progs.cu_stream_sync,
            Prog::StreamSyncPtsz => &progs.cu_stream_sync_ptsz,
            Prog::StreamQuery => &progs.cu_stream_query,
            Prog::StreamQueryPtsz => &progs.cu_stream_query_ptsz,
            Prog::CtxSync => &progs.cu_ctx_sync,
            Prog::EventSync => &progs.cu_event_sync,
            Prog::EventQuery => &progs.cu_event_query,
            Prog::SyncRet => &progs.cu_sync_ret,
        }
    }

    /// Distinct library files attached.
    pub fn files(&self) -> usize {
        self.attached.len()
    }

    /// (cgroup storage unavailable, object map full, frees of unknown
    /// objects, launches whose stream was not tracked)
    pub fn kernel_stats(&self) -> [u64; limits::STATS] {
        [
            limits::STAT_NO_STORAGE,
            limits::STAT_OBJECTS_FULL,
            limits::STAT_UNKNOWN_FREE,
            limits::STAT_UNTRACKED_LAUNCH,
        ]
        .map(|i| percpu_sum(&self.stats, i as u32))
    }
}

impl GpuProcessUnit for CudaProbe {
    type Series = CudaSeries;
    const NAME: &'static str = NAME;
    const FAMILIES: &'static [FamilySpec] = &[
        VRAM_FAMILY,
        PCIE_FAMILY,
        LAUNCHES_FAMILY,
        BUSY_FAMILY,
        SYNC_WAIT_FAMILY,
        FEED_STALL_FAMILY,
    ];
    /// When the busy estimate is the node's compute time (launches probed, no NVML).
    const FAMILIES_COMPUTE: &'static [FamilySpec] = &[
        VRAM_FAMILY,
        PCIE_FAMILY,
        LAUNCHES_FAMILY,
        BUSY_FAMILY,
        SYNC_WAIT_FAMILY,
        FEED_STALL_FAMILY,
        gpu_compute::COMPUTE_FAMILY,
        gpu_compute::DUTY_FAMILY,
    ];
    const SIGNAL: SignalSpec = SignalSpec {
        name: "gpu_sync_wait",
        family: SYNC_WAIT,
        kind: SignalKind::Latency,
    };

    fn parts(&self) -> &GpuProcesses<CudaSeries> {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut GpuProcesses<CudaSeries> {
        &mut self.parts
    }

    /// The busy estimate needs the launch probes.
    fn source(&self) -> Option<ComputeSource> {
        self.opts.launches.then_some(ComputeSource::LaunchEstimate)
    }

    fn forget(&mut self, tgids: &PodProcesses) {
        self.done.retain(|&t| tgids.contains(t));
    }

    /// Looks for the driver library in the processes not yet known to map it,
    /// and attaches to every new library file. Returns the number of files
    /// newly attached.
    fn look_at(
        &mut self,
        tgids: impl Iterator<Item = i32>,
        changed: Option<&HashSet<i32>>,
    ) -> usize {
        let mut new = 0;
        for tgid in tgids {
            if self.done.contains(&tgid) || !self.parts.lookout.look(tgid, changed) {
                continue;
            }
            let Ok(maps) = std::fs::read_to_string(format!("/proc/{tgid}/maps")) else {
                continue;
            };
            let libs = find_libs(&maps, &self.opts.library_prefix);
            if libs.is_empty() {
                continue;
            }
            self.done.insert(tgid);
            for lib in libs {
                match self.attach_file(tgid, &lib) {
                    Ok(true) => new += 1,
                    Ok(false) => {}
                    Err(e) => tracing::warn!(tgid, path = %lib.path, "cuda: {e}"),
                }
            }
        }
        new
    }

    /// The VRAM each owner's cgroups hold now.
    fn gauges(&mut self, ctx: &TickContext<'_>) -> Vec<(&'static str, Vec<GaugeValue>)> {
        let mut per_owner: HashMap<&Owner, i64> = HashMap::new();
        for (id, bytes) in &self.parts.cgroups.series.vram {
            if let Some(owner) = ctx.owners.get(id) {
                *per_owner.entry(owner).or_default() += bytes;
            }
        }
        let vram = per_owner
            .into_iter()
            .map(|(owner, bytes)| GaugeValue {
                owner: owner.clone(),
                labels: no_labels(),
                // memory allocated before the probe attached and freed
                // after it makes a cgroup's balance negative
                value: bytes.max(0) as f64,
            })
            .collect();
        vec![(VRAM, vram)]
    }

    fn self_series(&self) -> (u64, Vec<SelfSeries>) {
        let [failures, full, unknown, untracked] = self.kernel_stats();
        (failures, vec![
            SelfSeries::gauge("gpufeed_cuda_libraries", "Distinct libcuda files (device, inode) the CUDA probes are attached to", self.files() as f64),
            SelfSeries::counter("gpufeed_cuda_objects_dropped_total", "CUDA allocations (or their address ranges) not tracked because the object or range map was full", full),
            SelfSeries::counter("gpufeed_cuda_launches_untracked_total", "Kernel launches left out of the busy estimate (stream map full, launch stack unreadable)", untracked),
            SelfSeries::counter("gpufeed_cuda_unknown_frees_total", "Frees, releases and unmaps of objects the probes never saw allocated (made before they attached)", unknown),
        ])
    }
}

/// A cgroup's PCIe bytes, sync waits and (with `--cuda-launches`) launches
/// and busy estimate; its VRAM balance, set whole by the tick; its compute
/// time where the busy estimate is the node's compute source.
pub struct CudaSeries {
    launches: bool,
    /// The feed stall is counted (launch probes on a kernel with sched_info).
    feed_stall: bool,
    /// VRAM per cgroup at its last read.
    vram: HashMap<u64, i64>,
    compute: Option<ComputeSeries>,
}

impl ComputeSlot for CudaSeries {
    fn compute(&self) -> Option<&ComputeSeries> {
        self.compute.as_ref()
    }

    fn compute_mut(&mut self) -> &mut Option<ComputeSeries> {
        &mut self.compute
    }
}

impl CgroupSeries for CudaSeries {
    type Value = CudaCgroup;

    fn decode(bytes: &[u8]) -> Option<CudaCgroup> {
        CudaCgroup::from_bytes(bytes)
    }

    fn delta(now: &CudaCgroup, prev: &CudaCgroup) -> CudaCgroup {
        now.delta_since(prev)
    }

    fn deltas(&mut self, id: u64, now: &CudaCgroup, d: CudaCgroup, out: &mut Vec<Delta>) {
        self.vram.insert(id, now.vram_bytes);
        if let Some(c) = self.compute.as_mut() {
            out.push(c.cgroup_delta(id, Labels::new(), d.busy_ns));
        }
        for (direction, bytes) in [("h2d", d.h2d_bytes), ("d2h", d.d2h_bytes)] {
            out.push(Delta {
                family: PCIE,
                labels: Labels::from([("direction", direction.to_string())]),
                value: Value::Count(bytes),
            });
        }
        if !d.sync_wait.is_empty() {
            out.push(Delta {
                family: SYNC_WAIT,
                labels: Labels::new(),
                value: Value::Hist(d.sync_wait),
            });
        }
        if self.launches {
            out.push(Delta {
                family: LAUNCHES,
                labels: Labels::new(),
                value: Value::Count(d.launches),
            });
            out.push(Delta {
                family: BUSY,
                labels: Labels::new(),
                value: Value::Count(d.busy_ns),
            });
        }
        if self.feed_stall {
            // The probes' raw account, by part, kept in the store under the family: /metrics
            // shows the join's split by cause instead (`crate::join::feed_stall`), the one
            // place that knows the host's link and events too.
            for (part, v) in [
                (FeedPart::Cpu, d.feed_cpu_ns),
                (FeedPart::All, d.feed_idle_ns),
                (FeedPart::CopyNs, d.h2d_copy_ns),
                (FeedPart::CopyBytes, d.h2d_copy_bytes),
            ] {
                out.push(Delta {
                    family: FEED_STALL,
                    labels: Labels::from([(FEED_PART, part.as_str().to_string())]),
                    value: Value::Count(v),
                });
            }
        }
    }

    /// A gone cgroup holds no VRAM: its processes' exit gave their memory back.
    fn forget(&mut self, id: u64) {
        self.vram.remove(&id);
    }
}

/// The path through which the agent reaches a library process `tgid` maps,
/// and the file's (dev, inode). The path in maps is the process's view: inside
/// its root for a container, or a host path when the file is reachable from
/// the agent's root (a chroot below it). The inode from maps tells which is
/// the file.
pub fn reachable(tgid: i32, lib: &MappedLib) -> Option<(PathBuf, (u64, u64))> {
    let candidates = [
        PathBuf::from(format!("/proc/{tgid}/root{}", lib.path)),
        PathBuf::from(&lib.path),
    ];
    candidates.iter().find_map(|p| {
        let md = std::fs::metadata(p).ok()?;
        let dev = (libc::major(md.dev()), libc::minor(md.dev()));
        (md.ino() == lib.inode && dev == lib.dev).then(|| (p.clone(), (md.dev(), md.ino())))
    })
}

/// Attaches `prog` to function `sym` of the ELF file at `path`, in process
/// `pid` only (the kernel then installs the breakpoint in that address space
/// alone) or in every process that maps the file (`pid` -1).
pub fn attach_uprobe(
    prog: &ProgramMut<'static>,
    pid: i32,
    path: &std::path::Path,
    sym: &str,
    retprobe: bool,
) -> Result<Link, String> {
    prog.attach_uprobe_with_opts(
        pid,
        path,
        0,
        UprobeOpts {
            func_name: Some(sym.to_string()),
            retprobe,
            ..Default::default()
        },
    )
    .map_err(|e| format!("attaching {sym}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_from_maps() {
        let maps = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1234 /usr/bin/python3.11
7f1c2a000000-7f1c2a200000 r--p 00000000 fd:01 5678 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1c2a200000-7f1c2b000000 r-xp 00200000 fd:01 5678 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1c2c000000-7f1c2c001000 rw-p 00000000 00:00 0 
7f1c2d000000-7f1c2d001000 r--p 00000000 00:1f 99 /tmp/x y/libcuda.so.1
7f1c2e000000-7f1c2e001000 r--p 00000000 fd:01 77 /old/libcuda.so.1 (deleted)
7ffd1000-7ffd2000 rw-p 00000000 00:00 0 [stack]
garbage line
";
        let libs = find_libs(maps, "libcuda.so");
        assert_eq!(
            libs,
            vec![
                MappedLib {
                    dev: (0xfd, 1),
                    inode: 5678,
                    path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15".into()
                },
                MappedLib {
                    dev: (0, 0x1f),
                    inode: 99,
                    path: "/tmp/x y/libcuda.so.1".into()
                },
            ]
        );
        assert!(find_libs("", "libcuda.so").is_empty());
    }

    /// A `_ptsz`/`_ptds` export is probed as its base call is: at return
    /// too where the base call is, in the launch set where the base call is.
    #[test]
    fn per_thread_variants_are_probed_like_their_base_calls() {
        let mut variants = 0;
        for &(sym, _, ret, launch_set) in SYMBOLS {
            let Some(base) = sym
                .strip_suffix("_ptsz")
                .or_else(|| sym.strip_suffix("_ptds"))
            else {
                continue;
            };
            let &(_, _, base_ret, base_set) = SYMBOLS
                .iter()
                .find(|s| s.0 == base)
                .unwrap_or_else(|| panic!("{sym}: its base call {base} is probed"));
            assert_eq!(
                (ret.is_some(), launch_set),
                (base_ret.is_some(), base_set),
                "{sym}"
            );
            variants += 1;
        }
        assert_eq!(variants, 15);
    }

    #[test]
    fn decode_cgroup() {
        let mut b = Vec::new();
        // vram, h2d, d2h, launches, busy_ns, busy_since, busy_streams,
        // feed_cpu_ns, feed_idle_ns, h2d_copy_ns, h2d_copy_bytes
        for v in [
            -4096i64 as u64,
            10,
            20,
            3,
            7_000,
            1_000,
            1,
            300,
            500,
            900,
            4096,
        ] {
            b.extend_from_slice(&v.to_ne_bytes());
        }
        // the sync-wait histogram (bpf/hist.h): two waits under 2^17 ns
        // (bucket 7), one in the overflow slot, their exact sum
        let mut buckets = [0u64; super::super::hist::SLOTS];
        buckets[7] = 2;
        buckets[super::super::hist::SLOTS - 1] = 1;
        for v in buckets.iter().chain(&[40_000_000_000u64]) {
            b.extend_from_slice(&v.to_ne_bytes());
        }
        // the activity epoch (bpf/cgroup_active.h)
        b.extend_from_slice(&7u64.to_ne_bytes());
        let c = CudaCgroup::from_bytes(&b).unwrap();
        assert_eq!(c.vram_bytes, -4096);
        assert_eq!((c.h2d_bytes, c.d2h_bytes, c.launches), (10, 20, 3));
        assert_eq!(c.busy_ns, 7_000, "an interval still open is left out");
        assert_eq!((c.feed_cpu_ns, c.feed_idle_ns), (300, 500));
        assert_eq!((c.h2d_copy_ns, c.h2d_copy_bytes), (900, 4096));
        assert_eq!((c.sync_wait.count, c.sync_wait.sum_ns), (3, 40_000_000_000));
        assert_eq!(c.sync_wait.buckets[7], 2);
        assert!(CudaCgroup::from_bytes(&b[..b.len() - 1]).is_none());
    }
}
