//! Which network interface belongs to which pod.
//!
//! A pod's processes live in its network namespace; CNIs join it to the node
//! with a veth pair. From the node's namespace, rtnetlink says for each veth
//! which namespace (by id) its peer is in and the peer's ifindex; asking the
//! kernel for the id of a pod's namespace (from /proc/<pid>/ns/net) closes the
//! loop. No namespace is entered.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use crate::netlink;

/// A pod's interface pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIface {
    pub uid: String,
    /// host-side veth in the agent's namespace
    pub host_ifindex: u32,
    /// the pod's namespace (inode of its nsfs file, as the kernel's ns.inum)
    pub pod_netns: u32,
    pub pod_ifindex: u32,
}

/// Inode of a process's network namespace.
pub fn netns_inode(pid: i32) -> io::Result<u32> {
    Ok(std::fs::metadata(format!("/proc/{pid}/ns/net"))?.ino() as u32)
}

/// Which of the node's own devices carry hostNetwork pods' traffic.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeDevices {
    /// physical NICs: devices with a `device` link in sysfs (not lo, veth, bridges)
    Auto,
    None,
    Names(Vec<String>),
}

impl std::str::FromStr for NodeDevices {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(NodeDevices::Auto),
            "none" | "" => Ok(NodeDevices::None),
            list => {
                let names: Vec<String> = list.split(',').map(|n| n.trim().to_string()).collect();
                if let Some(bad) = names
                    .iter()
                    .find(|n| n.is_empty() || n.len() > 15 || n.contains('/'))
                {
                    return Err(format!("{bad:?} is not an interface name"));
                }
                Ok(NodeDevices::Names(names))
            }
        }
    }
}

impl NodeDevices {
    fn wants(&self, l: &netlink::Link) -> bool {
        match self {
            NodeDevices::None => false,
            NodeDevices::Names(n) => n.contains(&l.name),
            NodeDevices::Auto => {
                l.name != "lo"
                    && l.kind.is_empty()
                    && std::path::Path::new(&format!("/sys/class/net/{}/device", l.name)).exists()
            }
        }
    }
}

/// What one look at the node's interfaces found.
#[derive(Debug, Default)]
pub struct Discovery {
    /// node devices to count per socket owner (ifindex, name)
    pub node_devices: Vec<(u32, String)>,
    /// every veth in the node's namespace (a pod interface stays counted until
    /// its veth is gone, even if one look missed its pod)
    pub host_veths: HashSet<u32>,
    pub pods: Vec<PodIface>,
}

/// Maps pods (uid → pids of theirs) to their veths. A pod's namespace is the one
/// its processes are in that is not the node's: a process just starting may
/// not have entered it yet. Pods in the node's own namespace (hostNetwork)
/// have no veth.
pub fn discover(pods: &HashMap<String, Vec<i32>>, node: &NodeDevices) -> io::Result<Discovery> {
    let own = netns_inode(std::process::id() as i32)?;
    let links = netlink::links()?;
    let mut by_nsid: HashMap<i32, (String, u32)> = HashMap::new();
    for (uid, pids) in pods {
        for pid in pids {
            let Ok(f) = File::open(format!("/proc/{pid}/ns/net")) else {
                continue;
            };
            let Ok(meta) = f.metadata() else { continue };
            let ino = meta.ino() as u32;
            if ino == own {
                continue;
            }
            if let Ok(Some(id)) = netlink::nsid_of(f.as_raw_fd()) {
                by_nsid.insert(id, (uid.clone(), ino));
                break;
            }
        }
    }
    let mut d = Discovery {
        node_devices: links
            .iter()
            .filter(|l| node.wants(l))
            .map(|l| (l.ifindex, l.name.clone()))
            .collect(),
        ..Default::default()
    };
    for l in links.into_iter().filter(|l| l.kind == "veth") {
        d.host_veths.insert(l.ifindex);
        let (Some(nsid), Some(peer)) = (l.peer_netnsid, l.peer_ifindex) else {
            continue;
        };
        if let Some((uid, ino)) = by_nsid.get(&nsid) {
            d.pods.push(PodIface {
                uid: uid.clone(),
                host_ifindex: l.ifindex,
                pod_netns: *ino,
                pod_ifindex: peer,
            });
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_device_specs() {
        assert_eq!("auto".parse::<NodeDevices>(), Ok(NodeDevices::Auto));
        assert_eq!("none".parse::<NodeDevices>(), Ok(NodeDevices::None));
        assert_eq!(
            "eth0, bond0".parse::<NodeDevices>(),
            Ok(NodeDevices::Names(vec!["eth0".into(), "bond0".into()]))
        );
        assert!("eth0,,x".parse::<NodeDevices>().is_err());
        assert!("averyveryverylongname"
            .parse::<NodeDevices>()
            .unwrap_err()
            .contains("not an interface name"));
        let veth = netlink::Link {
            ifindex: 9,
            name: "vethx".into(),
            kind: "veth".into(),
            peer_ifindex: None,
            peer_netnsid: None,
            parent_bus: None,
        };
        assert!(!NodeDevices::Auto.wants(&veth));
        assert!(NodeDevices::Names(vec!["vethx".into()]).wants(&veth));
        let lo = netlink::Link {
            ifindex: 1,
            name: "lo".into(),
            kind: String::new(),
            peer_ifindex: None,
            peer_netnsid: None,
            parent_bus: None,
        };
        assert!(!NodeDevices::Auto.wants(&lo));
    }
}
