//! The `nvml` unit: what NVML says the GPUs did, per container and per GPU (`crate::nvml`
//! does the reading). No BPF: it works by the tick. A node without the library has the unit
//! up and idle (`gpufeed_nvml_gpus` 0; one info line, and the library looked for again every
//! few seconds). GPUs are enumerated each tick: one lost is left out and counted
//! (`gpufeed_nvml_errors_total`) while the others keep their numbers, and one that comes back
//! has its capacity read anew; the collector re-elects the compute source when NVML comes or
//! goes.
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

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::gpu_compute::{self, ComputeSeries, ComputeSource};
use super::options::OptionsSpec;
use super::signal::{SignalKind, SignalSpec};
use super::unit::{
    no_labels, Delta, FamilySpec, GaugeValue, Kind, Labels, LoadContext, Loaded, NodeFamily, Probe,
    Scope, SelfSeries, SharedLabels, TickContext, TickOutput, UnitSpec, UnitStats,
};
use crate::ebpf::ProbeError;
use crate::nvml::process::Starts;
use crate::nvml::sm_time::{GpuReading, SmClock};
use crate::nvml::{
    codes, mps, Failure, Failures, Gpu, GpuCapacity, LinkState, Nvml, Opened, Survey,
};
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
pub const GPUS: &str = "gpufeed_nvml_gpus";
pub const MIG_MEMORY: &str = "gpufeed_nvml_mig_process_memory_bytes";
pub const UNATTRIBUTED: &str = "gpufeed_gpu_compute_unattributed";
pub const OUTSIDE_MEMORY: &str = "gpufeed_nvml_outside_pods_memory_bytes";
pub const OUTSIDE_SM: &str = "gpufeed_nvml_outside_pods_sm_seconds_total";
pub const ERRORS: &str = "gpufeed_nvml_errors_total";
pub const CALL_MISSING: &str = "gpufeed_nvml_call_missing";
pub const LIBRARY_INFO: &str = "gpufeed_nvml_library_info";
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
const MIG_MEMORY_FAMILY: FamilySpec = FamilySpec {
    name: MIG_MEMORY,
    help: "GPU memory the container's processes use on each MIG instance by NVML, labels gpu, gpu_instance, compute_instance",
    kind: Kind::Gauge,
    scope: Scope::Container,
    pod_labels: false,
};
/// NVML's own, and the compute time and duty cycle for when it is the node's source.
static FAMILIES_COMPUTE: [FamilySpec; 6] = [
    SM_FAMILY,
    MEMORY_FAMILY,
    POD_LINK_FAMILY,
    MIG_MEMORY_FAMILY,
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
    let library = ctx.options.get::<Config>().library.clone();
    Ok(Loaded::single(NAME, Ok(NvmlUnit::open(library))))
}

/// What is left of an owner's GPU activity after a tick, for the MPS weights: the last few
/// ticks count (at 1 s ticks, about 4 s), a single tick's noise does not.
const ACTIVITY_DECAY: f64 = 0.75;

/// How often a node without NVML looks for it again: the toolkit's mounts, a driver
/// extension or a `--nvml-library` path may appear after the agent started.
const RETRY: Duration = Duration::from_secs(2);

pub struct NvmlUnit {
    /// `--nvml-library` as given.
    library: String,
    nvml: Option<Nvml>,
    /// Why NVML is not loaded (None while it is), with the fix.
    absent: Option<String>,
    /// When to look for the library again.
    retry_at: Instant,
    /// The GPUs NVML enumerates now, with their capacity: read when a GPU appears (at start,
    /// or back from being lost: an eGPU replugged), again while a number is missing.
    gpus: BTreeMap<u32, GpuCapacity>,
    /// GPUs lost (or no longer enumerated) and not back yet: said once when lost, once when back.
    lost: BTreeSet<u32>,
    /// GPUs in MIG mode at the last tick: their processes' compute is unattributed.
    mig_gpus: BTreeSet<u32>,
    /// MPS servers with samples at the last tick.
    mps_servers: usize,
    /// Each owner's recent GPU activity (ns, decayed per tick): the weights of MPS shares.
    activity: FxHashMap<Owner, f64>,
    /// Start times of the processes at the last read, to tell a reused pid.
    starts: Starts,
    /// Per GPU, what processes no owner has (outside pods and slices, or exited) used: memory
    /// at the last tick, SM time since start.
    outside_memory: BTreeMap<u32, u64>,
    outside_sm_ns: BTreeMap<u32, u64>,
    clock: SmClock,
    /// Each GPU's link at the last tick.
    links: Vec<LinkState>,
    failures: Failures,
    compute: Option<ComputeSeries>,
    /// Each (container, GPU) whose compute time was handed to `compute` at the previous
    /// tick, with the tick: see [`NvmlUnit::compute_deltas`].
    compute_handed: FxHashMap<(Owner, u32), u64>,
    /// Ticks since `compute` was published.
    compute_ticks: u64,
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
    /// The unit over the library `library` names ([`crate::nvml::locate`]): up whether or not
    /// NVML is there; without it, it looks again every few seconds.
    pub fn open(library: String) -> NvmlUnit {
        let mut unit = NvmlUnit {
            library,
            nvml: None,
            absent: None,
            retry_at: Instant::now(),
            gpus: BTreeMap::new(),
            lost: BTreeSet::new(),
            mig_gpus: BTreeSet::new(),
            mps_servers: 0,
            activity: FxHashMap::default(),
            starts: Starts::default(),
            outside_memory: BTreeMap::new(),
            outside_sm_ns: BTreeMap::new(),
            clock: SmClock::default(),
            links: Vec::new(),
            failures: Failures::default(),
            compute: None,
            compute_handed: FxHashMap::default(),
            compute_ticks: 0,
        };
        unit.look_for_library();
        unit.survey();
        unit
    }

    /// Opens NVML if it is not open yet and it is time to look.
    fn look_for_library(&mut self) {
        if self.nvml.is_some() || Instant::now() < self.retry_at {
            return;
        }
        self.retry_at = Instant::now() + RETRY;
        let why = match Nvml::open(&self.library) {
            Ok(Opened::Loaded(nvml)) => {
                let missing = nvml.missing().join(", ");
                tracing::info!(
                    library = nvml.opened(),
                    missing_calls = %missing,
                    "NVML loaded{}",
                    if self.absent.is_some() { " (it appeared after start)" } else { "" }
                );
                self.nvml = Some(nvml);
                self.absent = None;
                return;
            }
            Ok(Opened::Absent(why)) => why,
            Err(e) => format!("{}: {e}", self.library),
        };
        if self.absent.as_deref() != Some(why.as_str()) {
            tracing::info!(
                "NVML not available, no NVML series (looked for again every {RETRY:?}): {why}"
            );
        }
        self.absent = Some(why);
    }

    /// Enumerates the GPUs: a GPU that appeared has its capacity read, one that is gone is
    /// dropped. Returns the GPUs NVML answers for now.
    fn survey(&mut self) -> Vec<Gpu> {
        let Some(nvml) = self.nvml.as_ref() else {
            return Vec::new();
        };
        let Survey { gpus, mut failures } = nvml.gpus();
        let lost = &mut self.lost;
        self.gpus.retain(|index, _| {
            let here = gpus.iter().any(|g| g.index == *index);
            if !here && lost.insert(*index) {
                tracing::warn!(gpu = index, "GPU gone: NVML no longer enumerates it");
            }
            here
        });
        for g in &gpus {
            let known = self.gpus.get(&g.index);
            if known.is_some_and(GpuCapacity::complete) {
                continue;
            }
            let capacity = nvml.capacity_of(g, &mut failures);
            if known.is_none() && !self.lost.contains(&g.index) {
                tracing::info!(
                    gpu = g.index,
                    memory_bytes = ?capacity.memory_total_bytes,
                    link_bytes_per_second = ?capacity.link_bytes_per_second,
                    "GPU present"
                );
            }
            self.gpus.insert(g.index, capacity);
        }
        self.book(failures);
        gpus.into_iter()
            .filter(|g| self.gpus.contains_key(&g.index))
            .collect()
    }

    /// Counts failures; a GPU that answered one call with "lost" is left out until it is
    /// enumerated again (its capacity is then read anew).
    fn book(&mut self, failures: Vec<Failure>) {
        for f in &failures {
            if let Some(g) = f.gpu.filter(|_| codes::gpu_gone(f.code)) {
                self.gpus.remove(&g);
                if self.lost.insert(g) {
                    tracing::warn!(gpu = g, "GPU lost, left out until it answers again: {f}");
                }
            }
        }
        self.failures.book(failures);
    }

    /// The compute time of the tick, per container and GPU, handed to the compute series.
    /// NVML lists a process holding a GPU at every read, busy or not, so most of a node's
    /// (container, GPU) pairs book 0 at most ticks. A pair's first 0 opens its duty-cycle
    /// window, and its counter at 0 where its container has series already (the collector
    /// keeps no series of zeros alone). Once the pair was handed at the previous tick (its
    /// owner live, its window kept), another 0 changes nothing: the window carries its total
    /// forward by itself and a counter adds nothing. So it is left out, and an idle pair
    /// costs no delta, no label and no duty entry per tick. What differs from handing every
    /// 0: a container whose first series comes after its pair's first 0 shows that pair's
    /// counter from its first non-zero time, as any container's series start, not at 0.
    fn compute_deltas(&mut self, per_owner: &FxHashMap<Owner, OwnerUse>) -> Vec<(Owner, Delta)> {
        let Some(c) = self.compute.as_mut() else {
            return Vec::new();
        };
        self.compute_ticks += 1;
        let tick = self.compute_ticks;
        let mut deltas = Vec::new();
        for (owner, u) in per_owner {
            for (gpu, ns) in &u.sm_ns {
                let previous = match self.compute_handed.entry((owner.clone(), *gpu)) {
                    Entry::Occupied(mut e) => Some(std::mem::replace(e.get_mut(), tick)),
                    Entry::Vacant(e) => {
                        e.insert(tick);
                        None
                    }
                };
                if *ns == 0 && previous == Some(tick - 1) {
                    continue;
                }
                deltas.push(c.owner_delta(owner.clone(), gpu_label(*gpu), *ns));
            }
        }
        // a pair not handed this tick is handed in full when it comes back
        self.compute_handed.retain(|_, t| *t == tick);
        deltas
    }

    /// Why this node's NVML cannot be its compute source now (None: it can).
    pub fn not_a_source(&self) -> Option<String> {
        let Some(nvml) = &self.nvml else {
            return Some(self.absent.clone().unwrap_or_default());
        };
        if nvml.missing().contains(&"nvmlDeviceGetProcessUtilization") {
            return Some(format!(
                "{} lacks nvmlDeviceGetProcessUtilization: no per-process SM utilisation",
                nvml.opened()
            ));
        }
        if self.gpus.is_empty() {
            return Some(format!("NVML ({}) sees 0 GPUs", nvml.opened()));
        }
        None
    }
}

/// The client containers of the MPS server `server` on `gpu` (the other processes NVML lists
/// there), each with its recent GPU activity ([`ACTIVITY_DECAY`]) as the weight of its share.
fn mps_clients(
    readings: &[GpuReading],
    gpu: u32,
    server: u32,
    owner_of: &dyn Fn(u32) -> Option<Owner>,
    activity: &FxHashMap<Owner, f64>,
) -> Vec<(Owner, u64)> {
    let server_owner = owner_of(server);
    let mut out: Vec<(Owner, u64)> = Vec::new();
    for (pid, _) in readings
        .iter()
        .filter(|r| r.gpu == gpu)
        .flat_map(|r| r.processes.iter())
    {
        if *pid == server {
            continue;
        }
        let Some(owner) = owner_of(*pid) else {
            continue;
        };
        if Some(&owner) == server_owner.as_ref() || out.iter().any(|(o, _)| *o == owner) {
            continue;
        }
        let weight = activity.get(&owner).copied().unwrap_or(0.0) as u64;
        out.push((owner, weight));
    }
    out
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
        kind: Kind::Gauge,
        samples: items.iter().flat_map(samples).collect(),
    }
}

fn gpu_label(gpu: u32) -> Labels {
    Labels::from([("gpu", gpu.to_string())])
}

impl Probe for NvmlUnit {
    /// The compute families always: NVML may appear or come back after start, and the
    /// exporter takes its family list once (they render only once elected and sampled).
    fn families(&self) -> &'static [FamilySpec] {
        &FAMILIES_COMPUTE
    }

    fn signals(&self) -> Vec<SignalSpec> {
        vec![link_signal()]
    }

    /// NVML is a source when it reports a GPU and per-process utilisation.
    fn compute_source(&self) -> Option<ComputeSource> {
        self.not_a_source().is_none().then_some(ComputeSource::Nvml)
    }

    fn not_a_source(&self) -> Option<(ComputeSource, String)> {
        NvmlUnit::not_a_source(self).map(|why| (ComputeSource::Nvml, why))
    }

    fn publish_compute(&mut self, series: ComputeSeries) {
        self.compute = Some(series);
        self.compute_handed.clear();
    }

    fn retire_compute(&mut self) {
        self.compute = None;
        self.compute_handed.clear();
    }

    fn tick(&mut self, ctx: &TickContext<'_>) -> TickOutput {
        self.look_for_library();
        let gpus = self.survey();
        let Some(nvml) = self.nvml.as_mut() else {
            return TickOutput::default();
        };
        // NVML names processes by pid in the host's pid namespace, as the
        // agent (hostPID) sees them; each GPU read on its own, failures booked
        let mut failures = Vec::new();
        let mut readings: Vec<GpuReading> = gpus
            .iter()
            .map(|g| nvml.read_gpu(g, &mut failures))
            .collect();
        let mut links: Vec<LinkState> = gpus
            .iter()
            .map(|g| nvml.link_of(g, &mut failures))
            .collect();
        self.book(failures);
        // a GPU lost during this read has no numbers this tick
        readings.retain(|r| self.gpus.contains_key(&r.gpu));
        links.retain(|l| self.gpus.contains_key(&l.gpu));
        self.links = links;
        // a GPU that answered a whole tick again is back (an eGPU replugged)
        let gpus = &self.gpus;
        self.lost.retain(|g| match gpus.get(g) {
            Some(c) => {
                tracing::info!(
                    gpu = g,
                    memory_bytes = ?c.memory_total_bytes,
                    link_bytes_per_second = ?c.link_bytes_per_second,
                    "GPU back, its capacity read anew"
                );
                false
            }
            None => true,
        });
        let (_, pod_processes) = ctx.pod_processes();
        // the slices' process lists are long (the node's own services) and hold no pod's
        // process: read only in a tick where NVML lists a process no pod has
        let slice_cgroup_of = std::cell::OnceCell::new();
        let owner_of = |pid: u32| {
            pod_processes
                .cgroup_of(pid)
                .or_else(|| {
                    slice_cgroup_of
                        .get_or_init(|| slice_pid_cgroups(ctx))
                        .get(&pid)
                        .copied()
                })
                .and_then(|id| ctx.owners.get(&id))
                .cloned()
        };
        let mut per_owner: FxHashMap<Owner, OwnerUse> = FxHashMap::default();
        // MIG GPUs where nothing gives the compute (no GPM): said unattributed
        self.mig_gpus = readings
            .iter()
            .filter(|r| r.mig.is_some() && r.mig_sm.is_none())
            .map(|r| r.gpu)
            .collect();
        // each owner's recent GPU activity: one tick's is noisy (a driver call is booked in
        // the tick it returns), so the weights decay over a few ticks
        self.activity.retain(|_, w| {
            *w *= ACTIVITY_DECAY;
            *w >= 1.0
        });
        for (owner, ns) in ctx.gpu_activity {
            *self.activity.entry(owner.clone()).or_default() += *ns as f64;
        }
        // MPS servers among the processes with samples (the clients have none)
        let servers: BTreeSet<u32> = readings
            .iter()
            .flat_map(|r| r.samples.iter().map(|s| s.pid))
            .filter(|pid| mps::is_server(*pid))
            .collect();
        self.mps_servers = servers.len();
        // a pid that names another process than at the previous read starts anew
        let pids = readings.iter().flat_map(|r| {
            r.processes
                .iter()
                .map(|(p, _)| *p)
                .chain(r.samples.iter().map(|s| s.pid))
        });
        for pid in self.starts.reused(pids) {
            self.clock.forget(pid);
        }
        for p in self.clock.advance(&readings) {
            // a MIG GPU has no samples: its processes' compute is unattributed, not 0
            if self.mig_gpus.contains(&p.gpu) {
                continue;
            }
            let clients = if servers.contains(&p.pid) {
                mps_clients(&readings, p.gpu, p.pid, &owner_of, &self.activity)
            } else {
                Vec::new()
            };
            if clients.is_empty() {
                match owner_of(p.pid) {
                    Some(owner) => {
                        let e = per_owner.entry(owner).or_default();
                        e.utilization += p.utilization;
                        *e.sm_ns.entry(p.gpu).or_default() += p.sm_ns;
                    }
                    None => *self.outside_sm_ns.entry(p.gpu).or_default() += p.sm_ns,
                }
                continue;
            }
            // the server's SM time goes to its clients, by their own GPU activity
            for (owner, ns) in mps::shares(p.sm_ns, &clients) {
                let e = per_owner.entry(owner).or_default();
                if p.sm_ns > 0 {
                    e.utilization += p.utilization * ns as f64 / p.sm_ns as f64;
                }
                *e.sm_ns.entry(p.gpu).or_default() += ns;
            }
        }
        // MIG with GPM: each instance's SM time, shared evenly by its processes (one pod
        // per instance is the rule: a MIG slice is handed out whole)
        for r in &readings {
            let (Some(procs), Some(instances)) = (&r.mig, &r.mig_sm) else {
                continue;
            };
            for i in instances {
                let on: Vec<u32> = procs
                    .iter()
                    .filter(|p| p.gpu_instance == i.gpu_instance)
                    .map(|p| p.pid)
                    .collect();
                let Some(n) = std::num::NonZeroU64::new(on.len() as u64) else {
                    continue;
                };
                let (share, utilization) = (
                    i.sm_ns / n,
                    i.sm_ns as f64 / i.span_ns.max(1) as f64 / n.get() as f64,
                );
                for pid in on {
                    match owner_of(pid) {
                        Some(owner) => {
                            let e = per_owner.entry(owner).or_default();
                            e.utilization += utilization;
                            *e.sm_ns.entry(r.gpu).or_default() += share;
                        }
                        None => *self.outside_sm_ns.entry(r.gpu).or_default() += share,
                    }
                }
            }
        }
        // the GPUs each pod's processes are on, for the link signal (hashed: an ordered map
        // compared the pods' UIDs byte by byte for each process)
        let mut pod_gpus: FxHashMap<Owner, Vec<u32>> = FxHashMap::default();
        self.outside_memory.clear();
        for r in &readings {
            for (pid, mem) in &r.processes {
                let Some(owner) = owner_of(*pid) else {
                    // a host process outside every followed cgroup, or one that exited
                    // while NVML still lists it: said, not dropped
                    *self.outside_memory.entry(r.gpu).or_default() += mem.unwrap_or(0);
                    continue;
                };
                let gpus = pod_gpus.entry(owner.pod_level()).or_default();
                if !gpus.contains(&r.gpu) {
                    gpus.push(r.gpu);
                }
                per_owner.entry(owner).or_default().memory_bytes += mem.unwrap_or(0) as f64;
            }
        }
        // MIG: each container's memory per instance; its compute is said unattributed
        let mut mig_memory: BTreeMap<(Owner, Labels), f64> = BTreeMap::new();
        for r in &readings {
            for p in r.mig.iter().flatten() {
                let Some(owner) = owner_of(p.pid) else {
                    continue;
                };
                let mut l = gpu_label(r.gpu);
                l.insert("gpu_instance", p.gpu_instance.to_string());
                l.insert("compute_instance", p.compute_instance.to_string());
                *mig_memory.entry((owner, l)).or_default() += p.memory_bytes.unwrap_or(0) as f64;
            }
        }
        let mig_memory: Vec<GaugeValue> = mig_memory
            .into_iter()
            .map(|((owner, labels), value)| GaugeValue {
                owner,
                labels: SharedLabels::new(labels),
                value,
            })
            .collect();
        let deltas = self.compute_deltas(&per_owner);
        let gauge = |pick: fn(&OwnerUse) -> f64| {
            per_owner
                .iter()
                .map(|(owner, u)| GaugeValue {
                    owner: owner.clone(),
                    labels: no_labels(),
                    value: pick(u),
                })
                .collect::<Vec<_>>()
        };
        let mut gauges = vec![
            (SM, gauge(|u| u.utilization)),
            (MEMORY, gauge(|u| u.memory_bytes)),
            (POD_LINK, pod_links(&pod_gpus, &self.links)),
            (MIG_MEMORY, mig_memory),
        ];
        gauges.extend(self.compute.as_mut().map(|c| c.duty_gauges(ctx)));
        TickOutput { deltas, gauges }
    }

    fn stats(&self) -> UnitStats {
        let links = &self.links;
        let gpus: Vec<&GpuCapacity> = self.gpus.values().collect();
        let mut node = vec![
            per_gpu(
                &gpus,
                MEMORY_TOTAL,
                "Total memory of each GPU by NVML (the denominator of VRAM shares)",
                |g| some(g.index, g.memory_total_bytes),
            ),
            per_gpu(
                &gpus,
                LINK_MAX,
                "Maximum PCIe bandwidth per direction of each GPU's link by NVML (maximum generation's per-lane rate after encoding, times maximum width)",
                |g| some(g.index, g.link_bytes_per_second),
            ),
            per_gpu(
                links,
                LINK_GENERATION,
                "Current PCIe generation of each GPU's link by NVML, as the guest sees it (an idle GPU lowers it)",
                |l| some(l.gpu, l.generation),
            ),
            per_gpu(
                links,
                LINK_WIDTH,
                "Current PCIe width (lanes) of each GPU's link by NVML, as the guest sees it",
                |l| some(l.gpu, l.width),
            ),
            per_gpu(
                links,
                THROUGHPUT,
                "PCIe throughput of each GPU by NVML (a 20 ms sample at the tick), by direction: tx GPU to host, rx host to GPU",
                |l| {
                    directions(l)
                        .into_iter()
                        .filter_map(|(d, v)| Some((direction_labels(l.gpu, d), v?)))
                        .collect()
                },
            ),
            NodeFamily {
                name: ERRORS,
                help: "NVML calls that failed, by GPU (empty: a call about no GPU), call and NVML's code name (GPU_IS_LOST, NOT_SUPPORTED, ...); the first of each is logged",
                kind: Kind::Counter,
                samples: self
                    .failures
                    .counts()
                    .iter()
                    .map(|((gpu, call, code), n)| {
                        let l = Labels::from([
                            ("gpu", gpu.clone()),
                            ("call", call.to_string()),
                            ("code", code.to_string()),
                        ]);
                        (l, *n as f64)
                    })
                    .collect(),
            },
            NodeFamily {
                name: OUTSIDE_MEMORY,
                help: "GPU memory of the processes NVML lists that belong to no pod or slice the agent follows (host processes, or processes that exited while NVML still lists them), per GPU",
                kind: Kind::Gauge,
                samples: self
                    .outside_memory
                    .iter()
                    .map(|(g, b)| (gpu_label(*g), *b as f64))
                    .collect(),
            },
            NodeFamily {
                name: OUTSIDE_SM,
                help: "SM time of the processes NVML sampled that belong to no pod or slice the agent follows, per GPU, in SM-seconds",
                kind: Kind::Counter,
                samples: self
                    .outside_sm_ns
                    .iter()
                    .map(|(g, ns)| (gpu_label(*g), *ns as f64 / 1e9))
                    .collect(),
            },
            NodeFamily {
                name: UNATTRIBUTED,
                help: "1 for each GPU whose compute time NVML cannot attribute to processes (reason mig: a MIG GPU keeps no per-process utilisation, and this GPU or NVML has no GPM to give its instances'): its containers have no compute time from NVML, which is not 0",
                kind: Kind::Gauge,
                samples: self
                    .mig_gpus
                    .iter()
                    .map(|g| {
                        let mut l = gpu_label(*g);
                        l.insert("reason", "mig".to_string());
                        (l, 1.0)
                    })
                    .collect(),
            },
            NodeFamily {
                name: CALL_MISSING,
                help: "1 for each NVML call this node's NVML lacks: its readings are absent, not failed",
                kind: Kind::Gauge,
                samples: self
                    .nvml
                    .iter()
                    .flat_map(|n| n.missing().iter())
                    .map(|c| (Labels::from([("call", c.to_string())]), 1.0))
                    .collect(),
            },
            NodeFamily {
                name: LIBRARY_INFO,
                help: "1 with the NVML library the agent opened (a name the loader found, or a path); absent without NVML",
                kind: Kind::Gauge,
                samples: self
                    .nvml
                    .iter()
                    .map(|n| (Labels::from([("library", n.opened().to_string())]), 1.0))
                    .collect(),
            },
        ];
        node.extend(self.compute.iter().map(ComputeSeries::info));
        UnitStats {
            series: vec![
                SelfSeries::gauge(
                    GPUS,
                    "GPUs NVML reports now (0: no NVML library on the node, or NVML sees no GPU; a lost GPU is not counted)",
                    self.gpus.len() as f64,
                ),
                SelfSeries::gauge(
                    "gpufeed_nvml_mps_servers",
                    "CUDA MPS servers whose SM utilisation NVML sampled at the last tick: their SM time is split among the client containers on their GPU",
                    self.mps_servers as f64,
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

/// One GPU's sample when NVML gave the number.
fn some(gpu: u32, v: Option<impl Into<u64>>) -> Vec<(Labels, f64)> {
    v.map(|v| (gpu_label(gpu), v.into() as f64))
        .into_iter()
        .collect()
}

fn directions(l: &LinkState) -> [(&'static str, Option<f64>); 2] {
    [
        ("tx", l.tx_bytes_per_second.map(|v| v as f64)),
        ("rx", l.rx_bytes_per_second.map(|v| v as f64)),
    ]
}

fn direction_labels(gpu: u32, direction: &'static str) -> Labels {
    let mut l = gpu_label(gpu);
    l.insert("direction", direction.to_string());
    l
}

/// Each pod's GPUs' link throughput, by GPU and direction (each GPU's and direction's labels
/// made once, shared by its pods).
fn pod_links(pod_gpus: &FxHashMap<Owner, Vec<u32>>, links: &[LinkState]) -> Vec<GaugeValue> {
    let readings: Vec<(u32, SharedLabels, f64)> = links
        .iter()
        .flat_map(|l| {
            directions(l).into_iter().filter_map(|(d, v)| {
                Some((l.gpu, SharedLabels::new(direction_labels(l.gpu, d)), v?))
            })
        })
        .collect();
    let mut out = Vec::new();
    for (pod, gpus) in pod_gpus {
        for (gpu, labels, v) in &readings {
            if gpus.contains(gpu) {
                out.push(GaugeValue {
                    owner: pod.clone(),
                    labels: labels.clone(),
                    value: *v,
                });
            }
        }
    }
    out
}

/// The cgroup id of every process of the owners that are not pods (slices), read here (the
/// pods' come from the collector's process lists, re-read only when the kernel says they
/// changed).
fn slice_pid_cgroups(ctx: &TickContext<'_>) -> FxHashMap<u32, u64> {
    let mut out = FxHashMap::default();
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
    use super::*;

    /// An idle (container, GPU) pair gets its 0 once, then nothing while it stays listed; a
    /// busy tick, a pair back after a tick away and a newly published series get theirs.
    #[test]
    fn idle_pairs_hand_their_zero_once() {
        let mut unit = NvmlUnit::open("/nonexistent/libnvidia-ml.so.1".into());
        unit.publish_compute(ComputeSeries::new(
            ComputeSource::Nvml,
            Duration::from_secs(60),
        ));
        let owner = Owner::Pod {
            uid: "uid-1".into(),
            container_id: Some("c1".into()),
        };
        let using = |ns: &[(u32, u64)]| {
            let u = OwnerUse {
                sm_ns: ns.iter().copied().collect(),
                ..OwnerUse::default()
            };
            FxHashMap::from_iter([(owner.clone(), u)])
        };
        let handed = |unit: &mut NvmlUnit, ns: &[(u32, u64)]| {
            let mut d: Vec<(String, u64)> = unit
                .compute_deltas(&using(ns))
                .into_iter()
                .map(|(_, d)| match d.value {
                    super::super::unit::Value::Count(n) => (d.labels["gpu"].clone(), n),
                    v => panic!("{v:?}"),
                })
                .collect();
            d.sort();
            d
        };
        let gpu = |g: &str, n: u64| (g.to_string(), n);
        assert_eq!(
            handed(&mut unit, &[(0, 0), (1, 0)]),
            [gpu("0", 0), gpu("1", 0)]
        );
        assert_eq!(handed(&mut unit, &[(0, 0), (1, 0)]), []);
        assert_eq!(handed(&mut unit, &[(0, 0), (1, 7)]), [gpu("1", 7)]);
        // GPU 1 not listed for a tick: its 0 comes again when it is back
        assert_eq!(handed(&mut unit, &[(0, 0)]), []);
        assert_eq!(handed(&mut unit, &[(0, 0), (1, 0)]), [gpu("1", 0)]);
        // a series published anew starts with every pair
        unit.publish_compute(ComputeSeries::new(
            ComputeSource::Nvml,
            Duration::from_secs(60),
        ));
        assert_eq!(
            handed(&mut unit, &[(0, 0), (1, 0)]),
            [gpu("0", 0), gpu("1", 0)]
        );
    }

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
