//! The cgroup v2 hierarchy: where it is mounted and which cgroups exist.
//!
//! The BPF maps are keyed by cgroup (cgroup-local storage), and userspace reads
//! them with an open fd of the cgroup's directory. `CgroupTree` keeps one such
//! fd per live cgroup, keyed by the cgroup id (the directory's inode number,
//! which is the kernfs id `bpf_get_current_cgroup_id()` returns on 64-bit).
//!
//! On a cgroup2 mount the tree follows the kernel's creation and removal
//! events (`events`) instead of walking the whole hierarchy every tick, so an
//! idle node's tick does not grow with the number of cgroups.

mod events;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::DirEntryExt;
use std::path::{Path, PathBuf};

use rustc_hash::FxHashMap;

pub use events::{Born, CgroupEvents, Died, Events, ProcessChanges};

/// Finds the cgroup2 mount point in a mountinfo text (`/proc/self/mountinfo`).
/// Field 5 is the mount point; the filesystem type follows the ` - ` separator.
pub fn cgroup2_mount_from(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        if post.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mount_point = pre.split_whitespace().nth(4)?;
        Some(PathBuf::from(unescape_mountinfo(mount_point)))
    })
}

/// mountinfo escapes space, tab, newline and backslash as \ooo octal.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn cgroup2_mount() -> io::Result<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    cgroup2_mount_from(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no cgroup2 filesystem in /proc/self/mountinfo",
        )
    })
}

/// A live cgroup: its path relative to the mount ("/" for the root) and an
/// open directory fd used as the key of cgroup-storage maps.
pub struct Cgroup {
    pub path: String,
    pub dir: File,
}

pub struct CgroupTree {
    root: PathBuf,
    pub cgroups: FxHashMap<u64, Cgroup>,
    /// Creation and removal as the kernel reports them; None: walk every refresh.
    events: Option<CgroupEvents>,
    walked: bool,
}

/// What changed in one refresh.
#[derive(Default)]
pub struct Changes {
    pub added: Vec<u64>,
    /// Removed cgroups that were in the tree (their directory fds, now of
    /// offline cgroups: the kernel no longer reads their storage through them).
    pub removed: HashMap<u64, Cgroup>,
    /// Every cgroup the kernel reported removed, known to the tree or not
    /// (one created and removed between two refreshes): who it was.
    pub died: Vec<Died>,
    /// The changes in processes the kernel reported; None when the tree does
    /// not follow them (or some were lost): every list is stale.
    pub processes: Option<ProcessChanges>,
}

/// CGROUP2_SUPER_MAGIC (linux/magic.h)
const CGROUP2_MAGIC: i64 = 0x6367_7270;

fn is_cgroup2(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes one struct statfs; the path is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == CGROUP2_MAGIC }
}

impl CgroupTree {
    /// A tree rooted at `root` that walks the hierarchy at every refresh
    /// (any directory: tests, and readers that must not load BPF).
    pub fn new(root: PathBuf) -> CgroupTree {
        CgroupTree {
            root,
            cgroups: FxHashMap::default(),
            events: None,
            walked: false,
        }
    }

    /// The agent's tree: on a cgroup2 mount it follows creation and removal
    /// through BPF when the kernel lets it load (else it walks, as `new`).
    pub fn following(root: PathBuf) -> CgroupTree {
        let mut tree = CgroupTree::new(root);
        if is_cgroup2(&tree.root) {
            let read_paths = crate::privileges::lockdown().as_deref() != Some("confidentiality");
            // without a process hook the cgroups are still followed
            let loaded = CgroupEvents::load(read_paths, true).or_else(|e| {
                tracing::info!(error = %e, "process changes unavailable: process lists follow activity");
                CgroupEvents::load(read_paths, false)
            });
            match loaded {
                Ok(e) => tree.events = Some(e),
                Err(e) => {
                    tracing::info!(error = %e, "cgroup events unavailable: walking the hierarchy every tick");
                }
            }
        }
        tree
    }

    /// Whether the tree follows kernel events rather than walking each refresh.
    pub fn follows_events(&self) -> bool {
        self.events.is_some()
    }

    /// Absolute path of a cgroup of this tree.
    pub fn path_of(&self, c: &Cgroup) -> PathBuf {
        self.root.join(c.path.trim_start_matches('/'))
    }

    /// Brings the tree up to date: from the kernel's creation and removal
    /// events (listing only the parents of new cgroups) when it follows them,
    /// else, and the first time, by walking the whole hierarchy.
    pub fn refresh(&mut self) -> io::Result<Changes> {
        let Some(events) = &mut self.events else {
            return self.walk();
        };
        // events first: whatever happens after this read is in the next one
        let ev = events.take();
        let processes = events.processes();
        let mut changes = if !self.walked || ev.overflowed {
            self.walked = true;
            self.walk()?
        } else {
            let mut changes = Changes::default();
            for d in &ev.died {
                if let Some(c) = self.cgroups.remove(&d.id) {
                    changes.removed.insert(d.id, c);
                }
            }
            if !self.add_born(ev.born, &mut changes) {
                let walked = self.walk()?;
                changes.added.extend(walked.added);
                changes.removed.extend(walked.removed);
            }
            changes
        };
        changes.died = ev.died;
        changes.processes = processes;
        Ok(changes)
    }

    /// Opens the new cgroups by listing their parents' directories, parents
    /// first. False when a parent is unknown (the caller walks instead).
    fn add_born(&mut self, mut born: Vec<Born>, changes: &mut Changes) -> bool {
        born.sort_by_key(|b| b.level);
        let mut listed = HashSet::new();
        for b in born {
            if self.cgroups.contains_key(&b.id) || !listed.insert(b.parent) {
                continue;
            }
            let Some(parent) = self.cgroups.get(&b.parent) else {
                return false;
            };
            let dir = self.path_of(parent);
            let entries = match std::fs::read_dir(&dir) {
                Ok(e) => e,
                // the parent went meanwhile: its removal is in the next events
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(_) => return false,
            };
            let found: Vec<(u64, PathBuf)> = entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| (e.ino(), e.path()))
                .filter(|(id, _)| !self.cgroups.contains_key(id))
                .collect();
            for (id, path) in found {
                if self.open(id, &path) {
                    changes.added.push(id);
                }
            }
        }
        true
    }

    /// Adds a cgroup to the tree with an open fd of its directory.
    fn open(&mut self, id: u64, path: &Path) -> bool {
        let Ok(dir) = File::open(path) else {
            return false;
        };
        let rel = path
            .strip_prefix(&self.root)
            .map(|p| format!("/{}", p.display()))
            .unwrap_or_default();
        self.cgroups.insert(id, Cgroup { path: rel, dir });
        true
    }

    /// Walks the hierarchy: opens newly created cgroups and drops removed ones.
    /// Only directory entries are considered (d_type, no stat per entry).
    fn walk(&mut self) -> io::Result<Changes> {
        let mut seen: HashMap<u64, PathBuf> = HashMap::with_capacity(self.cgroups.len() + 16);
        let root_ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&self.root)?);
        seen.insert(root_ino, self.root.clone());
        let mut stack = vec![self.root.clone()];
        while let Some(dir) = stack.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(e) => e,
                // removed between listing and reading: normal under churn
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    seen.insert(entry.ino(), entry.path());
                    stack.push(entry.path());
                }
            }
        }
        let mut changes = Changes::default();
        let gone: Vec<u64> = self
            .cgroups
            .keys()
            .filter(|id| !seen.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            if let Some(c) = self.cgroups.remove(&id) {
                changes.removed.insert(id, c);
            }
        }
        for (id, path) in seen {
            if !self.cgroups.contains_key(&id) && self.open(id, &path) {
                changes.added.push(id);
            }
        }
        Ok(changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_in_hybrid_mountinfo() {
        let mi = "\
25 30 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/cpu rw,relatime shared:11 - cgroup cgroup rw,cpu
";
        assert_eq!(
            cgroup2_mount_from(mi),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup2_mount_from("garbage\n\n - \n1 2 3"), None);
        let esc = "26 25 0:23 / /mnt/with\\040space rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount_from(esc),
            Some(PathBuf::from("/mnt/with space"))
        );
    }

    #[test]
    fn tree_tracks_dirs_and_removal() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("kubepods/burstable/podabc")).unwrap();
        std::fs::write(tmp.path().join("kubepods/cgroup.procs"), "").unwrap();
        let mut t = CgroupTree::new(tmp.path().to_path_buf());
        let c = t.refresh().unwrap();
        assert_eq!(c.added.len(), 4, "root + 3 dirs, files ignored");
        let mut paths: Vec<_> = t.cgroups.values().map(|c| c.path.clone()).collect();
        paths.sort();
        assert_eq!(
            paths,
            [
                "/",
                "/kubepods",
                "/kubepods/burstable",
                "/kubepods/burstable/podabc"
            ]
        );
        std::fs::remove_dir(tmp.path().join("kubepods/burstable/podabc")).unwrap();
        let c = t.refresh().unwrap();
        assert_eq!((c.added.len(), c.removed.len()), (0, 1));
    }
}
