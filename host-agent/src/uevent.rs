//! Kernel uevents over `NETLINK_KOBJECT_UEVENT` (group 1, kernel messages only).
//! Message: `ACTION@DEVPATH\0KEY=VALUE\0...`.

use gpufeed_shared::event::{PciErrorRecovery, ThunderboltTunnel};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uevent {
    pub action: String,
    pub devpath: String,
    pub env: BTreeMap<String, String>,
}

impl Uevent {
    pub fn get(&self, k: &str) -> Option<&str> {
        self.env.get(k).map(String::as_str)
    }
}

/// Parse a kernel uevent message. `libudev` (udevd re-broadcast) messages are not handled.
pub fn parse_uevent(buf: &[u8]) -> Option<Uevent> {
    let mut parts = buf.split(|b| *b == 0).filter(|p| !p.is_empty());
    let head = std::str::from_utf8(parts.next()?).ok()?;
    let (action, devpath) = head.split_once('@')?;
    if action.is_empty() || !devpath.starts_with('/') {
        return None;
    }
    let mut env = BTreeMap::new();
    for p in parts {
        let Ok(s) = std::str::from_utf8(p) else {
            continue;
        };
        if let Some((k, v)) = s.split_once('=') {
            env.insert(k.to_string(), v.to_string());
        }
    }
    Some(Uevent {
        action: action.to_string(),
        devpath: devpath.to_string(),
        env,
    })
}

/// What one uevent asks of the watchers. Kept free of I/O so that the routing is tested on
/// the kernel's exact messages; the agent carries it out.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Reaction {
    /// Re-read the Thunderbolt routers now instead of at the next rescan.
    pub poke_thunderbolt: bool,
    /// A device came or went: rediscover which host devices belong to which VM.
    pub rediscover: bool,
    /// A PCI device came or went (hotplug): re-read the links now rather than at the next
    /// poll (a link that went down with its device, or came up with it).
    pub poke_pcie: bool,
    /// Re-read the AER counters now (the PCI core reported an error recovery).
    pub poke_aer: bool,
    /// `TUNNEL_EVENT` of a Thunderbolt router (kernel 6.4+).
    pub tunnel: Option<ThunderboltTunnel>,
    /// `ERROR_EVENT` of a PCI device (the PCI core's recovery uevent); `vmid` left for the
    /// caller, who knows the topology.
    pub recovery: Option<PciErrorRecovery>,
}

impl Reaction {
    pub fn is_empty(&self) -> bool {
        *self == Reaction::default()
    }
}

/// Route a uevent: Thunderbolt routers and PCI devices matter, everything else (the machine's
/// disks, network devices, ...) is ignored. A receive overrun means uevents were lost: rescan.
pub fn react(u: &Uevent) -> Reaction {
    let mut r = Reaction::default();
    let add_remove = u.action == "add" || u.action == "remove";
    if u.action == "overrun" {
        r.poke_thunderbolt = true;
        r.rediscover = true;
        r.poke_pcie = true;
        return r;
    }
    match u.get("SUBSYSTEM").unwrap_or("") {
        "thunderbolt" => {
            if let Some(ev) = u.get("TUNNEL_EVENT") {
                r.tunnel = Some(ThunderboltTunnel {
                    device: u.devpath.rsplit('/').next().unwrap_or("").to_string(),
                    event: ev.to_string(),
                    details: u.get("TUNNEL_DETAILS").map(String::from),
                });
            }
            r.poke_thunderbolt = true;
            r.rediscover = add_remove;
        }
        "pci" => {
            if let Some(ev) = u.get("ERROR_EVENT") {
                r.recovery = Some(PciErrorRecovery {
                    bdf: u.get("PCI_SLOT_NAME").unwrap_or("").to_string(),
                    vmid: None,
                    event: ev.to_string(),
                    device_online: u.get("DEVICE_ONLINE").map(|v| v == "1"),
                });
                r.poke_aer = true;
            }
            r.rediscover = add_remove;
            r.poke_pcie = add_remove;
        }
        _ => {}
    }
    r
}

/// Listen on a blocking thread and forward parsed uevents. Returns an error if the socket
/// cannot be opened (the caller turns the listener off).
pub fn spawn_listener(tx: tokio::sync::mpsc::Sender<Uevent>) -> std::io::Result<()> {
    use netlink_sys::{protocols::NETLINK_KOBJECT_UEVENT, Socket, SocketAddr};
    let mut sock = Socket::new(NETLINK_KOBJECT_UEVENT)?;
    sock.bind(&SocketAddr::new(0, 1))?;
    std::thread::Builder::new()
        .name("uevent".into())
        .spawn(move || {
            let mut buf = vec![0u8; 16384];
            loop {
                match sock.recv_from(&mut &mut buf[..], 0) {
                    Ok((n, addr)) => {
                        if addr.port_number() != 0 {
                            continue; // only the kernel may speak on group 1
                        }
                        if let Some(ev) = parse_uevent(&buf[..n.min(buf.len())]) {
                            if tx.blocking_send(ev).is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                        tracing::warn!("uevent socket overrun; rescanning");
                        let _ = tx.blocking_send(Uevent {
                            action: "overrun".into(),
                            devpath: "/".into(),
                            env: BTreeMap::new(),
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::warn!("uevent listener stopped: {e}");
                        return;
                    }
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_thunderbolt_change() {
        let m = b"change@/devices/pci0000:00/0000:00:0d.2/domain0/0-0/0-1\0ACTION=change\0DEVPATH=/devices/pci0000:00/0000:00:0d.2/domain0/0-0/0-1\0SUBSYSTEM=thunderbolt\0DEVTYPE=thunderbolt_device\0TUNNEL_EVENT=changed\0TUNNEL_DETAILS=0:1 <-> 1:3 (PCI)\0SEQNUM=4242\0";
        let u = parse_uevent(m).unwrap();
        assert_eq!(u.action, "change");
        assert_eq!(u.get("SUBSYSTEM"), Some("thunderbolt"));
        assert_eq!(u.get("TUNNEL_DETAILS"), Some("0:1 <-> 1:3 (PCI)"));
        assert!(parse_uevent(b"libudev\0\xfe\xed").is_none());
        assert!(parse_uevent(b"").is_none());
        assert!(parse_uevent(b"add@\0").is_none());
    }

    fn msg(fields: &[&str]) -> Uevent {
        let mut b = Vec::new();
        for f in fields {
            b.extend_from_slice(f.as_bytes());
            b.push(0);
        }
        parse_uevent(&b).unwrap()
    }

    #[test]
    fn routes_thunderbolt_pci_and_ignores_the_rest() {
        // A tunnel change on a TB4 router: event + immediate re-read, no rediscovery.
        let r = react(&msg(&[
            "change@/devices/pci0000:00/0000:00:0d.2/domain0/0-0/0-1",
            "ACTION=change",
            "SUBSYSTEM=thunderbolt",
            "DEVTYPE=thunderbolt_device",
            "TUNNEL_EVENT=low bandwidth",
            "TUNNEL_DETAILS=0:1 <-> 1:3 (PCI)",
        ]));
        let t = r.tunnel.clone().unwrap();
        assert_eq!(
            (t.device.as_str(), t.event.as_str()),
            ("0-1", "low bandwidth")
        );
        assert_eq!(t.details.as_deref(), Some("0:1 <-> 1:3 (PCI)"));
        assert!(r.poke_thunderbolt && !r.rediscover && !r.poke_aer);

        // The enclosure unplugged: re-read and rediscover, no tunnel event.
        let r = react(&msg(&[
            "remove@/devices/pci0000:00/0000:00:0d.2/domain0/0-0/0-1",
            "ACTION=remove",
            "SUBSYSTEM=thunderbolt",
            "DEVTYPE=thunderbolt_device",
        ]));
        assert_eq!(r.tunnel, None);
        assert!(r.poke_thunderbolt && r.rediscover);

        // The PCI core's recovery uevent (pci_uevent_ers).
        let r = react(&msg(&[
            "change@/devices/pci0000:00/0000:00:07.0/0000:2c:00.0",
            "ACTION=change",
            "SUBSYSTEM=pci",
            "ERROR_EVENT=FAILED_RECOVERY",
            "DEVICE_ONLINE=0",
            "PCI_SLOT_NAME=0000:2c:00.0",
        ]));
        let rec = r.recovery.clone().unwrap();
        assert_eq!(rec.bdf, "0000:2c:00.0");
        assert_eq!(rec.event, "FAILED_RECOVERY");
        assert_eq!(rec.device_online, Some(false));
        assert!(r.poke_aer && !r.rediscover && !r.poke_thunderbolt);

        // A hot-added PCI function: rediscover and re-read the links.
        let r = react(&msg(&[
            "add@/devices/pci0000:00/0000:00:07.0/0000:2c:00.0",
            "ACTION=add",
            "SUBSYSTEM=pci",
            "PCI_SLOT_NAME=0000:2c:00.0",
        ]));
        assert_eq!(
            r,
            Reaction {
                rediscover: true,
                poke_pcie: true,
                ..Default::default()
            }
        );

        // Everything else is noise.
        for m in [
            &[
                "add@/devices/virtual/net/tap100i0",
                "ACTION=add",
                "SUBSYSTEM=net",
            ][..],
            &[
                "change@/devices/virtual/block/loop0",
                "ACTION=change",
                "SUBSYSTEM=block",
            ][..],
            &["bind@/devices/pci0000:00/0000:00:02.0", "ACTION=bind"][..],
        ] {
            assert!(react(&msg(m)).is_empty(), "{m:?}");
        }
        // Lost uevents: rescan everything.
        let r = react(&Uevent {
            action: "overrun".into(),
            devpath: "/".into(),
            env: BTreeMap::new(),
        });
        assert!(r.poke_thunderbolt && r.rediscover && r.poke_pcie);
    }
}
