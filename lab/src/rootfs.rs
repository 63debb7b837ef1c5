//! Root filesystems built with `mmdebstrap` from Debian's packages, and the disk images the VMs
//! boot: one root filesystem per variant, one image per (variant, kernel) with that kernel's
//! modules in place so that the VM's own `modprobe` finds them (qdiscs, veth, netfilter).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use crate::cache::Cache;
use crate::kernel::Kernel;
use crate::{cmd, image, io_err, Error, Result};

/// The tools the scenarios use inside a VM: `ip`, `tc`, `ss`, `nstat` (iproute2), iperf3 for
/// traffic, modprobe (kmod) for the kernel's modules, curl for the agents' HTTP.
const TOOLS: &[&str] = &["iproute2", "iperf3", "procps", "curl", "kmod", "iptables"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// trixie, minbase, with the guest agent's libraries: for the guest agent and the host
    /// agent run directly by a scenario script as PID 1's child.
    Minbase,
    /// trixie with systemd as PID 1: the host agent's package under systemd 257.
    SystemdTrixie,
    /// bookworm with systemd as PID 1: the host agent's package under systemd 252.
    SystemdBookworm,
    /// minbase with the scheduler benchmark's peers and tools (`perf`, `bpftool`,
    /// libbpf-tools' `runqlat`): the overhead benchmark run by hand on another kernel. No test
    /// boots it, so a CI machine never builds it.
    Bench,
}

impl Variant {
    pub fn suite(self) -> &'static str {
        match self {
            Variant::Minbase | Variant::SystemdTrixie | Variant::Bench => "trixie",
            Variant::SystemdBookworm => "bookworm",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Variant::Minbase => "minbase",
            Variant::SystemdTrixie => "systemd-trixie",
            Variant::SystemdBookworm => "systemd-bookworm",
            Variant::Bench => "bench",
        }
    }

    pub fn systemd(self) -> bool {
        matches!(self, Variant::SystemdTrixie | Variant::SystemdBookworm)
    }

    fn packages(self) -> Vec<&'static str> {
        let mut p = TOOLS.to_vec();
        match self.suite() {
            // the guest agent links libelf and zlib (trixie renamed libelf1 for 64-bit time)
            "trixie" => p.extend(["libelf1t64", "zlib1g"]),
            _ => p.extend(["libelf1", "zlib1g"]),
        }
        if self == Variant::Bench {
            // perf bench sched pipe, bpf_stats per program, the peer
            p.extend(["linux-perf", "bpftool", "libbpf-tools", "util-linux"]);
        }
        if self.systemd() {
            // udev: device units (the serial console, virtio ports) appear, as on a host
            p.extend(["systemd-sysv", "dbus", "udev"]);
        }
        p
    }

    /// The `mmdebstrap` tarball of this variant, built when absent. The caller holds the
    /// cache lock.
    pub fn tarball(self, cache: &Cache) -> Result<PathBuf> {
        let packages = self.packages();
        let rel = format!("rootfs/{}-{:016x}.tar", self.name(), digest(&packages));
        cache.entry(&rel, |out| {
            eprintln!(
                "lab: mmdebstrap {} ({}) with {}",
                self.suite(),
                self.name(),
                packages.join(",")
            );
            cmd::run(
                Command::new("mmdebstrap")
                    .args(["--variant=minbase", "--quiet"])
                    .arg(format!("--include={}", packages.join(",")))
                    .arg(self.suite())
                    .arg(out)
                    .arg("http://deb.debian.org/debian"),
            )
            .map(|_| ())
        })
    }

    /// The boot disk of this variant for `kernel`, built when absent (from the tarball, the
    /// kernel's modules and the lab's in-guest files). The caller holds the cache lock.
    pub fn image(self, cache: &Cache, kernel: &Kernel) -> Result<PathBuf> {
        let tar = self.tarball(cache)?;
        let files = guest_files(self);
        let mut parts = vec![tar.display().to_string()];
        for (p, t, m) in &files {
            parts.extend([p.to_string(), t.to_string(), m.to_string()]);
        }
        let key = digest(&parts);
        let rel = format!(
            "images/{}-{}-{}-{key:016x}.img",
            self.name(),
            kernel.name,
            kernel.version
        );
        cache.entry(&rel, |out| {
            let dir = tempfile::tempdir_in(cache.root()).map_err(io_err("make a temporary dir"))?;
            let root = dir.path();
            cmd::run(Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(root))?;
            let modules = root.join("usr/lib/modules");
            std::fs::create_dir_all(&modules).map_err(io_err("create usr/lib/modules"))?;
            cmd::run(
                Command::new("cp")
                    .arg("-a")
                    .arg(kernel.modules())
                    .arg(modules.join(&kernel.release)),
            )?;
            for (path, text, mode) in &files {
                let p = root.join(path.trim_start_matches('/'));
                if let Some(parent) = p.parent() {
                    std::fs::create_dir_all(parent).map_err(io_err("lay out guest files"))?;
                }
                write_mode(&p, text, *mode)?;
            }
            if self.systemd() {
                let wants = root.join("etc/systemd/system/multi-user.target.wants");
                std::fs::create_dir_all(&wants).map_err(io_err("create wants"))?;
                let _ = std::fs::remove_file(wants.join("gpufeed-lab.service"));
                std::os::unix::fs::symlink(
                    "/etc/systemd/system/gpufeed-lab.service",
                    wants.join("gpufeed-lab.service"),
                )
                .map_err(io_err("enable gpufeed-lab.service"))?;
                // the console is the test's log, not a login prompt
                for getty in ["getty@tty1.service", "serial-getty@ttyS0.service"] {
                    let unit = root.join("etc/systemd/system").join(getty);
                    let _ = std::fs::remove_file(&unit);
                    std::os::unix::fs::symlink("/dev/null", &unit)
                        .map_err(io_err("mask the gettys"))?;
                }
            }
            image::ext4_from_dir(root, out, "root", 768)
        })
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Variant {
    type Err = Error;
    fn from_str(s: &str) -> Result<Variant> {
        match s {
            "minbase" => Ok(Variant::Minbase),
            "systemd-trixie" => Ok(Variant::SystemdTrixie),
            "systemd-bookworm" => Ok(Variant::SystemdBookworm),
            "bench" => Ok(Variant::Bench),
            _ => Err(Error::Lab(format!(
                "unknown variant {s:?}: one of minbase, systemd-trixie, systemd-bookworm, bench"
            ))),
        }
    }
}

/// Files the lab puts into every image of `variant`: (path, text, mode).
fn guest_files(variant: Variant) -> Vec<(&'static str, &'static str, u32)> {
    let mut f = vec![
        ("/etc/hostname", "lab\n", 0o644),
        ("/etc/hosts", "127.0.0.1 localhost lab\n", 0o644),
        (
            "/etc/fstab",
            "# the lab's disks are mounted by its initramfs\n",
            0o644,
        ),
    ];
    if variant.systemd() {
        f.push((
            "/etc/systemd/system/gpufeed-lab.service",
            include_str!("../guest/gpufeed-lab.service"),
            0o644,
        ));
    }
    f
}

fn write_mode(path: &Path, text: &str, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).map_err(io_err(format!("write {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io_err(format!("chmod {}", path.display())))
}

/// FNV-1a of the parts: stable across runs and Rust versions, so it can name cache entries
/// (an entry's inputs changed: a new name, built afresh).
pub(crate) fn digest<S: AsRef<str>>(parts: &[S]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.as_ref().bytes().chain(std::iter::once(0)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
