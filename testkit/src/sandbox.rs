//! Cgroup sandboxes: a private subtree under the cgroup2 root, unique per test, removed
//! depth-first when dropped (also when the test fails), with whatever still runs in it killed.

use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// A private subtree `gpufeed-test-<unique>` under the cgroup2 root.
pub struct CgroupSandbox {
    /// The cgroup2 mount.
    pub root: PathBuf,
    /// The subtree this test owns.
    pub prefix: PathBuf,
}

impl CgroupSandbox {
    pub fn new() -> CgroupSandbox {
        let root = cgroup2_root();
        let prefix = root.join(format!("gpufeed-test-{}", crate::uniq()));
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
