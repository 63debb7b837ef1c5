//! Tests that need root: they run as root, skip with a line on an unprivileged laptop, and fail
//! under `CI=true`, so CI can never pass by skipping. Kernel tests measure latency and rates,
//! so they also serialise through one lock file in the temporary directory, across test
//! binaries and across checkouts on the same machine.

use std::os::fd::AsRawFd;

/// Held while a kernel test runs.
pub struct KernelLock(#[allow(dead_code)] std::fs::File);

/// Waits for, and takes, the machine's kernel-test lock.
pub fn kernel_lock() -> KernelLock {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(std::env::temp_dir().join("gpufeed-kernel-tests.lock"))
        .expect("opening the kernel-test lock file");
    // SAFETY: flock on a file descriptor this function owns.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock: {}", std::io::Error::last_os_error());
    KernelLock(f)
}

/// True when running as root. Otherwise panics under `CI=true`, or prints a SKIP line naming
/// `test` and returns false.
pub fn root_or_skip(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test}: needs root, and CI=true: kernel tests must run, not skip");
    }
    eprintln!("SKIP {test}: needs root (set CI=true to make this a failure)");
    false
}

/// For kernel tests: [`root_or_skip`], then the kernel-test lock.
pub fn require_root() -> Option<KernelLock> {
    root_or_skip("kernel test").then(kernel_lock)
}
