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

/// A guest's filter: empty lists take every event.
#[derive(Debug, Default, Clone)]
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

/// Indices of the guests that get an event: catch-all guests always; guests whose filter
/// matches; and every guest when no filter matches (an event about a bridge or root port that
/// no guest lists is still delivered rather than lost).
pub fn targets(filters: &[Filter], r: &Route) -> Vec<usize> {
    let specific: Vec<usize> = (0..filters.len())
        .filter(|&i| !filters[i].is_catch_all() && filters[i].matches(r))
        .collect();
    if specific.is_empty() {
        return (0..filters.len()).collect();
    }
    (0..filters.len())
        .filter(|&i| filters[i].is_catch_all() || specific.contains(&i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing() {
        let f = vec![
            Filter {
                vmids: vec![100],
                devices: vec![],
            },
            Filter {
                vmids: vec![101],
                devices: vec!["0000:09:00.0".into()],
            },
            Filter::default(),
        ];
        let vm100 = Route {
            vmids: vec![100],
            bdfs: vec![],
        };
        assert_eq!(targets(&f, &vm100), vec![0, 2]);
        let dev = Route {
            vmids: vec![],
            bdfs: vec!["0000:09:00.0".into()],
        };
        assert_eq!(targets(&f, &dev), vec![1, 2]);
        assert_eq!(targets(&f, &Route::default()), vec![0, 1, 2]);
        let other = Route {
            vmids: vec![999],
            bdfs: vec!["0000:00:01.0".into()],
        };
        assert_eq!(targets(&f, &other), vec![0, 1, 2]);
        assert_eq!(
            Route::of(&HostEvent::KmsgLost { count: 1 }),
            Route::default()
        );
    }
}
