//! What the lab's tests share: the check that they may run here, the lock that keeps VMs
//! from running beside the suite's timing tests, and the workspace's binaries.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use gpufeed_lab::Cache;

/// Held while a test boots VMs: the suite's kernel tests take the same lock, so no
/// measurement runs beside a VM's CPU load (and no two VMs share the two cores).
pub struct LabLock(std::fs::File);

fn lock() -> LabLock {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(std::env::temp_dir().join("gpufeed-kernel-tests.lock"))
        .expect("the kernel tests' lock file");
    // SAFETY: flock on an fd we own.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
    LabLock(f)
}

/// The cache and the lock, when this machine can run the lab: root, QEMU, mmdebstrap. A
/// laptop without them skips; with `CI=true` a missing piece fails the test.
pub fn lab() -> Option<(Cache, LabLock)> {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root".to_string());
    }
    for tool in [
        "qemu-system-x86_64",
        "mmdebstrap",
        "mke2fs",
        "cpio",
        "depmod",
    ] {
        if !gpufeed_lab::cmd::have(tool) && !Path::new("/usr/sbin").join(tool).exists() {
            missing.push(tool.to_string());
        }
    }
    if !missing.is_empty() {
        let why = format!(
            "the VM lab needs {} (scripts/setup.sh installs them)",
            missing.join(", ")
        );
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true: {why}");
        }
        eprintln!("skipping: {why}");
        return None;
    }
    let lock = lock();
    Some((Cache::open().expect("the lab cache"), lock))
}

/// The workspace's target directory of this build (`target/debug`), where the agents'
/// binaries are: `cargo test --workspace` builds them before any test runs.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/debug/deps/<test>-<hash>
    exe.parent()
        .and_then(Path::parent)
        .expect("target/debug")
        .to_path_buf()
}

/// A binary of the workspace, built.
pub fn binary(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (cargo build --workspace)",
        p.display()
    );
    p
}

pub use gpufeed_testkit::repo;
