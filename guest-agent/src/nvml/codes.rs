//! NVML's return codes (`nvmlReturn_t` in nvml.h) and their names, which label
//! `gpufeed_nvml_errors_total{code}` and the log lines: a code an operator can
//! look up, not a number.

use std::ffi::c_int;

pub const SUCCESS: c_int = 0;
pub const ERROR_NOT_FOUND: c_int = 6;
pub const ERROR_INSUFFICIENT_SIZE: c_int = 7;
pub const ERROR_GPU_IS_LOST: c_int = 15;

/// NVML's name of `code` without the `NVML_ERROR_` prefix (`GPU_IS_LOST`);
/// `OTHER` for a code this table does not know (a newer driver's).
pub fn name(code: c_int) -> &'static str {
    match code {
        0 => "SUCCESS",
        1 => "UNINITIALIZED",
        2 => "INVALID_ARGUMENT",
        3 => "NOT_SUPPORTED",
        4 => "NO_PERMISSION",
        5 => "ALREADY_INITIALIZED",
        6 => "NOT_FOUND",
        7 => "INSUFFICIENT_SIZE",
        8 => "INSUFFICIENT_POWER",
        9 => "DRIVER_NOT_LOADED",
        10 => "TIMEOUT",
        11 => "IRQ_ISSUE",
        12 => "LIBRARY_NOT_FOUND",
        13 => "FUNCTION_NOT_FOUND",
        14 => "CORRUPTED_INFOROM",
        15 => "GPU_IS_LOST",
        16 => "RESET_REQUIRED",
        17 => "OPERATING_SYSTEM",
        18 => "LIB_RM_VERSION_MISMATCH",
        19 => "IN_USE",
        20 => "MEMORY",
        21 => "NO_DATA",
        22 => "VGPU_ECC_NOT_ENABLED",
        23 => "INSUFFICIENT_RESOURCES",
        24 => "FREQ_NOT_SUPPORTED",
        25 => "ARGUMENT_VERSION_MISMATCH",
        26 => "DEPRECATED",
        27 => "NOT_READY",
        28 => "GPU_NOT_FOUND",
        29 => "INVALID_STATE",
        999 => "UNKNOWN",
        _ => "OTHER",
    }
}

/// Whether `code` says the GPU itself is gone (fell off the bus, an eGPU
/// unplugged): the GPU is left out until it answers again, and its capacity
/// is read anew then.
pub fn gpu_gone(code: c_int) -> bool {
    // GPU_NOT_FOUND: newer drivers' answer for a device that went away
    code == ERROR_GPU_IS_LOST || code == 28
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_follow_nvml_h() {
        assert_eq!(super::name(3), "NOT_SUPPORTED");
        assert_eq!(super::name(4), "NO_PERMISSION");
        assert_eq!(super::name(7), "INSUFFICIENT_SIZE");
        assert_eq!(super::name(15), "GPU_IS_LOST");
        assert_eq!(super::name(999), "UNKNOWN");
        assert_eq!(super::name(-1), "OTHER");
        assert!(super::gpu_gone(15) && !super::gpu_gone(3));
    }
}
