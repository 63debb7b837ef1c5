//! The node's network as the pods' traffic meets it: the agent in the node's namespace, BBR as
//! the congestion control, Cilium's bandwidth manager (an fq qdisc) on the node devices, and
//! the datapath the pods' bytes take (veth or netkit, peer redirect, EDT/fq) with where the
//! tc probe counts each direction.

use std::path::Path;

use gpufeed_shared::doctor::Finding;

use crate::ifaces::NodeDevices;
use crate::netlink::{self, Link, Qdisc, Route};

/// The three network checks, read in `netns` (`None`: the caller's own namespace).
pub fn checks(netns: Option<&Path>, devices: &NodeDevices) -> Vec<Finding> {
    let read = || -> std::io::Result<_> {
        let cc = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")?;
        Ok((
            netlink::links()?,
            cc.trim().to_string(),
            netlink::routes()?,
            netlink::qdiscs()?,
        ))
    };
    match in_netns(netns, read) {
        Ok((links, cc, routes, qdiscs)) => vec![
            host_netns(&links),
            bbr(&cc, &routes, &links),
            bandwidth_manager(&links, &qdiscs, devices),
        ],
        Err(e) => {
            let what = netns.map_or("this network namespace".to_string(), |p| {
                p.display().to_string()
            });
            ["host_netns", "bbr", "bandwidth_manager"]
                .into_iter()
                .map(|c| {
                    Finding::fail(
                        c,
                        format!("cannot read {what}: {e}"),
                        "run the doctor in the agent's container (kubectl exec)",
                    )
                })
                .collect()
        }
    }
}

/// Whether a device's root qdisc is fq, or mq with fq on every queue (what it is), or not
/// (what it is instead).
fn fq_on(d: &Link, qdiscs: &[Qdisc]) -> Result<String, String> {
    let root = qdiscs.iter().find(|q| q.ifindex == d.ifindex && q.root);
    match root.map(|q| q.kind.as_str()) {
        Some("fq") => Ok("fq".to_string()),
        Some("mq") => {
            let major = root.map_or(0, |q| q.handle_major);
            let children: Vec<&Qdisc> = qdiscs
                .iter()
                .filter(|q| q.ifindex == d.ifindex && !q.root && q.parent_major == major)
                .collect();
            match children.iter().find(|q| q.kind != "fq") {
                None if !children.is_empty() => Ok(format!("mq with {} fq", children.len())),
                None => Err("mq without child qdiscs".to_string()),
                Some(q) => Err(format!("mq with a {} queue", q.kind)),
            }
        }
        Some(other) => Err(format!("root qdisc {other}")),
        None => Err("no qdisc".to_string()),
    }
}

/// What the running agent's tc probe has seen (its own series), for [`datapath`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcSeen {
    /// pod interfaces counted (`gpufeed_tc_interfaces`)
    pub interfaces: u64,
    /// of which netkit pairs (`gpufeed_tc_netkit_interfaces`)
    pub netkit: u64,
    /// of which ingress reached the pod's sockets around the host side
    /// (`gpufeed_tc_peer_redirect_interfaces`)
    pub peer_redirect: u64,
    /// pod ingress also counted at socket delivery (`gpufeed_tc_socket_delivery_counted`)
    pub socket_delivery: bool,
}

/// What the running agent's tc probe has seen, from its store (its own series); None when
/// the tc probe is not running.
pub fn tc_seen(store: &crate::collect::Store) -> Option<TcSeen> {
    let series = |name: &str| {
        store
            .stats
            .units
            .iter()
            .flat_map(|u| u.series.iter())
            .find(|s| s.name == name)
            .map(|s| s.value as u64)
    };
    Some(TcSeen {
        interfaces: series("gpufeed_tc_interfaces")?,
        netkit: series("gpufeed_tc_netkit_interfaces").unwrap_or(0),
        peer_redirect: series("gpufeed_tc_peer_redirect_interfaces").unwrap_or(0),
        socket_delivery: series("gpufeed_tc_socket_delivery_counted").unwrap_or(0) == 1,
    })
}

/// `datapath`, read in `netns` (`None`: the caller's own namespace).
pub fn datapath_now(netns: Option<&Path>, devices: &NodeDevices, tc: Option<TcSeen>) -> Finding {
    match in_netns(netns, || Ok((netlink::links()?, netlink::qdiscs()?))) {
        Ok((links, qdiscs)) => datapath(&links, &qdiscs, devices, tc),
        Err(e) => Finding::fail(
            "datapath",
            format!("cannot read the links and qdiscs: {e}"),
            "run the doctor in the agent's container (kubectl exec)",
        ),
    }
}

/// `datapath`: which datapath the pods' traffic takes on this node and where the tc probe
/// counts each direction: pod interfaces by kind (a veth or netkit device here whose peer is
/// in another namespace), `bpf_redirect_peer` seen by the running agent (`tc`), and EDT/fq on
/// which node devices. Fails where a pod's bytes are not counted: socket delivery off while
/// the host side alone misses what a peer redirect delivers.
pub fn datapath(
    links: &[Link],
    qdiscs: &[Qdisc],
    devices: &NodeDevices,
    tc: Option<TcSeen>,
) -> Finding {
    const CHECK: &str = "datapath";
    let pod_side = |kind: &str| {
        links
            .iter()
            .filter(|l| l.kind == kind && l.peer_netnsid.is_some())
            .count()
    };
    let (veth, netkit) = (pod_side("veth"), pod_side("netkit"));
    let mut parts = vec![format!(
        "veth: {veth} into other namespaces{} (egress counted at the host side's tc ingress; \
         ingress at the host side's tc egress and at socket delivery, the larger per interval)",
        match tc {
            Some(t) => format!(
                ", {} of them pods' and counted",
                t.interfaces.saturating_sub(t.netkit)
            ),
            None => String::new(),
        }
    )];
    if netkit > 0 {
        parts.push(format!(
            "netkit: {netkit} into other namespaces{} (egress counted in netkit's peer hook on \
             the primary, before the CNI's program; ingress in its primary hook and at socket \
             delivery, the larger per interval)",
            match tc {
                Some(t) => format!(", {} of them pods' and counted", t.netkit),
                None => String::new(),
            }
        ));
    }
    parts.push(match tc {
        Some(t) if !t.socket_delivery => {
            "bpf_redirect_peer: cannot be seen (socket delivery is not counted)".to_string()
        }
        Some(t) if t.peer_redirect > 0 => format!(
            "bpf_redirect_peer seen on {} of {} (their ingress counted at socket delivery)",
            t.peer_redirect, t.interfaces
        ),
        Some(t) => format!("bpf_redirect_peer: not seen on {} interfaces", t.interfaces),
        None => "bpf_redirect_peer: the running agent says (its /doctor)".to_string(),
    });
    let devs: Vec<&Link> = match devices {
        NodeDevices::None => Vec::new(),
        NodeDevices::Auto => nics(links).collect(),
        NodeDevices::Names(n) => links.iter().filter(|l| n.contains(&l.name)).collect(),
    };
    let fq: Vec<String> = devs
        .iter()
        .filter_map(|d| fq_on(d, qdiscs).ok().map(|v| format!("{} ({v})", d.name)))
        .collect();
    parts.push(if fq.is_empty() {
        "EDT/fq: on no node device".to_string()
    } else {
        format!("EDT/fq: on {}", fq.join(", "))
    });
    let detail = parts.join("; ");
    if tc.is_some_and(|t| !t.socket_delivery) {
        return Finding::fail(
            CHECK,
            detail,
            "pod ingress is counted on the host-side veth only, which Cilium's BPF host \
             routing (bpf_redirect_peer) goes around: socket delivery needs kernel >= 6.3 \
             (bpf_cast_to_kern_ctx) and the cgroup2 root (the agent logged why)",
        );
    }
    Finding::pass(CHECK, detail)
}

/// Runs `f` in the network namespace behind `netns` (on a thread of its own, which alone
/// enters it: the caller's namespace never changes), or here when `None`. Entering needs
/// CAP_SYS_ADMIN, which only tests and a root shell have; the agent reads its own.
pub fn in_netns<T: Send>(
    netns: Option<&Path>,
    f: impl FnOnce() -> std::io::Result<T> + Send,
) -> std::io::Result<T> {
    use std::os::fd::AsRawFd;
    let Some(path) = netns else { return f() };
    let ns = std::fs::File::open(path)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on a file we hold open; it changes only this thread's namespace.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("check thread panicked")))
    })
}

/// Interfaces backed by a device on a bus (PCI, virtio, vmbus): the node's NICs. A pod's
/// namespace holds only lo and its veth (or ipvlan/macvlan), none of which has one.
fn nics(links: &[Link]) -> impl Iterator<Item = &Link> {
    links.iter().filter(|l| l.parent_bus.is_some())
}

/// `host_netns`: the agent sees the node's NICs, so it is in the node's network namespace
/// (`hostNetwork: true`): the tc programs attach to the host side of pod veths and the node
/// devices, which a pod namespace does not have.
pub fn host_netns(links: &[Link]) -> Finding {
    let found: Vec<String> = nics(links)
        .map(|l| format!("{} ({})", l.name, l.parent_bus.as_deref().unwrap_or("")))
        .collect();
    if found.is_empty() {
        let names: Vec<&str> = links.iter().map(|l| l.name.as_str()).collect();
        Finding::fail(
            "host_netns",
            format!(
                "no interface backed by a device (only {}): this is a pod's network namespace",
                names.join(", ")
            ),
            "set hostNetwork: true in the agent's pod spec (the base DaemonSet has it)",
        )
    } else {
        Finding::pass(
            "host_netns",
            format!("node NICs here: {}", found.join(", ")),
        )
    }
}

/// `bbr`: BBR is the namespace's default congestion control (pod namespaces inherit the
/// node's default when they are created) and no route overrides it with `congctl`.
pub fn bbr(default_cc: &str, routes: &[Route], links: &[Link]) -> Finding {
    let mut problems = Vec::new();
    if default_cc != "bbr" {
        problems.push(format!("net.ipv4.tcp_congestion_control={default_cc}"));
    }
    for r in routes {
        if let Some(cc) = r.congctl.as_deref().filter(|cc| *cc != "bbr") {
            let dev = r
                .oif
                .and_then(|i| links.iter().find(|l| l.ifindex == i))
                .map_or("?", |l| l.name.as_str());
            let dst = if r.dst_len == 0 {
                "default".to_string()
            } else {
                format!("a /{} route", r.dst_len)
            };
            problems.push(format!("{dst} via {dev} has congctl {cc}"));
        }
    }
    if problems.is_empty() {
        return Finding::pass(
            "bbr",
            "net.ipv4.tcp_congestion_control=bbr, no route overrides it",
        );
    }
    Finding::fail(
        "bbr",
        problems.join("; "),
        "install Cilium with bandwidthManager.enabled=true and bandwidthManager.bbr=true \
         (docs/cilium.md), which sets BBR for the node and new pods; remove `congctl` from \
         routes (ip route change ... without congctl). Pods created before keep their \
         namespace's setting until restarted",
    )
}

/// `bandwidth_manager`: every node device has an fq qdisc at its root, or `mq` with fq on
/// every queue: what Cilium's bandwidth manager installs to enforce
/// `kubernetes.io/egress-bandwidth` with earliest departure times (and what BBR needs to pace).
pub fn bandwidth_manager(links: &[Link], qdiscs: &[Qdisc], devices: &NodeDevices) -> Finding {
    const CHECK: &str = "bandwidth_manager";
    let devs: Vec<&Link> = match devices {
        NodeDevices::None => {
            return Finding::skip(CHECK, "--node-devices=none: no node devices to look at")
        }
        NodeDevices::Auto => nics(links).collect(),
        NodeDevices::Names(n) => links.iter().filter(|l| n.contains(&l.name)).collect(),
    };
    if devs.is_empty() {
        return Finding::fail(
            CHECK,
            "no node devices found (a NIC, or the names given to --node-devices)",
            "name the devices pods' traffic leaves by with --node-devices",
        );
    }
    let mut ok = Vec::new();
    let mut bad = Vec::new();
    for d in devs {
        match fq_on(d, qdiscs) {
            Ok(v) => ok.push(format!("{}: {v}", d.name)),
            Err(v) => bad.push(format!("{}: {v}", d.name)),
        }
    }
    if bad.is_empty() {
        Finding::pass(CHECK, ok.join(", "))
    } else {
        Finding::fail(
            CHECK,
            format!("not fq: {}", bad.join(", ")),
            "enable Cilium's bandwidth manager (Helm bandwidthManager.enabled=true, \
             docs/cilium.md); `cilium status` shows `BandwidthManager: EDT with BPF` and the \
             devices; without it the bandwidth annotations are not enforced",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufeed_shared::doctor::Status;

    fn link(ifindex: u32, name: &str, kind: &str, peer_ns: Option<i32>) -> Link {
        Link {
            ifindex,
            name: name.into(),
            kind: kind.into(),
            peer_ifindex: peer_ns.map(|_| 2),
            peer_netnsid: peer_ns,
            parent_bus: (kind.is_empty() && name != "lo").then(|| "pci".into()),
        }
    }

    fn root(ifindex: u32, kind: &str) -> Qdisc {
        Qdisc {
            ifindex,
            kind: kind.into(),
            handle_major: 1,
            root: true,
            parent_major: 0,
        }
    }

    #[test]
    fn datapath_names_the_interfaces_the_peer_redirect_and_fq() {
        let links = [
            link(1, "lo", "", None),
            link(2, "eth0", "", None),
            link(7, "lxc1", "veth", Some(3)),
            link(8, "lxc2", "veth", Some(4)),
            link(9, "cilium_host", "veth", None),
        ];
        let qdiscs = [root(2, "fq")];
        let seen = TcSeen {
            interfaces: 2,
            netkit: 0,
            peer_redirect: 2,
            socket_delivery: true,
        };
        let f = datapath(&links, &qdiscs, &NodeDevices::Auto, Some(seen));
        assert_eq!(f.status, Status::Pass, "{f:?}");
        assert!(
            f.detail
                .contains("veth: 2 into other namespaces, 2 of them pods' and counted"),
            "{}",
            f.detail
        );
        assert!(
            f.detail.contains("bpf_redirect_peer seen on 2 of 2"),
            "{}",
            f.detail
        );
        assert!(f.detail.contains("EDT/fq: on eth0 (fq)"), "{}", f.detail);

        // socket delivery refused: a peer redirect would go uncounted
        let off = TcSeen {
            socket_delivery: false,
            ..seen
        };
        let f = datapath(&links, &[root(2, "noqueue")], &NodeDevices::Auto, Some(off));
        assert_eq!(f.status, Status::Fail);
        assert!(
            f.detail.contains("EDT/fq: on no node device"),
            "{}",
            f.detail
        );

        // netkit pods are named with where they are counted
        let mut with_netkit = links.to_vec();
        with_netkit.push(link(10, "nk1", "netkit", Some(5)));
        let nk = TcSeen {
            interfaces: 3,
            netkit: 1,
            ..seen
        };
        let f = datapath(&with_netkit, &qdiscs, &NodeDevices::Auto, Some(nk));
        assert_eq!(f.status, Status::Pass, "{f:?}");
        assert!(
            f.detail.contains(
                "netkit: 1 into other namespaces, 1 of them pods' and counted (egress counted \
                 in netkit's peer hook"
            ),
            "{}",
            f.detail
        );
        assert!(
            f.detail
                .contains("veth: 2 into other namespaces, 2 of them"),
            "{}",
            f.detail
        );
    }
}
