//! Which guests an event concerns: by VMID and by PCI device (BDF).
//!
//! [`Route::of`] matches every event kind by name, without a wildcard: a new kind is a compile
//! error here until its route is written.

use gpufeed_shared::event::HostEvent;

/// VMIDs and BDFs named by an event (empty: a host-wide event).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Route {
    pub vmids: Vec<u32>,
    pub bdfs: Vec<String>,
}

impl Route {
    pub fn of(ev: &HostEvent) -> Route {
        let mut r = Route::default();
        let mut bdf = |b: &str| r.bdfs.push(b.to_owned());
        match ev {
            HostEvent::PcieLinkChange(e) => {
                bdf(&e.bdf);
                e.upstream_bdf.as_deref().map(&mut bdf);
                e.target_bdf.as_deref().map(&mut bdf);
                r.vmids.extend(e.vmid);
            }
            HostEvent::AerCounter(e) => {
                bdf(&e.bdf);
                r.vmids.extend(e.vmid);
            }
            HostEvent::AerRootPortTotal(e) => bdf(&e.bdf),
            HostEvent::AerTrace(e) => bdf(&e.dev_name),
            HostEvent::PciErrorRecovery(e) => {
                bdf(&e.bdf);
                r.vmids.extend(e.vmid);
            }
            HostEvent::PciHotplug(e) => bdf(&e.port),
            HostEvent::ThunderboltDevice(e) => r.vmids.extend(e.vmids.iter().copied()),
            HostEvent::Kmsg(e) => {
                e.bdf.as_deref().map(&mut bdf);
                r.vmids.extend(e.vmid);
            }
            HostEvent::VmState(e) => r.vmids.push(e.vmid),
            HostEvent::BridgePort(e) => r.vmids.extend(e.vmid),
            HostEvent::DeviceMapped(e) => {
                bdf(&e.bdf);
                r.vmids.extend(e.vmid);
            }
            // Host-wide: every guest gets them. Listed one by one (no wildcard) so that a new
            // kind does not compile until someone decides whom it concerns.
            HostEvent::ThunderboltTunnel(_)
            | HostEvent::KmsgLost { .. }
            | HostEvent::WatcherDisabled { .. } => {}
        }
        r
    }
}

/// A guest's filter from the configuration (`vmids`, `devices`): empty lists take every
/// event.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Filter {
    pub vmids: Vec<u32>,
    pub devices: Vec<String>,
}

impl Filter {
    pub fn is_catch_all(&self) -> bool {
        self.vmids.is_empty() && self.devices.is_empty()
    }

    pub fn matches(&self, r: &Route) -> bool {
        r.vmids.iter().any(|v| self.vmids.contains(v))
            || r.bdfs
                .iter()
                .any(|b| self.devices.iter().any(|d| d.eq_ignore_ascii_case(b)))
    }
}

/// What a guest gets, as routing sees it at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// Nothing (not bound yet, or refused): the router holds recent events for it instead.
    Nothing,
    /// Every event (an empty filter where guests are not bound to VMs, or a guest that named
    /// no VM).
    Everything,
    /// What its configured filter matches; an event that no configured filter matches goes to
    /// every configured guest (an event about a bridge or root port nobody listed is delivered
    /// rather than lost).
    Filter(Filter),
    /// Its VM's: an event that names this VM or one of its passed-through `devices`, and one
    /// that names a port or bridge `upstream` of them (on the path to the root port), so
    /// that a port's or bridge's event reaches every VM below it.
    Vm {
        vmid: u32,
        devices: Vec<String>,
        upstream: Vec<String>,
    },
}

/// Why a guest gets an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Why {
    /// It names the guest's VM or one of its devices (or matches its filter).
    Own,
    /// It names a port or bridge above the guest's VM's devices, and not the VM itself (it
    /// may concern other VMs below the same port too).
    Upstream,
    /// It names no VM and no device: the host's own (kmsg loss, a watcher down).
    HostWide,
    /// The guest takes everything, or nothing configured matched (the configured guests'
    /// fallback).
    Unclaimed,
}

impl Why {
    /// Every reason, in declaration order (`why as usize` indexes it).
    pub const ALL: [Why; 4] = [Why::Own, Why::Upstream, Why::HostWide, Why::Unclaimed];

    pub fn name(self) -> &'static str {
        match self {
            Why::Own => "own",
            Why::Upstream => "upstream",
            Why::HostWide => "host_wide",
            Why::Unclaimed => "unclaimed",
        }
    }
}

/// Whether a VM-bound guest gets an event, and why.
fn vm_reach(vmid: u32, devices: &[String], upstream: &[String], r: &Route) -> Option<Why> {
    let named = |list: &[String]| {
        r.bdfs
            .iter()
            .any(|b| list.iter().any(|d| d.eq_ignore_ascii_case(b)))
    };
    if r.vmids.contains(&vmid) || named(devices) {
        Some(Why::Own)
    } else if named(upstream) {
        // also when the event names another VM: a link or bridge shared by both
        Some(Why::Upstream)
    } else {
        None
    }
}

/// The guests that get an event (indices into `guests`), each with why; see [`Reach`]. A
/// host-wide event (no VM, no device) reaches every guest that takes anything.
pub fn targets(guests: &[Reach], r: &Route) -> Vec<(usize, Why)> {
    if r.vmids.is_empty() && r.bdfs.is_empty() {
        return (0..guests.len())
            .filter(|&i| guests[i] != Reach::Nothing)
            .map(|i| (i, Why::HostWide))
            .collect();
    }
    let filter_matched = guests
        .iter()
        .any(|g| matches!(g, Reach::Filter(f) if !f.is_catch_all() && f.matches(r)));
    guests
        .iter()
        .enumerate()
        .filter_map(|(i, g)| {
            let why = match g {
                Reach::Nothing => None,
                Reach::Everything => Some(Why::Unclaimed),
                Reach::Filter(f) if f.is_catch_all() => Some(Why::Unclaimed),
                Reach::Filter(f) if f.matches(r) => Some(Why::Own),
                Reach::Filter(_) if !filter_matched => Some(Why::Unclaimed),
                Reach::Filter(_) => None,
                Reach::Vm {
                    vmid,
                    devices,
                    upstream,
                } => vm_reach(*vmid, devices, upstream, r),
            };
            why.map(|w| (i, w))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(vmids: &[u32], bdfs: &[&str]) -> Route {
        Route {
            vmids: vmids.to_vec(),
            bdfs: bdfs.iter().map(|b| b.to_string()).collect(),
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn configured_filters_keep_their_fallback() {
        let f = vec![
            Reach::Filter(Filter {
                vmids: vec![100],
                devices: vec![],
            }),
            Reach::Filter(Filter {
                vmids: vec![101],
                devices: vec!["0000:09:00.0".into()],
            }),
            Reach::Filter(Filter::default()),
        ];
        let idx = |t: Vec<(usize, Why)>| t.into_iter().map(|(i, _)| i).collect::<Vec<_>>();
        assert_eq!(idx(targets(&f, &route(&[100], &[]))), vec![0, 2]);
        assert_eq!(idx(targets(&f, &route(&[], &["0000:09:00.0"]))), vec![1, 2]);
        assert_eq!(idx(targets(&f, &Route::default())), vec![0, 1, 2]);
        // nobody listed it: every configured guest rather than none
        assert_eq!(
            idx(targets(&f, &route(&[999], &["0000:00:01.0"]))),
            vec![0, 1, 2]
        );
        assert_eq!(
            Route::of(&HostEvent::KmsgLost { count: 1 }),
            Route::default()
        );
    }

    /// Two VMs below one root port (00:01.0) through a switch (01:00.0 up, 02:00.0 and
    /// 02:01.0 down), a third VM on its own root port, a guest not bound yet, and an old
    /// guest that takes everything.
    fn host() -> Vec<Reach> {
        vec![
            Reach::Vm {
                vmid: 101,
                devices: strings(&["0000:03:00.0", "0000:03:00.1"]),
                upstream: strings(&["0000:02:00.0", "0000:01:00.0", "0000:00:01.0"]),
            },
            Reach::Vm {
                vmid: 102,
                devices: strings(&["0000:04:00.0"]),
                upstream: strings(&["0000:02:01.0", "0000:01:00.0", "0000:00:01.0"]),
            },
            Reach::Vm {
                vmid: 103,
                devices: strings(&["0000:81:00.0"]),
                upstream: strings(&["0000:80:01.0"]),
            },
            Reach::Nothing,
            Reach::Everything,
        ]
    }

    #[test]
    fn a_vm_gets_its_own_events_only() {
        let g = host();
        // its device, named with its VM (a link drop) or without (an AER trace)
        assert_eq!(
            targets(&g, &route(&[102], &["0000:04:00.0", "0000:02:01.0"])),
            vec![(1, Why::Own), (4, Why::Unclaimed)]
        );
        assert_eq!(
            targets(&g, &route(&[], &["0000:03:00.1"])),
            vec![(0, Why::Own), (4, Why::Unclaimed)]
        );
        // a VM event (its state, its bridge port) by VM id alone
        assert_eq!(
            targets(&g, &route(&[103], &[])),
            vec![(2, Why::Own), (4, Why::Unclaimed)]
        );
        // a device no VM owns, a VM no guest is bound to: only the catch-all guest
        assert_eq!(
            targets(&g, &route(&[], &["0000:05:00.0"])),
            vec![(4, Why::Unclaimed)]
        );
        assert_eq!(targets(&g, &route(&[999], &[])), vec![(4, Why::Unclaimed)]);
    }

    #[test]
    fn a_shared_port_reaches_every_vm_below_it() {
        let g = host();
        // the root port above both VMs: 101 and 102, not 103
        assert_eq!(
            targets(&g, &route(&[], &["0000:00:01.0"])),
            vec![(0, Why::Upstream), (1, Why::Upstream), (4, Why::Unclaimed)]
        );
        // the switch's link, reported with the first VM it serves: the other VM below it too
        assert_eq!(
            targets(&g, &route(&[101], &["0000:01:00.0", "0000:00:01.0"])),
            vec![(0, Why::Own), (1, Why::Upstream), (4, Why::Unclaimed)]
        );
        // a downstream port of the switch: only the VM below it
        assert_eq!(
            targets(&g, &route(&[], &["0000:02:01.0"])),
            vec![(1, Why::Upstream), (4, Why::Unclaimed)]
        );
    }

    #[test]
    fn every_why_indexes_its_own_place() {
        for (i, w) in Why::ALL.iter().enumerate() {
            assert_eq!(*w as usize, i, "{}", w.name());
        }
    }

    #[test]
    fn host_wide_events_reach_every_guest_that_takes_anything() {
        assert_eq!(
            targets(&host(), &Route::default()),
            vec![
                (0, Why::HostWide),
                (1, Why::HostWide),
                (2, Why::HostWide),
                (4, Why::HostWide)
            ]
        );
    }
}
