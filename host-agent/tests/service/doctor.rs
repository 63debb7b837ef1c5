//! `gpufeed-host doctor`'s checks in their pass and fail states. Real kernel state where a test
//! machine can have it (the capabilities of a process that dropped some, tracefs mounted or
//! not); recorded sysfs trees where it cannot (a GPU behind a degraded link, the AER driver
//! bound to root ports, the lockdown mode). Then the binary: its exit status, and the running
//! agent's `gpufeed_check_ok`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gpufeed_host::doctor::{self, Finding, Status};
use gpufeed_host::roots::Roots;

fn get(f: &[Finding], check: &str) -> Finding {
    f.iter()
        .find(|x| x.check == check)
        .unwrap_or_else(|| panic!("no {check} in {f:?}"))
        .clone()
}

/// The recorded host: an eGPU behind Thunderbolt for VM 100, a plain-slot GPU for VM 101.
fn host_tree() -> Tree {
    let t = Tree::new();
    topology(&t);
    pve_basic(&t);
    t
}

fn gpu_link(t: &Tree) -> Finding {
    doctor::link::degraded(&Roots::new(t.root()), "testnode", &[])
}

#[test]
fn gpu_link_full_narrow_slow_and_idle() {
    let t = host_tree();
    // Every link at what both its ends can do: the x16 eGPU in a x4 enclosure is a x4 link.
    let f = gpu_link(&t);
    assert_eq!(f.status, Status::Pass, "{f:?}");
    assert_eq!(f.detail, "3 links at full speed and width");

    // The plain-slot GPU trained at x8 of x16 (a riser, a badly seated card).
    t.write(
        &format!("sys/devices/{PLAIN_GPU}/current_link_width"),
        "8\n",
    );
    let f = gpu_link(&t);
    assert_eq!(f.status, Status::Fail);
    assert_eq!(
        f.detail,
        "below capability: 0000:01:00.0 (for 0000:01:00.0): x8 of x16"
    );
    assert!(f.fix.as_deref().unwrap().contains("LnkSta"));
    t.write(
        &format!("sys/devices/{PLAIN_GPU}/current_link_width"),
        "16\n",
    );

    // The GPU's own link slower at full width: an idle GPU saving power, noted.
    t.write(
        &format!("sys/devices/{PLAIN_GPU}/current_link_speed"),
        "2.5 GT/s PCIe\n",
    );
    let f = gpu_link(&t);
    assert_eq!(f.status, Status::Pass, "{f:?}");
    assert!(
        f.detail
            .ends_with("slower while idle (GPUs lower the speed, full width): 0000:01:00.0 (for 0000:01:00.0): 2.5 GT/s of 16.0 GT/s"),
        "{f:?}"
    );

    // A slower link further up (Thunderbolt controller to root port) does not power-manage:
    // a failure.
    t.write(
        &format!("sys/devices/{TB_USP}/current_link_speed"),
        "2.5 GT/s PCIe\n",
    );
    let f = gpu_link(&t);
    assert_eq!(f.status, Status::Fail);
    assert_eq!(
        f.detail,
        "below capability: 0000:05:00.0 (for 0000:0a:00.0): 2.5 GT/s of 8.0 GT/s"
    );

    // A sleeping device is not read (that would wake it).
    t.write(
        &format!("sys/devices/{TB_USP}/power/runtime_status"),
        "suspended\n",
    );
    let f = gpu_link(&t);
    assert_eq!(f.status, Status::Pass, "{f:?}");
    assert!(
        f.detail
            .contains("not read (runtime-suspended): 0000:05:00.0"),
        "{f:?}"
    );

    // No device watched: not applicable.
    let empty = Tree::new();
    assert_eq!(gpu_link(&empty).status, Status::Skip);
}

#[test]
fn aer_owner_driver_bound_or_firmware_first() {
    let t = host_tree();
    let roots = Roots::new(t.root());
    // Firmware first: no port has the AER driver; the log says why.
    t.append_kmsg(
        "6,100,1000,-;acpi PNP0A08:00: _OSC: OS supports [ExtendedConfig ASPM ClockPM Segments MSI HPX-Type3]\n\
         6,101,1001,-;acpi PNP0A08:00: _OSC: platform does not support [AER]\n\
         6,102,1002,-;GHES: APEI firmware first mode is enabled by APEI bit.\n\
         6,103,1003,-;pci 0000:00:01.0: PME# supported from D0 D3hot D3cold\n",
    );
    let f = doctor::aer::owner(&roots);
    assert_eq!(f.status, Status::Fail, "{f:?}");
    assert!(
        f.detail.ends_with(
            "the kernel log says: acpi PNP0A08:00: _OSC: platform does not support [AER] | \
             GHES: APEI firmware first mode is enabled by APEI bit."
        ),
        "{f:?}"
    );
    assert!(f.fix.as_deref().unwrap().contains("OS native AER"));

    // The OS owns it: the port service driver `aer` is bound to the root ports.
    for port in ["0000:00:01.0:pcie002", "0000:00:1c.4:pcie002"] {
        std::fs::create_dir_all(t.p("sys/bus/pci_express/drivers/aer").join(port)).unwrap();
    }
    let f = doctor::aer::owner(&roots);
    assert_eq!(f.status, Status::Pass, "{f:?}");
    assert_eq!(
        f.detail,
        "the kernel's AER driver serves 0000:00:01.0:pcie002, 0000:00:1c.4:pcie002"
    );
}

#[test]
fn kernel_log_history_from_the_device() {
    if !require_root("kernel_log_history_from_the_device") {
        return;
    }
    // The real /dev/kmsg: the history is read without blocking and ends (EAGAIN), and it
    // holds what was just written to it.
    let mark = format!("gpufeed doctor test {}", std::process::id());
    std::fs::write("/dev/kmsg", format!("{mark}\n")).unwrap();
    let t0 = Instant::now();
    let log = doctor::aer::kernel_log(Path::new("/dev/kmsg"));
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(log.iter().any(|l| l == &mark), "{} records", log.len());
}

/// `<root>/proc/self` pointing at a real process's /proc entry.
fn proc_self(t: &Tree, target: &Path) {
    let _ = std::fs::remove_file(t.p("proc/self"));
    std::os::unix::fs::symlink(target, t.p("proc/self")).unwrap();
}

fn config(t: &Tree) -> gpufeed_host::config::Config {
    base_config(t, 100)
}

#[test]
fn capabilities_of_a_process_that_dropped_syslog() {
    if !require_root("capabilities_of_a_process_that_dropped_syslog") {
        return;
    }
    let t = host_tree();
    proc_self(&t, Path::new("/proc/self"));
    let f = get(&doctor::checks(&config(&t)), "capabilities");
    assert_eq!(f.status, Status::Pass, "{f:?}");

    // As a unit whose bounding set lost CAP_SYSLOG (34) and CAP_SYS_ADMIN (21) would run it.
    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            for cap in [21, 34] {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(200)); // past the exec
    proc_self(&t, &PathBuf::from(format!("/proc/{}", child.id())));
    let mut cfg = config(&t);
    let f = get(&doctor::checks(&cfg), "capabilities");
    // Without [bridge] netns only CAP_SYSLOG is needed.
    assert_eq!(f.status, Status::Fail, "{f:?}");
    assert!(
        f.detail.contains("lacks CAP_SYSLOG (reading /dev/kmsg"),
        "{f:?}"
    );
    assert!(!f.detail.contains("CAP_SYS_ADMIN"), "{f:?}");
    cfg.bridge.netns = Some("/run/netns/bridges".into());
    let f = get(&doctor::checks(&cfg), "capabilities");
    assert!(
        f.detail
            .contains("CAP_SYS_ADMIN (setns into [bridge] netns)"),
        "{f:?}"
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// tracefs mounted at `<root>/sys/kernel/tracing` for one test.
struct Tracefs(PathBuf);

impl Tracefs {
    fn mount(t: &Tree) -> Tracefs {
        let at = t.p("sys/kernel/tracing");
        std::fs::create_dir_all(&at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tracefs", "nodev"])
            .arg(&at)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount tracefs at {}", at.display());
        Tracefs(at)
    }
}

impl Drop for Tracefs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn tracefs_and_lockdown() {
    if !require_root("tracefs_and_lockdown") {
        return;
    }
    let t = host_tree();
    let f = get(&doctor::checks(&config(&t)), "tracefs");
    assert_eq!(f.status, Status::Fail);
    assert!(f
        .fix
        .as_deref()
        .unwrap()
        .contains("only through the kernel log"));
    let _tr = Tracefs::mount(&t);
    let f = get(&doctor::checks(&config(&t)), "tracefs");
    assert_eq!(f.status, Status::Pass, "{f:?}");

    // Lockdown: files (a running kernel's mode can only be raised).
    assert!(get(&doctor::checks(&config(&t)), "lockdown").passed());
    t.write(
        "sys/kernel/security/lockdown",
        "none [integrity] confidentiality\n",
    );
    assert!(get(&doctor::checks(&config(&t)), "lockdown").passed());
    t.write(
        "sys/kernel/security/lockdown",
        "none integrity [confidentiality]\n",
    );
    let f = get(&doctor::checks(&config(&t)), "lockdown");
    assert_eq!(f.status, Status::Fail);
    assert!(f.detail.contains("ras:aer_event"), "{f:?}");
}

/// The config file of a test run: the tree as root, watchers that need a live system off.
fn config_file(t: &Tree, dir: &Path) -> PathBuf {
    let p = dir.join("host.toml");
    std::fs::write(
        &p,
        format!(
            "host_id = \"testnode\"\nroot = {:?}\nmetrics_listen = \"127.0.0.1:0\"\n\
             [vm]\nqmp = false\n[bridge]\nenabled = false\n[host]\nenabled = false\n\
             [thunderbolt]\nuevents = false\n",
            t.root().display().to_string()
        ),
    )
    .unwrap();
    p
}

#[test]
fn doctor_command_and_the_running_agents_gauge() {
    if !require_root("doctor_command_and_the_running_agents_gauge") {
        return;
    }
    let t = host_tree();
    proc_self(&t, Path::new("/proc/self")); // the doctor's own process
    let _tr = Tracefs::mount(&t);
    std::fs::create_dir_all(t.p("sys/bus/pci_express/drivers/aer/0000:00:01.0:pcie002")).unwrap();
    let work = tempfile::tempdir().unwrap();
    let cfg = config_file(&t, work.path());
    let doctor = || {
        Command::new(env!("CARGO_BIN_EXE_gpufeed-host"))
            .args(["doctor", "--config"])
            .arg(&cfg)
            .output()
            .unwrap()
    };
    let o = doctor();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.ends_with("5 checks, 0 failed\n"), "{out}");

    t.write(
        &format!("sys/devices/{PLAIN_GPU}/current_link_width"),
        "4\n",
    );
    let o = doctor();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("FAIL  gpu_link"), "{out}");
    assert!(out.contains("x4 of x16"), "{out}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("1 checks failed"));

    // The running agent: the same verdicts as gpufeed_check_ok{check}.
    let log = work.path().join("agent.log");
    let mut agent = Command::new(env!("CARGO_BIN_EXE_gpufeed-host"))
        .args(["run", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let metrics = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        let addr = text
            .split("metrics on http://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .map(str::to_string);
        if let Some(m) = addr
            .and_then(|a| http_get(&a, "/metrics"))
            .filter(|m| m.contains("gpufeed_check_ok{check=\"gpu_link\""))
        {
            break m;
        }
        assert!(Instant::now() < deadline, "no gauge; log:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = agent.kill();
    let _ = agent.wait();
    for (check, v) in [("gpu_link", 0), ("aer_owner", 1), ("tracefs", 1)] {
        let line = format!("gpufeed_check_ok{{check=\"{check}\",host=\"testnode\"}} {v}");
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.lines().any(|l| l.contains("doctor: below capability: 0000:01:00.0") && l.contains("gpu_link")),
        "{text}"
    );
}
