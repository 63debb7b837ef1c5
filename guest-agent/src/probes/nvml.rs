//! The `nvml` unit: what NVML says the GPUs did, per container and per GPU (`crate::nvml`
//! does the reading). No BPF: it works by the tick. A node without the library has the unit
//! up and idle (`gpufeed_nvml_gpus` 0; one info line at start).
//!
//! * Per container: SM utilisation and memory of its processes (the ground truth beside the
//!   eBPF GPU series), and, as the node's best compute-time source (`gpu_compute`), SM time
//!   per GPU: each utilisation sample × the time it stands for (`nvml::sm_time`).
//! * Per GPU: capacity (total memory, maximum link bandwidth: the FinOps denominators), and
//!   the link now (generation, width, TX/RX throughput).
//! * Per pod: the throughput of the links of the GPUs its processes use, offered to the
//!   correlator as the `gpu_link_throughput` signal (a level, one reading per tick), so that
//!   a host link event can be shown with the dip it caused in what the pod's GPUs move (or
//!   with none). The correlator reads this signal for dips (its policy `falls`).

use std::collections::{BTreeMap, HashMap};

use super::gpu_compute::{self, ComputeSeries, ComputeSource};
use super::options::OptionsSpec;
use super::signal::{SignalKind, SignalSpec};
use super::unit::{
    Delta, FamilySpec, GaugeValue, Kind, Labels, LoadContext, Loaded, NodeFamily, Probe, Scope,
    SelfSeries, TickContext, TickOutput, UnitSpec, UnitStats,
};
use crate::ebpf::ProbeError;
use crate::nvml::sm_time::SmClock;
use crate::nvml::{GpuCapacity, LinkState, Nvml};
use crate::owner::Owner;

pub const NAME: &str = "nvml";
pub const SM: &str = "gpufeed_nvml_process_sm_utilization_ratio";
pub const MEMORY: &str = "gpufeed_nvml_process_memory_bytes";
pub const POD_LINK: &str = "gpufeed_nvml_pod_gpu_pcie_bytes_per_second";
pub const MEMORY_TOTAL: &str = "gpufeed_gpu_memory_total_bytes";
pub const LINK_MAX: &str = "gpufeed_gpu_link_max_bytes_per_second";
pub const LINK_GENERATION: &str = "gpufeed_gpu_pcie_link_generation";
pub const LINK_WIDTH: &str = "gpufeed_gpu_pcie_link_width";
pub const THROUGHPUT: &str = "gpufeed_gpu_pcie_throughput_bytes_per_second";
/// The correlator's name of the pod's GPU link throughput.
pub const LINK_SIGNAL: &str = "gpu_link_throughput";

/// Each pod's GPU link throughput, a level the correlator reads for dips.
fn link_signal() -> SignalSpec {
    SignalSpec {
        name: LINK_SIGNAL,
        family: POD_LINK,
        kind: SignalKind::Level,
    }
}

pub const UNIT: UnitSpec = UnitSpec {
    names: &[NAME],
    reports: &[NAME],
    options: OptionsSpec::flags::<Config>(),
    load: load_unit,
};

const SM_FAMILY: FamilySpec = FamilySpec {
    name: SM,
    help: "SM utilisation of the container's processes by NVML's newest samples, summed over its processes and GPUs (1 = one GPU's SMs busy)",
    kind: Kind::Gauge,
    scope: Scope::Container,
    pod_labels: false,
};
const MEMORY_FAMILY: FamilySpec = FamilySpec {
    name: MEMORY,
    help: "GPU memory the container's processes use by NVML, summed over its processes and GPUs",
    kind: Kind::Gauge,
    scope: Scope::Container,
    pod_labels: false,
};
const POD_LINK_FAMILY: FamilySpec = FamilySpec {
    name: POD_LINK,
    help: "PCIe throughput by NVML of each GPU the pod's processes use, by direction (tx: GPU to host, rx: host to GPU): the GPU's whole traffic, not the pod's share",
    kind: Kind::Gauge,
    scope: Scope::Pod,
    pod_labels: false,
};
static FAMILIES: [FamilySpec; 3] = [SM_FAMILY, MEMORY_FAMILY, POD_LINK_FAMILY];
/// With the library: NVML's SM time is the node's compute time.
static FAMILIES_COMPUTE: [FamilySpec; 5] = [
    SM_FAMILY,
    MEMORY_FAMILY,
    POD_LINK_FAMILY,
    gpu_compute::COMPUTE_FAMILY,
    gpu_compute::DUTY_FAMILY,
];

/// What the unit takes from the command line.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
#[group(id = "nvml options")]
pub struct Config {
    // dlopen'ed: a name the loader searches for, or a path
    /// NVML library (name or path), opened at run time when the `nvml` probe is selected.
    #[arg(long = "nvml-library", value_name = "NVML_LIBRARY", default_value = crate::nvml::LIBRARY)]
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
    let nvml = Nvml::load(&ctx.options.get::<Config>().library).map_err(|e| ProbeError::Io {
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
    clock: SmClock,
    /// Each GPU's link at the last tick.
    links: Vec<LinkState>,
    failures: u64,
    compute: Option<ComputeSeries>,
}

/// One owner's numbers in one tick.
#[derive(Default)]
struct OwnerUse {
    utilization: f64,
    memory_bytes: f64,
    /// SM time per GPU, ns.
    sm_ns: BTreeMap<u32, u64>,
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
            clock: SmClock::default(),
            links: Vec::new(),
            failures: 0,
            compute: None,
        }
    }

    fn failed(&mut self, e: crate::nvml::NvmlError) {
        if self.failures == 0 {
            tracing::warn!("NVML: {e}");
        }
        self.failures += 1;
    }
}

/// One gauge per GPU, labelled `gpu` (NVML's index), and `direction` for throughput.
fn per_gpu<T>(
    items: &[T],
    name: &'static str,
    help: &'static str,
    samples: impl Fn(&T) -> Vec<(Labels, f64)>,
) -> NodeFamily {
    NodeFamily {
        name,
        help,
        samples: items.iter().flat_map(samples).collect(),
    }
}

fn gpu_label(gpu: u32) -> Labels {
    Labels::from([("gpu", gpu.to_string())])
}

impl Probe for NvmlUnit {
    fn families(&self) -> &'static [FamilySpec] {
        match self.compute {
            Some(_) => &FAMILIES_COMPUTE,
            None => &FAMILIES,
        }
    }

    fn signals(&self) -> Vec<SignalSpec> {
        vec![link_signal()]
    }

    /// NVML is a source when it reports a GPU.
    fn compute_source(&self) -> Option<ComputeSource> {
        (!self.gpus.is_empty()).then_some(ComputeSource::Nvml)
    }

    fn publish_compute(&mut self, series: ComputeSeries) {
        self.compute = Some(series);
    }

    fn tick(&mut self, ctx: &TickContext<'_>) -> TickOutput {
        let Some(nvml) = self.nvml.as_mut() else {
            return TickOutput::default();
        };
        // NVML names processes by pid in the host's pid namespace, as the
        // agent (hostPID) sees them
        let readings = match nvml.read() {
            Ok(r) => r,
            Err(e) => {
                self.failed(e);
                return TickOutput::default();
            }
        };
        match nvml.links() {
            Ok(l) => self.links = l,
            Err(e) => self.failed(e),
        }
        let cgroup_of = pid_cgroups(ctx);
        let owner_of = |pid: u32| {
            cgroup_of
                .get(&pid)
                .and_then(|id| ctx.owners.get(id))
                .cloned()
        };
        let mut per_owner: HashMap<Owner, OwnerUse> = HashMap::new();
        for p in self.clock.advance(&readings) {
            if let Some(owner) = owner_of(p.pid) {
                let e = per_owner.entry(owner).or_default();
                e.utilization += p.utilization;
                *e.sm_ns.entry(p.gpu).or_default() += p.sm_ns;
            }
        }
        // the GPUs each pod's processes are on, for the link signal
        let mut pod_gpus: BTreeMap<Owner, Vec<u32>> = BTreeMap::new();
        for r in &readings {
            for (pid, mem) in &r.processes {
                let Some(owner) = owner_of(*pid) else {
                    continue;
                };
                let gpus = pod_gpus.entry(owner.pod_level()).or_default();
                if !gpus.contains(&r.gpu) {
                    gpus.push(r.gpu);
                }
                per_owner.entry(owner).or_default().memory_bytes += mem.unwrap_or(0) as f64;
            }
        }
        let mut deltas: Vec<(Owner, Delta)> = Vec::new();
        if let Some(c) = self.compute.as_mut() {
            for (owner, u) in &per_owner {
                for (gpu, ns) in &u.sm_ns {
                    deltas.push(c.owner_delta(owner.clone(), gpu_label(*gpu), *ns));
                }
            }
        }
        let gauge = |pick: fn(&OwnerUse) -> f64| {
            per_owner
                .iter()
                .map(|(owner, u)| GaugeValue {
                    owner: owner.clone(),
                    labels: Labels::new(),
                    value: pick(u),
                })
                .collect::<Vec<_>>()
        };
        let mut gauges = vec![
            (SM, gauge(|u| u.utilization)),
            (MEMORY, gauge(|u| u.memory_bytes)),
            (POD_LINK, pod_links(&pod_gpus, &self.links)),
        ];
        gauges.extend(self.compute.as_mut().map(|c| c.duty_gauges(ctx)));
        TickOutput { deltas, gauges }
    }

    fn stats(&self) -> UnitStats {
        let links = &self.links;
        let mut node = vec![
            per_gpu(
                &self.gpus,
                MEMORY_TOTAL,
                "Total memory of each GPU by NVML (the denominator of VRAM shares)",
                |g| vec![(gpu_label(g.index), g.memory_total_bytes as f64)],
            ),
            per_gpu(
                &self.gpus,
                LINK_MAX,
                "Maximum PCIe bandwidth per direction of each GPU's link by NVML (maximum generation's per-lane rate after encoding, times maximum width)",
                |g| vec![(gpu_label(g.index), g.link_bytes_per_second as f64)],
            ),
            per_gpu(
                links,
                LINK_GENERATION,
                "Current PCIe generation of each GPU's link by NVML, as the guest sees it (an idle GPU lowers it)",
                |l| vec![(gpu_label(l.gpu), f64::from(l.generation))],
            ),
            per_gpu(
                links,
                LINK_WIDTH,
                "Current PCIe width (lanes) of each GPU's link by NVML, as the guest sees it",
                |l| vec![(gpu_label(l.gpu), f64::from(l.width))],
            ),
            per_gpu(
                links,
                THROUGHPUT,
                "PCIe throughput of each GPU by NVML (a 20 ms sample at the tick), by direction: tx GPU to host, rx host to GPU",
                |l| {
                    directions(l)
                        .into_iter()
                        .map(|(d, v)| (direction_labels(l.gpu, d), v))
                        .collect()
                },
            ),
        ];
        node.extend(self.compute.iter().map(ComputeSeries::info));
        UnitStats {
            series: vec![
                SelfSeries::gauge(
                    "gpufeed_nvml_gpus",
                    "GPUs NVML reports (0: no NVML library on the node)",
                    self.gpus.len() as f64,
                ),
                SelfSeries::counter(
                    "gpufeed_nvml_errors_total",
                    "NVML reads that failed (the first is logged)",
                    self.failures,
                ),
                SelfSeries::counter(
                    "gpufeed_nvml_invalid_samples_total",
                    "NVML utilisation samples above 100%, counted as 0",
                    self.clock.invalid_samples(),
                ),
            ],
            node,
            ..UnitStats::default()
        }
    }
}

fn directions(l: &LinkState) -> [(&'static str, f64); 2] {
    [
        ("tx", l.tx_bytes_per_second as f64),
        ("rx", l.rx_bytes_per_second as f64),
    ]
}

fn direction_labels(gpu: u32, direction: &'static str) -> Labels {
    let mut l = gpu_label(gpu);
    l.insert("direction", direction.to_string());
    l
}

/// Each pod's GPUs' link throughput, by GPU and direction.
fn pod_links(pod_gpus: &BTreeMap<Owner, Vec<u32>>, links: &[LinkState]) -> Vec<GaugeValue> {
    let mut out = Vec::new();
    for (pod, gpus) in pod_gpus {
        for l in links.iter().filter(|l| gpus.contains(&l.gpu)) {
            for (d, v) in directions(l) {
                out.push(GaugeValue {
                    owner: pod.clone(),
                    labels: direction_labels(l.gpu, d),
                    value: v,
                });
            }
        }
    }
    out
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

#[cfg(test)]
mod tests {
    /// The throughput is declared a level, which the correlator reads for dips: no entry of
    /// its configuration names the signal, its windows' shape says it.
    #[test]
    fn the_correlator_reads_the_link_signal_for_dips() {
        use crate::correlate::{Config, SignalShape};
        assert!(!Config::default().signals.contains_key(super::LINK_SIGNAL));
        let policy = Config::policy_of_shape(SignalShape::Level);
        assert!(policy.falls && policy.rate, "{policy:?}");
        assert_eq!(super::link_signal().kind, super::SignalKind::Level);
    }
}
