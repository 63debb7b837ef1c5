//! `probes`: which probes load on this kernel, and why the others do not.
//!
//! The doctor command does not guess from kernel versions or feature lists: it loads the
//! selected probes exactly as `run` would (the verifier, the map types, the kfuncs, lockdown,
//! the storage fallback) and lets them go again before attaching anything to an interface
//! or a process. So what it says before the agent starts is what the agent will get. The
//! running agent reports the statuses its own load gave.

use crate::probes::unit::LoadContext;
use crate::probes::{self, KernelBtf, ProbeStatus, UnitOptions};

use super::Finding;

const CHECK: &str = "probes";

/// Loads the probes `spec` selects (as `--probes`) with their options as given to `run`,
/// drops them (before a tick attaches anything to an interface), and reports.
pub fn predict(spec: &str, options: &UnitOptions) -> Finding {
    let selected = match probes::select(spec) {
        Ok(s) => s,
        Err(e) => return Finding::fail(CHECK, e.to_string(), "pass --probes as given to run"),
    };
    if selected.is_empty() {
        return Finding::skip(CHECK, "no probe selected (--probes none)");
    }
    let btf = KernelBtf::load();
    let lockdown = crate::privileges::lockdown();
    let ctx = LoadContext {
        btf: &btf,
        options,
        interval: std::time::Duration::from_secs(1),
        lockdown: lockdown.as_deref(),
    };
    match probes::load(&ctx, &selected) {
        Ok((units, statuses)) => {
            drop(units);
            from_statuses(&statuses)
        }
        Err(e) => Finding::fail(
            CHECK,
            format!("no probe can load: {e}"),
            "run with CAP_BPF and CAP_PERFMON (the DaemonSet grants them), or as root",
        ),
    }
}

/// The finding for the statuses a load gave: a pass names how each probe runs, a failure
/// names each probe that is down with the kernel's reason.
pub fn from_statuses(statuses: &[ProbeStatus]) -> Finding {
    let down: Vec<String> = statuses
        .iter()
        .filter(|s| !s.up)
        .map(|s| format!("{}: {}", s.name, s.reason.as_deref().unwrap_or("down")))
        .collect();
    let up: Vec<String> = statuses
        .iter()
        .filter(|s| s.up)
        .map(|s| {
            let storage = s
                .how
                .iter()
                .find(|(k, _)| *k == "storage")
                .map(|(_, v)| format!(" ({v})"))
                .unwrap_or_default();
            format!("{}{storage}", s.name)
        })
        .collect();
    if down.is_empty() {
        Finding::pass(
            CHECK,
            format!("{} of {} load: {}", up.len(), statuses.len(), up.join(", ")),
        )
    } else {
        Finding::fail(
            CHECK,
            format!(
                "{} of {} will not load here: {}",
                down.len(),
                statuses.len(),
                down.join("; ")
            ),
            "the other probes run and are served; docs/kernel-support.md lists what each \
             kernel loads and why, docs/probes.md what each probe needs",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    #[test]
    fn names_what_is_down_and_how_the_rest_runs() {
        let ok = [
            ProbeStatus::up("sched_latency").with("storage", "hash-by-id"),
            ProbeStatus::up("nvml"),
        ];
        let f = from_statuses(&ok);
        assert_eq!(f.status, Status::Pass);
        assert_eq!(f.detail, "2 of 2 load: sched_latency (hash-by-id), nvml");
        let bad = [
            ProbeStatus::up("sched_latency"),
            ProbeStatus::down(
                "cuda",
                "program cu_launch_kernel: unknown func bpf_probe_read#4",
            ),
        ];
        let f = from_statuses(&bad);
        assert_eq!(f.status, Status::Fail);
        assert!(
            f.detail
                .contains("1 of 2 will not load here: cuda: program cu_launch_kernel"),
            "{}",
            f.detail
        );
    }
}
