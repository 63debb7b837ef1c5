//! The few rtnetlink queries the agent needs, synchronously: the host's links
//! The few rtnetlink queries the agent needs, synchronously: the host's links
//! (which veth leads into which network namespace), the addresses of another
//! namespace (read from here, by its id), the id this namespace gives to
//! another one, for the doctor the routes' congestion control and the
//! qdiscs, and for the tc probe the BPF filters on a clsact hook. Messages are
//! built and parsed by netlink-packet-route.

use std::io;
use std::net::IpAddr;
use std::os::fd::RawFd;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use netlink_packet_route::nsid::{NsidAttribute, NsidMessage};
use netlink_packet_route::route::{RouteAttribute, RouteMessage, RouteMetric};
use netlink_packet_route::tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

/// One network interface of this namespace.
#[derive(Debug, Clone, PartialEq)]
pub struct Link {
    pub ifindex: u32,
    pub name: String,
    /// e.g. "veth", "bridge"; empty when the kernel reports none
    pub kind: String,
    /// For a veth: the peer's ifindex (in the peer's namespace).
    pub peer_ifindex: Option<u32>,
    /// For a veth whose peer is in another namespace: that namespace's id here.
    pub peer_netnsid: Option<i32>,
    /// The bus of the device behind the interface ("pci", "virtio", "vmbus"): set for NICs,
    /// never for veths, bridges or lo (IFLA_PARENT_DEV_BUS_NAME, reported since kernel 5.14).
    pub parent_bus: Option<String>,
}

/// One route of the main table (or any table), as far as the doctor looks at it.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Destination prefix length: 0 is a default route.
    pub dst_len: u8,
    /// Output interface, when the route names one.
    pub oif: Option<u32>,
    /// `congctl` of the route (`ip route ... congctl NAME`): overrides the namespace's
    /// net.ipv4.tcp_congestion_control for connections using the route.
    pub congctl: Option<String>,
}

/// One qdisc.
#[derive(Debug, Clone, PartialEq)]
pub struct Qdisc {
    pub ifindex: u32,
    pub kind: String,
    /// Handle major number (the `1:` of `1:0`).
    pub handle_major: u16,
    /// Attached at the root of the device.
    pub root: bool,
    /// Parent class major number (for a child of `mq`, the mq's handle).
    pub parent_major: u16,
}

fn request(msg: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
    request_with(msg, flags, false)
}

/// `strict`: the kernel checks the request's header and attributes, and honours filters
/// such as a target namespace (it ignores them otherwise).
fn request_with(
    msg: RouteNetlinkMessage,
    flags: u16,
    strict: bool,
) -> io::Result<Vec<RouteNetlinkMessage>> {
    let mut sock = Socket::new(NETLINK_ROUTE)?;
    if strict {
        sock.set_netlink_get_strict_chk(true)?;
    }
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags;
    header.sequence_number = 1;
    let mut nl = NetlinkMessage::new(header, NetlinkPayload::from(msg));
    nl.finalize();
    let mut buf = vec![0u8; nl.buffer_len()];
    nl.serialize(&mut buf);
    sock.send(&buf, 0)?;

    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let mut out = Vec::new();
    let mut rbuf = vec![0u8; 64 * 1024];
    loop {
        let n = sock.recv(&mut &mut rbuf[..], 0)?;
        let mut off = 0;
        while off < n {
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rbuf[off..n])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("netlink: {e}")))?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(out),
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        None => Ok(out),
                        Some(c) => Err(io::Error::from_raw_os_error(-c.get())),
                    }
                }
                NetlinkPayload::InnerMessage(m) => out.push(m),
                _ => {}
            }
            if len == 0 {
                break;
            }
            off += (len + 3) & !3;
        }
        if !dump {
            return Ok(out);
        }
    }
}

/// All links of the calling thread's network namespace.
pub fn links() -> io::Result<Vec<Link>> {
    let msgs = request(
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        NLM_F_DUMP,
    )?;
    Ok(msgs
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => Some(link_of(l)),
            _ => None,
        })
        .collect())
}

fn link_of(l: LinkMessage) -> Link {
    let mut out = Link {
        ifindex: l.header.index,
        name: String::new(),
        kind: String::new(),
        peer_ifindex: None,
        peer_netnsid: None,
        parent_bus: None,
    };
    for a in l.attributes {
        match a {
            LinkAttribute::IfName(n) => out.name = n,
            LinkAttribute::ParentDevBusName(b) => out.parent_bus = Some(b),
            LinkAttribute::Link(i) => out.peer_ifindex = Some(i),
            LinkAttribute::LinkNetNsId(i) => out.peer_netnsid = Some(i),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        out.kind = match k {
                            InfoKind::Veth => "veth".into(),
                            InfoKind::Bridge => "bridge".into(),
                            InfoKind::Ifb => "ifb".into(),
                            other => format!("{other:?}").to_lowercase(),
                        };
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Every IPv4 and IPv6 route of the calling thread's network namespace.
pub fn routes() -> io::Result<Vec<Route>> {
    let msgs = request(
        RouteNetlinkMessage::GetRoute(RouteMessage::default()),
        NLM_F_DUMP,
    )?;
    Ok(msgs
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewRoute(r) => Some(route_of(r)),
            _ => None,
        })
        .collect())
}

fn route_of(r: RouteMessage) -> Route {
    let mut out = Route {
        dst_len: r.header.destination_prefix_length,
        oif: None,
        congctl: None,
    };
    for a in r.attributes {
        match a {
            RouteAttribute::Oif(i) => out.oif = Some(i),
            RouteAttribute::Metrics(ms) => {
                for m in ms {
                    if let RouteMetric::CcAlgo(cc) = m {
                        out.congctl = Some(cc);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Every qdisc of the calling thread's network namespace.
pub fn qdiscs() -> io::Result<Vec<Qdisc>> {
    let msgs = request(
        RouteNetlinkMessage::GetQueueDiscipline(TcMessage::default()),
        NLM_F_DUMP,
    )?;
    Ok(msgs
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewQueueDiscipline(q) => Some(Qdisc {
                ifindex: q.header.index as u32,
                kind: q
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        TcAttribute::Kind(k) => Some(k.clone()),
                        _ => None,
                    })
                    .unwrap_or_default(),
                handle_major: q.header.handle.major,
                root: q.header.parent == TcHandle::ROOT,
                parent_major: q.header.parent.major,
            }),
            _ => None,
        })
        .collect())
}

/// One filter on a clsact hook, as `tc filter show dev X ingress` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Filter {
    pub priority: u16,
    /// The filter's handle (the `handle 0x1` of tc's listing).
    pub handle: u32,
    /// The classifier: "bpf", "matchall", "flower", …
    pub kind: String,
    /// For a BPF filter, the name its attacher gave it (libbpf:
    /// `<program>:[<id>]`); empty otherwise.
    pub name: String,
}

/// The filters on an interface's clsact ingress (or egress) hook. Read from
/// rtnetlink, so that CAP_NET_ADMIN is enough (asking the kernel about a BPF
/// program by its id would take CAP_SYS_ADMIN).
pub fn clsact_filters(ifindex: u32, egress: bool) -> io::Result<Vec<Filter>> {
    let mut m = TcMessage::default();
    m.header.index = ifindex as i32;
    m.header.parent = TcHandle {
        major: 0xffff,
        minor: if egress {
            TcHandle::MIN_EGRESS
        } else {
            TcHandle::MIN_INGRESS
        },
    };
    let msgs = request(RouteNetlinkMessage::GetTrafficFilter(m), NLM_F_DUMP)?;
    let mut out = Vec::new();
    for msg in msgs {
        let RouteNetlinkMessage::NewTrafficFilter(f) = msg else {
            continue;
        };
        let mut filter = Filter {
            // tcm_info: priority in the upper half, protocol in the lower
            priority: (f.header.info >> 16) as u16,
            handle: u32::from(f.header.handle),
            kind: String::new(),
            name: String::new(),
        };
        for a in f.attributes {
            match a {
                TcAttribute::Kind(k) => filter.kind = k,
                TcAttribute::Options(opts) => {
                    for o in opts {
                        if let TcOption::Bpf(TcFilterBpfOption::ProgName(n)) = o {
                            filter.name = n;
                        }
                    }
                }
                _ => {}
            }
        }
        out.push(filter);
    }
    Ok(out)
}

/// The addresses, as (ifindex, address), of the namespace this one calls `nsid`
/// (a veth's `peer_netnsid`), dumped from here with `IFA_TARGET_NETNSID`: no
/// namespace is entered, and no process of it needs to be visible; the caller
/// needs CAP_NET_ADMIN over that namespace's user namespace.
pub fn addresses_in(nsid: i32) -> io::Result<Vec<(u32, IpAddr)>> {
    let mut m = AddressMessage::default();
    m.attributes.push(AddressAttribute::TargetNetNsId(nsid));
    let msgs = request_with(RouteNetlinkMessage::GetAddress(m), NLM_F_DUMP, true)?;
    let mut out = Vec::new();
    for msg in msgs {
        let RouteNetlinkMessage::NewAddress(a) = msg else {
            continue;
        };
        // IFA_LOCAL is the interface's own address where it differs from IFA_ADDRESS
        // (point-to-point); otherwise the kernel sends IFA_ADDRESS alone or both equal.
        let (mut local, mut address) = (None, None);
        for attr in a.attributes {
            match attr {
                AddressAttribute::Local(ip) => local = Some(ip),
                AddressAttribute::Address(ip) => address = Some(ip),
                _ => {}
            }
        }
        if let Some(ip) = local.or(address) {
            out.push((a.header.index, ip));
        }
    }
    Ok(out)
}

/// The id this namespace uses for the namespace behind `netns_fd` (an open nsfs
/// file: a pinned namespace in /run/netns), or None when it has not assigned one.
pub fn nsid_of(netns_fd: RawFd) -> io::Result<Option<i32>> {
    let mut m = NsidMessage::default();
    m.attributes.push(NsidAttribute::Fd(netns_fd as u32));
    let msgs = request(RouteNetlinkMessage::GetNsId(m), 0)?;
    for msg in msgs {
        if let RouteNetlinkMessage::NewNsId(n) = msg {
            for a in n.attributes {
                if let NsidAttribute::Id(id) = a {
                    return Ok((id >= 0).then_some(id));
                }
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_loopback() {
        // every namespace has lo at ifindex 1
        let links = links().expect("rtnetlink dump");
        assert!(
            links.iter().any(|l| l.name == "lo" && l.ifindex == 1),
            "{links:?}"
        );
    }
}
