//! Loading of the eBPF probes and reading of their per-cgroup aggregates.
//!
//! Each probe family is one BPF object (`bpf/<name>.bpf.c`) with a Rust module
//! here. Loading extracts owned map handles and links and lets the skeleton go,
//! so no borrowed skeleton lifetimes leak into the rest of the agent: the kernel
//! keeps programs alive through their links and maps through the handles.

pub mod cuda;
pub mod gpu_driver;
pub mod hist;
pub mod sched;
pub mod tc;
pub mod tcp;

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use libbpf_rs::btf::types::{Struct, Typedef};
use libbpf_rs::btf::Btf;
use libbpf_rs::{MapCore, MapFlags, MapHandle};

/// What the agent exports as `gpufeed_probe_up{probe}`.
#[derive(Debug, Clone)]
pub struct ProbeStatus {
    pub name: &'static str,
    pub up: bool,
    /// Why a probe is down (logged once).
    pub reason: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{probe}: {what} failed: {source}")]
    Libbpf {
        probe: &'static str,
        what: &'static str,
        source: libbpf_rs::Error,
    },
    #[error("{probe}: {what} failed: {source}")]
    Io {
        probe: &'static str,
        what: &'static str,
        source: std::io::Error,
    },
}

impl ProbeError {
    pub fn is_permission(&self) -> bool {
        match self {
            ProbeError::Libbpf { source, .. } => {
                matches!(source.kind(), libbpf_rs::ErrorKind::PermissionDenied)
                    || source.to_string().contains("Operation not permitted")
            }
            ProbeError::Io { source, .. } => source.kind() == std::io::ErrorKind::PermissionDenied,
        }
    }
}

pub(crate) fn err(
    probe: &'static str,
    what: &'static str,
) -> impl FnOnce(libbpf_rs::Error) -> ProbeError {
    move |source| ProbeError::Libbpf {
        probe,
        what,
        source,
    }
}

/// Kernel BTF, loaded once, to decide which hooks exist before loading programs.
pub struct KernelBtf(Option<Btf<'static>>);

impl KernelBtf {
    pub fn load() -> KernelBtf {
        KernelBtf(Btf::from_vmlinux().ok())
    }

    pub fn btf(&self) -> Option<&Btf<'static>> {
        self.0.as_ref()
    }

    /// Whether the kernel has tcx attachment (6.6).
    pub fn has_tcx(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|b| b.type_by_name::<Struct<'_>>("tcx_entry").is_some())
    }

    /// Whether the scheduler keeps per-task run-queue timestamps
    /// (`task_struct.sched_info`, CONFIG_SCHED_INFO) and a task's run queue is
    /// reachable from it (`sched_entity.cfs_rq`, `cfs_rq.rq`:
    /// CONFIG_FAIR_GROUP_SCHED).
    pub fn has_sched_info(&self) -> bool {
        self.has_member("task_struct", "sched_info")
            && self.has_member("sched_entity", "cfs_rq")
            && self.has_member("cfs_rq", "rq")
    }

    fn has_member(&self, ty: &str, member: &str) -> bool {
        self.0.as_ref().is_some_and(|b| {
            b.type_by_name::<Struct<'_>>(ty)
                .is_some_and(|t| t.iter().any(|m| m.name.is_some_and(|n| n == member)))
        })
    }

    /// Whether the kernel has the tracepoint that `tp_btf/<name>` attaches to.
    pub fn has_tracepoint(&self, name: &str) -> bool {
        self.0.as_ref().is_some_and(|b| {
            b.type_by_name::<Typedef<'_>>(&format!("btf_trace_{name}"))
                .is_some()
        })
    }
}

/// Looks up the cgroup-local storage of one cgroup (the key of a
/// BPF_MAP_TYPE_CGRP_STORAGE map is an open fd of the cgroup's directory).
/// `Ok(None)` when the cgroup has no entry yet.
pub fn lookup_cgroup(map: &MapHandle, cgroup_dir: BorrowedFd<'_>) -> io::Result<Option<Vec<u8>>> {
    let key = cgroup_dir.as_raw_fd().to_ne_bytes();
    match map.lookup(&key, MapFlags::ANY) {
        Ok(v) => Ok(v),
        Err(e) => Err(io::Error::other(e.to_string())),
    }
}

/// Sums a per-CPU array of u64 counters.
pub fn percpu_sum(map: &MapHandle, index: u32) -> u64 {
    map.lookup_percpu(&index.to_ne_bytes(), MapFlags::ANY)
        .ok()
        .flatten()
        .map(|cpus| {
            cpus.iter()
                .filter_map(|b| b.get(..8))
                .map(|b| u64::from_ne_bytes(b.try_into().unwrap()))
                .sum()
        })
        .unwrap_or(0)
}

/// Keeps an owned handle of a loaded map.
pub(crate) fn handle<M: AsFd>(probe: &'static str, map: &M) -> Result<MapHandle, ProbeError>
where
    for<'a> MapHandle: TryFrom<&'a M, Error = libbpf_rs::Error>,
{
    MapHandle::try_from(map).map_err(err(probe, "taking a map handle"))
}

/// Routes libbpf's own log lines into tracing (debug level), so that a failed
/// load shows our one-line summary rather than a wall of verifier output, which
/// stays available with RUST_LOG=debug.
pub fn route_libbpf_logs() {
    fn cb(level: libbpf_rs::PrintLevel, msg: String) {
        let msg = msg.trim_end();
        match level {
            libbpf_rs::PrintLevel::Warn => tracing::debug!(target: "libbpf", "{msg}"),
            _ => tracing::trace!(target: "libbpf", "{msg}"),
        }
    }
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, cb)));
}
