//! Which VM each guest is bound to, decided at its handshakes: sans-IO, from the SMBIOS
//! system UUID the guest named (`WelcomeVm`) and the `smbios1: uuid=` of this host's VM
//! configurations, both passed in.
//!
//! A guest whose configuration lists `vmids` or `devices` is routed by that filter whatever
//! it names (an override). Any other guest waits for its first handshake: one that names a
//! VM of this host is bound to it and gets its events from then on (and the recent ones held
//! while it waited); one that names none (an older guest, or one that cannot read its UUID)
//! gets every event, as before guests named their VMs. A guest whose UUID is no VM of this
//! host, or names a VM another guest is bound to, is refused: it gets nothing, rather than
//! everything.

use std::collections::BTreeMap;

use super::route::{Filter, Reach};

/// One guest's standing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    /// Routed by its configured filter.
    Configured(Filter),
    /// No handshake that bound it yet.
    Waiting,
    /// Bound to this VM (kept across reconnects: a VM restarted keeps its UUID).
    Vm(u32),
    /// Named no VM: every event.
    Everything,
}

/// Why a guest is not streamed to (the host closes its connection with this as the reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("no VM on this host has SMBIOS UUID {uuid} (smbios1: uuid= of /etc/pve/qemu-server/<vmid>.conf); this guest gets no events from it")]
    UnknownVm { uuid: String },
    #[error("VM {vmid} (SMBIOS UUID {uuid}) is already bound to guest {holder}; two guests cannot claim one VM")]
    Taken {
        vmid: u32,
        uuid: String,
        holder: String,
    },
}

impl Refusal {
    /// Label value of the host's refusal counter.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::UnknownVm { .. } => "unknown_vm",
            Refusal::Taken { .. } => "vm_taken",
        }
    }
}

/// What a handshake changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bound {
    /// Nothing: routed by its filter, or bound as before.
    Unchanged,
    /// Newly bound to this VM (the held events that concern it are handed to it).
    Vm(u32),
    /// Newly taking everything (the held events are handed to it).
    Everything,
}

/// Every guest's slot, in the order of the configuration.
#[derive(Debug, Clone)]
pub struct Bindings {
    slots: Vec<Slot>,
    names: Vec<String>,
}

impl Bindings {
    /// `filters` and `names` in the configuration's order. With `by_vm` false (no VM
    /// configurations to bind to: tests, benchmarks), an empty filter takes everything from
    /// the start, as it always did.
    pub fn new(filters: Vec<Filter>, names: Vec<String>, by_vm: bool) -> Self {
        let slots = filters
            .into_iter()
            .map(|f| match (f.is_catch_all(), by_vm) {
                (false, _) => Slot::Configured(f),
                (true, true) => Slot::Waiting,
                (true, false) => Slot::Everything,
            })
            .collect();
        Bindings { slots, names }
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Whether any guest waits for its binding (the router then holds recent events).
    pub fn waiting(&self) -> bool {
        self.slots.contains(&Slot::Waiting)
    }

    /// A handshake of guest `guest` that named `uuid` (lowercase, as the guest sends it);
    /// `vms` maps each VM of this host to its SMBIOS UUID (read at this handshake, so that a
    /// VM created since the last scan is found).
    /// A refused guest waits again: whatever it was bound to before is not what it names now.
    pub fn bind(
        &mut self,
        guest: usize,
        uuid: Option<&str>,
        vms: &BTreeMap<u32, String>,
    ) -> Result<Bound, Refusal> {
        let r = self.decide(guest, uuid, vms);
        if r.is_err() {
            if let Some(slot) = self.slots.get_mut(guest) {
                *slot = Slot::Waiting;
            }
        }
        r
    }

    fn decide(
        &mut self,
        guest: usize,
        uuid: Option<&str>,
        vms: &BTreeMap<u32, String>,
    ) -> Result<Bound, Refusal> {
        let Some(slot) = self.slots.get(guest) else {
            return Ok(Bound::Unchanged);
        };
        if matches!(slot, Slot::Configured(_)) {
            return Ok(Bound::Unchanged);
        }
        let Some(uuid) = uuid else {
            return Ok(match slot {
                Slot::Everything => Bound::Unchanged,
                _ => {
                    self.slots[guest] = Slot::Everything;
                    Bound::Everything
                }
            });
        };
        let Some(vmid) = vms
            .iter()
            .find(|(_, u)| u.eq_ignore_ascii_case(uuid))
            .map(|(v, _)| *v)
        else {
            return Err(Refusal::UnknownVm {
                uuid: uuid.to_owned(),
            });
        };
        if let Some(holder) = self
            .slots
            .iter()
            .enumerate()
            .position(|(i, s)| i != guest && *s == Slot::Vm(vmid))
        {
            return Err(Refusal::Taken {
                vmid,
                uuid: uuid.to_owned(),
                holder: self.names.get(holder).cloned().unwrap_or_default(),
            });
        }
        if self.slots[guest] == Slot::Vm(vmid) {
            return Ok(Bound::Unchanged);
        }
        self.slots[guest] = Slot::Vm(vmid);
        Ok(Bound::Vm(vmid))
    }

    /// How routing sees guest `guest`, given each VM's devices and the ports above them
    /// (`devices_of`: a VM's passed-through devices and the bridges and ports on their paths).
    pub fn reach(
        &self,
        guest: usize,
        devices_of: &dyn Fn(u32) -> (Vec<String>, Vec<String>),
    ) -> Reach {
        match self.slots.get(guest) {
            Some(Slot::Configured(f)) => Reach::Filter(f.clone()),
            Some(Slot::Waiting) | None => Reach::Nothing,
            Some(Slot::Everything) => Reach::Everything,
            Some(Slot::Vm(vmid)) => {
                let (devices, upstream) = devices_of(*vmid);
                Reach::Vm {
                    vmid: *vmid,
                    devices,
                    upstream,
                }
            }
        }
    }

    /// The filter that picks guest `guest`'s share of the host's own series
    /// ([`super::state`]): its configured one, or its VM and that VM's devices and ports.
    pub fn state_filter(
        &self,
        guest: usize,
        devices_of: &dyn Fn(u32) -> (Vec<String>, Vec<String>),
    ) -> Filter {
        match self.slots.get(guest) {
            Some(Slot::Configured(f)) => f.clone(),
            Some(Slot::Vm(vmid)) => {
                let (mut devices, upstream) = devices_of(*vmid);
                devices.extend(upstream);
                Filter {
                    vmids: vec![*vmid],
                    devices,
                }
            }
            _ => Filter::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U101: &str = "9a8b7c6d-0101-4000-8000-000000000101";
    const U102: &str = "9a8b7c6d-0102-4000-8000-000000000102";

    fn vms() -> BTreeMap<u32, String> {
        [(101, U101.to_string()), (102, U102.to_string())].into()
    }

    fn three(by_vm: bool) -> Bindings {
        Bindings::new(
            vec![
                Filter::default(),
                Filter::default(),
                Filter {
                    vmids: vec![102],
                    devices: vec![],
                },
            ],
            vec!["a".into(), "b".into(), "c".into()],
            by_vm,
        )
    }

    #[test]
    fn a_guest_is_bound_by_its_uuid_and_stays_bound() {
        let mut b = three(true);
        assert_eq!(b.slots()[0], Slot::Waiting);
        assert!(b.waiting());
        assert_eq!(b.bind(0, Some(U101), &vms()), Ok(Bound::Vm(101)));
        // the VM restarted (new QEMU, same UUID): nothing to hand over again
        assert_eq!(b.bind(0, Some(U101), &vms()), Ok(Bound::Unchanged));
        // the UUID's case does not matter (firmware writes either)
        assert_eq!(
            b.bind(1, Some(&U102.to_uppercase()), &vms()),
            Ok(Bound::Vm(102))
        );
        assert!(!b.waiting());
        // a configured filter overrides what the guest names (c lists VM 102 too)
        assert_eq!(b.bind(2, Some(U101), &vms()), Ok(Bound::Unchanged));
        assert_eq!(
            b.slots()[2],
            Slot::Configured(Filter {
                vmids: vec![102],
                devices: vec![]
            })
        );
    }

    #[test]
    fn unknown_and_claimed_vms_are_refused() {
        let mut b = three(true);
        let e = b
            .bind(0, Some("00000000-1111-2222-3333-444444444444"), &vms())
            .unwrap_err();
        assert_eq!(e.reason(), "unknown_vm");
        assert!(e
            .to_string()
            .contains("00000000-1111-2222-3333-444444444444"));
        assert_eq!(b.slots()[0], Slot::Waiting, "refused: still nothing");
        assert_eq!(b.bind(0, Some(U101), &vms()), Ok(Bound::Vm(101)));
        let e = b.bind(1, Some(U101), &vms()).unwrap_err();
        assert_eq!(
            e,
            Refusal::Taken {
                vmid: 101,
                uuid: U101.into(),
                holder: "a".into()
            }
        );
        assert_eq!(b.slots()[1], Slot::Waiting);
        // a bound guest whose VM is gone from this host (its configuration deleted or moved)
        // gets nothing more, and its VM is free for another guest
        assert_eq!(
            b.bind(0, Some(U101), &BTreeMap::new())
                .unwrap_err()
                .reason(),
            "unknown_vm"
        );
        assert_eq!(b.slots()[0], Slot::Waiting);
        assert_eq!(b.bind(1, Some(U101), &vms()), Ok(Bound::Vm(101)));
        // no VM on the host at all
        assert_eq!(
            b.bind(1, Some(U102), &BTreeMap::new())
                .unwrap_err()
                .reason(),
            "unknown_vm"
        );
    }

    #[test]
    fn a_guest_that_names_no_vm_gets_everything() {
        let mut b = three(true);
        assert_eq!(b.bind(1, None, &vms()), Ok(Bound::Everything));
        assert_eq!(b.bind(1, None, &vms()), Ok(Bound::Unchanged));
        assert_eq!(b.reach(1, &|_| (vec![], vec![])), Reach::Everything);
        // without VM configurations an empty filter always took everything
        let b = three(false);
        assert_eq!(b.slots()[0], Slot::Everything);
        assert!(!b.waiting());
    }

    #[test]
    fn reach_and_state_filter_follow_the_topology() {
        let mut b = three(true);
        b.bind(0, Some(U101), &vms()).unwrap();
        let topo = |v: u32| match v {
            101 => (
                vec!["0000:03:00.0".to_string()],
                vec!["0000:00:01.0".to_string()],
            ),
            _ => (vec![], vec![]),
        };
        assert_eq!(
            b.reach(0, &topo),
            Reach::Vm {
                vmid: 101,
                devices: vec!["0000:03:00.0".into()],
                upstream: vec!["0000:00:01.0".into()]
            }
        );
        assert_eq!(b.reach(1, &topo), Reach::Nothing);
        assert_eq!(
            b.state_filter(0, &topo),
            Filter {
                vmids: vec![101],
                devices: vec!["0000:03:00.0".into(), "0000:00:01.0".into()]
            }
        );
    }
}
