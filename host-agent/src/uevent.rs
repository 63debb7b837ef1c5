//! Kernel uevents over `NETLINK_KOBJECT_UEVENT` (group 1, kernel messages only).
//! Message: `ACTION@DEVPATH\0KEY=VALUE\0...`.

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
}
