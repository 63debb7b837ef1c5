//! gpufeed's VM lab: boots the kernels users run (Debian's own cloud kernel packages) with
//! root filesystems built by `mmdebstrap`, under QEMU, for what the test machine is not: another
//! kernel, a `lockdown=confidentiality` boot, systemd as PID 1, a QEMU to watch, a kernel AER
//! driver fed by QEMU's error injection.
//!
//! Everything downloaded or built lives in a cache outside the work tree ([`Cache`]), made
//! once and reused while present. A VM ([`vm::Vm`]) always runs under a deadline and talks to
//! the test over a virtio-serial port in a line format ([`port`]); its console goes to a log
//! that a failure prints.

pub mod apt;
pub mod cache;
pub mod cmd;
pub mod image;
pub mod initramfs;
pub mod kernel;
pub mod payload;
pub mod port;
pub mod qmp;
pub mod rootfs;
pub mod vm;

pub use cache::Cache;
pub use kernel::{Kernel, KernelName};
pub use payload::Payload;
pub use rootfs::Variant;
pub use vm::{Vm, VmSpec};

/// What the lab's steps fail with: the command or file that failed, with what it said.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {output}")]
    Command {
        command: String,
        status: String,
        output: String,
    },
    #[error("{0}")]
    Lab(String),
    #[error("VM {name}: {what}\n--- console (last lines) ---\n{console}")]
    Vm {
        name: String,
        what: String,
        console: String,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}
