//! Which process a pid names, across reads: NVML names processes by pid alone, and a pid can
//! be reused between two reads (a process exits, another gets its number). The kernel's start
//! time (`/proc/<pid>/stat` field 22, clock ticks since boot) tells them apart.
//!
//! NVML lists every process holding a GPU at every read, busy or not, so reading each one's
//! start time at each read would make a tick cost grow with processes that did nothing. A pid
//! can only be reused once its process is gone, and a pidfd says when that happens: each
//! process seen is watched through one (in an epoll set), and its start time is read again
//! only after the kernel said it exited. Where the kernel gives no pidfd (before 5.3, or a pid
//! not visible), or past a quarter of the agent's open-file limit (the pidfds are open files,
//! and the agent's other work needs its own), the start time is read at every read.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use rustc_hash::FxHashMap;

/// The start time in `/proc/<pid>/stat`'s text: field 22, counted after the command name,
/// which is in parentheses and may itself hold spaces and parentheses. None for text that is
/// not a stat line.
pub fn start_time(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    // after the name: state is field 3, so start time (22) is the 20th field here
    after.split_whitespace().nth(19)?.parse().ok()
}

/// What is known of a pid seen at the previous read.
#[derive(Debug)]
struct Seen {
    start: u64,
    /// Watched for the process's exit (in [`Starts::exits`]); None: not watched (no pidfd,
    /// or it said the process exited), so the start time is read again at the next read.
    pidfd: Option<OwnedFd>,
    /// The read that last listed it.
    read: u64,
}

/// Start times of the processes seen at the previous read.
#[derive(Debug, Default)]
pub struct Starts {
    seen: FxHashMap<u32, Seen>,
    /// The epoll set of the pidfds (None where epoll failed: no process is watched).
    exits: Option<OwnedFd>,
    /// Processes watched now, and at most.
    watched: usize,
    watch_max: usize,
    reads: u64,
}

impl Starts {
    /// Reads the start time of each of `pids` whose process may have changed since the
    /// previous read (new, or its process exited) and returns those whose pid now names
    /// another process than at the previous read. A pid whose /proc entry is gone (the
    /// process exited) keeps no entry, nor does one not listed in this read.
    pub fn reused(&mut self, pids: impl IntoIterator<Item = u32>) -> Vec<u32> {
        self.check(
            pids,
            |pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .as_deref()
                    .and_then(start_time)
            },
            |pid| pidfd_open(pid).ok(),
        )
    }

    /// [`Starts::reused`] with the start times from `start_of` and the pidfds from `watch`
    /// (None: that pid cannot be watched).
    pub fn check(
        &mut self,
        pids: impl IntoIterator<Item = u32>,
        start_of: impl Fn(u32) -> Option<u64>,
        watch: impl Fn(u32) -> Option<OwnedFd>,
    ) -> Vec<u32> {
        if self.reads == 0 {
            self.exits = epoll().ok();
            self.watch_max = open_files_limit() / 4;
        }
        self.reads += 1;
        let read = self.reads;
        for pid in self.exited() {
            // closing it takes it out of the epoll set
            if let Some(fd) = self.seen.get_mut(&pid).and_then(|s| s.pidfd.take()) {
                drop(fd);
                self.watched -= 1;
            }
        }
        let mut reused = Vec::new();
        for pid in pids {
            if let Some(s) = self.seen.get_mut(&pid) {
                if s.read == read || s.pidfd.is_some() {
                    // listed twice in this read, or the same process as at the previous one
                    s.read = read;
                    continue;
                }
            }
            // watched before its start time is read: an exit after the watch began, and a
            // reuse of its pid, are told at the next read
            let pidfd = self
                .exits
                .as_ref()
                .filter(|_| self.watched < self.watch_max)
                .and_then(|ep| watch(pid).filter(|fd| add(ep, fd, pid).is_ok()));
            let Some(start) = start_of(pid) else {
                self.seen.remove(&pid);
                continue;
            };
            self.watched += usize::from(pidfd.is_some());
            // an entry found here was not watched (see above)
            let previous = self.seen.insert(pid, Seen { start, pidfd, read });
            if previous.is_some_and(|p| p.read == read - 1 && p.start != start) {
                reused.push(pid);
            }
        }
        let watched = &mut self.watched;
        self.seen.retain(|_, s| {
            let listed = s.read == read;
            if !listed && s.pidfd.is_some() {
                *watched -= 1;
            }
            listed
        });
        reused.sort_unstable();
        reused
    }

    /// The pids whose watched process exited, as the epoll set says now (without waiting).
    fn exited(&self) -> Vec<u32> {
        let Some(ep) = &self.exits else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            // SAFETY: an epoll fd this struct owns and a buffer of events.len() events.
            let n = unsafe {
                libc::epoll_wait(ep.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, 0)
            };
            if n <= 0 {
                break;
            }
            // a pidfd stays readable until closed: pids already handled are left out
            let fresh = events[..n as usize]
                .iter()
                .map(|e| e.u64 as u32)
                .filter(|pid| !out.contains(pid));
            let before = out.len();
            out.extend(fresh.collect::<Vec<_>>());
            if (n as usize) < events.len() || out.len() == before {
                break;
            }
        }
        out
    }
}

/// The soft limit on this process's open files.
fn open_files_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer to an rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 0;
    }
    usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
}

fn epoll() -> io::Result<OwnedFd> {
    // SAFETY: epoll_create1 takes flags and returns a new fd or -1.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds `pidfd` to the epoll set `ep`, its events naming `pid`.
fn add(ep: &OwnedFd, pidfd: &OwnedFd, pid: u32) -> io::Result<()> {
    let mut event = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: u64::from(pid),
    };
    // SAFETY: two fds owned by the caller and a valid event.
    let rc = unsafe {
        libc::epoll_ctl(
            ep.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            pidfd.as_raw_fd(),
            &mut event,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
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
        let unwatched = |_| None;
        assert!(s
            .check([1, 2], |p| Some(u64::from(p) * 10), unwatched)
            .is_empty());
        // pid 2 now started at another time; pid 3 is new; pid 1 exited
        let r = s.check([2, 3], |p| Some(if p == 2 { 99 } else { 30 }), unwatched);
        assert_eq!(r, [2]);
        // pid 1 back with another start: not seen at the previous read, so not "reused"
        assert!(s.check([1], |_| Some(5), unwatched).is_empty());
    }

    /// A watched process that is still there costs no read of its start time; one whose
    /// exit the kernel said is read again, and a new start there is a reused pid.
    #[test]
    fn a_watched_pid_is_read_again_only_after_its_process_exited() {
        use std::cell::Cell;
        let spawn = || {
            std::process::Command::new("sleep")
                .arg("60")
                .spawn()
                .unwrap()
        };
        let (mut a, mut b) = (spawn(), spawn());
        let (pa, pb) = (a.id(), b.id());
        let reads = Cell::new(0);
        // pa's start as read at each read: 1 until its process is gone, then 2 (another
        // process with its number)
        let next_start = Cell::new(1);
        let start_of = |p: u32| {
            reads.set(reads.get() + 1);
            Some(if p == pa { next_start.get() } else { 7 })
        };
        let watch = |p: u32| pidfd_open(p).ok();
        let mut s = Starts::default();
        assert!(s.check([pa, pb, pa], start_of, watch).is_empty());
        assert_eq!(reads.get(), 2, "each new pid once, even listed twice");
        assert_eq!(s.watched, 2);
        for _ in 0..3 {
            assert!(s.check([pa, pb], start_of, watch).is_empty());
        }
        assert_eq!(reads.get(), 2, "the same processes: no read");
        a.kill().unwrap();
        a.wait().unwrap();
        next_start.set(2);
        assert_eq!(s.check([pa, pb], start_of, watch), [pa]);
        assert_eq!(reads.get(), 3, "only the exited one read again");
        // a read that lists no process forgets them: b's next listing is read again
        assert!(s.check([0u32; 0], start_of, watch).is_empty());
        assert_eq!(s.watched, 0, "their pidfds closed");
        assert!(s.check([pb], start_of, watch).is_empty());
        assert_eq!(reads.get(), 4);
        b.kill().unwrap();
        b.wait().unwrap();
    }
}
