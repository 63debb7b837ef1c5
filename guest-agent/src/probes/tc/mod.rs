//! Per-pod bytes at the tc layer and tc/qdisc drops (`bpf/tc.bpf.c`).
//!
//! Unlike the cgroup-storage probes this unit works per interface: each tick
//! it finds the pods' host-side veths (and the node devices that carry
//! hostNetwork pods' bytes), attaches to new ones, reads their counters into
//! deltas, drains the drop map and attributes every drop to a pod. The
//! bandwidth caps from pods' annotations are exported beside the bytes.

mod attribute;
mod ingress;
mod loader;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use attribute::Direction;
pub use loader::{tc_drop_reasons, AttachMode, DropKey, IfBytes, TcProbe, BYTES, DROPS};

use super::options::{OptionsSpec, UnitOptions};
use super::signal::{SignalKind, SignalSpec};
use super::unit::{
    Delta, FamilySpec, GaugeValue, Kind, Labels, LoadContext, Loaded, MapFill, Probe, Scope,
    SelfSeries, TickContext, TickOutput, UnitSpec, UnitStats, Value,
};
use crate::bandwidth;
use crate::ebpf::ProbeError;
use crate::ifaces::{self, NodeDevices, PodIface};
use crate::owner::Owner;
use crate::pods::PodStore;

pub const BYTES_FAMILY: &str = "ebpf_tc_bytes_total";
pub const DROPS_FAMILY: &str = "ebpf_tc_dropped_packets_total";
pub const BW_LIMIT_FAMILY: &str = "gpufeed_bandwidth_limit_bits_per_second";

pub const NAME: &str = "tc";

pub const UNIT: UnitSpec = UnitSpec {
    names: &[NAME],
    reports: &[loader::BYTES, loader::DROPS],
    options: OptionsSpec::flags::<Config>(),
    load: load_unit,
};

/// The unit's part of the command line.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "tc options")]
pub struct Config {
    /// How tc programs attach to pod interfaces: tcx (6.6+), classic clsact, or auto.
    #[arg(
        long = "tc-attach",
        value_name = "TC_ATTACH",
        value_enum,
        default_value = "auto"
    )]
    pub attach: AttachMode,
    /// Node devices on which hostNetwork pods' bytes are counted per socket:
    /// `auto` (physical NICs), `none`, or NAME[,NAME...].
    #[arg(long = "node-devices", default_value = "auto")]
    pub node_devices: NodeDevices,
}

/// Counts pod interfaces only, not node devices: for loading the units to
/// compare them with the kernel's counters (`selftest`) or to see whether
/// they load (the doctor), without attaching to the node's NICs.
pub fn pod_interfaces_only(options: &mut UnitOptions) {
    let mut tc = options.get::<Config>().clone();
    tc.node_devices = NodeDevices::None;
    options.set(tc);
}

static FAMILIES: [FamilySpec; 3] = [
    FamilySpec {
        name: BYTES_FAMILY,
        help: "Bytes passing the tc layer of the pod's host-side interface; direction from the pod's point of view",
        kind: Kind::Counter,
        scope: Scope::Pod,
        pod_labels: false,
    },
    FamilySpec {
        name: DROPS_FAMILY,
        help: "Packets dropped in the tc/qdisc layer, by the kernel's drop reason",
        kind: Kind::Counter,
        scope: Scope::Pod,
        pod_labels: false,
    },
    FamilySpec {
        name: BW_LIMIT_FAMILY,
        help: "Bandwidth cap from the pod's kubernetes.io/{egress,ingress}-bandwidth annotation",
        kind: Kind::Gauge,
        scope: Scope::Pod,
        pod_labels: false,
    },
];

/// How often pod interfaces and annotations are looked at again when no
/// cgroup came or went.
const REDISCOVER: Duration = Duration::from_secs(5);

fn load_unit(ctx: &LoadContext<'_>, _names: &[&'static str]) -> Result<Loaded, ProbeError> {
    let cfg = ctx.options.get::<Config>();
    // Reading packet headers for the IP fallback needs bpf_probe_read_kernel,
    // which lockdown=confidentiality refuses.
    let read_addrs = ctx.lockdown != Some("confidentiality");
    if !read_addrs {
        tracing::info!("lockdown=confidentiality: tc drops are attributed by socket and device only, not by IP");
    }
    let (probe, statuses) = match TcProbe::load(ctx.btf, cfg.attach, read_addrs) {
        Ok(loaded) => loaded,
        // The lockdown mode may be unreadable (no securityfs): a refused
        // bpf_probe_read_kernel then shows up as a failed load. Fail safe.
        Err(e) if read_addrs => {
            tracing::info!("tc: loading with packet-header reads failed ({e}); retrying without the IP fallback");
            TcProbe::load(ctx.btf, cfg.attach, false)?
        }
        Err(e) => return Err(e),
    };
    let unit = TcUnit::new(probe, cfg.node_devices.clone()).map_err(|source| ProbeError::Io {
        probe: loader::OBJ,
        what: "finding the agent's network namespace",
        source,
    })?;
    Ok(Loaded {
        unit: Some(Box::new(unit)),
        statuses,
    })
}

/// The tc probe with what it knows about pod interfaces.
pub struct TcUnit {
    probe: TcProbe,
    own_netns: u32,
    /// host ifindex → pod
    by_host: HashMap<u32, PodIface>,
    /// (pod netns, pod ifindex) → pod
    by_pod_side: HashMap<(u32, u32), String>,
    last: HashMap<u32, IfBytes>,
    /// last socket-delivery reading (bytes, packets) per host ifindex, and the join of that
    /// count with the host side's
    last_rx: HashMap<u32, ((u64, u64), ingress::IngressJoin)>,
    /// pod interfaces whose sockets received more than their host side sent
    /// (ingress delivered around the host-side veth: bpf_redirect_peer)
    peer_seen: HashSet<u32>,
    last_discovery: Option<Instant>,
    node_spec: NodeDevices,
    /// node devices counted per socket owner (hostNetwork pods)
    node_devices: HashSet<u32>,
    /// last node-device counters per socket-owner cgroup
    last_cg: HashMap<u64, IfBytes>,
    /// drop records drained in the last tick (how full the map was)
    drained: usize,
    /// (pod uid, annotation value) pairs already warned about, of live pods only
    warned: HashSet<(String, String)>,
    /// interfaces whose attach failed, with the reason last warned about: each
    /// look tries again, but a reason is logged once, not at every look
    refused: HashMap<u32, String>,
    /// attachments refused, counted once per interface and reason (as they are logged)
    refusals: u64,
}

impl TcUnit {
    pub fn new(probe: TcProbe, node_spec: NodeDevices) -> std::io::Result<TcUnit> {
        Ok(TcUnit {
            probe,
            own_netns: ifaces::netns_inode(std::process::id() as i32)?,
            by_host: HashMap::new(),
            by_pod_side: HashMap::new(),
            last: HashMap::new(),
            last_rx: HashMap::new(),
            peer_seen: HashSet::new(),
            last_discovery: None,
            node_spec,
            node_devices: HashSet::new(),
            last_cg: HashMap::new(),
            drained: 0,
            warned: HashSet::new(),
            refused: HashMap::new(),
            refusals: 0,
        })
    }

    /// Looks at the node's interfaces again: attaches to new pod veths and
    /// node devices, detaches from gone ones (their last bytes go to `out`).
    fn rediscover(&mut self, ctx: &TickContext<'_>, out: &mut Vec<(Owner, Delta)>) -> bool {
        let pod_of_ip = |ip| ctx.pods.by_ip(ip).map(|m| m.uid);
        let pinned = std::path::Path::new(ifaces::PINNED_NETNS);
        let pod_pids = || ctx.pod_pids();
        let found = ifaces::discover(&pod_of_ip, &pod_pids, pinned, &self.node_spec);
        self.last_discovery = Some(Instant::now());
        let found = match found {
            Ok(f) => f,
            Err(e) => {
                // keep counting what we have; look again next time
                tracing::warn!("listing pod interfaces failed: {e}");
                return false;
            }
        };
        let new: HashMap<u32, PodIface> = found
            .pods
            .into_iter()
            .map(|f| (f.host_ifindex, f))
            .collect();
        // An interface stops being counted when its veth is gone or another
        // pod owns it now, not because one look missed its pod.
        let gone: Vec<u32> = self
            .by_host
            .iter()
            .filter(|(i, p)| {
                !found.host_veths.contains(i) || new.get(i).is_some_and(|n| n.uid != p.uid)
            })
            .map(|(i, _)| *i)
            .collect();
        for i in gone {
            self.read_interface(i, out);
            if let Some(pi) = self.by_host.remove(&i) {
                self.probe.forget_pod_side(pi.pod_netns, pi.pod_ifindex);
            }
            self.probe.detach(i);
            self.last.remove(&i);
            self.last_rx.remove(&i);
            self.peer_seen.remove(&i);
        }
        for (i, pi) in &new {
            if let Some(known) = self.by_host.get_mut(i) {
                // the pod side's namespace may be found after the interface
                if known.pod_netns == 0 && pi.pod_netns != 0 {
                    known.pod_netns = pi.pod_netns;
                    known.pod_ifindex = pi.pod_ifindex;
                    if let Err(e) = self.probe.watch_pod_side(pi.pod_netns, pi.pod_ifindex) {
                        self.refusals += 1;
                        tracing::warn!(ifindex = i, pod = %pi.uid, "cannot count the pod's ingress at socket delivery: {e}");
                    }
                }
                continue;
            }
            let attached = if pi.netkit {
                self.probe
                    .attach_netkit(*i, pi.pod_netns, pi.pod_ifindex)
                    .map_err(|e| std::io::Error::new(e.kind(), format!("netkit: {e}")))
            } else {
                self.probe.attach(*i)
            };
            match attached {
                Ok(()) => {
                    tracing::debug!(ifindex = i, pod = %pi.uid, netkit = pi.netkit, "counting pod interface");
                    if pi.pod_netns != 0 {
                        if let Err(e) = self.probe.watch_pod_side(pi.pod_netns, pi.pod_ifindex) {
                            self.refusals += 1;
                            tracing::warn!(ifindex = i, pod = %pi.uid, "cannot count the pod's ingress at socket delivery: {e}");
                        }
                    }
                    self.by_host.insert(*i, pi.clone());
                    self.refused.remove(i);
                }
                Err(e) => {
                    if self.refuse(*i, &e) {
                        tracing::warn!(ifindex = i, pod = %pi.uid, "cannot attach tc programs: {e}")
                    }
                }
            }
        }
        self.by_pod_side = self
            .by_host
            .values()
            .filter(|p| p.pod_netns != 0)
            .map(|p| ((p.pod_netns, p.pod_ifindex), p.uid.clone()))
            .collect();
        let node_now: HashSet<u32> = found.node_devices.iter().map(|(i, _)| *i).collect();
        for gone in self
            .node_devices
            .difference(&node_now)
            .copied()
            .collect::<Vec<_>>()
        {
            self.probe.detach(gone);
            self.node_devices.remove(&gone);
        }
        for (i, name) in &found.node_devices {
            if self.node_devices.contains(i) {
                continue;
            }
            match self.probe.attach_node(*i) {
                Ok(()) => {
                    tracing::info!(device = %name, "counting hostNetwork pods' bytes on node device");
                    self.node_devices.insert(*i);
                    self.refused.remove(i);
                }
                Err(e) => {
                    if self.refuse(*i, &e) {
                        tracing::warn!(device = %name, "cannot attach tc programs: {e}")
                    }
                }
            }
        }
        self.refused
            .retain(|i, _| new.contains_key(i) || node_now.contains(i));
        true
    }

    /// Reads one pod interface's counters into deltas since the last read. The pod's
    /// ingress joins what its host side sent and what its sockets received (`ingress`):
    /// the first is exact on a plain veth (and counts what no socket takes), the second
    /// holds where packets reach the pod around the host side (bpf_redirect_peer).
    fn read_interface(&mut self, i: u32, out: &mut Vec<(Owner, Delta)>) {
        let Some(pi) = self.by_host.get(&i) else {
            return;
        };
        let Some(b) = self.probe.read(i) else {
            return;
        };
        let prev = self.last.insert(i, b).unwrap_or_default();
        let egress = grown(b.egress_bytes, prev.egress_bytes);
        let host_side = grown(b.ingress_bytes, prev.ingress_bytes);
        let mut ingress = host_side;
        if let Some(rx) = self.probe.read_pod_side(pi.pod_netns, pi.pod_ifindex) {
            let (last, join) = self.last_rx.entry(i).or_default();
            let delivered = grown(rx.0, last.0);
            *last = rx;
            let joined = join.tick(host_side, delivered);
            // a margin for what the two hooks see differently on a plain veth
            // (headers of packets no socket takes)
            if joined.fresh_delivered > host_side + host_side / 8 + 65536
                && self.peer_seen.insert(i)
            {
                tracing::info!(
                    ifindex = i,
                    pod = %pi.uid,
                    "the pod's ingress reaches its sockets around its host-side interface \
                     (bpf_redirect_peer): counted at socket delivery"
                );
            }
            ingress = joined.bytes;
        }
        push_bytes(out, pi.uid.as_str().into(), egress, ingress);
    }

    /// Records that attaching to `ifindex` failed; true when this reason is
    /// new for it (and so worth a warning).
    fn refuse(&mut self, ifindex: u32, e: &std::io::Error) -> bool {
        let reason = e.to_string();
        if self.refused.get(&ifindex) == Some(&reason) {
            return false;
        }
        self.refused.insert(ifindex, reason);
        self.refusals += 1;
        true
    }

    /// Drains the drop map and attributes each drop.
    fn drops(&mut self, ctx: &TickContext<'_>, out: &mut Vec<(Owner, Delta)>) {
        let drained = self.probe.drain_drops();
        self.drained = drained.len();
        let pod_of_cgroup = |id: u64| ctx.pod_of_cgroup(id);
        let pod_of_ip = |ip| ctx.pods.by_ip(ip).map(|m| m.uid);
        for (k, n) in drained {
            let reason = self.probe.reason_name(k.reason);
            let known = attribute::Known {
                own_netns: self.own_netns,
                by_host: &self.by_host,
                by_pod_side: &self.by_pod_side,
                pod_of_cgroup: &pod_of_cgroup,
                pod_of_ip: &pod_of_ip,
                ingress_hook: reason == "tc_ingress",
            };
            let (owner, dir) = attribute::attribute(&k, &known);
            let labels = Labels::from([
                (
                    "direction",
                    dir.map(Direction::as_str).unwrap_or("").to_string(),
                ),
                ("reason", reason),
            ]);
            out.push((
                owner,
                Delta {
                    family: DROPS_FAMILY,
                    labels,
                    value: Value::Count(n),
                },
            ));
        }
    }

    /// Caps from annotations; an unparsable value is warned about once.
    fn bandwidth_limits(&mut self, ctx: &TickContext<'_>) -> Vec<GaugeValue> {
        bandwidth_limits(ctx.pods, &mut self.warned)
    }
}

/// The pods' bandwidth caps from their annotations. An unparsable value is warned about once
/// per (pod, value); `warned` keeps only the pairs that are still current, so it holds at
/// most two entries per live pod: deleted pods and fixed annotations leave it.
fn bandwidth_limits(pods: &PodStore, warned: &mut HashSet<(String, String)>) -> Vec<GaugeValue> {
    let mut out = Vec::new();
    let mut still_bad = HashSet::new();
    for uid in pods.uids() {
        let Some(meta) = pods.get(&uid) else {
            continue;
        };
        if meta.deleted_at.is_some() {
            continue;
        }
        for (key, dir) in [
            (bandwidth::EGRESS, Direction::Egress),
            (bandwidth::INGRESS, Direction::Ingress),
        ] {
            let Some(v) = meta.annotations.get(key) else {
                continue;
            };
            match bandwidth::parse_quantity(v) {
                Ok(bps) => out.push(GaugeValue {
                    owner: Owner::Pod {
                        uid: uid.as_str().into(),
                        container_id: None,
                    },
                    labels: Labels::from([("direction", dir.as_str().to_string())]).into(),
                    value: bps,
                }),
                Err(e) => {
                    let k = (uid.clone(), format!("{key}={v}"));
                    if !warned.contains(&k) {
                        tracing::warn!(
                            "pod {}/{}: annotation {key}={v:?} is not a valid quantity ({e}); no bandwidth limit exported",
                            meta.namespace,
                            meta.name
                        );
                    }
                    still_bad.insert(k);
                }
            }
        }
    }
    *warned = still_bad;
    out
}

impl Probe for TcUnit {
    fn families(&self) -> &'static [FamilySpec] {
        &FAMILIES
    }

    fn signals(&self) -> Vec<SignalSpec> {
        vec![SignalSpec {
            name: "tc_drop_rate",
            family: DROPS_FAMILY,
            kind: SignalKind::Rate,
        }]
    }

    fn tick(&mut self, ctx: &TickContext<'_>) -> TickOutput {
        let mut out = TickOutput::default();
        let rediscover = ctx.cgroups_changed
            || self
                .last_discovery
                .is_none_or(|t| t.elapsed() >= REDISCOVER);
        if rediscover {
            if !self.rediscover(ctx, &mut out.deltas) {
                return TickOutput::default();
            }
            let limits = self.bandwidth_limits(ctx);
            out.gauges.push((BW_LIMIT_FAMILY, limits));
        }
        let ifs: Vec<u32> = self.by_host.keys().copied().collect();
        for i in ifs {
            self.read_interface(i, &mut out.deltas);
        }
        // hostNetwork pods: node-device bytes per socket-owner cgroup
        let per_cgroup = self.probe.read_cgroups().unwrap_or_default();
        let mut node_bytes = Vec::with_capacity(per_cgroup.len());
        for (id, b) in per_cgroup {
            let prev = self.last_cg.insert(id, b).unwrap_or_default();
            node_bytes.push((id, b, prev));
        }
        self.drops(ctx, &mut out.deltas);
        for (id, b, prev) in node_bytes {
            match ctx.pod_of_cgroup(id) {
                Some(Owner::Pod { uid, .. }) => push_bytes(
                    &mut out.deltas,
                    uid,
                    grown(b.egress_bytes, prev.egress_bytes),
                    grown(b.ingress_bytes, prev.ingress_bytes),
                ),
                Some(_) => {} // a non-pod process on the node: not this series' business
                None => {
                    // the cgroup is gone: its last bytes were read above
                    self.probe.forget_cgroup(id);
                    self.last_cg.remove(&id);
                }
            }
        }
        out
    }

    fn stats(&self) -> UnitStats {
        UnitStats {
            maps: vec![
                MapFill {
                    map: "if_bytes",
                    entries: self.by_host.len(),
                    capacity: Some(loader::IF_BYTES_ENTRIES),
                },
                MapFill {
                    map: "cg_bytes",
                    entries: self.last_cg.len(),
                    capacity: Some(loader::CG_BYTES_ENTRIES),
                },
                MapFill {
                    map: "drops",
                    entries: self.drained,
                    capacity: Some(loader::DROPS_ENTRIES),
                },
                MapFill {
                    map: "tc_reasons",
                    entries: self.probe.reasons(),
                    capacity: Some(self.probe.reasons().max(1) as u32),
                },
            ],
            storage_failures: None,
            series: vec![
                SelfSeries::gauge(
                    "gpufeed_tc_interfaces",
                    "Pod interfaces the tc programs are attached to",
                    self.by_host.len() as f64,
                ),
                SelfSeries::gauge(
                    "gpufeed_tc_netkit_interfaces",
                    "Of the pod interfaces counted, netkit pairs (counted in netkit's own hooks on the primary device)",
                    self.by_host.values().filter(|p| p.netkit).count() as f64,
                ),
                SelfSeries::gauge(
                    "gpufeed_tc_peer_redirect_interfaces",
                    "Pod interfaces whose sockets received more than their host side sent (ingress by bpf_redirect_peer, counted at socket delivery)",
                    self.peer_seen.len() as f64,
                ),
                SelfSeries::gauge(
                    "gpufeed_tc_socket_delivery_counted",
                    "1 when pod ingress is also counted at socket delivery (cgroup_skb/ingress on the cgroup2 root), 0 when only on the host side",
                    if self.probe.delivery_off().is_none() { 1.0 } else { 0.0 },
                ),
                SelfSeries::counter(
                    "gpufeed_tc_attach_refusals_total",
                    "Attachments to pod interfaces and node devices refused (another program at our clsact priority, a device gone mid-attach, a full map), once per interface and reason, as logged",
                    self.refusals,
                ),
                SelfSeries::counter(
                    "gpufeed_tc_drop_overflow_total",
                    "tc/qdisc drops not recorded because the drop map was full",
                    self.probe.overflow(),
                ),
            ],
            node: Vec::new(),
        }
    }
}

/// What a counter grew by: counters only grow while their entry exists; a smaller
/// value is a new entry.
fn grown(now: u64, prev: u64) -> u64 {
    if now >= prev {
        now - prev
    } else {
        now
    }
}

fn push_bytes(out: &mut Vec<(Owner, Delta)>, uid: Arc<str>, egress: u64, ingress: u64) {
    let owner = Owner::Pod {
        uid,
        container_id: None,
    };
    for (dir, n) in [(Direction::Egress, egress), (Direction::Ingress, ingress)] {
        out.push((
            owner.clone(),
            Delta {
                family: BYTES_FAMILY,
                labels: Labels::from([("direction", dir.as_str().to_string())]),
                value: Value::Count(n),
            },
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pods::PodMeta;

    fn pod(uid: &str, egress: &str) -> PodMeta {
        PodMeta {
            annotations: [(bandwidth::EGRESS.to_string(), egress.to_string())].into(),
            ..PodMeta::named(uid, "ns", uid)
        }
    }

    /// The warned set holds the current bad annotations of live pods only.
    #[test]
    fn warned_pairs_of_deleted_pods_and_fixed_values_are_dropped() {
        let pods = PodStore::new();
        let mut warned = HashSet::new();
        for i in 0..100 {
            pods.upsert(pod(&format!("p{i}"), &format!("lots-{i}")));
        }
        pods.upsert(pod("good", "10M"));
        let caps = bandwidth_limits(&pods, &mut warned);
        assert_eq!(caps.len(), 1);
        assert_eq!(caps[0].value, 10e6);
        assert_eq!(warned.len(), 100);
        // 99 pods deleted, the last one fixes its annotation.
        for i in 0..99 {
            pods.mark_deleted(&format!("p{i}"));
        }
        bandwidth_limits(&pods, &mut warned);
        assert_eq!(
            warned.iter().collect::<Vec<_>>(),
            [&("p99".to_string(), format!("{}=lots-99", bandwidth::EGRESS))]
        );
        pods.upsert(pod("p99", "1G"));
        assert_eq!(bandwidth_limits(&pods, &mut warned).len(), 2);
        assert!(warned.is_empty());
    }
}
