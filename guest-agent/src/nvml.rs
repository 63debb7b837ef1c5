//! NVML, when the node has it: the ground truth beside the eBPF GPU signals.
//!
//! `libnvidia-ml.so.1` comes with the NVIDIA driver, not with the agent: it
//! is opened at run time with dlopen (never linked, never a build
//! dependency), and a node without it gets one info line and no NVML series.
//!
//! What it answers:
//! * per GPU, the capacity the FinOps cost model divides by ([`GpuCapacity`]:
//!   total memory, the link's maximum PCIe bandwidth);
//! * per process, GPU memory in use (`nvmlDeviceGetComputeRunningProcesses`)
//!   and SM utilisation (`nvmlDeviceGetProcessUtilization`), summed per
//!   cgroup ([`Nvml::per_cgroup`]).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr, CString};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The library's name as the driver installs it.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("{call} returned NVML error {code}")]
    Call { call: &'static str, code: c_int },
    #[error("symbol {0} missing from the NVML library")]
    Symbol(&'static str),
}

/// One GPU's capacity: the denominators of utilisation and cost shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuCapacity {
    /// NVML's device index (the `gpu` label).
    pub index: u32,
    pub memory_total_bytes: u64,
    /// Maximum PCIe link bandwidth per direction: the link's maximum
    /// generation's per-lane rate (after line encoding) times its maximum width.
    pub link_bytes_per_second: u64,
}

/// One process's use of one GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessUsage {
    pub pid: u32,
    pub gpu: u32,
    /// GPU memory the process uses (None when NVML cannot tell, e.g. under
    /// some virtualisation modes).
    pub memory_bytes: Option<u64>,
    /// SM utilisation 0..=1 over NVML's samples since the previous call
    /// (None when NVML had no sample for it).
    pub sm_utilization: Option<f64>,
}

/// What a cgroup's processes use, summed over processes and GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CgroupUsage {
    pub memory_bytes: u64,
    /// Sum of the processes' SM utilisation (1.0 = one GPU's SMs busy all the time).
    pub sm_utilization: f64,
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

type Device = *mut c_void;

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

const SUCCESS: c_int = 0;
const ERROR_NOT_FOUND: c_int = 6;
const ERROR_INSUFFICIENT_SIZE: c_int = 7;
/// usedGpuMemory when NVML cannot tell (NVML_VALUE_NOT_AVAILABLE).
const VALUE_NOT_AVAILABLE: c_ulonglong = c_ulonglong::MAX;

struct Api {
    init: unsafe extern "C" fn() -> c_int,
    shutdown: unsafe extern "C" fn() -> c_int,
    count: unsafe extern "C" fn(*mut c_uint) -> c_int,
    handle: unsafe extern "C" fn(c_uint, *mut Device) -> c_int,
    memory: unsafe extern "C" fn(Device, *mut Memory) -> c_int,
    max_gen: unsafe extern "C" fn(Device, *mut c_uint) -> c_int,
    max_width: unsafe extern "C" fn(Device, *mut c_uint) -> c_int,
    processes: unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfo) -> c_int,
    utilization:
        unsafe extern "C" fn(Device, *mut UtilizationSample, *mut c_uint, c_ulonglong) -> c_int,
}

/// An initialised NVML. Dropping it shuts NVML down and closes the library.
pub struct Nvml {
    lib: *mut c_void,
    api: Api,
    /// Per GPU, the newest utilisation sample seen (µs), to ask only for newer.
    last_seen: HashMap<u32, c_ulonglong>,
}

// SAFETY: NVML is thread-safe (documented); the handle is only a library handle.
unsafe impl Send for Nvml {}

fn check(call: &'static str, code: c_int) -> Result<(), NvmlError> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(NvmlError::Call { call, code })
    }
}

/// dlsym of `name` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the function's real C signature.
unsafe fn symbol<F: Copy>(lib: *mut c_void, name: &'static str) -> Result<F, NvmlError> {
    let c = CString::new(name).map_err(|_| NvmlError::Symbol(name))?;
    // SAFETY: lib is a live dlopen handle and c a valid C string.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() || std::mem::size_of::<F>() != std::mem::size_of::<*mut c_void>() {
        return Err(NvmlError::Symbol(name));
    }
    // SAFETY: F is a function pointer type of the same size (checked), and
    // the caller guarantees it is the symbol's signature.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

impl Nvml {
    /// Opens and initialises NVML from `library` (a name the loader searches
    /// for, like [`LIBRARY`], or a path). `Ok(None)` when the library is not
    /// there (logged once at info: a node without an NVIDIA driver).
    pub fn load(library: &str) -> Result<Option<Nvml>, NvmlError> {
        let Ok(name) = CString::new(library) else {
            return Ok(None);
        };
        // SAFETY: dlopen with a valid C string; a null result is handled.
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            // SAFETY: dlerror returns null or a C string valid until the next dl call.
            let why = unsafe {
                let e = libc::dlerror();
                if e.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(e as *const c_char)
                        .to_string_lossy()
                        .into_owned()
                }
            };
            tracing::info!(library, reason = %why, "NVML not available: no NVML series");
            return Ok(None);
        }
        // SAFETY: each type is the function's signature in nvml.h.
        let api = unsafe {
            Api {
                init: symbol(lib, "nvmlInit_v2")?,
                shutdown: symbol(lib, "nvmlShutdown")?,
                count: symbol(lib, "nvmlDeviceGetCount_v2")?,
                handle: symbol(lib, "nvmlDeviceGetHandleByIndex_v2")?,
                memory: symbol(lib, "nvmlDeviceGetMemoryInfo")?,
                max_gen: symbol(lib, "nvmlDeviceGetMaxPcieLinkGeneration")?,
                max_width: symbol(lib, "nvmlDeviceGetMaxPcieLinkWidth")?,
                processes: symbol(lib, "nvmlDeviceGetComputeRunningProcesses_v3")?,
                utilization: symbol(lib, "nvmlDeviceGetProcessUtilization")?,
            }
        };
        let nvml = Nvml {
            lib,
            api,
            last_seen: HashMap::new(),
        };
        // SAFETY: nvmlInit_v2 takes no arguments.
        check("nvmlInit_v2", unsafe { (nvml.api.init)() })?;
        Ok(Some(nvml))
    }

    fn devices(&self) -> Result<Vec<(u32, Device)>, NvmlError> {
        let mut n: c_uint = 0;
        // SAFETY: a valid out-pointer.
        check("nvmlDeviceGetCount_v2", unsafe { (self.api.count)(&mut n) })?;
        let mut out = Vec::new();
        for i in 0..n {
            let mut d: Device = std::ptr::null_mut();
            // SAFETY: an index below the count and a valid out-pointer.
            check("nvmlDeviceGetHandleByIndex_v2", unsafe {
                (self.api.handle)(i, &mut d)
            })?;
            out.push((i, d));
        }
        Ok(out)
    }

    /// Every GPU's total memory and maximum link bandwidth.
    pub fn capacity(&self) -> Result<Vec<GpuCapacity>, NvmlError> {
        let mut out = Vec::new();
        for (index, d) in self.devices()? {
            let mut mem = Memory::default();
            let (mut gen, mut width): (c_uint, c_uint) = (0, 0);
            // SAFETY: a device handle from NVML and valid out-pointers.
            unsafe {
                check("nvmlDeviceGetMemoryInfo", (self.api.memory)(d, &mut mem))?;
                check(
                    "nvmlDeviceGetMaxPcieLinkGeneration",
                    (self.api.max_gen)(d, &mut gen),
                )?;
                check(
                    "nvmlDeviceGetMaxPcieLinkWidth",
                    (self.api.max_width)(d, &mut width),
                )?;
            }
            out.push(GpuCapacity {
                index,
                memory_total_bytes: mem.total,
                link_bytes_per_second: pcie_lane_bytes_per_second(gen) * u64::from(width),
            });
        }
        Ok(out)
    }

    /// Every compute process on every GPU, with its memory and its SM
    /// utilisation since the previous call.
    pub fn processes(&mut self) -> Result<Vec<ProcessUsage>, NvmlError> {
        let mut out = Vec::new();
        for (gpu, d) in self.devices()? {
            let util = self.sm_utilization(gpu, d)?;
            for p in self.running(d)? {
                out.push(ProcessUsage {
                    pid: p.pid,
                    gpu,
                    memory_bytes: (p.used_gpu_memory != VALUE_NOT_AVAILABLE)
                        .then_some(p.used_gpu_memory),
                    sm_utilization: util.get(&p.pid).copied(),
                });
            }
        }
        Ok(out)
    }

    /// nvmlDeviceGetComputeRunningProcesses_v3, grown until the list fits
    /// (processes may start between the size query and the call).
    fn running(&self, d: Device) -> Result<Vec<ProcessInfo>, NvmlError> {
        let mut cap: c_uint = 16;
        loop {
            let mut buf = vec![ProcessInfo::default(); cap as usize];
            let mut n = cap;
            // SAFETY: buf holds n elements of the struct nvml.h declares.
            let rc = unsafe { (self.api.processes)(d, &mut n, buf.as_mut_ptr()) };
            if rc == ERROR_INSUFFICIENT_SIZE && n > cap && cap < 1 << 16 {
                cap = n + 8;
                continue;
            }
            check("nvmlDeviceGetComputeRunningProcesses_v3", rc)?;
            buf.truncate(n.min(cap) as usize);
            return Ok(buf);
        }
    }

    /// Mean SM utilisation (0..=1) per pid over the samples newer than the
    /// last call's; empty when NVML has none (NVML_ERROR_NOT_FOUND).
    fn sm_utilization(&mut self, gpu: u32, d: Device) -> Result<HashMap<u32, f64>, NvmlError> {
        let since = self.last_seen.get(&gpu).copied().unwrap_or(0);
        let mut n: c_uint = 0;
        // SAFETY: a null buffer asks for the sample count.
        let rc = unsafe { (self.api.utilization)(d, std::ptr::null_mut(), &mut n, since) };
        if rc == ERROR_NOT_FOUND {
            return Ok(HashMap::new());
        }
        if rc != ERROR_INSUFFICIENT_SIZE && rc != SUCCESS {
            return Err(NvmlError::Call {
                call: "nvmlDeviceGetProcessUtilization",
                code: rc,
            });
        }
        let mut buf = vec![UtilizationSample::default(); n as usize + 8];
        let mut n = buf.len() as c_uint;
        // SAFETY: buf holds n elements of the struct nvml.h declares.
        let rc = unsafe { (self.api.utilization)(d, buf.as_mut_ptr(), &mut n, since) };
        if rc == ERROR_NOT_FOUND {
            return Ok(HashMap::new());
        }
        check("nvmlDeviceGetProcessUtilization", rc)?;
        buf.truncate((n as usize).min(buf.len()));
        let mut sums: HashMap<u32, (f64, u32)> = HashMap::new();
        for s in &buf {
            let e = sums.entry(s.pid).or_default();
            e.0 += f64::from(s.sm_util.min(100)) / 100.0;
            e.1 += 1;
        }
        if let Some(newest) = buf.iter().map(|s| s.time_stamp).max() {
            self.last_seen.insert(gpu, newest);
        }
        Ok(sums
            .into_iter()
            .map(|(pid, (sum, k))| (pid, sum / f64::from(k)))
            .collect())
    }

    /// The processes' use summed per cgroup, keyed by what `cgroup_of` says
    /// of each pid (the collector's cgroup ids; see [`cgroup_id_of`]).
    /// Processes it knows nothing of (gone, or in no cgroup of interest) are
    /// left out.
    pub fn per_cgroup(
        processes: &[ProcessUsage],
        cgroup_of: impl Fn(u32) -> Option<u64>,
    ) -> HashMap<u64, CgroupUsage> {
        let mut out: HashMap<u64, CgroupUsage> = HashMap::new();
        for p in processes {
            let Some(id) = cgroup_of(p.pid) else {
                continue;
            };
            let e = out.entry(id).or_default();
            e.memory_bytes += p.memory_bytes.unwrap_or(0);
            e.sm_utilization += p.sm_utilization.unwrap_or(0.0);
        }
        out
    }
}

/// The cgroup v2 id of process `pid` (the inode of its directory under the
/// hierarchy mounted at `cgroup_root`), from `/proc/<pid>/cgroup`.
pub fn cgroup_id_of(pid: u32, cgroup_root: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = cgroup_root.join(rel.trim().trim_start_matches('/'));
    std::fs::metadata(dir).ok().map(|m| m.ino())
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: NVML was initialised by load; the handle came from dlopen.
        unsafe {
            (self.api.shutdown)();
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
