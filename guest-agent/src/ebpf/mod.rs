//! The BPF toolbox: what loading, attaching and reading BPF objects takes, shared by the probe
//! units and by the cgroup tree (which follows the kernel's cgroup events through a BPF object
//! of its own): the kernel's BTF checks, errors, map handles and decoding, per-CPU sums, the
//! cgroup maps' userspace halves, the object loader's rules, libbpf's log, and the thread that
//! closes uprobe links off the tick.

pub mod cgroup_maps;
pub mod libbpf_log;
pub mod link_reaper;
pub mod object;

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use libbpf_rs::btf::types::{Struct, Typedef};
use libbpf_rs::btf::Btf;
use libbpf_rs::{MapCore, MapFlags, MapHandle};

/// Decodes a map value into its skeleton-generated type (a copy: map bytes
/// carry no alignment guarantee). None when the bytes are too short.
pub fn decode<T: plain::Plain + Default>(b: &[u8]) -> Option<T> {
    let mut v = T::default();
    plain::copy_from_bytes(&mut v, b).ok()?;
    Some(v)
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{probe}: {what} failed: {source}")]
    Libbpf {
        probe: &'static str,
        what: &'static str,
        source: libbpf_rs::Error,
    },
    /// A program breaks a rule the loader relies on (see [`object`]).
    #[error("{probe}: program {program}: {why}")]
    Rule {
        probe: &'static str,
        program: String,
        why: String,
    },
    #[error("{probe}: {what} failed: {source}")]
    Io {
        probe: &'static str,
        what: &'static str,
        source: std::io::Error,
    },
}

impl ProbeError {
    /// Whether the kernel refused for want of a privilege (EPERM), which no other way of
    /// loading would change. EACCES is not: the verifier answers it for a program it
    /// rejects (an untrusted pointer), which a fallback may avoid.
    pub fn is_permission(&self) -> bool {
        match self {
            ProbeError::Libbpf { source, .. } => errno_of(source) == Some(libc::EPERM),
            ProbeError::Io { source, .. } => source.raw_os_error() == Some(libc::EPERM),
            ProbeError::Rule { .. } => false,
        }
    }
}

/// The OS error under a libbpf error: from its source chain, else from its text
/// ("... (os error N)").
fn errno_of(e: &libbpf_rs::Error) -> Option<i32> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(code) = c
            .downcast_ref::<io::Error>()
            .and_then(io::Error::raw_os_error)
        {
            return Some(code);
        }
        cur = c.source();
    }
    let text = e.to_string();
    let n = text.rsplit("(os error ").next()?.split(')').next()?;
    n.parse().ok()
}

/// The object lacks a map or program (`what`) its loader names: an object built from
/// other sources than the loader's, reported at load.
pub(crate) fn not_in_object(probe: &'static str, what: &str, name: &str) -> ProbeError {
    ProbeError::Io {
        probe,
        what: "finding the object's maps and programs",
        source: std::io::Error::other(format!("the object has no {what} {name}")),
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

    /// Whether the kernel's struct `ty` has a member `member`.
    pub fn has_member(&self, ty: &str, member: &str) -> bool {
        self.0.as_ref().is_some_and(|b| {
            b.type_by_name::<Struct<'_>>(ty)
                .is_some_and(|t| t.iter().any(|m| m.name.is_some_and(|n| n == member)))
        })
    }

    /// Whether the kernel has the kfunc `name` (a BTF function of vmlinux).
    pub fn has_kfunc(&self, name: &str) -> bool {
        self.0.as_ref().is_some_and(|b| {
            b.type_by_name::<libbpf_rs::btf::types::Func<'_>>(name)
                .is_some()
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

/// Attaches each program to the hook it names (tracepoints, by the program's
/// section); the error names the hook that failed.
pub(crate) fn attach_all<'a>(
    probe: &'static str,
    progs: impl IntoIterator<Item = (&'a libbpf_rs::ProgramMut<'a>, &'static str)>,
) -> Result<Vec<libbpf_rs::Link>, ProbeError> {
    progs
        .into_iter()
        .map(|(prog, hook)| {
            prog.attach().map_err(|source| ProbeError::Libbpf {
                probe,
                what: hook,
                source,
            })
        })
        .collect()
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

/// Sets a map's size before load; the size lives in the unit, not in the C file.
pub(crate) fn set_max_entries(
    probe: &'static str,
    map: &mut libbpf_rs::OpenMapMut<'_>,
    entries: u32,
) -> Result<(), ProbeError> {
    map.set_max_entries(entries)
        .map_err(err(probe, "setting a map's max_entries"))
}

/// Keeps an owned handle of a loaded map.
pub(crate) fn handle<M: AsFd>(probe: &'static str, map: &M) -> Result<MapHandle, ProbeError>
where
    for<'a> MapHandle: TryFrom<&'a M, Error = libbpf_rs::Error>,
{
    MapHandle::try_from(map).map_err(err(probe, "taking a map handle"))
}
