//! Which process a pid names, across reads: NVML names processes by pid alone, and a pid can
//! be reused between two reads (a process exits, another gets its number). The kernel's start
//! time (`/proc/<pid>/stat` field 22, clock ticks since boot) tells them apart.

use std::collections::HashMap;

/// The start time in `/proc/<pid>/stat`'s text: field 22, counted after the command name,
/// which is in parentheses and may itself hold spaces and parentheses. None for text that is
/// not a stat line.
pub fn start_time(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    // after the name: state is field 3, so start time (22) is the 20th field here
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Start times of the processes seen at the previous read.
#[derive(Debug, Default)]
pub struct Starts {
    seen: HashMap<u32, u64>,
}

impl Starts {
    /// Reads the start time of each of `pids` and returns those whose pid now names another
    /// process than at the previous read. A pid whose /proc entry is gone (the process
    /// exited) keeps no entry.
    pub fn reused(&mut self, pids: impl IntoIterator<Item = u32>) -> Vec<u32> {
        self.check(pids, |pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .as_deref()
                .and_then(start_time)
        })
    }

    /// [`Starts::reused`] with the start times from `start_of`.
    pub fn check(
        &mut self,
        pids: impl IntoIterator<Item = u32>,
        start_of: impl Fn(u32) -> Option<u64>,
    ) -> Vec<u32> {
        let mut now = HashMap::new();
        let mut reused = Vec::new();
        for pid in pids {
            let Some(start) = start_of(pid) else { continue };
            if self.seen.get(&pid).is_some_and(|s| *s != start) {
                reused.push(pid);
            }
            now.insert(pid, start);
        }
        self.seen = now;
        reused.sort_unstable();
        reused.dedup();
        reused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_after_a_name_with_spaces_and_parentheses() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 5 6 0 0 20 0 1 0 987654 1000 100";
        assert_eq!(start_time(stat), Some(987_654));
        assert_eq!(start_time("garbage"), None);
        assert_eq!(start_time("1 (x) S 1"), None);
        assert_eq!(start_time(""), None);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(start_time(&own).is_some());
    }

    #[test]
    fn a_pid_with_another_start_time_is_reused() {
        let mut s = Starts::default();
        assert!(s.check([1, 2], |p| Some(u64::from(p) * 10)).is_empty());
        // pid 2 now started at another time; pid 3 is new; pid 1 exited
        let r = s.check([2, 3], |p| Some(if p == 2 { 99 } else { 30 }));
        assert_eq!(r, [2]);
        // pid 1 back with another start: not seen at the previous read, so not "reused"
        assert!(s.check([1], |_| Some(5)).is_empty());
    }
}
