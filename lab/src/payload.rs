//! The payload disk: what one test hands a VM (the agents' binaries, a scenario script and
//! its files), made per boot as a small ext4 image and mounted read-only at `/payload`. The
//! VM runs `/payload/init`, which sources the lab's shell helpers (`lab/guest/lab.sh`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::{image, io_err, Result};

const LAB_SH: &str = include_str!("../guest/lab.sh");

pub struct Payload {
    dir: tempfile::TempDir,
}

impl Payload {
    /// A payload whose `/payload/init` is `script` (a shell script; `. /payload/lab.sh`
    /// gives it the lab's helpers).
    pub fn new(script: &str) -> Result<Payload> {
        let dir = tempfile::tempdir().map_err(io_err("make the payload directory"))?;
        let p = Payload { dir };
        p.add("lab.sh", LAB_SH.as_bytes(), 0o644)?;
        p.add("init", script.as_bytes(), 0o755)?;
        Ok(p)
    }

    /// Adds a file with `bytes` at `rel` (directories made as needed).
    pub fn add(&self, rel: &str, bytes: &[u8], mode: u32) -> Result<&Payload> {
        let path = self.dir.path().join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io_err("lay out the payload"))?;
        }
        std::fs::write(&path, bytes).map_err(io_err(format!("write payload {rel}")))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(io_err(format!("chmod payload {rel}")))?;
        Ok(self)
    }

    /// Copies the file `src` to `rel`, keeping its mode.
    pub fn copy(&self, src: &Path, rel: &str) -> Result<&Payload> {
        let bytes = std::fs::read(src).map_err(io_err(format!("read {}", src.display())))?;
        let mode = std::fs::metadata(src)
            .map_err(io_err(format!("stat {}", src.display())))?
            .permissions()
            .mode();
        self.add(rel, &bytes, mode & 0o7777)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The disk image, written beside the payload's directory (removed with it).
    pub fn image(&self) -> Result<PathBuf> {
        let out = self.dir.path().with_extension("img");
        let files = self.dir.path();
        image::ext4_from_dir(files, &out, "payload", 8)?;
        Ok(out)
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.path().with_extension("img"));
    }
}
