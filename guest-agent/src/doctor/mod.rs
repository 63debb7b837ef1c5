//! `gpufeed-guest doctor`: what the field gets wrong on a node, checked where the agent runs.
//! Each check passes or fails with its fix (docs/doctor.md lists them); the running agent
//! evaluates them at start and every [`PERIOD`], exports `gpufeed_check_ok{check}` and serves
//! its latest findings at `/doctor`.
//!
//! The checks take their inputs ([`Inputs`]: a `/proc/<pid>`, a sysfs root, a network
//! namespace) so that tests can hand them real kernel state in the state they want.

pub mod gpu;
pub mod kernel;
pub mod network;
pub mod pods;
pub mod probes;
pub mod stream;

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub use gpufeed_shared::doctor::{any_failed, render, CheckGauge, Finding, Status};

use crate::ifaces::NodeDevices;
use crate::probes::gpu_driver::Hook;

/// [`Inputs::tracefs_wanted`] from `--probes` and `--gpu-driver-hook`.
pub fn tracefs_wanted(probes: &str, hook: Hook) -> bool {
    let gpu = crate::probes::select(probes).is_ok_and(|sel| {
        sel.iter()
            .any(|(_, names)| names.contains(&crate::probes::gpu_driver::NAME))
    });
    // only the per-syscall tracepoints attach by tracefs ids; uprobes and the BTF
    // tracepoints need none
    gpu && hook == Hook::Syscalls
}

/// The probe names `--probes` selects ([`Inputs::probes`]); a spec the agent would refuse
/// counts as all of them (the strictest reading).
pub fn selected_probes(probes: &str) -> Vec<&'static str> {
    crate::probes::select(probes).map_or_else(
        |_| crate::probes::names(),
        |sel| sel.into_iter().flat_map(|(_, names)| names).collect(),
    )
}

/// How often the running agent re-evaluates its checks (all are cheap: a few file reads and
/// three rtnetlink dumps).
pub const PERIOD: Duration = Duration::from_secs(300);

/// Where the checks look.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// `/proc/<pid>` of the process whose capabilities count (the agent's: `/proc/self`).
    pub proc_pid: PathBuf,
    /// sysfs root (`/sys`): BTF, securityfs, tracefs below it.
    pub sys: PathBuf,
    /// The cgroup v2 root the agent reads (`--cgroup-root`); `None`: from mountinfo.
    pub cgroup_root: Option<PathBuf>,
    /// The network namespace to look at (an nsfs file such as `/run/netns/NAME`); `None`:
    /// the caller's own, which is the agent's.
    pub netns: Option<PathBuf>,
    /// The devices where pods' traffic leaves the node (`--node-devices`).
    pub node_devices: NodeDevices,
    /// Whether anything selected wants tracefs: the GPU driver probe with a hook other than
    /// the raw syscall tracepoints.
    pub tracefs_wanted: bool,
    /// The selected probes ([`selected_probes`]): what the capabilities must cover.
    pub probes: Vec<&'static str>,
}

impl Inputs {
    /// The inputs of an agent run with `--probes probes` and the probes' flags `options`:
    /// the node devices it counts, whether it needs tracefs, the probes it selects.
    pub fn for_run(probes: &str, options: &crate::probes::UnitOptions) -> Inputs {
        use crate::probes::{gpu_driver, tc};
        Inputs {
            node_devices: options.get::<tc::Config>().node_devices.clone(),
            tracefs_wanted: tracefs_wanted(probes, options.get::<gpu_driver::Config>().hook),
            probes: selected_probes(probes),
            ..Inputs::default()
        }
    }
}

impl Default for Inputs {
    fn default() -> Self {
        Inputs {
            proc_pid: "/proc/self".into(),
            sys: "/sys".into(),
            cgroup_root: None,
            netns: None,
            node_devices: NodeDevices::Auto,
            tracefs_wanted: true,
            probes: crate::probes::names(),
        }
    }
}

/// The checks that need only this node (not the running agent's state), in report order.
pub fn local(inputs: &Inputs) -> Vec<Finding> {
    let mut out = vec![
        kernel::capabilities(&inputs.proc_pid, &inputs.probes),
        kernel::btf(&inputs.sys),
        kernel::cgroup2(inputs.cgroup_root.as_deref()),
        if inputs.tracefs_wanted {
            kernel::tracefs(&inputs.sys)
        } else {
            Finding::skip(
                "tracefs",
                "not needed: the GPU driver probe is off or uses the raw syscall hooks",
            )
        },
        kernel::lockdown(&inputs.sys),
    ];
    out.extend(network::checks(
        inputs.netns.as_deref(),
        &inputs.node_devices,
    ));
    out
}

/// The running agent's findings: the local checks, then those of its own state.
#[derive(Clone, Default)]
pub struct Latest(Arc<RwLock<Vec<Finding>>>);

impl Latest {
    pub fn get(&self) -> Vec<Finding> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set(&self, f: Vec<Finding>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = f;
    }
}
