//! Proxmox VE's names for a VM's network ports: `tap<vmid>i<n>` (a VM's NIC), `fwpr<vmid>p<n>`
//! (the firewall bridge's port), `veth<vmid>i<n>` (a container's NIC). The bridge watcher
//! attributes port counters with it and the kernel log classifier finds the VM a line is about.

/// `tap100i0` → (100, 0); `fwpr100p1` → (100, 1); `veth105i0` → (105, 0).
pub fn parse_port_name(name: &str) -> Option<(u32, u32)> {
    for (pfx, sep) in [("tap", 'i'), ("fwpr", 'p'), ("veth", 'i')] {
        if let Some(rest) = name.strip_prefix(pfx) {
            let (v, n) = rest.split_once(sep)?;
            if v.is_empty() || n.is_empty() || v.len() > 9 || n.len() > 3 {
                return None;
            }
            if !v.bytes().all(|b| b.is_ascii_digit()) || !n.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            return Some((v.parse().ok()?, n.parse().ok()?));
        }
    }
    None
}

/// Whether bridge `name` is watched when `names` are configured (empty: every bridge but
/// Proxmox's firewall bridges).
///
/// With `firewall=1` a VM NIC is `tap<vmid>i<n>` on its own bridge `fwbr<vmid>i<n>`, linked by
/// the veth pair `fwln<vmid>i<n>`/`fwpr<vmid>p<n>` to the bridge the VM's config names
/// (`vmbr0`). Every byte of the NIC then crosses `tap…` and `fwpr…` both; watching the
/// `fwbr` bridges would count the VM's traffic twice under its VMID. The NIC is counted once,
/// at its port on the configured bridge: `tap…` without the firewall, `fwpr…` with it.
pub fn bridge_watched(name: &str, names: &[String]) -> bool {
    if names.is_empty() {
        !is_firewall_bridge(name)
    } else {
        names.iter().any(|n| n == name)
    }
}

/// `fwbr<vmid>i<n>`: the per-NIC bridge Proxmox's firewall puts between a tap and its bridge.
pub fn is_firewall_bridge(name: &str) -> bool {
    name.strip_prefix("fwbr")
        .and_then(|r| r.split_once('i'))
        .is_some_and(|(v, n)| {
            [v, n]
                .iter()
                .all(|x| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_names() {
        assert_eq!(parse_port_name("tap100i0"), Some((100, 0)));
        assert_eq!(parse_port_name("fwpr101p2"), Some((101, 2)));
        assert_eq!(parse_port_name("veth102i1"), Some((102, 1)));
        assert_eq!(parse_port_name("tap100"), None);
        assert_eq!(parse_port_name("tapxi0"), None);
        assert_eq!(parse_port_name("enp1s0"), None);
        assert_eq!(parse_port_name("vethab12"), None);
    }

    #[test]
    fn firewall_bridges() {
        assert!(is_firewall_bridge("fwbr100i0"));
        assert!(!is_firewall_bridge("fwbr100"));
        assert!(!is_firewall_bridge("fwbrxi0"));
        assert!(!is_firewall_bridge("vmbr0"));
        assert!(!bridge_watched("fwbr100i0", &[]));
        assert!(bridge_watched("vmbr0", &[]));
        let only = ["fwbr100i0".to_string()];
        assert!(bridge_watched("fwbr100i0", &only));
        assert!(!bridge_watched("vmbr0", &only));
    }
}
