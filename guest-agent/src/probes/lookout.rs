//! Which of a pod's processes the GPU units look at (again) in a tick: each
//! new process once, then a known one only after its mappings may have
//! changed (a library loaded with dlopen(), a device file opened and mapped).
//!
//! The kernel says which processes exec'd or mapped something
//! (`cgroups::ProcessChanges::processes`), so a tick on a busy but steady
//! node reads nothing from /proc. Without that word (the hooks are missing,
//! or changes were lost) a process is looked at again when its address-space
//! size changed, which costs a read of /proc/<pid>/stat per process and tick.

use std::collections::{HashMap, HashSet};

use super::tick::PodProcesses;

#[derive(Debug, Default)]
pub struct Lookout {
    /// Processes looked at, with their address-space size then (0 when the
    /// kernel's word was used: a later size check then sees a change).
    known: HashMap<i32, u64>,
}

impl Lookout {
    /// Forgets the processes no longer listed.
    pub fn retain(&mut self, tgids: &PodProcesses) {
        self.known.retain(|&t, _| tgids.contains(t));
    }

    /// Whether to look at `tgid` now: it is new, or the kernel named it in
    /// `changed`, or (`changed` None) its address-space size moved since the
    /// last look. A process that is gone is not looked at.
    pub fn look(&mut self, tgid: i32, changed: Option<&HashSet<i32>>) -> bool {
        match changed {
            Some(set) => self.known.insert(tgid, 0).is_none() || set.contains(&tgid),
            None => match vsize(tgid) {
                Some(v) => self.known.insert(tgid, v) != Some(v),
                None => false,
            },
        }
    }
}

/// Virtual memory size of a process (field 23 of /proc/<pid>/stat).
pub fn vsize(tgid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{tgid}/stat")).ok()?;
    // the command name (field 2) may hold spaces and parentheses: skip past its end
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(20)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vsize_of_self() {
        let v = vsize(std::process::id() as i32).expect("own /proc/<pid>/stat");
        assert!(
            v > 1 << 20,
            "a running test has more than 1 MiB mapped: {v}"
        );
        assert_eq!(vsize(-1), None);
    }

    #[test]
    fn new_processes_once_then_named_or_grown_ones() {
        let me = std::process::id() as i32;
        let mut l = Lookout::default();
        let none = HashSet::new();
        assert!(l.look(me, Some(&none)), "new");
        assert!(!l.look(me, Some(&none)), "known, not named");
        assert!(
            l.look(me, Some(&HashSet::from([me]))),
            "named by the kernel"
        );
        // without the kernel's word: the size recorded as 0 differs once
        // (sizes after that move with other tests' allocations: not asserted)
        assert!(l.look(me, None));
        assert!(!l.look(-1, None), "gone");
        l.retain(&PodProcesses::default());
        assert!(l.known.is_empty());
    }
}
