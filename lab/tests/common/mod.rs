//! What the lab's tests share: the check that they may run here, the lock that keeps their
//! VMs one at a time, and the workspace's binaries.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use gpufeed_lab::Cache;

/// Held while a test boots VMs: no two VMs share the two cores. The suite's kernel tests do
/// not wait for it: scripts/test.sh runs the lab beside them at SCHED_IDLE, so that their
/// tasks take a CPU from the emulator whenever they want one. A VM that must not be starved
/// meanwhile also holds the kernel tests' lock ([`lab_alone`]).
pub struct LabLock(Vec<std::fs::File>);

fn flock(name: &str) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(std::env::temp_dir().join(name))
        .unwrap_or_else(|e| panic!("the lock file {name}: {e}"));
    // SAFETY: flock on an fd we own.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
    f
}

/// The lab's own lock (taken first, then the kernel tests' where asked: one order, no
/// deadlock).
fn lock(alone: bool) -> LabLock {
    let mut held = vec![flock("gpufeed-lab-vms.lock")];
    if alone {
        held.push(flock("gpufeed-kernel-tests.lock"));
    }
    LabLock(held)
}

/// The cache and the lock, when this machine can run the lab: root, QEMU, mmdebstrap. A
/// laptop without them skips; with `CI=true` a missing piece fails the test.
pub fn lab() -> Option<(Cache, LabLock)> {
    lab_with(false)
}

/// [`lab`], and no kernel test beside it, for VMs that must not share the machine with one:
/// systemd's start timeout and watchdog in a VM fail when the emulator is starved of CPU for
/// a minute, as the suite's contention tests starve a SCHED_IDLE one (`host_package`); a VM
/// on a tap and a bridge of this machine puts packets, and drops, where kernel tests count
/// the whole node's (`stream_vm`: a tap's drop once read as an unattributed tc drop).
pub fn lab_alone() -> Option<(Cache, LabLock)> {
    lab_with(true)
}

fn lab_with(alone: bool) -> Option<(Cache, LabLock)> {
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
    let lock = lock(alone);
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
