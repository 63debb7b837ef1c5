//! A small initramfs per kernel: a static busybox, the virtio modules the cloud kernels build
//! as modules (block, net, console; 6.1 also virtio_pci), decompressed so that busybox's
//! `insmod` can load them, and `/init` (`lab/guest/init`), which mounts the root disk and
//! switches to it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache::Cache;
use crate::kernel::Kernel;
use crate::{cmd, io_err, Error, Result};

/// What the VMs need before the root disk is mounted (those built in are skipped).
const WANTED: &[&str] = &["virtio_pci", "virtio_blk", "virtio_net", "virtio_console"];

const INIT: &str = include_str!("../guest/init");

/// The initramfs of `kernel`, built into the cache when absent.
pub fn prepare(cache: &Cache, kernel: &Kernel) -> Result<PathBuf> {
    let busybox = busybox()?;
    let rel = format!("initramfs/{}-{}.cpio.gz", kernel.name, kernel.version);
    cache.entry(&rel, |out| build(kernel, &busybox, out))
}

fn busybox() -> Result<PathBuf> {
    for p in ["/bin/busybox", "/usr/bin/busybox"] {
        let p = Path::new(p);
        if p.exists() {
            let ldd = Command::new("ldd").arg(p).output();
            let dynamic = ldd
                .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("=>"))
                .unwrap_or(false);
            if !dynamic {
                return Ok(p.to_path_buf());
            }
        }
    }
    Err(Error::Lab(
        "no static busybox (install Debian's busybox-static)".into(),
    ))
}

/// The modules to load for `wanted`, dependencies first, as paths relative to the modules
/// directory; a module built into the kernel is left out.
pub fn load_order(modules_dep: &str, builtin: &str, wanted: &[&str]) -> Result<Vec<String>> {
    let base = |path: &str| -> String {
        let file = path.rsplit('/').next().unwrap_or(path);
        file.split(".ko").next().unwrap_or(file).replace('-', "_")
    };
    let deps: HashMap<String, (String, Vec<String>)> = modules_dep
        .lines()
        .filter_map(|l| {
            let (m, d) = l.split_once(':')?;
            Some((
                base(m),
                (
                    m.to_string(),
                    d.split_whitespace().map(str::to_string).collect(),
                ),
            ))
        })
        .collect();
    let builtin: Vec<String> = builtin.lines().map(base).collect();
    let mut order: Vec<String> = Vec::new();
    for w in wanted {
        if builtin.iter().any(|b| b == w) {
            continue;
        }
        let (path, ds) = deps
            .get(*w)
            .ok_or_else(|| Error::Lab(format!("module {w} is neither built in nor a module")))?;
        // modules.dep lists a module's dependencies so that the last must load first
        for d in ds.iter().rev().chain(std::iter::once(path)) {
            if !order.contains(d) {
                order.push(d.clone());
            }
        }
    }
    Ok(order)
}

fn build(kernel: &Kernel, busybox: &Path, out: &Path) -> Result<()> {
    let dir = tempfile::tempdir().map_err(io_err("make a temporary directory"))?;
    let root = dir.path();
    for d in ["bin", "dev", "proc", "sys", "newroot", "modules"] {
        std::fs::create_dir_all(root.join(d)).map_err(io_err("lay out the initramfs"))?;
    }
    std::fs::copy(busybox, root.join("bin/busybox")).map_err(io_err("copy busybox"))?;
    write_exec(&root.join("init"), INIT)?;
    let mods = kernel.modules();
    let read = |f: &str| {
        std::fs::read_to_string(mods.join(f))
            .map_err(io_err(format!("read {f} of {}", kernel.release)))
    };
    let order = load_order(&read("modules.dep")?, &read("modules.builtin")?, WANTED)?;
    let mut names = Vec::new();
    for (i, rel) in order.iter().enumerate() {
        let src = mods.join(rel);
        let name = format!(
            "{i:02}-{}.ko",
            rel.rsplit('/')
                .next()
                .unwrap_or(rel)
                .split(".ko")
                .next()
                .unwrap_or(rel)
        );
        let dst = root.join("modules").join(&name);
        let tool = if rel.ends_with(".xz") {
            Some("xz")
        } else if rel.ends_with(".zst") {
            Some("zstd")
        } else if rel.ends_with(".gz") {
            Some("gzip")
        } else {
            None
        };
        match tool {
            Some(t) => {
                let data = Command::new(t)
                    .arg("-dc")
                    .arg(&src)
                    .output()
                    .map_err(io_err(format!("{t} -dc {}", src.display())))?;
                if !data.status.success() {
                    return Err(Error::Lab(format!("cannot decompress {}", src.display())));
                }
                std::fs::write(&dst, data.stdout).map_err(io_err("write a module"))?;
            }
            None => {
                std::fs::copy(&src, &dst).map_err(io_err("copy a module"))?;
            }
        }
        names.push(name);
    }
    std::fs::write(root.join("modules/order"), names.join("\n") + "\n")
        .map_err(io_err("write the module order"))?;
    cmd::sh(
        root,
        &format!(
            "find . -print0 | cpio --null -o -H newc --quiet | gzip -1 > '{}'",
            out.display()
        ),
    )?;
    Ok(())
}

pub(crate) fn write_exec(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).map_err(io_err(format!("write {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err(format!("chmod {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dependencies_load_first_and_builtins_are_skipped() {
        let dep = "kernel/drivers/block/virtio_blk.ko.xz: kernel/drivers/virtio/virtio_ring.ko.xz kernel/drivers/virtio/virtio.ko.xz\n\
                   kernel/drivers/net/virtio_net.ko.xz: kernel/net/core/failover.ko.xz kernel/drivers/virtio/virtio_ring.ko.xz kernel/drivers/virtio/virtio.ko.xz\n\
                   kernel/drivers/virtio/virtio.ko.xz:\n";
        let builtin = "kernel/drivers/virtio/virtio_pci.ko\n";
        let o = load_order(dep, builtin, &["virtio_pci", "virtio_blk", "virtio_net"]).unwrap();
        assert_eq!(
            o,
            vec![
                "kernel/drivers/virtio/virtio.ko.xz",
                "kernel/drivers/virtio/virtio_ring.ko.xz",
                "kernel/drivers/block/virtio_blk.ko.xz",
                "kernel/net/core/failover.ko.xz",
                "kernel/drivers/net/virtio_net.ko.xz",
            ]
        );
        assert!(load_order(dep, builtin, &["nope"]).is_err());
    }
}
