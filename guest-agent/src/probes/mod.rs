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
//!
//! The modules import one way, from the units down: `registry` imports the
//! units; a unit imports `unit` (the trait, re-exporting `model`, `tick` and
//! `status`), its helpers (`per_cgroup`, `gpu_compute`, `signal`, `options`,
//! `lookout`) and the BPF toolbox in `crate::ebpf`; `model` is the bottom.
//! This file only declares them and re-exports what the rest of the agent
//! names as `probes::…`.

pub mod cgroup_batch;
pub mod cgroup_storage;
pub mod cuda;
pub mod gpu_activity;
pub mod gpu_compute;
pub mod gpu_driver;
pub mod gpu_process;
pub mod hist;
pub mod lookout;
pub mod model;
pub mod nvml;
pub mod options;
pub mod per_cgroup;
pub mod registry;
pub mod sched;
pub mod signal;
pub mod status;
pub mod tc;
pub mod tcp;
pub mod tick;
pub mod unit;

pub use options::UnitOptions;
pub use registry::{
    load, names, probes_help, select, ComputeElection, ComputeStatus, UnknownProbe, UNITS,
};
pub use status::ProbeStatus;

// The BPF toolbox, as `probes::…` for the rest of the agent (the units take it from
// `crate::ebpf`).
pub use crate::ebpf::libbpf_log::route as route_libbpf_logs;
pub use crate::ebpf::{
    cgroup_maps, decode, libbpf_log, lookup_cgroup, object, percpu_sum, KernelBtf, ProbeError,
};
