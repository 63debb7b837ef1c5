//! ext4 disk images made from a directory (`mke2fs -d`): no loop mount, no root filesystem
//! of the machine touched.

use std::path::Path;
use std::process::Command;

use crate::{cmd, io_err, Result};

/// Writes an ext4 image of `dir` to `out`, labelled `label`, with `extra_mb` free beyond the
/// directory's size (the VM's scratch space: its writes go to a snapshot, but need room).
pub fn ext4_from_dir(dir: &Path, out: &Path, label: &str, extra_mb: u64) -> Result<()> {
    let du = cmd::run(Command::new("du").args(["-s", "-B1M"]).arg(dir))?;
    let used: u64 = du
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    // ext4's own metadata (inode tables, journal) on top of the files
    let size_mb = used + used / 5 + extra_mb + 16;
    let f = std::fs::File::create(out).map_err(io_err(format!("create {}", out.display())))?;
    f.set_len(size_mb << 20)
        .map_err(io_err(format!("size {}", out.display())))?;
    drop(f);
    cmd::run(
        Command::new(cmd::sbin("mke2fs"))
            .args([
                "-q",
                "-F",
                "-t",
                "ext4",
                "-L",
                label,
                "-E",
                "root_owner=0:0",
                "-d",
            ])
            .arg(dir)
            .arg(out),
    )
    .map(|_| ())
}
