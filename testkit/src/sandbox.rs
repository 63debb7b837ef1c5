//! Cgroup sandboxes: a private subtree under the cgroup2 root, unique per test, removed
//! depth-first when dropped (also when the test fails), with whatever still runs in it killed.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Every sandbox's name starts so; the owner's pid follows.
const PREFIX: &str = "gpufeed-test-";

/// Where cgroup v2 is mounted (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid
/// machine), from this process's mountinfo.
pub fn cgroup2_root() -> PathBuf {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").expect("reading mountinfo");
    mi.lines()
        .filter_map(|line| line.split_once(" - "))
        .find(|(_, post)| post.starts_with("cgroup2 "))
        .and_then(|(pre, _)| pre.split_whitespace().nth(4))
        .map(PathBuf::from)
        .expect("no cgroup2 mount")
}

/// A private subtree `gpufeed-test-<pid>-<n>` under the cgroup2 root, named for the process
/// that owns it.
pub struct CgroupSandbox {
    /// The cgroup2 mount.
    pub root: PathBuf,
    /// The subtree this test owns.
    pub prefix: PathBuf,
}

impl CgroupSandbox {
    /// Creates the sandbox, first removing those whose owner is gone: a test or benchmark
    /// killed outright (SIGKILL, a timeout) never runs its drop.
    pub fn new() -> CgroupSandbox {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let root = cgroup2_root();
        sweep_orphans(&root);
        let prefix = root.join(format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&prefix)
            .unwrap_or_else(|e| panic!("creating {}: {e}", prefix.display()));
        CgroupSandbox { root, prefix }
    }
}

impl CgroupSandbox {
    /// Pod `n` shaped as kubelet lays it out with the systemd-less cgroupfs driver:
    /// `kubepods/burstable/pod<uid>/<64-hex container id>` under the sandbox, so the agent
    /// takes it for a pod and its container. Returns the container's cgroup. The uid and id
    /// are made of `n` and this process's id: distinct per pod, and per concurrent sandbox
    /// owner (the agent keys pods by uid).
    pub fn kube_pod(&self, n: usize) -> PathBuf {
        let uid = format!("{n:08x}-0000-4000-8000-{:012x}", std::process::id());
        let ctr = self
            .prefix
            .join(format!("kubepods/burstable/pod{uid}"))
            .join(format!("{n:064x}"));
        std::fs::create_dir_all(&ctr).unwrap_or_else(|e| panic!("creating {}: {e}", ctr.display()));
        ctr
    }
}

impl Default for CgroupSandbox {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for CgroupSandbox {
    fn drop(&mut self) {
        remove_cgroup_tree(&self.prefix);
    }
}

/// Removes the sandboxes under `root` whose owning process no longer exists. Only names of
/// the form `gpufeed-test-<pid>-<n>` are considered; a live owner's (another test binary's
/// running beside this one) are left alone.
fn sweep_orphans(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(owner) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .filter(|(_, n)| n.parse::<u32>().is_ok())
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{owner}")).exists() {
            remove_cgroup_tree(&e.path());
        }
    }
}

/// Removes a cgroup directory tree bottom-up, killing the tasks still in it (a cgroup with
/// tasks cannot be removed; the kernel frees a dead task's membership shortly after, hence
/// the retries).
pub fn remove_cgroup_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup_tree(&e.path());
        }
    }
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
            // SAFETY: kill has no memory preconditions; a pid that exited meanwhile is ESRCH.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    for _ in 0..50 {
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sandbox whose owner was killed before its drop ran is removed by the next one made,
    /// subtree included; a sandbox whose owner lives (this process's first) is kept.
    #[test]
    fn a_killed_owners_sandbox_is_swept_by_the_next() {
        if !crate::root::root_or_skip("a_killed_owners_sandbox_is_swept_by_the_next") {
            return;
        }
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawning true");
        let dead = child.id();
        child.wait().expect("reaping true");
        let root = cgroup2_root();
        let left = root.join(format!("{PREFIX}{dead}-0"));
        let pod = left.join("kubepods/burstable/pod-left");
        std::fs::create_dir_all(&pod).expect("creating the left-behind sandbox");
        let first = CgroupSandbox::new();
        assert!(!left.exists(), "{} was not swept", left.display());
        let second = CgroupSandbox::new();
        assert!(first.prefix.exists(), "a live owner's sandbox was swept");
        assert_ne!(first.prefix, second.prefix);
        drop((first, second));
    }
}
