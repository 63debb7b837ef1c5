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

/// What one look at the node's interfaces found.
#[derive(Debug, Default)]
pub struct Discovery {
    /// every veth in the node's namespace (a pod interface stays counted until
    /// its veth is gone, even if one look missed its pod)
    pub host_veths: HashSet<u32>,
    pub pods: Vec<PodIface>,
}

/// Maps pods (uid → pids of theirs) to their veths. A pod's namespace is the one
/// its processes are in that is not the node's: a process just starting may
/// not have entered it yet. Pods in the node's own namespace (hostNetwork)
/// have no veth.
pub fn discover(pods: &HashMap<String, Vec<i32>>) -> io::Result<Discovery> {
    let own = netns_inode(std::process::id() as i32)?;
    let links = netlink::links()?;
    let mut by_nsid: HashMap<i32, (String, u32)> = HashMap::new();
    for (uid, pids) in pods {
        for pid in pids {
            let Ok(f) = File::open(format!("/proc/{pid}/ns/net")) else { continue };
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
    let mut d = Discovery::default();
    for l in links.into_iter().filter(|l| l.kind == "veth") {
        d.host_veths.insert(l.ifindex);
        let (Some(nsid), Some(peer)) = (l.peer_netnsid, l.peer_ifindex) else { continue };
        if let Some((uid, ino)) = by_nsid.get(&nsid) {
            d.pods.push(PodIface { uid: uid.clone(), host_ifindex: l.ifindex, pod_netns: *ino, pod_ifindex: peer });
        }
    }
    Ok(d)
}
