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
}
