//! Tracepoints (the `tracepoints` watcher): `ras:aer_event`, `pci:pcie_link_event` and
//! `pci:pci_hp_event` through the private tracefs instance of [`crate::tracefs`], decoded by
//! [`crate::tracefs::decode`]. They sharpen the pollers rather than replace them: an AER
//! record pokes the aer watcher with its detail, a link event pokes the pcie watcher for that
//! port, a hotplug event is emitted and pokes the pcie watcher.
//!
//! Configured by `aer.tracepoint` and `pcie.tracepoints`; absent tracepoints leave polling
//! alone (`watcher_enabled` 0, no event).

use super::unit::{Cx, Outcome, Poke, Starting, Unit, Watcher};
use crate::tracefs::{setup, spawn_reader, SetupError, TraceEvent};
use gpufeed_shared::event::{HostEvent, Source};
use tokio::sync::mpsc;

pub const UNIT: Unit = Unit {
    name: "tracepoints",
    describe,
};

/// The tracepoints the AER and PCIe sections ask for (`[aer] tracepoint`, `[pcie] tracepoints`,
/// each with its watcher on): what this unit is built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    pub aer: bool,
    pub pcie: bool,
}

impl Wanted {
    pub fn of(c: &crate::config::Config) -> Wanted {
        Wanted {
            aer: c.aer.enabled && c.aer.tracepoint,
            pcie: c.pcie.enabled && c.pcie.tracepoints,
        }
    }

    pub fn any(self) -> bool {
        self.aer || self.pcie
    }
}

/// Builds the unit for the tracepoints `wanted`.
pub fn watcher(wanted: Wanted) -> Box<dyn Watcher> {
    Box::new(TracepointWatcher(wanted))
}

struct TracepointWatcher(Wanted);

impl Watcher for TracepointWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            let mut want: Vec<(&str, &str)> = Vec::new();
            if self.0.aer {
                want.push(("ras", "aer_event"));
            }
            if self.0.pcie {
                want.push(("pci", "pcie_link_event"));
                want.push(("pci", "pci_hp_event"));
            }
            if want.is_empty() {
                return Outcome::Skipped;
            }
            let inst = match setup(&a.roots, &want) {
                Ok(inst) => inst,
                Err(e @ SetupError::Absent { .. }) => {
                    tracing::info!("tracefs: {e}; polling only");
                    return Outcome::Absent;
                }
                // the events exist and cannot be used: a deployment to fix, said as such
                Err(e) => return Outcome::Off(format!("tracefs: {e}; polling only")),
            };
            let enabled = inst.enabled.join(", ");
            let aer_on = inst.enabled.iter().any(|e| e == "ras:aer_event");
            let (tx, mut rx) = mpsc::channel(256);
            if let Err(e) = spawn_reader(inst, tx) {
                tracing::info!("tracefs: cannot read trace_pipe: {e}; polling only");
                return Outcome::Skipped;
            }
            tracing::info!("tracefs: using {enabled}");
            if aer_on {
                a.aer_records
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            let (pcie, aer) = (super::pcie::UNIT.name, super::aer::UNIT.name);
            Outcome::On(vec![tokio::spawn(async move {
                while let Some(ev) = rx.recv().await {
                    match ev {
                        TraceEvent::Aer(d) => a.poke(aer, Poke::Aer(d)),
                        TraceEvent::Link { port } => {
                            a.poke(pcie, Poke::Port(port, Source::Tracepoint))
                        }
                        TraceEvent::Hotplug(h) => {
                            // the links below that port, and a replugged device's kept link
                            let port = h.port.clone();
                            a.bus.emit(HostEvent::PciHotplug(h));
                            a.poke(pcie, Poke::Port(port, Source::Tracepoint));
                        }
                    }
                }
            })])
        })
    }
}

fn describe(e: &HostEvent) -> Option<String> {
    let HostEvent::PciHotplug(h) = e else {
        return None;
    };
    Some(format!("{} slot {}: {}", h.port, h.slot, h.event))
}
