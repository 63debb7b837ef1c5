//! Who a tc/qdisc drop belongs to: the socket's owner, else the device's pod,
//! else the pod whose IP the packet carries.

use std::collections::HashMap;
use std::net::IpAddr;

use super::loader::DropKey;
use crate::ifaces::PodIface;
use crate::owner::Owner;

/// What attribution looks at besides the drop record.
pub struct Known<'a> {
    /// The agent's own network namespace (where the host-side veths live).
    pub own_netns: u32,
    /// host ifindex → pod interface
    pub by_host: &'a HashMap<u32, PodIface>,
    /// (pod netns, pod ifindex) → pod uid
    pub by_pod_side: &'a HashMap<(u32, u32), String>,
    /// the pod (or slice) of a cgroup id
    pub pod_of_cgroup: &'a dyn Fn(u64) -> Option<Owner>,
    /// the uid of the pod that has an IP
    pub pod_of_ip: &'a dyn Fn(IpAddr) -> Option<String>,
    /// whether the drop happened at tc ingress (`tc_ingress` reason)
    pub ingress_hook: bool,
}

fn pod(uid: String) -> Owner {
    Owner::Pod {
        uid: uid.into(),
        container_id: None,
    }
}

/// Direction from the pod's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// The owner of a drop and, where known, its direction from the pod's view.
pub fn attribute(k: &DropKey, known: &Known<'_>) -> (Owner, Option<Direction>) {
    // the device says the direction when it is a pod's: host side carries
    // the pod's ingress on egress, and the other way round
    let (host_dir, pod_dir) = if known.ingress_hook {
        (Direction::Egress, Direction::Ingress)
    } else {
        (Direction::Ingress, Direction::Egress)
    };
    let dev_side = if k.netns == known.own_netns {
        known
            .by_host
            .get(&k.ifindex)
            .map(|p| (p.uid.clone(), host_dir))
    } else {
        known
            .by_pod_side
            .get(&(k.netns, k.ifindex))
            .map(|u| (u.clone(), pod_dir))
    };
    let by_ip = |ip: Option<IpAddr>| ip.and_then(known.pod_of_ip);
    let ip_dir = |uid: &str| -> Option<Direction> {
        if by_ip(k.saddr).as_deref() == Some(uid) {
            Some(Direction::Egress)
        } else if by_ip(k.daddr).as_deref() == Some(uid) {
            Some(Direction::Ingress)
        } else {
            None
        }
    };
    if k.cgroup_id != 0 {
        if let Some(owner) = (known.pod_of_cgroup)(k.cgroup_id) {
            let dir = match &owner {
                Owner::Pod { uid, .. } => dev_side
                    .as_ref()
                    .filter(|(u, _)| u.as_str() == &**uid)
                    .map(|(_, d)| *d)
                    .or_else(|| ip_dir(uid))
                    // a pod's own socket on a device not its own: it was sending
                    .or(Some(Direction::Egress)),
                _ => None,
            };
            return (owner, dir);
        }
    }
    if let Some((uid, dir)) = dev_side {
        return (pod(uid), Some(dir));
    }
    if let Some(uid) = by_ip(k.saddr).or_else(|| by_ip(k.daddr)) {
        let dir = ip_dir(&uid);
        return (pod(uid), dir);
    }
    (Owner::Unattributed, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: u32 = 4026531840;

    fn key(cgroup_id: u64, netns: u32, ifindex: u32) -> DropKey {
        DropKey {
            cgroup_id,
            netns,
            ifindex,
            reason: 0,
            saddr: None,
            daddr: None,
        }
    }

    fn iface(uid: &str) -> PodIface {
        PodIface {
            uid: uid.into(),
            host_ifindex: 7,
            pod_netns: 4026532000,
            pod_ifindex: 2,
            netkit: false,
        }
    }

    #[test]
    fn socket_owner_then_device_then_ip() {
        let by_host = HashMap::from([(7, iface("dev-pod"))]);
        let by_pod_side = HashMap::from([((4026532000, 2), "dev-pod".to_string())]);
        let pod_of_cgroup = |id: u64| (id == 42).then(|| pod("sock-pod".into()));
        let pod_of_ip = |ip: IpAddr| (ip == IpAddr::from([10, 0, 0, 9])).then(|| "ip-pod".into());
        let known = Known {
            own_netns: OWN,
            by_host: &by_host,
            by_pod_side: &by_pod_side,
            pod_of_cgroup: &pod_of_cgroup,
            pod_of_ip: &pod_of_ip,
            ingress_hook: false,
        };
        // the socket's owner wins; on a device not its own it was sending
        assert_eq!(
            attribute(&key(42, OWN, 7), &known),
            (pod("sock-pod".into()), Some(Direction::Egress))
        );
        // no socket: the device's pod; host-side egress is the pod's ingress
        assert_eq!(
            attribute(&key(0, OWN, 7), &known),
            (pod("dev-pod".into()), Some(Direction::Ingress))
        );
        // the pod-side device of the same pod: its egress
        assert_eq!(
            attribute(&key(0, 4026532000, 2), &known),
            (pod("dev-pod".into()), Some(Direction::Egress))
        );
        // neither: the packet's destination IP
        let mut k = key(0, OWN, 99);
        k.daddr = Some(IpAddr::from([10, 0, 0, 9]));
        assert_eq!(
            attribute(&k, &known),
            (pod("ip-pod".into()), Some(Direction::Ingress))
        );
        k.daddr = Some(IpAddr::from([10, 0, 0, 10]));
        assert_eq!(attribute(&k, &known), (Owner::Unattributed, None));
    }
}
