//! One QEMU VM under a deadline. The VM boots the lab's initramfs, which mounts the root
//! image (as a snapshot: the cached image is never written) and the payload, and runs the
//! payload's scenario (directly, or as a systemd service). The scenario reports over the lab
//! port ([`crate::port`]); the console goes to a log that errors carry.
//!
//! Acceleration: KVM where the machine's `/dev/kvm` runs ordinary guests, QEMU's TCG
//! otherwise. The test machines' `/dev/kvm` is kvm-pvm, which runs only kernels built for PVM
//! (Debian's fault in their first BMI2 instruction), so there the lab uses TCG
//! (`GPUFEED_LAB_ACCEL=tcg|kvm` overrides).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cache::Cache;
use crate::kernel::{Kernel, KernelName};
use crate::port::{Missing, Port};
use crate::qmp::Qmp;
use crate::rootfs::Variant;
use crate::{cmd, initramfs, io_err, Error, Result};

/// What to boot.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// for logs and errors
    pub name: String,
    pub kernel: Kernel,
    pub variant: Variant,
    /// extra kernel command-line arguments (`lockdown=confidentiality`)
    pub cmdline: Vec<String>,
    pub memory_mb: u32,
    pub cpus: u32,
    /// `-M q35` (PCIe root ports, AER) instead of the default i440fx machine
    pub q35: bool,
    /// extra QEMU arguments (devices, netdevs)
    pub args: Vec<String>,
    /// the whole VM's life, boot included: QEMU is killed when it runs out
    pub deadline: Duration,
}

impl VmSpec {
    /// `kernel` (prepared into `cache`) with `variant`, 2 vCPUs, 1 GiB, a 4-minute deadline.
    pub fn new(cache: &Cache, name: &str, kernel: KernelName, variant: Variant) -> Result<VmSpec> {
        let _lock = cache.lock()?;
        let kernel = Kernel::prepare(cache, kernel, false)?;
        Ok(VmSpec {
            name: name.to_string(),
            kernel,
            variant,
            cmdline: Vec::new(),
            memory_mb: 1024,
            cpus: 2,
            q35: false,
            args: Vec::new(),
            deadline: Duration::from_secs(240),
        })
    }
}

pub struct Vm {
    pub name: String,
    child: Child,
    dir: tempfile::TempDir,
    pub port: Port,
    started: Instant,
    deadline: Duration,
    /// ends the deadline watcher when the VM is gone
    stop_watch: Option<mpsc::Sender<()>>,
    /// whether QEMU was killed at its deadline
    expired: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// The accelerator this machine can use for Debian's kernels.
pub fn accelerator() -> &'static str {
    match std::env::var("GPUFEED_LAB_ACCEL").as_deref() {
        Ok("kvm") => return "kvm",
        Ok("tcg") => return "tcg",
        _ => {}
    }
    // kvm-pvm runs only PVM guests; an ordinary kernel hangs on its first BMI2 instruction
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if kvm && !pvm {
        "kvm"
    } else {
        "tcg"
    }
}

impl Vm {
    /// Boots `spec` with `payload_image` as its payload disk and connects the lab port.
    pub fn start(cache: &Cache, spec: &VmSpec, payload_image: &Path) -> Result<Vm> {
        let (initrd, disk) = {
            let _lock = cache.lock()?;
            (
                initramfs::prepare(cache, &spec.kernel)?,
                spec.variant.image(cache, &spec.kernel)?,
            )
        };
        let dir = tempfile::Builder::new()
            .prefix("gpufeed-lab-vm")
            .tempdir()
            .map_err(io_err("make the VM's directory"))?;
        let sock = dir.path().join("lab.sock");
        let init = if spec.variant.systemd() {
            "/sbin/init"
        } else {
            "/payload/init"
        };
        let mut append = vec![
            "console=ttyS0".to_string(),
            "panic=-1".into(),
            "oops=panic".into(),
            format!("lab.init={init}"),
            // no time lost to the serial console's per-character cost under TCG
            "loglevel=4".into(),
        ];
        if spec.variant.systemd() {
            // the console is a log: no progress animation, no colour codes
            append.push("systemd.show_status=false".into());
        }
        append.extend(spec.cmdline.iter().cloned());
        let accel = accelerator();
        let mut c = Command::new("qemu-system-x86_64");
        // thread names as Proxmox has them ("CPU 0/TCG"): the host agent finds vCPUs by them
        let name = format!("{},debug-threads=on", spec.name);
        c.args([
            "-name",
            &name,
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
        ])
        .args(["-machine", if spec.q35 { "q35" } else { "pc" }])
        .args([
            "-accel",
            if accel == "tcg" {
                "tcg,thread=multi"
            } else {
                "kvm"
            },
        ])
        .args(["-cpu", if accel == "tcg" { "max" } else { "host" }])
        .args([
            "-smp",
            &spec.cpus.to_string(),
            "-m",
            &spec.memory_mb.to_string(),
        ])
        .arg("-kernel")
        .arg(&spec.kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(append.join(" "))
        .arg("-serial")
        .arg(format!("file:{}", dir.path().join("console.log").display()))
        .arg("-drive")
        .arg(format!(
            "file={},format=raw,if=virtio,snapshot=on",
            disk.display()
        ))
        .arg("-drive")
        .arg(format!(
            "file={},format=raw,if=virtio,readonly=on",
            payload_image.display()
        ))
        .args(["-device", "virtio-serial-pci"])
        .arg("-chardev")
        .arg(format!(
            "socket,id=lab,path={},server=on,wait=off",
            sock.display()
        ))
        .args(["-device", "virtserialport,chardev=lab,name=lab.0"])
        .arg("-qmp")
        .arg(format!(
            "unix:{},server=on,wait=off",
            dir.path().join("qmp.sock").display()
        ))
        .args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("qemu.err")).map_err(io_err("qemu.err"))?);
        // QEMU dies with the test process, whatever ends it
        unsafe {
            use std::os::unix::process::CommandExt;
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = c.spawn().map_err(io_err("start qemu-system-x86_64"))?;
        let (stop_watch, stop) = mpsc::channel::<()>();
        let expired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        {
            let (pid, deadline, expired) = (child.id() as i32, spec.deadline, expired.clone());
            std::thread::spawn(move || {
                if let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(deadline) {
                    expired.store(true, std::sync::atomic::Ordering::SeqCst);
                    // SAFETY: kill of our own child's pid (not yet reaped: Vm::drop reaps)
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            });
        }
        let mut vm = Vm {
            name: spec.name.clone(),
            child,
            port: match Port::connect(&sock, Duration::from_secs(20)) {
                Ok(p) => p,
                Err(e) => {
                    return Err(Error::Vm {
                        name: spec.name.clone(),
                        what: format!("lab port: {e}"),
                        console: std::fs::read_to_string(dir.path().join("qemu.err"))
                            .unwrap_or_default(),
                    })
                }
            },
            dir,
            started: Instant::now(),
            deadline: spec.deadline,
            stop_watch: Some(stop_watch),
            expired,
        };
        if let Some(status) = vm.child.try_wait().ok().flatten() {
            return Err(vm.error(&format!("QEMU exited at start ({status})")));
        }
        eprintln!(
            "lab: {} booting {} ({}, {accel}), console {}",
            vm.name,
            spec.kernel.release,
            spec.variant,
            vm.console_path().display()
        );
        Ok(vm)
    }

    pub fn console_path(&self) -> PathBuf {
        self.dir.path().join("console.log")
    }

    /// The last lines of the console and of QEMU's own error output.
    pub fn console_tail(&self, n: usize) -> String {
        let console = std::fs::read_to_string(self.console_path()).unwrap_or_default();
        let err = std::fs::read_to_string(self.dir.path().join("qemu.err")).unwrap_or_default();
        let mut s = cmd::tail(&console, n);
        if !err.trim().is_empty() {
            s.push_str("\n--- qemu ---\n");
            s.push_str(&cmd::tail(&err, 20));
        }
        s
    }

    /// An error about this VM, with its console.
    pub fn error(&self, what: &str) -> Error {
        Error::Vm {
            name: self.name.clone(),
            what: what.to_string(),
            console: self.console_tail(80),
        }
    }

    fn left(&self) -> Duration {
        self.deadline.saturating_sub(self.started.elapsed())
    }

    /// The value of the scenario's next `key` line, within `timeout` (and the VM's deadline).
    pub fn expect(&mut self, key: &str, timeout: Duration) -> Result<String> {
        let t = timeout.min(self.left());
        match self.port.expect(key, t) {
            Ok(v) => Ok(v),
            Err(Missing::Failed(why)) => Err(self.error(&format!("scenario failed: {why}"))),
            Err(Missing::Closed) => Err(self.error(&format!("VM ended before reporting {key}"))),
            Err(Missing::Timeout) => {
                let what = if self.expired.load(std::sync::atomic::Ordering::SeqCst)
                    || self.left().is_zero()
                {
                    format!("deadline ({:?}) passed before {key}", self.deadline)
                } else {
                    format!("no {key} within {t:?}")
                };
                Err(self.error(&what))
            }
        }
    }

    /// Sends a command line to the scenario.
    pub fn send(&mut self, line: &str) -> Result<()> {
        self.port
            .send(line)
            .map_err(|e| self.error(&format!("send {line:?}: {e}")))
    }

    /// The test's own QMP monitor.
    pub fn qmp(&self) -> Result<Qmp> {
        Qmp::connect(&self.dir.path().join("qmp.sock"), Duration::from_secs(10))
    }

    /// QEMU's process id (its vCPU threads are its tasks).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A directory that lives as long as the VM (sockets, pid files for the test).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Waits for the VM to power itself off within `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<()> {
        let end = Instant::now() + timeout.min(self.left());
        loop {
            if let Some(st) = self.child.try_wait().map_err(io_err("wait for QEMU"))? {
                if self.expired.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(self.error("killed at its deadline"));
                }
                return if st.success() {
                    Ok(())
                } else {
                    Err(self.error(&format!("QEMU exited with {st}")))
                };
            }
            if Instant::now() >= end {
                return Err(self.error("did not power off in time"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Seconds since QEMU started.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(s) = self.stop_watch.take() {
            let _ = s.send(());
        }
        if std::thread::panicking() {
            eprintln!(
                "--- {} console (last lines) ---\n{}",
                self.name,
                self.console_tail(60)
            );
        }
    }
}
