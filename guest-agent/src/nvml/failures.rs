//! NVML calls that failed, counted per GPU, call and code, each kind logged once.
//!
//! One failing GPU must not hide the others: every call's failure is booked here and the
//! reading goes on without that one number. A GPU that is lost fails every tick, so a log line
//! per failure would flood the journal; the first of each (GPU, call, code) is logged and the
//! rest counted (`gpufeed_nvml_errors_total{gpu,call,code}`).

use std::collections::BTreeMap;
use std::ffi::c_int;

use super::codes;

/// One failed call: on which GPU (None: a call about no GPU, such as the device count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub gpu: Option<u32>,
    pub call: &'static str,
    pub code: c_int,
}

impl Failure {
    /// NVML's name of the code (`GPU_IS_LOST`).
    pub fn code_name(&self) -> &'static str {
        codes::name(self.code)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(g) = self.gpu {
            write!(f, "GPU {g}: ")?;
        }
        write!(
            f,
            "{} returned NVML_ERROR_{} ({})",
            self.call,
            self.code_name(),
            self.code
        )
    }
}

/// Key of a count: the `gpu` label ("" for calls about no GPU), the call, the code's name.
pub type FailureKey = (String, &'static str, &'static str);

/// Failure counts since start.
#[derive(Debug, Default)]
pub struct Failures {
    counts: BTreeMap<FailureKey, u64>,
}

impl Failures {
    /// Counts `failures`; logs each (GPU, call, code) the first time.
    pub fn book(&mut self, failures: impl IntoIterator<Item = Failure>) {
        for f in failures {
            let gpu = f.gpu.map(|g| g.to_string()).unwrap_or_default();
            let n = self.counts.entry((gpu, f.call, f.code_name())).or_default();
            if *n == 0 {
                tracing::warn!(
                    "NVML: {f}; that reading is left out, the other GPUs' and calls' go on \
                     (counted in gpufeed_nvml_errors_total, logged once)"
                );
            }
            *n += 1;
        }
    }

    /// Every count, by (gpu, call, code).
    pub fn counts(&self) -> &BTreeMap<FailureKey, u64> {
        &self.counts
    }

    /// All failures.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_per_gpu_call_and_code() {
        let mut f = Failures::default();
        let lost = Failure {
            gpu: Some(1),
            call: "nvmlDeviceGetMemoryInfo",
            code: 15,
        };
        f.book([lost, lost]);
        f.book([Failure {
            gpu: None,
            call: "nvmlDeviceGetCount_v2",
            code: 999,
        }]);
        assert_eq!(
            f.counts()[&("1".into(), "nvmlDeviceGetMemoryInfo", "GPU_IS_LOST")],
            2
        );
        assert_eq!(
            f.counts()[&(String::new(), "nvmlDeviceGetCount_v2", "UNKNOWN")],
            1
        );
        assert_eq!(f.total(), 3);
        assert_eq!(
            lost.to_string(),
            "GPU 1: nvmlDeviceGetMemoryInfo returned NVML_ERROR_GPU_IS_LOST (15)"
        );
    }
}
