//! The registry: every unit, the `--probes` names that select them, the
//! loading of the selected ones, every unit's flags gathered into one command
//! line, and the election of the node's GPU compute source among the loaded.
//! It imports the units; no unit imports it.

use std::time::Duration;

use clap::{ArgMatches, Args, Command, FromArgMatches};

use super::gpu_compute::{ComputeSeries, ComputeSource};
use super::options::UnitOptions;
use super::status::ProbeStatus;
use super::unit::{LoadContext, UnitSpec, Units};
use super::{cuda, gpu_driver, nvml, sched, tc, tcp};
use crate::ebpf::{libbpf_log, ProbeError};

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

/// The node's GPU compute source: the best any unit offers, published by that unit. Checked
/// again each tick ([`ComputeElection::update`]): NVML may appear after start, a GPU may be
/// lost and come back, and the series move to the best source there is then.
pub struct ComputeElection {
    window: Duration,
    elected: Option<ComputeSource>,
    /// Better sources than the elected one, and why each is unavailable, as of the last tick.
    unavailable: Vec<(ComputeSource, String)>,
}

/// The election as the doctor reads it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ComputeStatus {
    /// The elected source (None: no unit can be one).
    pub source: Option<ComputeSource>,
    /// Better sources, each with why it is not there (NVML not found, 0 GPUs).
    pub unavailable: Vec<(ComputeSource, String)>,
}

impl ComputeElection {
    /// Elects the best source among `units` (duty cycles over `window`).
    pub fn new(units: &mut Units, window: Duration) -> ComputeElection {
        let mut e = ComputeElection {
            window,
            elected: None,
            unavailable: Vec::new(),
        };
        e.update(units);
        e
    }

    /// The source elected now.
    pub fn elected(&self) -> Option<ComputeSource> {
        self.elected
    }

    /// The source and why better ones are unavailable.
    pub fn status(&self) -> ComputeStatus {
        ComputeStatus {
            source: self.elected,
            unavailable: self.unavailable.clone(),
        }
    }

    /// Elects again when the best source changed; the change is logged with why no better
    /// one is there. Returns whether it changed.
    pub fn update(&mut self, units: &mut Units) -> bool {
        let best = units.iter().filter_map(|u| u.compute_source()).min();
        self.unavailable = units
            .iter()
            .filter_map(|u| u.not_a_source())
            .filter(|(s, _)| best.is_none_or(|b| *s < b))
            .collect();
        if best == self.elected {
            return false;
        }
        for u in units.iter_mut() {
            if u.compute_source() != best || best.is_none() {
                u.retire_compute();
            }
        }
        if let Some(best) = best {
            if let Some(u) = units.iter_mut().find(|u| u.compute_source() == Some(best)) {
                u.publish_compute(ComputeSeries::new(best, self.window));
            }
        }
        let why_not: Vec<String> = self
            .unavailable
            .iter()
            .map(|(s, why)| format!("{}: {why}", s.label()))
            .collect();
        let label = |s: Option<ComputeSource>| s.map_or("none", ComputeSource::label);
        tracing::info!(
            source = label(best),
            was = label(self.elected),
            better_sources_unavailable = %why_not.join("; "),
            "GPU compute time source"
        );
        self.elected = best;
        true
    }
}

impl UnitOptions {
    /// Every unit's options as the command line has them when none of their
    /// flags is given.
    pub fn defaults() -> UnitOptions {
        let cmd = UnitOptions::augment_args(Command::new("defaults").no_binary_name(true));
        let m = cmd
            .try_get_matches_from(std::iter::empty::<&str>())
            .expect("every unit's flags have defaults");
        UnitOptions::from_arg_matches(&m).expect("every unit's defaults are valid")
    }
}

impl FromArgMatches for UnitOptions {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut options = UnitOptions::default();
        for unit in UNITS {
            options.parse_unit(&unit.options, m)?;
        }
        Ok(options)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = UnitOptions::from_arg_matches(m)?;
        Ok(())
    }
}

impl Args for UnitOptions {
    fn augment_args(cmd: Command) -> Command {
        UNITS
            .iter()
            .fold(cmd, |cmd, unit| unit.options.add_flags(cmd))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        UnitOptions::augment_args(cmd)
    }
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
