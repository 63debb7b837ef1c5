//! The node's network as the pods' traffic meets it: the agent in the node's namespace, BBR as
//! the congestion control, and Cilium's bandwidth manager (an fq qdisc) on the node devices.

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
        let root = qdiscs.iter().find(|q| q.ifindex == d.ifindex && q.root);
        let verdict = match root.map(|q| q.kind.as_str()) {
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
        };
        match verdict {
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
