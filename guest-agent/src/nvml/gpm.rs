//! GPM (GPU performance monitoring, NVML R520+, Hopper and newer): the SM utilisation of each
//! MIG instance, where a MIG GPU keeps no per-process utilisation.
//!
//! GPM answers a metric between two samples: each read takes a new sample of every instance
//! that has processes and asks `NVML_GPM_METRIC_SM_UTIL` (the percentage of the instance's SMs
//! that were busy) between it and the instance's previous sample; the instance's SM time is
//! that share × the time between the two samples, the instance's SMs counted as the GPU's
//! share they are (an instance of 2 of 7 slices busy for a second is 2/7 of a GPU-second of
//! the node's price, see docs/metrics.md). An instance's first sample books nothing.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::time::Instant;

use super::codes::SUCCESS;
use super::failures::Failure;
use super::ffi::{symbol, Device, Gpu};

/// `nvmlGpmSample_t`: an opaque sample NVML allocates.
type Sample = *mut c_void;

const SUPPORT_VERSION: c_uint = 1;
const METRICS_GET_VERSION: c_uint = 1;
/// `NVML_GPM_METRIC_SM_UTIL`.
const SM_UTIL: c_uint = 2;
/// Metrics the request has room for: more than any NVML defines (`NVML_GPM_METRIC_MAX` has
/// grown across releases); NVML reads and writes only `numMetrics` of them.
const METRIC_SLOTS: usize = 256;

pub const QUERY: &str = "nvmlGpmQueryDeviceSupport";
pub const ALLOC: &str = "nvmlGpmSampleAlloc";
pub const FREE: &str = "nvmlGpmSampleFree";
pub const MIG_SAMPLE: &str = "nvmlGpmMigSampleGet";
pub const METRICS: &str = "nvmlGpmMetricsGet";

/// `nvmlGpmSupport_t`.
#[repr(C)]
struct Support {
    version: c_uint,
    is_supported_device: c_uint,
}

/// `nvmlGpmMetric_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Metric {
    metric_id: c_uint,
    nvml_return: c_int,
    value: f64,
    short_name: *mut c_char,
    long_name: *mut c_char,
    unit: *mut c_char,
}

/// `nvmlGpmMetricsGet_t`, with room for [`METRIC_SLOTS`] metrics.
#[repr(C)]
struct MetricsGet {
    version: c_uint,
    num_metrics: c_uint,
    sample1: Sample,
    sample2: Sample,
    metrics: [Metric; METRIC_SLOTS],
}

/// The GPM calls; all or none.
#[derive(Clone, Copy)]
pub struct Api {
    query: unsafe extern "C" fn(Device, *mut Support) -> c_int,
    alloc: unsafe extern "C" fn(*mut Sample) -> c_int,
    free: unsafe extern "C" fn(Sample) -> c_int,
    mig_sample: unsafe extern "C" fn(Device, c_uint, Sample) -> c_int,
    metrics: unsafe extern "C" fn(*mut MetricsGet) -> c_int,
}

impl Api {
    /// The GPM calls of the library `lib`, when it has all of them (drivers before R520 have
    /// none).
    ///
    /// # Safety
    /// `lib` is a live dlopen handle of an NVML.
    pub unsafe fn of(lib: *mut c_void) -> Option<Api> {
        // SAFETY: each type is the function's signature in nvml.h.
        unsafe {
            Some(Api {
                query: symbol(lib, QUERY)?,
                alloc: symbol(lib, ALLOC)?,
                free: symbol(lib, FREE)?,
                mig_sample: symbol(lib, MIG_SAMPLE)?,
                metrics: symbol(lib, METRICS)?,
            })
        }
    }
}

/// An instance's previous sample.
struct Previous {
    sample: Sample,
    at: Instant,
}

/// One MIG instance's SM time in one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceSm {
    pub gpu_instance: u32,
    /// The instance's SMs' busy time since its previous sample, ns.
    pub sm_ns: u64,
    /// The time since its previous sample, ns (`sm_ns` ÷ this: the share of its SMs busy).
    pub span_ns: u64,
}

/// The samples kept between reads, per (GPU, instance), and which GPUs have GPM.
#[derive(Default)]
pub struct Instances {
    previous: HashMap<(u32, u32), Previous>,
    supported: HashMap<u32, bool>,
}

// SAFETY: the samples are NVML allocations only this struct touches, through a thread-safe
// library.
unsafe impl Send for Instances {}

impl Instances {
    /// Whether `gpu` has GPM (asked once per GPU index).
    pub fn supported(&mut self, api: &Api, gpu: &Gpu, failures: &mut Vec<Failure>) -> bool {
        if let Some(s) = self.supported.get(&gpu.index) {
            return *s;
        }
        const NOT_SUPPORTED: c_int = 3;
        let mut s = Support {
            version: SUPPORT_VERSION,
            is_supported_device: 0,
        };
        // SAFETY: a device handle from NVML and a valid, versioned struct.
        let rc = unsafe { (api.query)(gpu.handle, &mut s) };
        let yes = match rc {
            SUCCESS => s.is_supported_device != 0,
            NOT_SUPPORTED => false,
            _ => {
                failures.push(Failure {
                    gpu: Some(gpu.index),
                    call: QUERY,
                    code: rc,
                });
                return false; // asked again at the next read
            }
        };
        self.supported.insert(gpu.index, yes);
        yes
    }

    /// The SM time of each of `instances` of `gpu` since its previous sample (none for an
    /// instance's first); a failed call is said and that instance books nothing this read.
    pub fn read(
        &mut self,
        api: &Api,
        gpu: &Gpu,
        instances: &[u32],
        failures: &mut Vec<Failure>,
    ) -> Vec<InstanceSm> {
        let mut out = Vec::new();
        let fail = |call, code, failures: &mut Vec<Failure>| {
            failures.push(Failure {
                gpu: Some(gpu.index),
                call,
                code,
            })
        };
        for &gi in instances {
            let mut sample: Sample = std::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            let rc = unsafe { (api.alloc)(&mut sample) };
            if rc != SUCCESS {
                fail(ALLOC, rc, failures);
                continue;
            }
            // SAFETY: a device handle from NVML and a sample NVML allocated.
            let rc = unsafe { (api.mig_sample)(gpu.handle, gi, sample) };
            let at = Instant::now();
            if rc != SUCCESS {
                fail(MIG_SAMPLE, rc, failures);
                // SAFETY: allocated above, not kept.
                unsafe { (api.free)(sample) };
                continue;
            }
            let Some(prev) = self
                .previous
                .insert((gpu.index, gi), Previous { sample, at })
            else {
                continue;
            };
            let mut get = MetricsGet {
                version: METRICS_GET_VERSION,
                num_metrics: 1,
                sample1: prev.sample,
                sample2: sample,
                metrics: [Metric {
                    metric_id: 0,
                    nvml_return: 0,
                    value: 0.0,
                    short_name: std::ptr::null_mut(),
                    long_name: std::ptr::null_mut(),
                    unit: std::ptr::null_mut(),
                }; METRIC_SLOTS],
            };
            get.metrics[0].metric_id = SM_UTIL;
            // SAFETY: a versioned request with two samples of the same instance.
            let rc = unsafe { (api.metrics)(&mut get) };
            // SAFETY: the previous sample is no longer needed.
            unsafe { (api.free)(prev.sample) };
            let m = get.metrics[0];
            if rc != SUCCESS || m.nvml_return != SUCCESS {
                let code = if rc != SUCCESS { rc } else { m.nvml_return };
                fail(METRICS, code, failures);
                continue;
            }
            let utilization = (m.value / 100.0).clamp(0.0, 1.0);
            let span_ns = at.saturating_duration_since(prev.at).as_nanos() as u64;
            out.push(InstanceSm {
                gpu_instance: gi,
                sm_ns: (utilization * span_ns as f64) as u64,
                span_ns,
            });
        }
        // instances that have no processes now start anew when they have some again
        let gpu_index = gpu.index;
        let gone: Vec<(u32, u32)> = self
            .previous
            .keys()
            .filter(|(g, gi)| *g == gpu_index && !instances.contains(gi))
            .copied()
            .collect();
        for k in gone {
            if let Some(p) = self.previous.remove(&k) {
                // SAFETY: a sample NVML allocated, no longer needed.
                unsafe { (api.free)(p.sample) };
            }
        }
        out
    }

    /// Frees every kept sample (before NVML shuts down).
    pub fn clear(&mut self, api: &Api) {
        for (_, p) in self.previous.drain() {
            // SAFETY: samples NVML allocated, no longer needed.
            unsafe { (api.free)(p.sample) };
        }
    }
}
