//! The `nvml` unit: NVML's per-process SM utilisation and memory, summed per
//! container, exported beside the eBPF GPU series as their ground truth, and
//! each GPU's capacity (total memory, maximum link bandwidth: the FinOps
//! denominators) (`crate::nvml` does the reading). No BPF: it works by the tick. A node
//! without the library has the unit up and idle (`gpufeed_nvml_gpus` 0; one
//! info line at start).

use std::collections::HashMap;

use super::unit::{
    FamilySpec, GaugeValue, Kind, Labels, LoadContext, Loaded, NodeFamily, Probe, Scope,
    SelfSeries, TickContext, TickOutput, UnitSpec, UnitStats,
};
use super::ProbeError;
use crate::collect::Owner;
use crate::nvml::{GpuCapacity, Nvml};

pub const NAME: &str = "nvml";
pub const SM: &str = "gpufeed_nvml_process_sm_utilization_ratio";
pub const MEMORY: &str = "gpufeed_nvml_process_memory_bytes";
pub const MEMORY_TOTAL: &str = "gpufeed_gpu_memory_total_bytes";
pub const LINK_MAX: &str = "gpufeed_gpu_link_max_bytes_per_second";

pub const UNIT: UnitSpec = UnitSpec {
    names: &[NAME],
    load: load_unit,
};

static FAMILIES: [FamilySpec; 2] = [
    FamilySpec {
        name: SM,
        help: "SM utilisation of the container's processes by NVML, summed over its processes and GPUs (1 = one GPU's SMs busy)",
        kind: Kind::Gauge,
        scope: Scope::Container,
    },
    FamilySpec {
        name: MEMORY,
        help: "GPU memory the container's processes use by NVML, summed over its processes and GPUs",
        kind: Kind::Gauge,
        scope: Scope::Container,
    },
];

/// What the unit takes from the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The library to dlopen: a name the loader searches for, or a path.
    pub library: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            library: crate::nvml::LIBRARY.into(),
        }
    }
}

fn load_unit(ctx: &LoadContext<'_>, _names: &[&'static str]) -> Result<Loaded, ProbeError> {
    let nvml = Nvml::load(&ctx.config.nvml.library).map_err(|e| ProbeError::Io {
        probe: NAME,
        what: "NVML",
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(Loaded::single(NAME, Ok(NvmlUnit::new(nvml))))
}

pub struct NvmlUnit {
    nvml: Option<Nvml>,
    /// Read once at start: a GPU's memory and link maximum do not change
    /// while the driver is loaded.
    gpus: Vec<GpuCapacity>,
    failures: u64,
}

impl NvmlUnit {
    pub fn new(nvml: Option<Nvml>) -> NvmlUnit {
        let gpus = match nvml.as_ref().map(Nvml::capacity) {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                tracing::warn!("NVML: GPU capacity: {e}");
                Vec::new()
            }
            None => Vec::new(),
        };
        NvmlUnit {
            nvml,
            gpus,
            failures: 0,
        }
    }

    /// One gauge per GPU, labelled `gpu` (NVML's index).
    fn per_gpu(
        &self,
        name: &'static str,
        help: &'static str,
        pick: fn(&GpuCapacity) -> u64,
    ) -> NodeFamily {
        NodeFamily {
            name,
            help,
            samples: self
                .gpus
                .iter()
                .map(|g| {
                    let labels = Labels::from([("gpu", g.index.to_string())]);
                    (labels, pick(g) as f64)
                })
                .collect(),
        }
    }
}

impl Probe for NvmlUnit {
    fn families(&self) -> &'static [FamilySpec] {
        &FAMILIES
    }

    fn tick(&mut self, ctx: &TickContext<'_>) -> TickOutput {
        let Some(nvml) = self.nvml.as_mut() else {
            return TickOutput::default();
        };
        // NVML names processes by pid in the host's pid namespace, as the
        // agent (hostPID) sees them
        let processes = match nvml.processes() {
            Ok(p) => p,
            Err(e) => {
                if self.failures == 0 {
                    tracing::warn!("NVML: {e}");
                }
                self.failures += 1;
                return TickOutput::default();
            }
        };
        let cgroup_of = pid_cgroups(ctx);
        let mut per_owner: HashMap<&Owner, (f64, f64)> = HashMap::new();
        for (id, usage) in Nvml::per_cgroup(&processes, |pid| cgroup_of.get(&pid).copied()) {
            if let Some(owner) = ctx.owners.get(&id) {
                let e = per_owner.entry(owner).or_default();
                e.0 += usage.sm_utilization;
                e.1 += usage.memory_bytes as f64;
            }
        }
        let gauge = |pick: fn(&(f64, f64)) -> f64| {
            per_owner
                .iter()
                .map(|(owner, v)| GaugeValue {
                    owner: (*owner).clone(),
                    labels: Labels::new(),
                    value: pick(v),
                })
                .collect::<Vec<_>>()
        };
        TickOutput {
            deltas: Vec::new(),
            gauges: vec![(SM, gauge(|v| v.0)), (MEMORY, gauge(|v| v.1))],
        }
    }

    fn stats(&self) -> UnitStats {
        UnitStats {
            series: vec![
                SelfSeries {
                    name: "gpufeed_nvml_gpus",
                    help: "GPUs NVML reports (0: no NVML library on the node)",
                    kind: Kind::Gauge,
                    value: self.gpus.len() as f64,
                },
                SelfSeries {
                    name: "gpufeed_nvml_errors_total",
                    help: "NVML reads that failed (the first is logged)",
                    kind: Kind::Counter,
                    value: self.failures as f64,
                },
            ],
            node: vec![
                self.per_gpu(
                    MEMORY_TOTAL,
                    "Total memory of each GPU by NVML (the denominator of VRAM shares)",
                    |g| g.memory_total_bytes,
                ),
                self.per_gpu(
                    LINK_MAX,
                    "Maximum PCIe bandwidth per direction of each GPU's link by NVML (maximum generation's per-lane rate after encoding, times maximum width)",
                    |g| g.link_bytes_per_second,
                ),
            ],
            ..UnitStats::default()
        }
    }
}

/// The cgroup id of every process of the owners' cgroups: the pods' from the
/// collector's process lists (re-read only when the kernel says they
/// changed), the few other owners' (slices) read here.
fn pid_cgroups(ctx: &TickContext<'_>) -> HashMap<u32, u64> {
    let mut out = ctx.pod_pid_cgroups();
    for (id, owner) in ctx.owners {
        if matches!(owner, Owner::Pod { .. }) {
            continue;
        }
        let Some(cg) = ctx.tree.cgroups.get(id) else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(ctx.tree.path_of(cg).join("cgroup.procs")) else {
            continue;
        };
        out.extend(
            text.lines()
                .filter_map(|l| l.trim().parse::<u32>().ok())
                .map(|pid| (pid, *id)),
        );
    }
    out
}
