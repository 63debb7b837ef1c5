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
pub mod cgroup_storage;
pub mod cuda;
pub mod gpu_compute;
pub mod gpu_driver;
pub mod hist;
pub mod lookout;
pub mod nvml;
pub mod options;
pub mod per_cgroup;
pub mod sched;
pub mod signal;
pub mod tc;
pub mod tcp;
pub mod unit;

pub use options::UnitOptions;
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
/// statuses say why. A unit the kernel refuses (the verifier, a map type or kfunc it
/// lacks) is down with the refusal as its reason, and the others load: one probe's failure
/// is never the agent's. Only a missing privilege, which no probe can load without, is an
/// error.
pub fn load(
    ctx: &LoadContext<'_>,
    selected: &[(&'static UnitSpec, Vec<&'static str>)],
) -> Result<(Units, Vec<ProbeStatus>), ProbeError> {
    let mut units = Vec::new();
    let mut statuses = Vec::new();
    for (spec, names) in selected {
        let capture = libbpf_log::Capture::start();
        match (spec.load)(ctx, names) {
            Ok(loaded) => {
                statuses.extend(loaded.statuses);
                units.extend(loaded.unit);
            }
            Err(e) if e.is_permission() => return Err(e),
            Err(e) => {
                let reason = match capture.refusal() {
                    Some(why) => format!("{e}: {why}"),
                    None => e.to_string(),
                };
                let down = spec.reported(names);
                statuses.extend(
                    down.into_iter()
                        .map(|n| ProbeStatus::down(n, reason.clone())),
                );
            }
        }
    }
    Ok((units, statuses))
}

/// What the agent exports as `gpufeed_probe_up{probe}` and `gpufeed_probe_info`.
#[derive(Debug, Clone)]
pub struct ProbeStatus {
    pub name: &'static str,
    pub up: bool,
    /// Why a probe is down (logged once).
    pub reason: Option<String>,
    /// How it runs on this kernel: `hook`, `storage`, `reads` (labels of `gpufeed_probe_info`)
    pub how: Vec<(&'static str, String)>,
}

impl ProbeStatus {
    pub fn up(name: &'static str) -> ProbeStatus {
        ProbeStatus {
            name,
            up: true,
            reason: None,
            how: Vec::new(),
        }
    }

    pub fn down(name: &'static str, reason: impl Into<String>) -> ProbeStatus {
        ProbeStatus {
            name,
            up: false,
            reason: Some(reason.into()),
            how: Vec::new(),
        }
    }

    /// Adds how the probe runs (`hook`, `storage`, `reads`).
    pub fn with(mut self, key: &'static str, value: impl Into<String>) -> ProbeStatus {
        self.how.push((key, value.into()));
        self
    }
}

// The BPF toolbox the units use (the cgroup tree's events use it too), as `probes::…`.
pub use crate::ebpf::libbpf_log::route as route_libbpf_logs;
pub(crate) use crate::ebpf::{attach_all, err, handle, set_max_entries};
pub use crate::ebpf::{
    cgroup_maps, decode, libbpf_log, lookup_cgroup, object, percpu_sum, KernelBtf, ProbeError,
};

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
