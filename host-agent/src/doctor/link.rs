//! `gpu_link`: at start, no watched device's PCIe link runs below what both its ends can do
//! (a card reseated badly, a riser or cable that trained at fewer lanes, a slot that shares
//! lanes). The PCIe watcher reports changes later as events; this is the state it starts from.

use gpufeed_shared::doctor::Finding;

use crate::discovery::discover;
use crate::roots::Roots;
use crate::sysfs::fmt_speed;
use crate::watch::pcie::{read_link, runtime_suspended};

const CHECK: &str = "gpu_link";

/// Checks every link on the path of every watched device (passed through to a VM, or in
/// `devices`), from the device up to its root port; Thunderbolt tunnel hops (synthetic speeds)
/// are skipped. A link narrower than its maximum fails. A slower one fails too, except the
/// device's own link: GPUs lower their link speed when idle and raise it under load, so there
/// a lower speed is noted, not failed.
pub fn degraded(roots: &Roots, node: &str, devices: &[String]) -> Finding {
    let (_, topo) = discover(roots, node, devices);
    if topo.is_empty() {
        return Finding::skip(
            CHECK,
            "no device watched (none passed through to a VM, none in `devices`)",
        );
    }
    let mut bad = Vec::new();
    let mut noted = Vec::new();
    let mut asleep = Vec::new();
    let mut full = 0;
    // A card's functions share one link: each link once.
    let mut seen = std::collections::HashSet::new();
    for t in topo.iter().filter(|t| t.present) {
        // links[0] is the device's own link (for a function other than 0, function 0's)
        for (i, l) in t
            .links
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.virtual_tunnel)
        {
            if !seen.insert(l.child.clone()) {
                continue;
            }
            // Reading the link status of a runtime-suspended device would wake it (as the
            // PCIe watcher, the doctor leaves it asleep).
            if runtime_suspended(roots, &l.child) {
                asleep.push(l.child.clone());
                continue;
            }
            let Some(s) = read_link(roots, &l.child, l.parent.as_deref()) else {
                continue;
            };
            let what = |why: String| format!("{} (for {}): {why}", l.child, t.assignment.bdf);
            if s.width == 0 {
                bad.push(what("link down".into()));
            } else if s.max_width > 0 && s.width < s.max_width {
                bad.push(what(format!("x{} of x{}", s.width, s.max_width)));
            } else if matches!((s.speed, s.max_speed), (Some(a), Some(b)) if a < b) {
                let txt = format!(
                    "{} of {}",
                    fmt_speed(s.speed).trim(),
                    fmt_speed(s.max_speed).trim()
                );
                if i == 0 {
                    noted.push(what(txt));
                } else {
                    bad.push(what(txt));
                }
            } else {
                full += 1;
            }
        }
    }
    if !bad.is_empty() {
        return Finding::fail(
            CHECK,
            format!("below capability: {}", bad.join("; ")),
            "power the VM off and reseat the card or the cable/riser, check the slot's lane \
             sharing in the board manual and the BIOS's link speed setting; \
             `lspci -vv -s BDF` shows LnkSta against LnkCap",
        );
    }
    let mut detail = format!("{full} links at full speed and width");
    if !asleep.is_empty() {
        detail.push_str(&format!(
            "; not read (runtime-suspended): {}",
            asleep.join(", ")
        ));
    }
    if !noted.is_empty() {
        detail.push_str(&format!(
            "; slower while idle (GPUs lower the speed, full width): {}",
            noted.join("; ")
        ));
    }
    Finding::pass(CHECK, detail)
}
