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

pub mod sm_time;

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr, CString};

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

/// One GPU's PCIe link as NVML reports it now (in a VM: as the guest's driver sees it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkState {
    pub gpu: u32,
    /// Current PCIe generation and width (an idle GPU lowers its generation).
    pub generation: u32,
    pub width: u32,
    /// Bytes per second the GPU sent (TX: towards the host) and received (RX: from the
    /// host) over the link, by NVML's throughput counters (a 20 ms sample, in KiB/s).
    pub tx_bytes_per_second: u64,
    pub rx_bytes_per_second: u64,
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
/// nvmlPcieUtilCounter_t
const PCIE_UTIL_TX_BYTES: c_int = 0;
const PCIE_UTIL_RX_BYTES: c_int = 1;
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
    curr_gen: unsafe extern "C" fn(Device, *mut c_uint) -> c_int,
    curr_width: unsafe extern "C" fn(Device, *mut c_uint) -> c_int,
    throughput: unsafe extern "C" fn(Device, c_int, *mut c_uint) -> c_int,
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
                curr_gen: symbol(lib, "nvmlDeviceGetCurrPcieLinkGeneration")?,
                curr_width: symbol(lib, "nvmlDeviceGetCurrPcieLinkWidth")?,
                throughput: symbol(lib, "nvmlDeviceGetPcieThroughput")?,
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

    /// Every GPU's compute processes with their memory, and the utilisation samples NVML
    /// took since the previous read ([`sm_time::SmClock`] books them).
    pub fn read(&mut self) -> Result<Vec<sm_time::GpuReading>, NvmlError> {
        let mut out = Vec::new();
        for (gpu, d) in self.devices()? {
            let samples = self.samples(gpu, d)?;
            let processes = self
                .running(d)?
                .into_iter()
                .map(|p| {
                    let mem =
                        (p.used_gpu_memory != VALUE_NOT_AVAILABLE).then_some(p.used_gpu_memory);
                    (p.pid, mem)
                })
                .collect();
            out.push(sm_time::GpuReading {
                gpu,
                read_at_us: realtime_us(),
                processes,
                samples,
            });
        }
        Ok(out)
    }

    /// Every GPU's link now: current generation and width, TX/RX throughput.
    pub fn links(&self) -> Result<Vec<LinkState>, NvmlError> {
        let mut out = Vec::new();
        for (gpu, d) in self.devices()? {
            let (mut generation, mut width, mut tx, mut rx): (c_uint, c_uint, c_uint, c_uint) =
                (0, 0, 0, 0);
            // SAFETY: a device handle from NVML and valid out-pointers.
            unsafe {
                check(
                    "nvmlDeviceGetCurrPcieLinkGeneration",
                    (self.api.curr_gen)(d, &mut generation),
                )?;
                check(
                    "nvmlDeviceGetCurrPcieLinkWidth",
                    (self.api.curr_width)(d, &mut width),
                )?;
                check(
                    "nvmlDeviceGetPcieThroughput",
                    (self.api.throughput)(d, PCIE_UTIL_TX_BYTES, &mut tx),
                )?;
                check(
                    "nvmlDeviceGetPcieThroughput",
                    (self.api.throughput)(d, PCIE_UTIL_RX_BYTES, &mut rx),
                )?;
            }
            out.push(LinkState {
                gpu,
                generation,
                width,
                tx_bytes_per_second: u64::from(tx) * 1024,
                rx_bytes_per_second: u64::from(rx) * 1024,
            });
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

    /// The utilisation samples newer than the last read's newest (NVML_ERROR_NOT_FOUND: none).
    fn samples(&mut self, gpu: u32, d: Device) -> Result<Vec<sm_time::UtilSample>, NvmlError> {
        let since = self.last_seen.get(&gpu).copied().unwrap_or(0);
        let mut n: c_uint = 0;
        // SAFETY: a null buffer asks for the sample count.
        let rc = unsafe { (self.api.utilization)(d, std::ptr::null_mut(), &mut n, since) };
        if rc == ERROR_NOT_FOUND {
            return Ok(Vec::new());
        }
        if rc != ERROR_INSUFFICIENT_SIZE && rc != SUCCESS {
            return Err(NvmlError::Call {
                call: "nvmlDeviceGetProcessUtilization",
                code: rc,
            });
        }
        // room for processes that start between the two calls; drivers have been seen to
        // report a count far above the processes, so the count is bounded
        let mut buf = vec![UtilizationSample::default(); (n as usize).min(1 << 12) + 8];
        let mut n = buf.len() as c_uint;
        // SAFETY: buf holds n elements of the struct nvml.h declares.
        let rc = unsafe { (self.api.utilization)(d, buf.as_mut_ptr(), &mut n, since) };
        if rc == ERROR_NOT_FOUND {
            return Ok(Vec::new());
        }
        check("nvmlDeviceGetProcessUtilization", rc)?;
        buf.truncate((n as usize).min(buf.len()));
        if let Some(newest) = buf.iter().map(|s| s.time_stamp).max() {
            self.last_seen.insert(gpu, newest.max(since));
        }
        Ok(buf
            .iter()
            .filter(|s| s.time_stamp > since)
            .map(|s| sm_time::UtilSample {
                pid: s.pid,
                timestamp_us: s.time_stamp,
                sm_percent: s.sm_util,
            })
            .collect())
    }
}

fn realtime_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
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
