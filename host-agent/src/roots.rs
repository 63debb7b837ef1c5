//! File system roots. Every path the agent reads is built from one prefix (`--root DIR`), so
//! tests can point the agent at a recorded tree.

use std::path::{Path, PathBuf};

/// Where the shipped unit binds tracefs (`BindPaths=-/sys/kernel/tracing:...`).
pub const UNIT_TRACEFS: &str = "/run/gpufeed-host/tracing";

#[derive(Debug, Clone)]
pub struct Roots {
    root: PathBuf,
}

impl Roots {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Roots { root: root.into() }
    }

    /// True when the agent reads the live system (`/`).
    pub fn is_live(&self) -> bool {
        self.root == Path::new("/")
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Map an absolute system path (`/sys/bus/pci`) under the prefix.
    pub fn path(&self, abs: &str) -> PathBuf {
        self.root.join(abs.trim_start_matches('/'))
    }

    pub fn sys(&self) -> PathBuf {
        self.path("/sys")
    }
    pub fn pci_devices(&self) -> PathBuf {
        self.path("/sys/bus/pci/devices")
    }
    pub fn thunderbolt_devices(&self) -> PathBuf {
        self.path("/sys/bus/thunderbolt/devices")
    }
    /// tracefs as this process may write it: the unit's own view first
    /// ([`UNIT_TRACEFS`], bound there by systemd/gpufeed-host.service because its
    /// `ProtectKernelTunables=yes` makes everything under /sys read-only, tracefs included,
    /// and `ReadWritePaths=` cannot undo it), else the system's mount.
    pub fn tracefs(&self) -> PathBuf {
        let unit = self.path(UNIT_TRACEFS);
        if unit.join("events").is_dir() {
            return unit;
        }
        self.path("/sys/kernel/tracing")
    }
    pub fn net_class(&self) -> PathBuf {
        self.path("/sys/class/net")
    }
    pub fn pve(&self) -> PathBuf {
        self.path("/etc/pve")
    }
    pub fn run(&self) -> PathBuf {
        self.path("/run")
    }
    pub fn proc(&self) -> PathBuf {
        self.path("/proc")
    }
    pub fn dev(&self) -> PathBuf {
        self.path("/dev")
    }
}
