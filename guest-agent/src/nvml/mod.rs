//! NVML, when the node has it: what the GPUs themselves say, beside the eBPF GPU signals.
//!
//! `libnvidia-ml.so.1` comes with the NVIDIA driver, not with the agent: it
//! is opened at run time with dlopen (never linked, never a build
//! dependency), and a node without it gets one info line and no NVML series.
//!
//! What it answers:
//! * per GPU, the capacity the FinOps cost model divides by ([`GpuCapacity`]:
//!   total memory, the link's maximum PCIe bandwidth);
//! * per GPU, its compute processes with their memory
//!   (`nvmlDeviceGetComputeRunningProcesses`) and the utilisation samples
//!   taken since the previous read (`nvmlDeviceGetProcessUtilization`), which
//!   [`sm_time::SmClock`] turns into SM time ([`Nvml::read`]);
//! * per GPU, its PCIe link as the guest sees it: current generation and
//!   width, TX/RX throughput ([`Nvml::links`]).
//!
//! Every call is optional on its own and every GPU fails on its own: drivers differ in which
//! calls their NVML exports (a missing symbol leaves that reading absent, [`Nvml::missing`]),
//! and one GPU may be lost while the others answer. Each read returns what it could read
//! ([`Survey`]) with the calls that failed ([`failures::Failure`]), never an error for all.

pub mod codes;
pub mod failures;
mod ffi;
pub mod gpm;
pub mod locate;
pub mod mps;
pub mod process;
pub mod sm_time;

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr, CString};

use codes::{ERROR_INSUFFICIENT_SIZE, ERROR_NOT_FOUND, SUCCESS};
pub use failures::{Failure, Failures};
pub use ffi::Gpu;
use ffi::{symbol, Device};

pub use locate::LIBRARY;

#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("{call} returned NVML_ERROR_{} ({code})", codes::name(*.code))]
    Call { call: &'static str, code: c_int },
    #[error("symbol {0} missing from the NVML library: it is not an NVML")]
    Symbol(&'static str),
}

/// One GPU's capacity: the denominators of utilisation and cost shares. A number its NVML
/// could not give (a call missing or failing) is None.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuCapacity {
    /// NVML's device index (the `gpu` label).
    pub index: u32,
    pub memory_total_bytes: Option<u64>,
    /// Maximum PCIe link bandwidth per direction: the link's maximum
    /// generation's per-lane rate (after line encoding) times its maximum width.
    pub link_bytes_per_second: Option<u64>,
}

impl GpuCapacity {
    /// Both numbers read.
    pub fn complete(&self) -> bool {
        self.memory_total_bytes.is_some() && self.link_bytes_per_second.is_some()
    }
}

/// One GPU's PCIe link as NVML reports it now (in a VM: as the guest's driver sees it); a
/// number whose call is missing or failed is None.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkState {
    pub gpu: u32,
    /// Current PCIe generation and width (an idle GPU lowers its generation).
    pub generation: Option<u32>,
    pub width: Option<u32>,
    /// Bytes per second the GPU sent (TX: towards the host) and received (RX: from the
    /// host) over the link, by NVML's throughput counters (a 20 ms sample, in KiB/s).
    pub tx_bytes_per_second: Option<u64>,
    pub rx_bytes_per_second: Option<u64>,
}

/// What one read across the GPUs got: each GPU that answered, and every call that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survey<T> {
    pub gpus: Vec<T>,
    pub failures: Vec<Failure>,
}

impl<T> Default for Survey<T> {
    fn default() -> Self {
        Survey {
            gpus: Vec::new(),
            failures: Vec::new(),
        }
    }
}

/// Per-lane bytes per second of a PCIe generation after line encoding
/// (8b/10b up to gen 2, 128b/130b from gen 3; gen 6 counted like gen 5 x2).
pub fn pcie_lane_bytes_per_second(generation: u32) -> u64 {
    const GT: u64 = 1_000_000_000;
    match generation {
        1 => 2_500_000_000 / 10,
        2 => 5 * GT / 10,
        3 => 8 * GT / 8 * 128 / 130,
        4 => 16 * GT / 8 * 128 / 130,
        5 => 32 * GT / 8 * 128 / 130,
        6 => 64 * GT / 8 * 128 / 130,
        _ => 0,
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Memory {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct UtilizationSample {
    pid: c_uint,
    time_stamp: c_ulonglong,
    sm_util: c_uint,
    mem_util: c_uint,
    enc_util: c_uint,
    dec_util: c_uint,
}

/// nvmlPcieUtilCounter_t
const PCIE_UTIL_TX_BYTES: c_int = 0;
const PCIE_UTIL_RX_BYTES: c_int = 1;
/// usedGpuMemory when NVML cannot tell (NVML_VALUE_NOT_AVAILABLE).
const VALUE_NOT_AVAILABLE: c_ulonglong = c_ulonglong::MAX;
/// Room in a process list's buffer beyond the GPU's last count, for processes that start
/// before the next read.
const LIST_ROOM: c_uint = 8;

type UintCall = unsafe extern "C" fn(Device, *mut c_uint) -> c_int;

/// The calls without which NVML is unusable: none of them is missing from any NVML.
struct Core {
    init: unsafe extern "C" fn() -> c_int,
    shutdown: unsafe extern "C" fn() -> c_int,
    count: unsafe extern "C" fn(*mut c_uint) -> c_int,
    handle: unsafe extern "C" fn(c_uint, *mut Device) -> c_int,
}

/// The calls each reading needs, each absent where this NVML lacks it.
struct Optional {
    memory: Option<unsafe extern "C" fn(Device, *mut Memory) -> c_int>,
    max_gen: Option<UintCall>,
    max_width: Option<UintCall>,
    processes: Option<unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfo) -> c_int>,
    utilization: Option<
        unsafe extern "C" fn(Device, *mut UtilizationSample, *mut c_uint, c_ulonglong) -> c_int,
    >,
    curr_gen: Option<UintCall>,
    curr_width: Option<UintCall>,
    throughput: Option<unsafe extern "C" fn(Device, c_int, *mut c_uint) -> c_int>,
    mig_mode: Option<unsafe extern "C" fn(Device, *mut c_uint, *mut c_uint) -> c_int>,
}

const MEMORY: &str = "nvmlDeviceGetMemoryInfo";
const MAX_GEN: &str = "nvmlDeviceGetMaxPcieLinkGeneration";
const MAX_WIDTH: &str = "nvmlDeviceGetMaxPcieLinkWidth";
const PROCESSES: &str = "nvmlDeviceGetComputeRunningProcesses_v3";
const UTILIZATION: &str = "nvmlDeviceGetProcessUtilization";
const CURR_GEN: &str = "nvmlDeviceGetCurrPcieLinkGeneration";
const CURR_WIDTH: &str = "nvmlDeviceGetCurrPcieLinkWidth";
const THROUGHPUT: &str = "nvmlDeviceGetPcieThroughput";
const MIG_MODE: &str = "nvmlDeviceGetMigMode";
const COUNT: &str = "nvmlDeviceGetCount_v2";
const HANDLE: &str = "nvmlDeviceGetHandleByIndex_v2";

/// An initialised NVML. Dropping it shuts NVML down and closes the library.
pub struct Nvml {
    lib: *mut c_void,
    core: Core,
    api: Optional,
    /// Optional calls this NVML lacks.
    missing: Vec<&'static str>,
    /// The library as opened (name or path).
    opened: String,
    /// What the last reads of each GPU said that the next one asks with.
    last: HashMap<u32, LastRead>,
    /// GPM's calls, where this NVML has them, and the MIG instances' samples.
    gpm_api: Option<Box<gpm::Api>>,
    gpm: Box<gpm::Instances>,
}

/// What the last reads of one GPU said.
#[derive(Default, Clone, Copy)]
struct LastRead {
    /// The newest utilisation sample seen (µs), to ask only for newer.
    sample_us: c_ulonglong,
    /// How many processes its last process list held: the next list is asked for with room
    /// for them, in one call, not first with a small buffer that NVML answers with the count
    /// (each call is a round trip to the driver).
    listed: c_uint,
}

// SAFETY: NVML is thread-safe (documented); the handle is only a library handle.
unsafe impl Send for Nvml {}

/// dlerror's text, or "".
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a C string valid until the next dl call.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            String::new()
        } else {
            CStr::from_ptr(e as *const c_char)
                .to_string_lossy()
                .into_owned()
        }
    }
}

/// What looking for NVML found.
pub enum Opened {
    /// NVML initialised, from this library.
    Loaded(Nvml),
    /// No library at any place tried: why, with the fix.
    Absent(String),
}

impl Nvml {
    /// Opens and initialises NVML from `library` (a name the loader searches for, like
    /// [`LIBRARY`], or a path). `Ok(None)` when the library is not there (a node without
    /// an NVIDIA driver, or a pod without the toolkit's mounts).
    pub fn load(library: &str) -> Result<Option<Nvml>, NvmlError> {
        Self::open_one(library).map(|r| r.ok())
    }

    /// Looks for NVML where `configured` says, then where driver stacks put it
    /// ([`locate::candidates`]).
    pub fn open(configured: &str) -> Result<Opened, NvmlError> {
        let mut why = Vec::new();
        for c in locate::candidates(configured) {
            match Self::open_one(&c)? {
                Ok(nvml) => return Ok(Opened::Loaded(nvml)),
                Err(e) => why.push(e),
            }
        }
        Ok(Opened::Absent(locate::not_found(
            configured,
            why.first().map_or("", String::as_str),
        )))
    }

    /// `Ok(Err(why))`: no library there.
    fn open_one(library: &str) -> Result<Result<Nvml, String>, NvmlError> {
        let Ok(name) = CString::new(library) else {
            return Ok(Err(format!("{library:?} is not a file name")));
        };
        // SAFETY: dlopen with a valid C string; a null result is handled.
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Ok(Err(dl_error()));
        }
        let close = |e| {
            // SAFETY: lib came from dlopen and nothing of it is kept.
            unsafe { libc::dlclose(lib) };
            Err(e)
        };
        // SAFETY: each type is the function's signature in nvml.h.
        let core = unsafe {
            match (
                symbol(lib, "nvmlInit_v2"),
                symbol(lib, "nvmlShutdown"),
                symbol(lib, COUNT),
                symbol(lib, HANDLE),
            ) {
                (Some(init), Some(shutdown), Some(count), Some(handle)) => Core {
                    init,
                    shutdown,
                    count,
                    handle,
                },
                (None, ..) => return close(NvmlError::Symbol("nvmlInit_v2")),
                (_, None, ..) => return close(NvmlError::Symbol("nvmlShutdown")),
                (_, _, None, _) => return close(NvmlError::Symbol(COUNT)),
                (.., None) => return close(NvmlError::Symbol(HANDLE)),
            }
        };
        // SAFETY: each type is the function's signature in nvml.h.
        let api = unsafe {
            Optional {
                memory: symbol(lib, MEMORY),
                max_gen: symbol(lib, MAX_GEN),
                max_width: symbol(lib, MAX_WIDTH),
                processes: symbol(lib, PROCESSES),
                utilization: symbol(lib, UTILIZATION),
                curr_gen: symbol(lib, CURR_GEN),
                curr_width: symbol(lib, CURR_WIDTH),
                throughput: symbol(lib, THROUGHPUT),
                mig_mode: symbol(lib, MIG_MODE),
            }
        };
        let missing = [
            (MEMORY, api.memory.is_none()),
            (MAX_GEN, api.max_gen.is_none()),
            (MAX_WIDTH, api.max_width.is_none()),
            (PROCESSES, api.processes.is_none()),
            (UTILIZATION, api.utilization.is_none()),
            (CURR_GEN, api.curr_gen.is_none()),
            (CURR_WIDTH, api.curr_width.is_none()),
            (THROUGHPUT, api.throughput.is_none()),
            (MIG_MODE, api.mig_mode.is_none()),
        ]
        .into_iter()
        .filter_map(|(name, gone)| gone.then_some(name))
        .collect();
        // SAFETY: nvmlInit_v2 takes no arguments.
        let rc = unsafe { (core.init)() };
        if rc != SUCCESS {
            return close(NvmlError::Call {
                call: "nvmlInit_v2",
                code: rc,
            });
        }
        Ok(Ok(Nvml {
            lib,
            core,
            api,
            missing,
            opened: library.to_string(),
            last: HashMap::new(),
            // SAFETY: lib is the live handle of this NVML.
            gpm_api: unsafe { gpm::Api::of(lib) }.map(Box::new),
            gpm: Box::default(),
        }))
    }

    /// The optional calls this NVML lacks (their readings are absent, not failed).
    pub fn missing(&self) -> &[&'static str] {
        &self.missing
    }

    /// The library as opened: the configured name, or the path where it was found.
    pub fn opened(&self) -> &str {
        &self.opened
    }

    /// The GPUs NVML enumerates now; a GPU whose handle cannot be had is left out, its
    /// failure said.
    pub fn gpus(&self) -> Survey<Gpu> {
        let mut out = Survey::default();
        let mut n: c_uint = 0;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.core.count)(&mut n) };
        if rc != SUCCESS {
            out.failures.push(Failure {
                gpu: None,
                call: COUNT,
                code: rc,
            });
            return out;
        }
        for index in 0..n {
            let mut handle: Device = std::ptr::null_mut();
            // SAFETY: an index below the count and a valid out-pointer.
            let rc = unsafe { (self.core.handle)(index, &mut handle) };
            if rc == SUCCESS {
                out.gpus.push(Gpu { index, handle });
            } else {
                out.failures.push(Failure {
                    gpu: Some(index),
                    call: HANDLE,
                    code: rc,
                });
            }
        }
        out
    }

    /// One unsigned reading of `gpu` by `call` (None: missing, or failed and said).
    fn uint(
        gpu: &Gpu,
        name: &'static str,
        call: Option<UintCall>,
        failures: &mut Vec<Failure>,
    ) -> Option<u32> {
        let call = call?;
        let mut v: c_uint = 0;
        // SAFETY: a device handle from NVML and a valid out-pointer.
        let rc = unsafe { call(gpu.handle, &mut v) };
        ok(gpu, name, rc, failures).then_some(v)
    }

    /// `gpu`'s total memory and maximum link bandwidth, each as far as NVML gives it.
    pub fn capacity_of(&self, gpu: &Gpu, failures: &mut Vec<Failure>) -> GpuCapacity {
        let memory_total_bytes = self.api.memory.and_then(|call| {
            let mut mem = Memory::default();
            // SAFETY: a device handle from NVML and a valid out-pointer.
            let rc = unsafe { call(gpu.handle, &mut mem) };
            ok(gpu, MEMORY, rc, failures).then_some(mem.total)
        });
        let gen = Self::uint(gpu, MAX_GEN, self.api.max_gen, failures);
        let width = Self::uint(gpu, MAX_WIDTH, self.api.max_width, failures);
        GpuCapacity {
            index: gpu.index,
            memory_total_bytes,
            link_bytes_per_second: gen
                .zip(width)
                .map(|(g, w)| pcie_lane_bytes_per_second(g) * u64::from(w))
                .filter(|b| *b > 0),
        }
    }

    /// Every GPU's total memory and maximum link bandwidth, as far as each gives them.
    pub fn capacity(&self) -> Survey<GpuCapacity> {
        let Survey { gpus, mut failures } = self.gpus();
        let gpus = gpus
            .iter()
            .map(|g| self.capacity_of(g, &mut failures))
            .collect();
        Survey { gpus, failures }
    }

    /// `gpu`'s compute processes with their memory, and the utilisation samples NVML took
    /// since the previous read ([`sm_time::SmClock`] books them); each half empty when its
    /// call is missing or failed.
    pub fn read_gpu(&mut self, gpu: &Gpu, failures: &mut Vec<Failure>) -> sm_time::GpuReading {
        let mig = self.mig_enabled(gpu, failures);
        // on a MIG GPU the driver keeps no per-process utilisation (NOT_SUPPORTED each read):
        // not asked; GPM gives each instance's, else the compute is said unattributed
        let samples = if mig {
            Vec::new()
        } else {
            self.samples(gpu, failures)
        };
        let running = self.running(gpu, failures);
        let mig_sm = match self.gpm_api.as_deref().copied() {
            Some(api) if mig && self.gpm.supported(&api, gpu, failures) => {
                let mut instances: Vec<u32> = running
                    .iter()
                    .map(|p| p.gpu_instance_id)
                    .filter(|gi| *gi != c_uint::MAX)
                    .collect();
                instances.sort_unstable();
                instances.dedup();
                Some(self.gpm.read(&api, gpu, &instances, failures))
            }
            _ => None,
        };
        let memory = |p: &ProcessInfo| {
            (p.used_gpu_memory != VALUE_NOT_AVAILABLE).then_some(p.used_gpu_memory)
        };
        sm_time::GpuReading {
            gpu: gpu.index,
            read_at_us: realtime_us(),
            processes: running.iter().map(|p| (p.pid, memory(p))).collect(),
            samples,
            mig: mig.then(|| {
                running
                    .iter()
                    .map(|p| sm_time::MigProcess {
                        pid: p.pid,
                        gpu_instance: p.gpu_instance_id,
                        compute_instance: p.compute_instance_id,
                        memory_bytes: memory(p),
                    })
                    .collect()
            }),
            mig_sm,
        }
    }

    /// Whether `gpu` is in MIG mode now (a GPU without MIG answers NOT_SUPPORTED: not a
    /// failure).
    pub fn mig_enabled(&self, gpu: &Gpu, failures: &mut Vec<Failure>) -> bool {
        const NOT_SUPPORTED: c_int = 3;
        let Some(call) = self.api.mig_mode else {
            return false;
        };
        let (mut current, mut pending): (c_uint, c_uint) = (0, 0);
        // SAFETY: a device handle from NVML and valid out-pointers.
        let rc = unsafe { call(gpu.handle, &mut current, &mut pending) };
        if rc == NOT_SUPPORTED {
            return false;
        }
        ok(gpu, MIG_MODE, rc, failures) && current == 1
    }

    /// Every GPU's processes and samples ([`Nvml::read_gpu`]).
    pub fn read(&mut self) -> Survey<sm_time::GpuReading> {
        let Survey { gpus, mut failures } = self.gpus();
        let gpus = gpus
            .iter()
            .map(|g| self.read_gpu(g, &mut failures))
            .collect();
        Survey { gpus, failures }
    }

    /// `gpu`'s link now: current generation and width, TX/RX throughput.
    pub fn link_of(&self, gpu: &Gpu, failures: &mut Vec<Failure>) -> LinkState {
        let throughput = |counter: c_int, failures: &mut Vec<Failure>| {
            let call = self.api.throughput?;
            let mut v: c_uint = 0;
            // SAFETY: a device handle from NVML and a valid out-pointer.
            let rc = unsafe { call(gpu.handle, counter, &mut v) };
            ok(gpu, THROUGHPUT, rc, failures).then_some(u64::from(v) * 1024)
        };
        LinkState {
            gpu: gpu.index,
            generation: Self::uint(gpu, CURR_GEN, self.api.curr_gen, failures),
            width: Self::uint(gpu, CURR_WIDTH, self.api.curr_width, failures),
            tx_bytes_per_second: throughput(PCIE_UTIL_TX_BYTES, failures),
            rx_bytes_per_second: throughput(PCIE_UTIL_RX_BYTES, failures),
        }
    }

    /// Every GPU's link now ([`Nvml::link_of`]).
    pub fn links(&self) -> Survey<LinkState> {
        let Survey { gpus, mut failures } = self.gpus();
        let gpus = gpus
            .iter()
            .map(|g| self.link_of(g, &mut failures))
            .collect();
        Survey { gpus, failures }
    }

    /// nvmlDeviceGetComputeRunningProcesses_v3, grown until the list fits: processes may
    /// start between the size query and the call, so INSUFFICIENT_SIZE is answered again
    /// with the new count; bounded, so a driver that keeps growing cannot hold the tick.
    /// The first buffer has room for the processes of the GPU's last list and a few more.
    fn running(&mut self, gpu: &Gpu, failures: &mut Vec<Failure>) -> Vec<ProcessInfo> {
        let Some(call) = self.api.processes else {
            return Vec::new();
        };
        let last = self.last.get(&gpu.index).map_or(0, |l| l.listed);
        let mut cap: c_uint = last.saturating_add(LIST_ROOM).clamp(16, 1 << 16);
        for _ in 0..8 {
            let mut buf = vec![ProcessInfo::default(); cap as usize];
            let mut n = cap;
            // SAFETY: buf holds n elements of the struct nvml.h declares.
            let rc = unsafe { call(gpu.handle, &mut n, buf.as_mut_ptr()) };
            if rc == ERROR_INSUFFICIENT_SIZE && cap < 1 << 16 {
                // room for the processes said, and a few more that may start meanwhile
                cap = n.max(cap).saturating_add(LIST_ROOM).min(1 << 16);
                continue;
            }
            if !ok(gpu, PROCESSES, rc, failures) {
                return Vec::new();
            }
            buf.truncate(n.min(cap) as usize);
            self.last.entry(gpu.index).or_default().listed = buf.len() as c_uint;
            return buf;
        }
        ok(gpu, PROCESSES, ERROR_INSUFFICIENT_SIZE, failures);
        Vec::new()
    }

    /// The utilisation samples newer than the last read's newest (NVML_ERROR_NOT_FOUND: none).
    fn samples(&mut self, gpu: &Gpu, failures: &mut Vec<Failure>) -> Vec<sm_time::UtilSample> {
        let Some(call) = self.api.utilization else {
            return Vec::new();
        };
        let since = self.last.get(&gpu.index).map_or(0, |l| l.sample_us);
        let mut n: c_uint = 0;
        // SAFETY: a null buffer asks for the sample count.
        let rc = unsafe { call(gpu.handle, std::ptr::null_mut(), &mut n, since) };
        if rc == ERROR_NOT_FOUND {
            return Vec::new();
        }
        if rc != ERROR_INSUFFICIENT_SIZE && !ok(gpu, UTILIZATION, rc, failures) {
            return Vec::new();
        }
        // room for processes that start between the two calls; drivers have been seen to
        // report a count far above the processes, so the count is bounded
        let mut buf = vec![UtilizationSample::default(); (n as usize).min(1 << 12) + 8];
        let mut n = buf.len() as c_uint;
        // SAFETY: buf holds n elements of the struct nvml.h declares.
        let rc = unsafe { call(gpu.handle, buf.as_mut_ptr(), &mut n, since) };
        if rc == ERROR_NOT_FOUND || !ok(gpu, UTILIZATION, rc, failures) {
            return Vec::new();
        }
        buf.truncate((n as usize).min(buf.len()));
        if let Some(newest) = buf.iter().map(|s| s.time_stamp).max() {
            self.last.entry(gpu.index).or_default().sample_us = newest.max(since);
        }
        buf.iter()
            .filter(|s| s.time_stamp > since)
            .map(|s| sm_time::UtilSample {
                pid: s.pid,
                timestamp_us: s.time_stamp,
                sm_percent: s.sm_util,
            })
            .collect()
    }
}

/// Whether `rc` is success; else the failure is added.
fn ok(gpu: &Gpu, call: &'static str, rc: c_int, failures: &mut Vec<Failure>) -> bool {
    if rc == SUCCESS {
        return true;
    }
    failures.push(Failure {
        gpu: Some(gpu.index),
        call,
        code: rc,
    });
    false
}

fn realtime_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl Drop for Nvml {
    fn drop(&mut self) {
        if let Some(api) = self.gpm_api.as_deref() {
            self.gpm.clear(api);
        }
        // SAFETY: NVML was initialised by load; the handle came from dlopen.
        unsafe {
            (self.core.shutdown)();
            libc::dlclose(self.lib);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pcie_bandwidth_per_generation() {
        // gen 4 x16: 16 GT/s x 128/130 / 8 bits = 1.969 GB/s per lane
        assert_eq!(pcie_lane_bytes_per_second(4) * 16, 31_507_692_304);
        assert_eq!(pcie_lane_bytes_per_second(1), 250_000_000);
        assert_eq!(pcie_lane_bytes_per_second(2), 500_000_000);
        assert_eq!(pcie_lane_bytes_per_second(0), 0);
        assert_eq!(pcie_lane_bytes_per_second(99), 0);
    }

    #[test]
    fn absent_library_is_none() {
        assert!(Nvml::load("/nonexistent/libnvidia-ml.so.1")
            .unwrap()
            .is_none());
        assert!(Nvml::load("bad\0name").unwrap().is_none());
    }
}
