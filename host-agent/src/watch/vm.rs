//! VM state per VMID from `/run/qemu-server/<vmid>.pid` and `/proc/<pid>` (plus a brief QMP
//! `query-status` for running/paused), and vCPU run delay from the QEMU threads' schedstat.

use super::recent::RecentKmsg;
use super::topology::Topology;
use super::unit::{Cx, Outcome, Starting, Unit, Watcher};
use crate::config::check::{range, Invalid};
use crate::metrics;
use crate::roots::Roots;
use gpufeed_shared::event::{HostEvent, KmsgClass, VmRunState, VmStateChange};
use prometheus::{CounterVec, IntGaugeVec, Registry};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// PID of the VM's QEMU if the pid file names a live process that is this VM's QEMU.
pub fn qemu_pid(roots: &Roots, vmid: u32) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(roots.run().join(format!("qemu-server/{vmid}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let proc_dir = roots.proc().join(pid.to_string());
    let cmdline = std::fs::read(proc_dir.join("cmdline")).ok()?;
    // QEMU argv carries `-id <vmid>`; accept a missing cmdline match only for kvm/qemu comms.
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let id = vmid.to_string();
    let has_id = args
        .windows(2)
        .any(|w| w[0] == b"-id" && w[1] == id.as_bytes());
    if has_id {
        return Some(pid);
    }
    let comm = std::fs::read_to_string(proc_dir.join("comm")).unwrap_or_default();
    if comm.trim() == "kvm" || comm.trim().starts_with("qemu") {
        return Some(pid);
    }
    None
}

/// One thread of a QEMU process: its schedstat wait time (ns), if it could be read, and whether
/// it is a vCPU ([`is_vcpu_thread`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadWait {
    pub tid: u32,
    pub wait_ns: Option<u64>,
    pub vcpu: bool,
}

/// Every thread of `pid` (`/proc/<pid>/task`), `None` when the process is gone. A thread whose
/// `schedstat` cannot be read (it is exiting, or the read failed) is listed without a value.
pub fn thread_waits(roots: &Roots, pid: u32) -> Option<Vec<ThreadWait>> {
    let task = roots.proc().join(format!("{pid}/task"));
    let mut out = Vec::new();
    for e in std::fs::read_dir(task).ok()?.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let p = e.path();
        // Without its name a thread cannot be counted or left out: it waits for the next read.
        let comm = std::fs::read_to_string(p.join("comm")).ok();
        let wait_ns = comm.as_ref().and_then(|_| {
            std::fs::read_to_string(p.join("schedstat"))
                .ok()?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        });
        out.push(ThreadWait {
            tid,
            wait_ns,
            vcpu: comm.is_some_and(|c| is_vcpu_thread(c.trim_end())),
        });
    }
    Some(out)
}

/// Whether a QEMU thread's name is a vCPU's: `CPU <n>/<accelerator>` (`CPU 0/KVM` on
/// Proxmox, `CPU 0/TCG` under emulation).
pub fn is_vcpu_thread(comm: &str) -> bool {
    comm.strip_prefix("CPU ")
        .and_then(|r| r.split_once('/'))
        .is_some_and(|(n, accel)| {
            !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && !accel.is_empty()
        })
}

/// Last read of one thread.
#[derive(Debug, Clone, Copy)]
struct Seen {
    wait_ns: u64,
    at: Instant,
}

/// The vCPU run delay of one QEMU process, tracked per thread.
///
/// Why per thread: the sum over the threads falls whenever a thread exits, a read fails or a
/// vCPU is unplugged, and a sum that falls cannot be told from a new process. Per thread, the
/// counter grows by each thread's own increase since its last read, and that increase is
/// capped at the wall time since that read (a thread cannot wait longer than the time that
/// passed), so one interval adds at most its wall time × the number of threads counted.
#[derive(Debug, Default)]
pub struct RunDelay {
    pid: u32,
    threads: BTreeMap<u32, Seen>,
    last: Option<Instant>,
}

impl RunDelay {
    /// Fold in one read of the process's threads taken at `now`; returns the seconds to add.
    /// Counted are the vCPU threads, or all threads of a QEMU that names none. The first read of
    /// a process adds its threads' totals so far (the counter starts at the process's run
    /// delay); a thread first seen later (a vCPU plugged, a read that works again) adds at most
    /// the wall time since the previous read.
    pub fn update(&mut self, pid: u32, threads: &[ThreadWait], now: Instant) -> f64 {
        if pid != self.pid {
            // A new QEMU (restarted VM): its threads are all new, and it started after `last`.
            self.pid = pid;
            self.threads.clear();
        }
        let since_last = self.last.map(|t| now.saturating_duration_since(t));
        let any_vcpu = threads.iter().any(|t| t.vcpu);
        let mut add_ns: u64 = 0;
        for t in threads {
            let Some(wait) = t.wait_ns else {
                continue; // keep the last read: the next one that works takes up from there
            };
            let prev = self.threads.get(&t.tid).copied();
            let gained = match (prev, since_last) {
                // Capped at the wall time since this thread's last read.
                (Some(p), _) if wait >= p.wait_ns => {
                    (wait - p.wait_ns).min(now.saturating_duration_since(p.at).as_nanos() as u64)
                }
                // Lower than before: the tid was reused by a new thread since the last read.
                (Some(p), _) => wait.min(now.saturating_duration_since(p.at).as_nanos() as u64),
                (None, Some(dt)) => wait.min(dt.as_nanos() as u64),
                (None, None) => wait,
            };
            // vCPU threads when there are any, every thread otherwise.
            if t.vcpu == any_vcpu {
                add_ns = add_ns.saturating_add(gained);
            }
            self.threads.insert(
                t.tid,
                Seen {
                    wait_ns: wait,
                    at: now,
                },
            );
        }
        // Exited threads leave; their time is already counted.
        self.threads
            .retain(|tid, _| threads.iter().any(|t| t.tid == *tid));
        self.last = Some(now);
        add_ns as f64 / 1e9
    }
}

/// Ask QEMU for its run state over QMP (connect, negotiate, query, close).
pub fn qmp_status(sock: &Path, timeout: Duration) -> Option<String> {
    let s = UnixStream::connect(sock).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(timeout)).ok()?;
    let mut r = BufReader::new(s.try_clone().ok()?);
    let mut w = s;
    let mut line = String::new();
    r.read_line(&mut line).ok()?; // greeting
    w.write_all(b"{\"execute\":\"qmp_capabilities\"}\n").ok()?;
    line.clear();
    r.read_line(&mut line).ok()?;
    w.write_all(b"{\"execute\":\"query-status\"}\n").ok()?;
    for _ in 0..8 {
        line.clear();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let v: serde_json::Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(_) => continue,
        };
        if let Some(st) = v
            .get("return")
            .and_then(|x| x.get("status"))
            .and_then(|x| x.as_str())
        {
            return Some(st.to_string());
        }
    }
    None
}

pub fn map_qmp_status(s: &str) -> VmRunState {
    match s {
        "running" => VmRunState::Running,
        "internal-error" | "io-error" | "guest-panicked" | "shutdown" => VmRunState::Error,
        _ => VmRunState::Paused,
    }
}

#[derive(Debug, Default)]
pub struct VmPoller {
    states: BTreeMap<u32, VmRunState>,
    run_delay: BTreeMap<u32, RunDelay>,
    /// Ask QEMU's QMP socket for the run state (paused vs running).
    qmp: bool,
}

impl VmPoller {
    pub fn new(qmp: bool) -> Self {
        Self {
            qmp,
            ..Self::default()
        }
    }

    /// VMIDs with a config or a pid file.
    pub fn vmids(roots: &Roots, from_conf: &BTreeSet<u32>) -> BTreeSet<u32> {
        let mut v = from_conf.clone();
        if let Ok(rd) = std::fs::read_dir(roots.run().join("qemu-server")) {
            for e in rd.flatten() {
                if let Some(id) = e
                    .file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".pid"))
                    .and_then(|n| n.parse().ok())
                {
                    v.insert(id);
                }
            }
        }
        v
    }

    pub fn poll(
        &mut self,
        roots: &Roots,
        vmids: &BTreeSet<u32>,
        topo: &Topology,
        recent: &RecentKmsg,
        cause_window: Duration,
        metrics: &VmMetrics,
    ) -> Vec<HostEvent> {
        let mut out = Vec::new();
        for &vmid in vmids {
            let pid = qemu_pid(roots, vmid);
            let mut detail = None;
            let state = match pid {
                None => VmRunState::Stopped,
                Some(_) if self.qmp => {
                    let sock = roots.run().join(format!("qemu-server/{vmid}.qmp"));
                    match qmp_status(&sock, Duration::from_millis(300)) {
                        Some(s) => {
                            let st = map_qmp_status(&s);
                            detail = Some(s);
                            st
                        }
                        // QMP busy (qm holds it) or absent: the process runs.
                        None => self
                            .states
                            .get(&vmid)
                            .copied()
                            .filter(|s| *s != VmRunState::Stopped)
                            .unwrap_or(VmRunState::Running),
                    }
                }
                Some(_) => VmRunState::Running,
            };
            let id = vmid.to_string();
            metrics
                .up
                .with_label_values(&[&id])
                .set((state == VmRunState::Running) as i64);
            for s in [
                VmRunState::Running,
                VmRunState::Paused,
                VmRunState::Error,
                VmRunState::Stopped,
            ] {
                metrics
                    .state
                    .with_label_values(&[&id, s.as_str()])
                    .set((s == state) as i64);
            }
            if let Some((pid, threads)) = pid.and_then(|p| Some((p, thread_waits(roots, p)?))) {
                let add =
                    self.run_delay
                        .entry(vmid)
                        .or_default()
                        .update(pid, &threads, Instant::now());
                metrics.vcpu_run_delay.with_label_values(&[&id]).inc_by(add);
            }
            let old = self.states.insert(vmid, state);
            if let Some(old) = old {
                if old != state {
                    let cause = if state != VmRunState::Running {
                        let bdfs = topo.bdfs_of_vm(vmid);
                        recent
                            .matching(cause_window, |r| {
                                let dev_match = r.bdf.as_ref().is_some_and(|b| bdfs.contains(b));
                                let aerish = matches!(
                                    r.class,
                                    KmsgClass::AerSource
                                        | KmsgClass::AerDetail
                                        | KmsgClass::AerRecovery
                                        | KmsgClass::Dpc
                                        | KmsgClass::Vfio
                                        | KmsgClass::LinkDown
                                );
                                (aerish && dev_match)
                                    || (r.class == KmsgClass::VmStop && r.vmid == Some(vmid))
                            })
                            .into_iter()
                            .map(|r| r.text)
                            .collect()
                    } else {
                        vec![]
                    };
                    out.push(HostEvent::VmState(VmStateChange {
                        vmid,
                        old,
                        new: state,
                        detail,
                        cause,
                    }));
                }
            }
        }
        // A VM that is gone (no config, no pid file: destroyed or migrated away) leaves
        // /metrics too, else every VM this host ever ran would stay there.
        for gone in self.states.keys().filter(|k| !vmids.contains(k)) {
            metrics.remove_vm(*gone);
        }
        self.states.retain(|k, _| vmids.contains(k));
        self.run_delay.retain(|k, _| vmids.contains(k));
        out
    }
}

// ---- The unit: configuration, series, loop. ----

/// `[vm]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VmConfig {
    pub enabled: bool,
    pub poll_interval_ms: u64,
    /// Ask QEMU for running/paused through `/run/qemu-server/<vmid>.qmp` (brief connections).
    pub qmp: bool,
    /// Kernel log records (AER/vfio) this recent are attached as the cause of a stop.
    pub cause_window_ms: u64,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            enabled: true,
            poll_interval_ms: 1000,
            qmp: true,
            cause_window_ms: 10_000,
        }
    }
}

impl VmConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        range("vm.poll_interval_ms", self.poll_interval_ms, 10, 600_000)?;
        range("vm.cause_window_ms", self.cause_window_ms, 0, 3_600_000)
    }
}

pub struct VmMetrics {
    pub up: IntGaugeVec,
    pub state: IntGaugeVec,
    pub vcpu_run_delay: CounterVec,
}

impl VmMetrics {
    /// Drops every series of `vmid`.
    pub fn remove_vm(&self, vmid: u32) {
        let id = vmid.to_string();
        let _ = self.up.remove_label_values(&[&id]);
        let _ = self.vcpu_run_delay.remove_label_values(&[&id]);
        for s in [
            VmRunState::Running,
            VmRunState::Paused,
            VmRunState::Error,
            VmRunState::Stopped,
        ] {
            let _ = self.state.remove_label_values(&[&id, s.as_str()]);
        }
    }

    pub fn new(r: &Registry) -> VmMetrics {
        VmMetrics {
            up: metrics::int_gauge_vec(
                r,
                "gpufeed_host_vm_up",
                "1 if the VM's QEMU process runs and the guest is running",
                &["vmid"],
            ),
            state: metrics::int_gauge_vec(
                r,
                "gpufeed_host_vm_state",
                "1 for the VM's current state",
                &["vmid", "state"],
            ),
            vcpu_run_delay: metrics::counter_vec(
                r,
                "gpufeed_host_vcpu_run_delay_seconds_total",
                "Time the VM's vCPU threads waited for a host CPU (schedstat)",
                &["vmid"],
            ),
        }
    }
}

pub const UNIT: Unit = Unit {
    name: "vm",
    describe,
};

/// Builds the unit from its section `[vm]`, registering its series in `r`.
pub fn watcher(r: &Registry, cfg: VmConfig) -> Box<dyn Watcher> {
    Box::new(VmWatcher {
        metrics: Arc::new(VmMetrics::new(r)),
        cfg,
    })
}

struct VmWatcher {
    metrics: Arc<VmMetrics>,
    cfg: VmConfig,
}

impl Watcher for VmWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            let cfg = self.cfg;
            let m = self.metrics;
            let mut p = VmPoller::new(cfg.qmp);
            let vmids = VmPoller::vmids(&a.roots, &a.topo.vmids());
            p.poll(
                &a.roots,
                &vmids,
                &a.topo.get(),
                &a.recent,
                Duration::ZERO,
                &m,
            );
            Outcome::On(vec![tokio::spawn(async move {
                let mut iv = a.ticker(cfg.poll_interval_ms);
                iv.tick().await;
                // Beats once a poll came back: a QMP socket or /proc read that never returns
                // (the poll waits on it) stops it.
                let beat = a.heartbeat("vm", cfg.poll_interval_ms);
                loop {
                    beat.now();
                    iv.tick().await;
                    let (a2, m2) = (a.clone(), m.clone());
                    let mut p2 = std::mem::take(&mut p);
                    // QMP and /proc reads may block briefly: keep them off the runtime thread.
                    let (p3, evs) = tokio::task::spawn_blocking(move || {
                        let vmids = VmPoller::vmids(&a2.roots, &a2.topo.vmids());
                        let t = a2.topo.get();
                        let w = Duration::from_millis(cfg.cause_window_ms);
                        let evs = p2.poll(&a2.roots, &vmids, &t, &a2.recent, w, &m2);
                        (p2, evs)
                    })
                    .await
                    .unwrap_or_default();
                    p = p3;
                    a.emit_all(evs);
                }
            })])
        })
    }
}

fn describe(e: &HostEvent) -> Option<String> {
    let HostEvent::VmState(v) = e else {
        return None;
    };
    Some(format!(
        "vm {}: {} -> {}{}{}",
        v.vmid,
        v.old.as_str(),
        v.new.as_str(),
        v.detail
            .as_ref()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default(),
        if v.cause.is_empty() {
            String::new()
        } else {
            format!(" cause: {}", v.cause.join(" | "))
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vcpu_threads_by_name() {
        for c in ["CPU 0/KVM", "CPU 12/KVM", "CPU 1/TCG"] {
            assert!(is_vcpu_thread(c), "{c}");
        }
        for c in [
            "qemu-system-x86",
            "IO mon_iothread",
            "CPU /KVM",
            "CPU 0/",
            "worker",
        ] {
            assert!(!is_vcpu_thread(c), "{c}");
        }
    }

    /// A VM whose config and pid file are gone leaves no series; the others stay.
    #[test]
    fn series_of_a_gone_vm_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run/qemu-server");
        std::fs::create_dir_all(&run).unwrap();
        // VM 100 runs (a pid file naming a QEMU of VM 100 in the tree's /proc), 101 is stopped.
        std::fs::write(run.join("100.pid"), "4242\n").unwrap();
        let proc = dir.path().join("proc/4242");
        std::fs::create_dir_all(&proc).unwrap();
        std::fs::write(proc.join("cmdline"), "/usr/bin/kvm\0-id\x00100\0").unwrap();
        let roots = Roots::new(dir.path());
        let reg = Registry::new();
        let m = VmMetrics::new(&reg);
        let mut p = VmPoller::new(false);
        let (topo, recent) = (Topology::default(), RecentKmsg::default());
        let vmids_of = |reg: &Registry| metrics::series_by_label(reg, "vmid");
        p.poll(
            &roots,
            &BTreeSet::from([100, 101]),
            &topo,
            &recent,
            Duration::ZERO,
            &m,
        );
        let before = vmids_of(&reg);
        assert!(
            before.contains(&("gpufeed_host_vm_up".into(), "101".into())),
            "{before:?}"
        );
        assert!(
            before.contains(&("gpufeed_host_vm_state".into(), "101".into())),
            "{before:?}"
        );
        // 101's config is deleted.
        p.poll(
            &roots,
            &BTreeSet::from([100]),
            &topo,
            &recent,
            Duration::ZERO,
            &m,
        );
        let after = vmids_of(&reg);
        assert!(after.iter().all(|(_, id)| id == "100"), "{after:?}");
        assert!(
            after.contains(&("gpufeed_host_vm_up".into(), "100".into())),
            "{after:?}"
        );
        assert_eq!(m.up.with_label_values(&["100"]).get(), 1);
    }
}
