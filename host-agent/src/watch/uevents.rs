//! Kernel uevents (the `uevent` watcher): the netlink listener of [`crate::uevent`] feeds
//! [`crate::uevent::react`], and this unit carries out the reaction: Thunderbolt tunnel and PCI
//! error recovery events, pokes to the thunderbolt and aer watchers and to discovery.
//!
//! Configured by `thunderbolt.uevents`; only on a live system (a recorded tree has no kernel
//! behind it).

use super::context::DISCOVERY;
use super::unit::vm_suffix;
use super::unit::{Cx, Outcome, Poke, Starting, Unit, Watcher};
use crate::uevent::{react, spawn_listener};
use gpufeed_shared::event::{HostEvent, Source};
use tokio::sync::mpsc;

pub const UNIT: Unit = Unit {
    name: "uevent",
    describe,
};

/// Builds the unit (the Thunderbolt section's `uevents` asks for it).
pub fn watcher() -> Box<dyn Watcher> {
    Box::new(UeventWatcher)
}

struct UeventWatcher;

impl Watcher for UeventWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            // a recorded tree (tests, `--root`) has no kernel behind it to send uevents
            if !a.roots.is_live() {
                return Outcome::Skipped;
            }
            let (tx, mut rx) = mpsc::channel(256);
            if let Err(e) = spawn_listener(tx) {
                return Outcome::Off(format!("cannot open the uevent netlink socket: {e}"));
            }
            Outcome::On(vec![tokio::spawn(async move {
                while let Some(u) = rx.recv().await {
                    let r = react(&u);
                    if let Some(t) = r.tunnel {
                        a.bus.emit(HostEvent::ThunderboltTunnel(t));
                    }
                    if let Some(mut rec) = r.recovery {
                        rec.vmid = a.topo.get().vmid_of(&rec.bdf);
                        a.bus.emit(HostEvent::PciErrorRecovery(rec));
                    }
                    if r.poke_thunderbolt {
                        a.poke(
                            super::thunderbolt::UNIT.name,
                            Poke::Port(String::new(), Source::Uevent),
                        );
                    }
                    if r.poke_aer {
                        a.poke(super::aer::UNIT.name, Poke::Tick);
                    }
                    if r.rediscover {
                        a.poke(DISCOVERY, Poke::Tick);
                    }
                    if r.poke_pcie {
                        // Now, and again after pciehp's power-off: a safe removal (attention
                        // button, slot `power`) removes the devices, sends this uevent and only
                        // then powers the slot off (pciehp's remove_board), so the port may still
                        // show its slot powered and the link up when the first read comes. The
                        // re-reads also catch a device whose discovery ran after the first.
                        let a = a.clone();
                        tokio::spawn(async move {
                            // at 0, 0.5, 2 and 5 s
                            for gap_ms in [0, 500, 1500, 3000] {
                                tokio::time::sleep(std::time::Duration::from_millis(gap_ms)).await;
                                a.poke(
                                    super::pcie::UNIT.name,
                                    Poke::Port(String::new(), Source::Uevent),
                                );
                            }
                        });
                    }
                }
            })])
        })
    }
}

fn describe(e: &HostEvent) -> Option<String> {
    Some(match e {
        HostEvent::PciErrorRecovery(r) => format!(
            "{}{}: {} online={:?}",
            r.bdf,
            vm_suffix(r.vmid),
            r.event,
            r.device_online
        ),
        HostEvent::ThunderboltTunnel(t) => format!(
            "{}: tunnel {} {}",
            t.device,
            t.event,
            t.details.clone().unwrap_or_default()
        ),
        _ => return None,
    })
}
