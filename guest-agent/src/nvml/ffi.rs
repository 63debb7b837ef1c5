//! What NVML's calls share: its device handle, a GPU as a read enumerated it, and looking up
//! a function of the library (absent where this NVML lacks it).

use std::ffi::{c_void, CString};

/// `nvmlDevice_t`.
pub type Device = *mut c_void;

/// A GPU NVML enumerated this read: its index and handle (valid while NVML is initialised).
#[derive(Debug, Clone, Copy)]
pub struct Gpu {
    pub index: u32,
    pub(super) handle: Device,
}

/// dlsym of `name` as a function pointer of type `F`; None when the library lacks it.
///
/// # Safety
/// `F` must be the function's real C signature.
pub(super) unsafe fn symbol<F: Copy>(lib: *mut c_void, name: &'static str) -> Option<F> {
    let c = CString::new(name).ok()?;
    // SAFETY: lib is a live dlopen handle and c a valid C string.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() || std::mem::size_of::<F>() != std::mem::size_of::<*mut c_void>() {
        return None;
    }
    // SAFETY: F is a function pointer type of the same size (checked), and
    // the caller guarantees it is the symbol's signature.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}
