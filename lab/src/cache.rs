//! The lab's cache: kernels, root filesystems, initramfs images and disk images, made once
//! and reused while present. It lives outside the work tree (`/var/cache/gpufeed-lab`, or
//! `$GPUFEED_LAB_CACHE`), so a clean checkout reuses it and `git clean` never removes it.
//! Each entry is built under a temporary name and renamed into place, so an interrupted build
//! leaves nothing that looks finished; builds hold a lock so that tests running side by side
//! build an entry once.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::{io_err, Result};

pub struct Cache {
    root: PathBuf,
}

/// An exclusive hold on the cache's build lock; released when dropped.
pub struct Locked(File);

impl Drop for Locked {
    fn drop(&mut self) {
        // SAFETY: the fd is the open lock file owned by self.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Cache {
    /// The cache at `$GPUFEED_LAB_CACHE`, else `/var/cache/gpufeed-lab`; created if absent.
    pub fn open() -> Result<Cache> {
        let root = std::env::var_os("GPUFEED_LAB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/cache/gpufeed-lab"));
        Cache::at(root)
    }

    pub fn at(root: PathBuf) -> Result<Cache> {
        std::fs::create_dir_all(&root).map_err(io_err(format!("create {}", root.display())))?;
        Ok(Cache { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// Holds the build lock until the guard is dropped (other processes and threads wait).
    pub fn lock(&self) -> Result<Locked> {
        let path = self.root.join(".lock");
        let f = File::create(&path).map_err(io_err(format!("open {}", path.display())))?;
        // SAFETY: flock on an fd we own; blocks until the lock is ours.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io_err("flock the lab cache")(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Locked(f))
    }

    /// The entry `rel` (a file or a directory): returned as it is when present, else made by
    /// `build` at a temporary path and renamed into place. The caller holds [`Cache::lock`].
    pub fn entry(&self, rel: &str, build: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
        let path = self.root.join(rel);
        if path.exists() {
            return Ok(path);
        }
        let parent = path.parent().unwrap_or(&self.root).to_path_buf();
        std::fs::create_dir_all(&parent).map_err(io_err(format!("create {}", parent.display())))?;
        // the name keeps its extension: tools choose the output format by it (mmdebstrap)
        let tmp = parent.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            path.file_name().unwrap_or_default().to_string_lossy()
        ));
        remove(&tmp);
        let built = build(&tmp);
        if let Err(e) = built {
            remove(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, &path).map_err(io_err(format!("rename into {}", path.display())))?;
        Ok(path)
    }
}

/// Removes a file or a directory tree, whichever is there.
pub fn remove(path: &Path) {
    if path.is_dir() {
        let _ = std::fs::remove_dir_all(path);
    } else {
        let _ = std::fs::remove_file(path);
    }
}
