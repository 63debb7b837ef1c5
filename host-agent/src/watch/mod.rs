//! Watchers, one unit each, and their registry. A unit file holds the watcher's configuration
//! section (its serde struct, defaults and checks), its series (a `*Metrics` struct registered
//! when it is built), its synchronous `poll`-style core that returns events (tested against
//! recorded trees) and the loop that drives that core, tied together by its [`unit::Unit`] and
//! a `watcher` function that builds it from its section.
//!
//! The registry ([`UNITS`]) is the one place that reads the composed configuration for the
//! units: each line says whether the configuration asks for its unit (else it is `Skipped`:
//! its series listed, nothing started) and hands it its own section, and what it needs of the
//! agent's wider settings, as plain values. Adding a watcher: a new file here with those parts,
//! its section's field in [`crate::config::Config`] and its line in [`UNITS`] (docs/host-agent.md
//! walks through one).

pub mod aer;
mod aer_hold;
pub mod bridge;
pub mod context;
pub mod hoststats;
pub mod kmsg;
pub mod pcie;
pub mod poke;
pub mod recent;
pub mod thunderbolt;
pub mod topology;
pub mod tracepoints;
pub mod uevents;
pub mod unit;
pub mod vm;

pub use context::{Context, DISCOVERY};
pub use recent::RecentKmsg;
pub use topology::{TopoCell, Topology};
pub use unit::vm_suffix;

use crate::config::Config;
use gpufeed_shared::event::HostEvent;
use prometheus::Registry;

/// One line of the registry.
pub struct Entry {
    pub unit: unit::Unit,
    /// Whether the configuration asks for the unit.
    pub wanted: fn(&Config) -> bool,
    /// Registers the unit's series and builds it with its section.
    pub build: fn(&Registry, &Config) -> Box<dyn unit::Watcher>,
}

impl Entry {
    /// The unit built from `cfg`: to start when asked for, else holding its series only.
    pub fn watcher(&self, registry: &Registry, cfg: &Config) -> Box<dyn unit::Watcher> {
        let w = (self.build)(registry, cfg);
        if (self.wanted)(cfg) {
            w
        } else {
            Box::new(unit::NotAsked)
        }
    }
}

/// The watchers, in the order the agent starts them (and lists them in its logs).
pub const UNITS: &[Entry] = &[
    Entry {
        unit: pcie::UNIT,
        wanted: |c| c.pcie.enabled,
        build: |r, c| pcie::watcher(r, c.pcie.clone(), c.discovery.rescan_interval_ms),
    },
    Entry {
        unit: aer::UNIT,
        wanted: |c| c.aer.enabled,
        build: |r, c| aer::watcher(r, c.aer.clone()),
    },
    Entry {
        unit: thunderbolt::UNIT,
        wanted: |c| c.thunderbolt.enabled,
        build: |r, c| thunderbolt::watcher(r, c.thunderbolt.clone()),
    },
    // the kernel's uevents, asked for by the Thunderbolt section
    Entry {
        unit: uevents::UNIT,
        wanted: |c| c.thunderbolt.uevents,
        build: |_, _| uevents::watcher(),
    },
    // the tracepoints the AER and PCIe sections ask for
    Entry {
        unit: tracepoints::UNIT,
        wanted: |c| tracepoints::Wanted::of(c).any(),
        build: |_, c| tracepoints::watcher(tracepoints::Wanted::of(c)),
    },
    Entry {
        unit: kmsg::UNIT,
        wanted: |c| c.kmsg.enabled,
        build: |r, c| kmsg::watcher(r, c.kmsg.clone()),
    },
    Entry {
        unit: bridge::UNIT,
        wanted: |c| c.bridge.enabled,
        build: |r, c| bridge::watcher(r, c.bridge.clone()),
    },
    Entry {
        unit: vm::UNIT,
        wanted: |c| c.vm.enabled,
        build: |r, c| vm::watcher(r, c.vm.clone()),
    },
    Entry {
        unit: hoststats::UNIT,
        wanted: |c| c.host.enabled,
        build: |r, c| hoststats::watcher(r, c.host.clone()),
    },
];

/// One line for a person: the unit that emits the event describes it.
pub fn describe(e: &HostEvent) -> String {
    UNITS
        .iter()
        .find_map(|u| (u.unit.describe)(e))
        .or_else(|| agent_event(e))
        .unwrap_or_else(|| format!("{e:?}"))
}

/// The events the agent itself emits (discovery's, and a watcher that is off).
fn agent_event(e: &HostEvent) -> Option<String> {
    match e {
        HostEvent::DeviceMapped(d) => Some(format!(
            "{}{} ({}): path {}{}",
            d.bdf,
            vm_suffix(d.vmid),
            d.origin,
            d.path.join(" <- "),
            d.thunderbolt_router
                .as_ref()
                .map(|t| format!(", thunderbolt router {t}"))
                .unwrap_or_default()
        )),
        HostEvent::WatcherDisabled { watcher, reason } => Some(format!("{watcher} off: {reason}")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufeed_shared::event::samples::one_of_each;

    /// Every kind is described by exactly one unit (or the agent), not by the debug fallback.
    #[test]
    fn every_kind_has_one_describer() {
        let all = one_of_each();
        let kinds: std::collections::BTreeSet<u16> = all.iter().map(HostEvent::kind).collect();
        assert_eq!(kinds.len(), 14, "one sample per kind");
        for e in &all {
            let by: Vec<String> = UNITS
                .iter()
                .filter_map(|u| (u.unit.describe)(e).map(|_| u.unit.name.to_string()))
                .chain(agent_event(e).map(|_| "agent".to_string()))
                .collect();
            assert_eq!(by.len(), 1, "{}: described by {by:?}", e.kind_name());
        }
        assert_eq!(
            describe(&all[0]),
            "0000:0a:00.0 vm 100: 16.0 GT/s x4 -> 2.5 GT/s x4 (speed_only, degraded, max 16.0 GT/s x16)"
        );
        // at full width the host cannot tell power saving from a degradation under load
        let HostEvent::PcieLinkChange(mut full) = all[0].clone() else {
            unreachable!()
        };
        (full.max_width, full.degraded) = (4, false);
        assert_eq!(
            describe(&HostEvent::PcieLinkChange(full)),
            "0000:0a:00.0 vm 100: 16.0 GT/s x4 -> 2.5 GT/s x4 (speed_only, full width: power \
             saving if the GPU is idle, max 16.0 GT/s x4)"
        );
        assert_eq!(describe(&all[9]), "3 kernel log records lost");
        assert_eq!(describe(&all[13]), "aer off: no aer_dev_* files");
    }
}
