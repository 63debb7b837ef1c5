//! Which network interface belongs to which pod.
//!
//! A pod's processes live in its network namespace; CNIs join it to the node
//! with a veth pair, or a netkit pair (Cilium's `bpf.datapathMode: netkit`,
//! kernel 6.7), whose primary device stays in the node's namespace. From the
//! node's namespace, rtnetlink says for each veth and netkit primary which
//! namespace (by id) its peer is in and the peer's ifindex, and lists
//! that namespace's addresses by the same id (`IFA_TARGET_NETNSID`): the
//! peer's address is the pod's IP, which the pod store maps to the pod. No
//! namespace is entered and no process is looked at, so the agent needs
//! neither the host PID namespace nor CAP_SYS_PTRACE, only CAP_NET_ADMIN (which
//! it has for tc anyway). Without pod IPs (no Kubernetes API) the pods'
//! processes stand in where the agent can read them (`/proc/<pid>/ns/net`).
//!
//! The pod side's namespace inode (for drops recorded inside the pod's
//! namespace) comes from the namespaces the runtime pins under /run/netns
//! (containerd and CRI-O pin each pod sandbox's there): opening one is a plain
//! file read. Without that directory the pod side stays unknown and such drops
//! are attributed by socket or IP alone.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::netlink;

/// Where container runtimes pin pod network namespaces.
pub const PINNED_NETNS: &str = "/run/netns";

/// A pod's interface pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIface {
    pub uid: String,
    /// host-side veth in the agent's namespace
    pub host_ifindex: u32,
    /// the pod's namespace (inode of its nsfs file, as the kernel's ns.inum); 0 when
    /// unknown (not pinned where the agent can see it)
    pub pod_netns: u32,
    pub pod_ifindex: u32,
    /// a netkit pair (the host side is netkit's primary device), not a veth
    pub netkit: bool,
}

/// Inode of a process's network namespace.
pub fn netns_inode(pid: i32) -> io::Result<u32> {
    Ok(std::fs::metadata(format!("/proc/{pid}/ns/net"))?.ino() as u32)
}

/// Inodes of the namespaces pinned in `dir`, by the id this namespace gives them.
fn pinned_by_nsid(dir: &Path) -> HashMap<i32, u32> {
    let mut out = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let Ok(f) = File::open(e.path()) else {
            continue;
        };
        let Ok(meta) = f.metadata() else { continue };
        if let Ok(Some(id)) = netlink::nsid_of(f.as_raw_fd()) {
            out.insert(id, meta.ino() as u32);
        }
    }
    out
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
    /// every veth and netkit device in the node's namespace (a pod interface stays
    /// counted until its device is gone, even if one look missed its pod)
    pub host_veths: HashSet<u32>,
    pub pods: Vec<PodIface>,
}

/// Namespaces of pods whose processes this agent can see and read (`/proc/<pid>/ns/net`:
/// the host PID namespace and CAP_SYS_PTRACE, or an agent run as root on the node), by the id
/// this namespace gives them, with their inode. A process just starting may not have entered
/// its pod's namespace yet: the first one not in the agent's own counts.
fn namespaces_of_processes(pods: &HashMap<String, Vec<i32>>) -> HashMap<i32, (String, u32)> {
    let mut out = HashMap::new();
    let Ok(own) = netns_inode(std::process::id() as i32) else {
        return out;
    };
    for (uid, pids) in pods {
        for pid in pids.iter().filter(|p| **p > 0) {
            let Ok(f) = File::open(format!("/proc/{pid}/ns/net")) else {
                continue;
            };
            let Ok(meta) = f.metadata() else { continue };
            let ino = meta.ino() as u32;
            if ino == own {
                continue;
            }
            if let Ok(Some(id)) = netlink::nsid_of(f.as_raw_fd()) {
                out.insert(id, (uid.clone(), ino));
                break;
            }
        }
    }
    out
}

/// Maps pods to their veths and netkit primaries: the pod whose IP (`pod_of_ip`) is on a veth's peer, else
/// anywhere in the peer's namespace. A veth that no pod IP explains (no Kubernetes API, or a
/// pod whose IP is not reported yet) is looked up through the pods' processes (`pod_pids`,
/// from their cgroups) where they are readable. Pods in the node's own namespace
/// (hostNetwork) have no veth.
pub fn discover(
    pod_of_ip: &dyn Fn(IpAddr) -> Option<String>,
    pod_pids: &dyn Fn() -> HashMap<String, Vec<i32>>,
    pinned: &Path,
    node: &NodeDevices,
) -> io::Result<Discovery> {
    let links = netlink::links()?;
    let mut d = Discovery {
        node_devices: links
            .iter()
            .filter(|l| node.wants(l))
            .map(|l| (l.ifindex, l.name.clone()))
            .collect(),
        ..Default::default()
    };
    let mut addresses: HashMap<i32, Vec<(u32, IpAddr)>> = HashMap::new();
    let mut inodes: Option<HashMap<i32, u32>> = None;
    let mut by_process: Option<HashMap<i32, (String, u32)>> = None;
    for l in links
        .into_iter()
        .filter(|l| l.kind == "veth" || l.kind == "netkit")
    {
        d.host_veths.insert(l.ifindex);
        let (Some(nsid), Some(peer)) = (l.peer_netnsid, l.peer_ifindex) else {
            continue;
        };
        let addrs = addresses
            .entry(nsid)
            .or_insert_with(|| match netlink::addresses_in(nsid) {
                Ok(a) => a,
                Err(e) => {
                    tracing::debug!(nsid, "addresses of a veth peer's namespace: {e}");
                    Vec::new()
                }
            });
        let on_peer = addrs.iter().filter(|(i, _)| *i == peer);
        let elsewhere = addrs.iter().filter(|(i, _)| *i != peer);
        let by_ip = on_peer.chain(elsewhere).find_map(|(_, ip)| pod_of_ip(*ip));
        let inodes = inodes.get_or_insert_with(|| pinned_by_nsid(pinned));
        let found = match by_ip {
            Some(uid) => Some((uid, inodes.get(&nsid).copied().unwrap_or(0))),
            None => by_process
                .get_or_insert_with(|| namespaces_of_processes(&pod_pids()))
                .get(&nsid)
                .cloned(),
        };
        let Some((uid, pod_netns)) = found else {
            continue;
        };
        d.pods.push(PodIface {
            uid,
            host_ifindex: l.ifindex,
            pod_netns: inodes.get(&nsid).copied().unwrap_or(pod_netns),
            pod_ifindex: peer,
            netkit: l.kind == "netkit",
        });
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
