//! Short attribute files read again and again by a poller (the PCIe link poller reads three
//! per link several times a second): with as few system calls as the filesystem allows.
//!
//! * Each device's directory is opened once and its attributes opened by their one name under
//!   it (`openat`), not by walking the whole sysfs path every time.
//! * On sysfs the attribute files themselves stay open and each poll is one `pread` at offset
//!   0: sysfs produces an attribute's text anew for every read that starts at offset 0 (its
//!   `show` runs again), so a kept file always reads the current value. Three system calls a
//!   read become one.
//! * On any other filesystem (a recorded tree in the tests and the demo, where a change is
//!   written as a new file renamed over the old, and a removal is a directory renamed away) an
//!   open file or directory would keep reading the old contents, so each read opens the
//!   attribute again by its whole path.
//!
//! A read that fails through kept handles (the device was removed, or replaced at the same
//! address: sysfs answers `ENODEV` on the old files and `ENOENT` under the old directory) drops
//! the device's handles and is tried once more from its path.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// The kept handles, by device (any key: the PCIe poller uses the BDF).
#[derive(Debug, Default)]
pub struct AttrFiles {
    devs: HashMap<String, Dev>,
}

#[derive(Debug)]
struct Dev {
    dir: File,
    /// The directory is on sysfs: attribute files are kept open.
    sysfs: bool,
    /// Open attribute files (sysfs only: other filesystems are read by path), by their name
    /// under `dir`.
    files: Vec<(String, File)>,
}

impl AttrFiles {
    /// Attribute `attr` (a path relative to the device's directory, `path()`) of device `dev`,
    /// trimmed. Errors are those of opening or reading the file (`NotFound` when it is not
    /// there).
    pub fn read(
        &mut self,
        dev: &str,
        path: impl Fn() -> PathBuf,
        attr: &str,
    ) -> std::io::Result<String> {
        let mut fresh = false;
        loop {
            let d = match self.devs.get_mut(dev) {
                Some(d) => d,
                None => {
                    fresh = true;
                    let dir = File::open(path())?;
                    let sysfs = nix::sys::statfs::fstatfs(&dir)
                        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::SYSFS_MAGIC);
                    self.devs.entry(dev.to_string()).or_insert(Dev {
                        dir,
                        sysfs,
                        files: Vec::new(),
                    })
                }
            };
            if !d.sysfs {
                // by its path every time, as anything but a kept handle reads it: a directory
                // renamed or replaced (a recorded tree's way of removing a device) is seen so
                return read_short(&path().join(attr));
            }
            match d.read(attr) {
                Ok(s) => return Ok(s),
                // Old handles: forget them and look again by the path.
                Err(_) if !fresh => {
                    self.devs.remove(dev);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Drops the handles of devices not in `keep`.
    pub fn retain(&mut self, keep: &HashSet<&str>) {
        self.devs.retain(|dev, _| keep.contains(dev.as_str()));
    }

    /// Drops the handles of device `dev` (it was removed).
    pub fn forget(&mut self, dev: &str) {
        self.devs.remove(dev);
    }

    /// Number of attribute files held open (for tests).
    pub fn open_files(&self) -> usize {
        self.devs.values().map(|d| d.files.len()).sum()
    }
}

impl Dev {
    fn read(&mut self, attr: &str) -> std::io::Result<String> {
        if let Some((_, f)) = self.files.iter().find(|(a, _)| a == attr) {
            return read_at_start(f);
        }
        use nix::fcntl::{openat, OFlag};
        let fd = openat(
            Some(self.dir.as_raw_fd()),
            attr,
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        // SAFETY: openat returned a new descriptor that nothing else owns.
        let f = unsafe { File::from_raw_fd(fd) };
        let text = read_at_start(&f)?;
        self.files.push((attr.to_string(), f));
        Ok(text)
    }
}

/// A short attribute by its path, trimmed (opened for this one read).
pub fn read_short(path: &std::path::Path) -> std::io::Result<String> {
    read_at_start(&File::open(path)?)
}

/// The file's text from offset 0, trimmed: one `pread` for the few bytes of a sysfs
/// attribute (no size query, no second read to see the end), the ordinary way beyond.
fn read_at_start(f: &File) -> std::io::Result<String> {
    let mut buf = [0u8; 64];
    let n = f.read_at(&mut buf, 0)?;
    if n < buf.len() {
        return Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string());
    }
    let mut all = buf.to_vec();
    loop {
        let mut more = [0u8; 4096];
        let m = f.read_at(&mut more, all.len() as u64)?;
        if m == 0 {
            break;
        }
        all.extend_from_slice(&more[..m]);
    }
    Ok(String::from_utf8_lossy(&all).trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rx_packets(files: &mut AttrFiles) -> u64 {
        files
            .read("lo", || "/sys/class/net/lo/statistics".into(), "rx_packets")
            .unwrap()
            .parse()
            .unwrap()
    }

    /// On sysfs the file stays open and every read is the current value: loopback's packet
    /// counter read through the kept file grows with the packets sent between two reads.
    #[test]
    fn a_kept_sysfs_file_reads_the_current_value() {
        let mut files = AttrFiles::default();
        let before = rx_packets(&mut files);
        assert_eq!(files.open_files(), 1, "kept open on sysfs");
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = sock.local_addr().unwrap();
        for _ in 0..5 {
            sock.send_to(b"x", to).unwrap();
        }
        let after = rx_packets(&mut files);
        assert!(after >= before + 5, "{before} -> {after}");
        assert_eq!(files.open_files(), 1);
    }

    /// Elsewhere each read opens the file again: a file replaced by a rename (how the
    /// recorded trees change) is read new; a device directory that went away is a
    /// `NotFound`, and one that comes back is read again.
    #[test]
    fn a_recorded_tree_is_read_anew_and_a_removed_device_is_not_found() {
        let tmp = tempfile::tempdir().unwrap();
        let dev = tmp.path().join("0000:0a:00.0");
        std::fs::create_dir(&dev).unwrap();
        std::fs::write(dev.join("current_link_width"), "4\n").unwrap();
        let mut files = AttrFiles::default();
        let read = |f: &mut AttrFiles| f.read("0000:0a:00.0", || dev.clone(), "current_link_width");
        assert_eq!(read(&mut files).unwrap(), "4");
        assert_eq!(files.open_files(), 0, "not sysfs: nothing kept");
        std::fs::write(dev.join("new~"), "1\n").unwrap();
        std::fs::rename(dev.join("new~"), dev.join("current_link_width")).unwrap();
        assert_eq!(read(&mut files).unwrap(), "1");
        std::fs::remove_dir_all(&dev).unwrap();
        let e = read(&mut files).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        std::fs::create_dir(&dev).unwrap();
        std::fs::write(dev.join("current_link_width"), "16\n").unwrap();
        assert_eq!(read(&mut files).unwrap(), "16");
    }
}
