//! The eBPF probes: one unit per BPF object, and the registry that lists them.
//!
//! A probe is one BPF file (`bpf/<name>.bpf.c`) and one unit here
//! (`<name>.rs`, or a folder for a large one) holding its loader, what it reads
//! per cgroup or interface with its delta state, and the series it exports
//! (`unit::Probe`). The collector, the exporter and `--probes` iterate over
//! [`UNITS`] and name no probe. Loading extracts owned map handles and links
//! and lets the skeleton go, so no borrowed skeleton lifetimes leak into the
//! rest of the agent: the kernel keeps programs alive through their links and
//! maps through the handles.

pub mod cgroup_batch;
pub mod cgroup_maps;
pub mod cuda;
pub mod gpu_driver;
pub mod hist;
pub mod lookout;
pub mod nvml;
pub mod sched;
pub mod signal;
pub mod tc;
pub mod tcp;
pub mod unit;

use unit::{LoadContext, UnitSpec, Units};

/// Every probe unit. Adding a probe adds one line here.
pub const UNITS: &[UnitSpec] = &[
    sched::UNIT,
    tcp::UNIT,
    tc::UNIT,
    gpu_driver::UNIT,
    cuda::UNIT,
    nvml::UNIT,
];

/// `--probes` names, in registry order.
pub fn names() -> Vec<&'static str> {
    UNITS.iter().flat_map(|u| u.names.iter().copied()).collect()
}

/// Help text of `--probes`, from the registry.
pub fn probes_help() -> String {
    format!(
        "Probes to load: comma-separated names ({}), `all` or `none`.",
        names().join(", ")
    )
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("unknown probe {name:?} (known: {known}, all, none)")]
pub struct UnknownProbe {
    name: String,
    known: String,
}

/// The units a `--probes` value selects, each with the names selected of it.
pub fn select(spec: &str) -> Result<Vec<(&'static UnitSpec, Vec<&'static str>)>, UnknownProbe> {
    let mut chosen: Vec<&'static str> = Vec::new();
    for p in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match p {
            "all" => chosen = names(),
            "none" => {}
            other => match names().into_iter().find(|n| *n == other) {
                Some(n) => chosen.push(n),
                None => {
                    return Err(UnknownProbe {
                        name: other.to_string(),
                        known: names().join(", "),
                    })
                }
            },
        }
    }
    Ok(UNITS
        .iter()
        .map(|u| {
            let sel: Vec<&'static str> = u
                .names
                .iter()
                .copied()
                .filter(|n| chosen.contains(n))
                .collect();
            (u, sel)
        })
        .filter(|(_, sel)| !sel.is_empty())
        .collect())
}

/// Loads the selected units; a unit of which nothing came up is left out, its
/// statuses say why.
pub fn load(
    ctx: &LoadContext<'_>,
    selected: &[(&'static UnitSpec, Vec<&'static str>)],
) -> Result<(Units, Vec<ProbeStatus>), ProbeError> {
    let mut units = Vec::new();
    let mut statuses = Vec::new();
    for (spec, names) in selected {
        let loaded = (spec.load)(ctx, names)?;
        statuses.extend(loaded.statuses);
        units.extend(loaded.unit);
    }
    Ok((units, statuses))
}

/// Decodes a map value into its skeleton-generated type (a copy: map bytes
/// carry no alignment guarantee). None when the bytes are too short.
pub fn decode<T: plain::Plain + Default>(b: &[u8]) -> Option<T> {
    let mut v = T::default();
    plain::copy_from_bytes(&mut v, b).ok()?;
    Some(v)
}

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

impl ProbeStatus {
    pub fn up(name: &'static str) -> ProbeStatus {
        ProbeStatus {
            name,
            up: true,
            reason: None,
        }
    }

    pub fn down(name: &'static str, reason: impl Into<String>) -> ProbeStatus {
        ProbeStatus {
            name,
            up: false,
            reason: Some(reason.into()),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn picked(spec: &str) -> Vec<Vec<&'static str>> {
        select(spec).unwrap().into_iter().map(|(_, n)| n).collect()
    }

    #[test]
    fn probes_select_units_and_their_names() {
        assert_eq!(picked("none"), Vec::<Vec<&str>>::new());
        assert_eq!(picked(""), Vec::<Vec<&str>>::new());
        assert_eq!(picked("all").concat(), names());
        assert_eq!(picked("tcp_retransmit"), [vec!["tcp_retransmit"]]);
        assert_eq!(
            picked(" tc , sched_latency"),
            [vec!["sched_latency"], vec!["tc"]]
        );
        let e = select("sched_latency,gpu").unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown probe \"gpu\" (known: sched_latency, tcp_rtt, tcp_retransmit, tc, gpu_driver, cuda, nvml, all, none)"
        );
        assert!(probes_help()
            .contains("sched_latency, tcp_rtt, tcp_retransmit, tc, gpu_driver, cuda, nvml"));
    }
}
