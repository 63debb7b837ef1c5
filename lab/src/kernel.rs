//! Kernels from Debian's own packages (`linux-image-cloud-amd64` of a suite and what it pins),
//! chosen by name: the kernels the product's users run.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use crate::apt::{self, Apt};
use crate::cache::Cache;
use crate::{cmd, io_err, Error, Result};

/// The lab's kernels, by the suite that ships them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelName {
    /// Debian 12's cloud kernel, 6.1.
    Bookworm,
    /// Debian 13's, 6.12: the series Talos 1.11 runs.
    Trixie,
    /// The newest in trixie-backports (7.x).
    TrixieBackports,
}

impl KernelName {
    pub const ALL: [KernelName; 3] = [
        KernelName::Bookworm,
        KernelName::Trixie,
        KernelName::TrixieBackports,
    ];

    pub fn suite(self) -> &'static str {
        match self {
            KernelName::Bookworm => "bookworm",
            KernelName::Trixie => "trixie",
            KernelName::TrixieBackports => "trixie-backports",
        }
    }

    /// Who runs it, for tables.
    pub fn what(self) -> &'static str {
        match self {
            KernelName::Bookworm => "Debian 12",
            KernelName::Trixie => "Debian 13, Talos 1.11's series",
            KernelName::TrixieBackports => "newest (trixie-backports)",
        }
    }
}

impl fmt::Display for KernelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.suite())
    }
}

impl FromStr for KernelName {
    type Err = Error;
    fn from_str(s: &str) -> Result<KernelName> {
        match s {
            "bookworm" | "debian12" | "6.1" => Ok(KernelName::Bookworm),
            "trixie" | "debian13" | "6.12" => Ok(KernelName::Trixie),
            "trixie-backports" | "newest" => Ok(KernelName::TrixieBackports),
            _ => Err(Error::Lab(format!(
                "unknown kernel {s:?}: one of bookworm (6.1), trixie (6.12), trixie-backports (newest)"
            ))),
        }
    }
}

/// A kernel unpacked in the cache.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub name: KernelName,
    /// the Debian package version (`6.12.117-1`)
    pub version: String,
    /// `uname -r` (`6.12.117+deb13-cloud-amd64`)
    pub release: String,
    pub vmlinuz: PathBuf,
    /// a root holding `lib/modules/<release>` with its `modules.dep`
    pub modules_root: PathBuf,
    /// the kernel's build configuration (`/boot/config-*`)
    pub config: PathBuf,
    /// the cache directory of this kernel
    pub dir: PathBuf,
}

const META: &str = "linux-image-cloud-amd64";

impl Kernel {
    /// The kernel `name` from the cache, or downloaded and unpacked into it when absent (or
    /// when `refresh` finds a newer version in its suite). The caller holds the cache lock.
    pub fn prepare(cache: &Cache, name: KernelName, refresh: bool) -> Result<Kernel> {
        if !refresh {
            if let Some(k) = Kernel::cached(cache, name)? {
                return Ok(k);
            }
        }
        let apt = Apt::open(cache, refresh)?;
        let version = apt::in_suite(&apt.candidates(META)?, META, name.suite())?;
        let rel = format!("kernels/{name}-{version}");
        let dir = cache.entry(&rel, |tmp| unpack(&apt, &version, tmp))?;
        Kernel::load(name, &dir)
    }

    /// The newest cached build of `name`, if any.
    pub fn cached(cache: &Cache, name: KernelName) -> Result<Option<Kernel>> {
        let prefix = format!("{name}-");
        let Ok(dir) = std::fs::read_dir(cache.path("kernels")) else {
            return Ok(None);
        };
        let mut found: Vec<(std::time::SystemTime, PathBuf)> = dir
            .flatten()
            .filter(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                // `trixie-` also prefixes `trixie-backports-`
                n.starts_with(&prefix)
                    && !n.starts_with('.')
                    && n[prefix.len()..]
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_ascii_digit())
            })
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        found.sort();
        match found.pop() {
            Some((_, d)) => Kernel::load(name, &d).map(Some),
            None => Ok(None),
        }
    }

    fn load(name: KernelName, dir: &Path) -> Result<Kernel> {
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .map(|s| s.trim().to_string())
                .map_err(io_err(format!("read {}/{f}", dir.display())))
        };
        Ok(Kernel {
            name,
            version: read("version")?,
            release: read("release")?,
            vmlinuz: dir.join("vmlinuz"),
            modules_root: dir.join("modules"),
            config: dir.join("config"),
            dir: dir.to_path_buf(),
        })
    }

    /// `lib/modules/<release>` of this kernel.
    pub fn modules(&self) -> PathBuf {
        self.modules_root.join("lib/modules").join(&self.release)
    }

    /// `major.minor` of the release (`6.12`).
    pub fn series(&self) -> String {
        self.release
            .split('.')
            .take(2)
            .collect::<Vec<_>>()
            .join(".")
    }

    /// Whether the kernel's configuration sets `option` (`CONFIG_X=y` or `=m`).
    pub fn has_config(&self, option: &str) -> bool {
        std::fs::read_to_string(&self.config)
            .map(|c| {
                c.lines()
                    .any(|l| l == format!("{option}=y") || l == format!("{option}=m"))
            })
            .unwrap_or(false)
    }
}

/// Downloads the image package at `version` and the kernel packages it pins (the 7.x series
/// splits the image into `linux-binary-*` and `linux-modules-*`), unpacks them and lays out
/// `vmlinuz`, `config`, `modules/lib/modules/<release>` (with a fresh `modules.dep`),
/// `release` and `version` in `out`.
fn unpack(apt: &Apt, version: &str, out: &Path) -> Result<()> {
    let mut wanted = vec![(META.to_string(), version.to_string())];
    let mut i = 0;
    while i < wanted.len() {
        let (n, v) = wanted[i].clone();
        for (dep, pinned) in apt.depends(&n, &v)? {
            // the parts of one kernel build pin each other's exact version (`linux-base-<v>`
            // holds the config); a loose dependency (kmod, initramfs-tools) is the system's
            if let (true, Some(pv)) = (dep.starts_with("linux-"), pinned) {
                if !wanted.iter().any(|(w, _)| *w == dep) {
                    wanted.push((dep, pv));
                }
            }
        }
        i += 1;
    }
    let debs = out.join("debs");
    let x = out.join("x");
    for d in [&debs, &x] {
        std::fs::create_dir_all(d).map_err(io_err("create the kernel's unpack directory"))?;
    }
    eprintln!(
        "lab: downloading {}",
        wanted
            .iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    apt.download(&wanted, &debs)?;
    for e in std::fs::read_dir(&debs).map_err(io_err("list the downloaded packages"))? {
        let p = e.map_err(io_err("list the downloaded packages"))?.path();
        cmd::run(Command::new("dpkg-deb").arg("-x").arg(&p).arg(&x))?;
    }
    // usrmerged packages keep modules under usr/lib/modules, older ones under lib/modules
    let modules = ["usr/lib/modules", "lib/modules"]
        .iter()
        .map(|d| x.join(d))
        .find(|d| d.is_dir())
        .ok_or_else(|| Error::Lab("the kernel packages hold no modules directory".into()))?;
    let release = std::fs::read_dir(&modules)
        .map_err(io_err("list the kernel's modules"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.contains('.'))
        .ok_or_else(|| Error::Lab("no kernel release under lib/modules".into()))?;
    let vmlinuz = [
        x.join("boot").join(format!("vmlinuz-{release}")),
        modules.join(&release).join("vmlinuz"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .ok_or_else(|| Error::Lab(format!("no vmlinuz for {release}")))?;
    let config = [
        x.join("boot").join(format!("config-{release}")),
        modules.join(&release).join("config"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .ok_or_else(|| Error::Lab(format!("no config for {release}")))?;
    std::fs::copy(&vmlinuz, out.join("vmlinuz")).map_err(io_err("copy vmlinuz"))?;
    std::fs::copy(&config, out.join("config")).map_err(io_err("copy the config"))?;
    let root = out.join("modules/lib/modules");
    std::fs::create_dir_all(&root).map_err(io_err("create modules root"))?;
    std::fs::rename(modules.join(&release), root.join(&release))
        .map_err(io_err("move the modules into place"))?;
    // Debian generates modules.dep at install time; the initramfs and the VM's modprobe need it
    cmd::run(
        Command::new(cmd::sbin("depmod"))
            .arg("-b")
            .arg(out.join("modules"))
            .arg(&release),
    )?;
    std::fs::write(out.join("release"), &release).map_err(io_err("write release"))?;
    std::fs::write(out.join("version"), version).map_err(io_err("write version"))?;
    std::fs::remove_dir_all(&x).map_err(io_err("remove the unpacked packages"))?;
    std::fs::remove_dir_all(&debs).map_err(io_err("remove the downloaded packages"))?;
    Ok(())
}
