//! Loading and attaching `bpf/tc.bpf.c`, and reading its maps.
//!
//! The byte programs are attached per pod interface as pods come and go, so
//! this module keeps the two program fds and creates one tcx link per
//! (interface, direction) with BPF_LINK_CREATE; closing the link fd detaches.
//! Where the kernel has no tcx (before 6.6), a clsact filter is added instead,
//! at a priority of its own, never replacing another program's filter (only
//! one an earlier, killed agent left at that priority).

pub(crate) mod skel {
    include!(concat!(env!("OUT_DIR"), "/tc.skel.rs"));
}

use std::collections::HashMap;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use libbpf_rs::btf::types::Enum;
use libbpf_rs::skel::SkelBuilder;
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle, TcHook, TcHookBuilder};

use crate::ebpf::cgroup_maps::MappedWords;
use crate::ebpf::{decode, err, handle, percpu_sum, set_max_entries, KernelBtf, ProbeError};
use crate::netlink;
use crate::probes::status::ProbeStatus;

pub const BYTES: &str = "tc_bytes";
pub const DROPS: &str = "tc_drops";
pub(super) const OBJ: &str = "tc";

// SAFETY: generated #[repr(C)] structs of integers: every bit pattern is valid.
unsafe impl plain::Plain for skel::types::drop_key {}
unsafe impl plain::Plain for skel::types::if_bytes {}

/// Map sizes, set before load (docs/probes.md says why each is what it is).
/// Pod interfaces counted (one entry per host-side veth).
pub const IF_BYTES_ENTRIES: u32 = 4096;
/// Socket-owner cgroups counted on node devices; LRU, so idle ones age out.
pub const CG_BYTES_ENTRIES: u32 = 16384;
/// Distinct (owner, device, reason, addresses) drop records between two
/// drains; more in one tick go to `gpufeed_tc_drop_overflow_total`.
pub const DROPS_ENTRIES: u32 = 8192;
/// Priority of our clsact filters (fallback path only), chosen to stay clear
/// of the low numbers people and CNIs use.
const CLSACT_PRIO: u32 = 0xfee1;

/// How byte programs are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AttachMode {
    /// tcx where the kernel has it, clsact otherwise.
    Auto,
    Tcx,
    Clsact,
}

/// Counters of one host-side interface: (bytes, packets) for the pod's egress
/// (host ingress) and ingress (host egress).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IfBytes {
    pub egress_bytes: u64,
    pub egress_packets: u64,
    pub ingress_bytes: u64,
    pub ingress_packets: u64,
}

/// One drained drop record.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DropKey {
    pub cgroup_id: u64,
    pub netns: u32,
    pub ifindex: u32,
    pub reason: u32,
    pub saddr: Option<std::net::IpAddr>,
    pub daddr: Option<std::net::IpAddr>,
}

enum Attachment {
    Tcx(Vec<OwnedFd>),
    Clsact(Vec<ClsactHook>),
    /// netkit links on the primary, and the pod side's key in `nk_primary_of`
    Netkit(Vec<OwnedFd>, [u8; 8]),
}

/// The longest program name the kernel keeps (BPF_OBJ_NAME_LEN less the NUL).
const KERNEL_NAME_LEN: usize = 15;

/// Prepares our filter on one clsact hook of an interface (creating the
/// clsact qdisc if needed). Unlike a tcx link, a clsact filter outlives the
/// process that added it: an agent that was killed (OOM, SIGKILL, a forced
/// pod delete) leaves its filters behind, counting into maps nobody reads and
/// holding our priority. Such a filter (one running a program named as one of
/// `ours`) is to be replaced; one of another program at our priority is left
/// alone and the interface refused.
fn clsact_hook(
    prog: &OwnedFd,
    ifindex: u32,
    point: libbpf_rs::TcAttachPoint,
    ours: &[String],
) -> io::Result<ClsactHook> {
    let mut h = TcHookBuilder::new(prog.as_fd())
        .ifindex(ifindex as i32)
        .replace(false)
        .handle(1)
        .priority(CLSACT_PRIO)
        .hook(point);
    // creating clsact fails with EEXIST when it is there already: fine
    let _ = h.create();
    // the dump also lists each classifier's head (handle 0): not a filter
    let held = netlink::clsact_filters(ifindex, point == libbpf_rs::TC_EGRESS)?
        .into_iter()
        .find(|f| u32::from(f.priority) == CLSACT_PRIO && f.handle != 0);
    if let Some(f) = held {
        // libbpf names a filter "<program>:[<id>]"
        let program = f.name.split(':').next().unwrap_or_default();
        if f.kind != "bpf" || !ours.iter().any(|o| o == program) {
            return Err(io::Error::other(format!(
                "a {} filter of another program ({}) holds clsact priority {CLSACT_PRIO:#x}; \
                 left in place, this interface is not counted",
                f.kind,
                if f.name.is_empty() {
                    "unnamed"
                } else {
                    &f.name
                }
            )));
        }
        tracing::info!(ifindex, filter = %f.name, "replacing a clsact filter an earlier agent left");
        h.replace(true);
    }
    Ok(ClsactHook(h))
}

/// A clsact filter libbpf attached. libbpf's hook struct carries a `const char *` (the
/// name of a qdisc to create, which this probe leaves NULL), so it is not `Send` by itself.
struct ClsactHook(TcHook);

// SAFETY: the hook's only pointer is libbpf's optional qdisc name, always NULL here; the
// rest is plain data (ifindex, attach point, handle, priority), owned by this value.
unsafe impl Send for ClsactHook {}

pub struct TcProbe {
    /// the byte programs' names as the kernel keeps them, to know our clsact filters by
    programs: Vec<String>,
    ingress_prog: OwnedFd,
    egress_prog: OwnedFd,
    /// netkit's primary hook (the pod's ingress), keyed through `nk_primary_of`; None on
    /// a kernel without bpf_cast_to_kern_ctx (6.3), which has no netkit (6.7) either
    netkit_primary_prog: Option<OwnedFd>,
    nk_primary_of: MapHandle,
    /// [ingress, egress] for node devices; None on a kernel without bpf_rdonly_cast
    node_progs: Option<[OwnedFd; 2]>,
    if_bytes: MapHandle,
    cg_bytes: MapHandle,
    drops: Option<MapHandle>,
    /// [0] cg_bytes counted a packet, [1] a drop was counted, since the last read;
    /// [2] the generation drops are counted under now
    touched: MappedWords,
    /// the generation `touched[2]` holds
    drop_gen: u16,
    /// whether the other generation may hold drops not yet taken
    retired_drops: bool,
    overflow: MapHandle,
    _drop_link: Option<Link>,
    /// pod ingress at socket delivery, by pod-side (netns, ifindex); None when the
    /// `cgroup_skb/ingress` program is not attached (`delivery_off` says why)
    pod_rx: Option<MapHandle>,
    _deliver_link: Option<Link>,
    delivery_off: Option<String>,
    reasons: HashMap<u32, String>,
    mode: AttachMode,
    attached: HashMap<u32, Attachment>,
}

/// The kernel's drop reasons of the tc/qdisc layer, value → lower-case name
/// without the SKB_DROP_REASON_ prefix, read from the running kernel's BTF.
pub fn tc_drop_reasons(btf: &KernelBtf) -> HashMap<u32, String> {
    let mut out = HashMap::new();
    if let Some(e) = btf
        .btf()
        .and_then(|b| b.type_by_name::<Enum<'_>>("skb_drop_reason"))
    {
        for m in e.iter() {
            let Some(name) = m.name.and_then(|n| n.to_str()) else {
                continue;
            };
            let Some(short) = name.strip_prefix("SKB_DROP_REASON_") else {
                continue;
            };
            if ["QDISC_", "TC_", "FQ_", "CAKE_"]
                .iter()
                .any(|p| short.starts_with(p))
            {
                out.insert(m.value as u32, short.to_ascii_lowercase());
            }
        }
    }
    // 7.x: the qdiscs' own reasons in a subsystem of drop reasons (enum qdisc_drop_reason,
    // values SKB_DROP_REASON_SUBSYS_QDISC << 16 | n): tbf's overlimit drops arrive as these
    if let Some(e) = btf
        .btf()
        .and_then(|b| b.type_by_name::<Enum<'_>>("qdisc_drop_reason"))
    {
        for m in e.iter() {
            let Some(name) = m.name.and_then(|n| n.to_str()) else {
                continue;
            };
            let sub = name.strip_prefix("QDISC_DROP_");
            if sub.is_some_and(|s| s != "UNSPEC" && s != "MAX") && m.value as u32 >> 16 != 0 {
                out.insert(m.value as u32, name.to_ascii_lowercase());
            }
        }
    }
    out
}

/// `SKB_DROP_REASON_MAX` of the running kernel, from its BTF.
fn core_reason_max(btf: &KernelBtf) -> Option<u32> {
    let e = btf.btf()?.type_by_name::<Enum<'_>>("skb_drop_reason")?;
    let max = e
        .iter()
        .find(|m| m.name.and_then(|n| n.to_str()) == Some("SKB_DROP_REASON_MAX"))
        .map(|m| m.value as u32);
    max
}

impl TcProbe {
    pub fn load(
        btf: &KernelBtf,
        mode: AttachMode,
        read_addrs: bool,
    ) -> Result<(TcProbe, Vec<ProbeStatus>), ProbeError> {
        let has_kfree = btf.has_tracepoint("kfree_skb");
        let reasons = tc_drop_reasons(btf);
        let drops_up = has_kfree && !reasons.is_empty();
        let mut storage = MaybeUninit::uninit();
        let mut open = skel::TcSkelBuilder::default()
            .open(&mut storage)
            .map_err(err(OBJ, "open"))?;
        set_max_entries(OBJ, &mut open.maps.if_bytes, IF_BYTES_ENTRIES)?;
        set_max_entries(OBJ, &mut open.maps.cg_bytes, CG_BYTES_ENTRIES)?;
        set_max_entries(OBJ, &mut open.maps.pod_rx, IF_BYTES_ENTRIES)?;
        set_max_entries(OBJ, &mut open.maps.nk_primary_of, IF_BYTES_ENTRIES)?;
        set_max_entries(OBJ, &mut open.maps.drops, DROPS_ENTRIES)?;
        // exactly the reasons this kernel has (at least one slot)
        set_max_entries(OBJ, &mut open.maps.tc_reasons, reasons.len().max(1) as u32)?;
        open.progs.kfree_skb.set_autoload(drops_up);
        // hostNetwork pods' bytes on node devices need bpf_rdonly_cast (6.2)
        let node_devices = btf.has_kfunc("bpf_rdonly_cast");
        open.progs.tc_node_ingress.set_autoload(node_devices);
        open.progs.tc_node_egress.set_autoload(node_devices);
        // pod ingress at socket delivery needs the skb behind the context (6.3)
        let delivery = btf.has_kfunc("bpf_cast_to_kern_ctx");
        open.progs.pod_deliver.set_autoload(delivery);
        open.progs.nk_primary.set_autoload(delivery);
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.read_addrs = read_addrs;
            ro.core_reason_max = core_reason_max(btf).unwrap_or(0);
            // node devices count only sockets of this (the host's) namespace
            ro.host_netns_ino = std::fs::metadata("/proc/self/ns/net")
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m) as u32)
                .unwrap_or(0);
        }
        let skel = crate::ebpf::object::load(OBJ, open)?;
        let drop_link = if drops_up {
            for r in reasons.keys() {
                skel.maps
                    .tc_reasons
                    .update(&r.to_ne_bytes(), &[1u8], MapFlags::ANY)
                    .map_err(err(DROPS, "filling tc_reasons"))?;
            }
            Some(
                skel.progs
                    .kfree_skb
                    .attach()
                    .map_err(err(DROPS, "attach kfree_skb"))?,
            )
        } else {
            None
        };
        let (deliver_link, delivery_off) = if delivery {
            match attach_delivery(&skel.progs.pod_deliver) {
                Ok(l) => (Some(l), None),
                Err(e) => {
                    tracing::warn!("pod ingress at socket delivery is not counted: {e}");
                    (None, Some(e))
                }
            }
        } else {
            (
                None,
                Some("this kernel has no bpf_cast_to_kern_ctx (6.3)".to_string()),
            )
        };
        let dup = |p: &libbpf_rs::ProgramMut<'_>| -> Result<OwnedFd, ProbeError> {
            p.as_fd().try_clone_to_owned().map_err(|e| ProbeError::Io {
                probe: BYTES,
                what: "dup program fd",
                source: e,
            })
        };
        let attach = match mode {
            AttachMode::Auto if btf.has_tcx() => AttachMode::Tcx,
            AttachMode::Auto => AttachMode::Clsact,
            m => m,
        };
        let bytes_hook = match attach {
            AttachMode::Tcx => "tcx on pod veths",
            _ => "tc clsact on pod veths",
        };
        let statuses = vec![
            ProbeStatus::up(BYTES)
                .with("hook", bytes_hook)
                .with("storage", "per-interface per-CPU hash")
                .with("reads", "each")
                .with(
                    "pod_ingress",
                    match &delivery_off {
                        None => "host-side egress and socket delivery (cgroup_skb/ingress)",
                        Some(_) => "host-side egress only",
                    },
                )
                .with(
                    "node_devices",
                    if node_devices {
                        "per socket owner"
                    } else {
                        "off (no bpf_rdonly_cast)"
                    },
                ),
            if drops_up {
                ProbeStatus::up(DROPS)
                    .with("hook", "tp_btf/kfree_skb")
                    .with("storage", "hash, drained each tick")
                    .with("reads", "drain")
            } else if has_kfree {
                ProbeStatus::down(
                    DROPS,
                    "kernel names no tc/qdisc drop reasons (skb_drop_reason)",
                )
            } else {
                ProbeStatus::down(DROPS, "kernel has no BTF tracepoint kfree_skb")
            },
        ];
        let progs = &skel.progs;
        let programs = [
            &progs.tc_host_ingress,
            &progs.tc_host_egress,
            &progs.tc_node_ingress,
            &progs.tc_node_egress,
        ]
        .iter()
        .map(|p| {
            let name = p.name().to_string_lossy();
            name[..name.len().min(KERNEL_NAME_LEN)].to_string()
        })
        .collect();
        let probe = TcProbe {
            programs,
            ingress_prog: dup(&skel.progs.tc_host_ingress)?,
            egress_prog: dup(&skel.progs.tc_host_egress)?,
            netkit_primary_prog: if delivery {
                Some(dup(&skel.progs.nk_primary)?)
            } else {
                None
            },
            nk_primary_of: handle(OBJ, &skel.maps.nk_primary_of)?,
            node_progs: if node_devices {
                Some([
                    dup(&skel.progs.tc_node_ingress)?,
                    dup(&skel.progs.tc_node_egress)?,
                ])
            } else {
                None
            },
            if_bytes: handle(OBJ, &skel.maps.if_bytes)?,
            cg_bytes: handle(OBJ, &skel.maps.cg_bytes)?,
            touched: MappedWords::new(OBJ, handle(OBJ, &skel.maps.tc_touched)?)?,
            drop_gen: 0,
            retired_drops: false,
            drops: if drops_up {
                Some(handle(OBJ, &skel.maps.drops)?)
            } else {
                None
            },
            overflow: handle(OBJ, &skel.maps.drop_overflow)?,
            _drop_link: drop_link,
            pod_rx: if deliver_link.is_some() {
                Some(handle(OBJ, &skel.maps.pod_rx)?)
            } else {
                None
            },
            _deliver_link: deliver_link,
            delivery_off,
            reasons,
            mode: attach,
            attached: HashMap::new(),
        };
        Ok((probe, statuses))
    }

    /// Why pod ingress is not counted at socket delivery; None when it is.
    pub fn delivery_off(&self) -> Option<&str> {
        self.delivery_off.as_deref()
    }

    /// Starts counting what the sockets of a pod's namespace receive through its
    /// pod-side interface (`netns` inode, `ifindex` there). False when delivery
    /// is not counted at all.
    pub fn watch_pod_side(&self, netns: u32, ifindex: u32) -> io::Result<bool> {
        let Some(map) = &self.pod_rx else {
            return Ok(false);
        };
        insert_zeroed(
            map,
            &pod_side_key(netns, ifindex),
            std::mem::size_of::<skel::types::if_bytes>(),
        )?;
        Ok(true)
    }

    /// Stops counting a pod-side interface.
    pub fn forget_pod_side(&self, netns: u32, ifindex: u32) {
        if let Some(map) = &self.pod_rx {
            let _ = map.delete(&pod_side_key(netns, ifindex));
        }
    }

    /// (bytes, packets) the sockets behind a pod-side interface received.
    pub fn read_pod_side(&self, netns: u32, ifindex: u32) -> Option<(u64, u64)> {
        let cpus = self
            .pod_rx
            .as_ref()?
            .lookup_percpu(&pod_side_key(netns, ifindex), MapFlags::ANY)
            .ok()
            .flatten()?;
        let mut out = (0, 0);
        for c in cpus {
            let mut v = skel::types::if_bytes::default();
            if plain::copy_from_bytes(&mut v, &c).is_ok() {
                out.0 += v.bytes;
                out.1 += v.packets;
            }
        }
        Some(out)
    }

    /// The kernel's tc/qdisc drop reasons, as `tc_reasons` holds them.
    pub fn reasons(&self) -> usize {
        self.reasons.len()
    }

    pub fn reason_name(&self, reason: u32) -> String {
        self.reasons
            .get(&reason)
            .cloned()
            // a value the kernel never defined (see core_reason_max in bpf/tc.bpf.c)
            .unwrap_or_else(|| format!("unnamed_{reason}"))
    }

    /// Starts counting a host-side pod interface: creates its counter entry,
    /// then attaches to ingress and egress, placed before any existing tcx
    /// program so that redirects by others do not hide packets from us (our
    /// programs return TCX_NEXT, so the order changes no verdict).
    pub fn attach(&mut self, ifindex: u32) -> io::Result<()> {
        if self.attached.contains_key(&ifindex) {
            return Ok(());
        }
        insert_zeroed(
            &self.if_bytes,
            &ifindex.to_ne_bytes(),
            std::mem::size_of::<[skel::types::if_bytes; 2]>(),
        )?;
        let progs = [
            self.ingress_prog.try_clone()?,
            self.egress_prog.try_clone()?,
        ];
        self.attach_progs(ifindex, progs)
    }

    /// Starts counting a netkit pod: `primary` is the host-side device, the pod side is
    /// `pod_ifindex` in the namespace of inode `netns`. Our programs go first in netkit's
    /// own hooks on the primary (`BPF_F_BEFORE`): the peer hook sees everything the pod
    /// sends, also what the pod's program (Cilium's `from-container`) then redirects
    /// straight to a node device, and the primary hook everything the host side hands
    /// to the pod. Both return NETKIT_NEXT: the programs after ours decide, as before.
    /// netkit runs them with the receiving device as `skb->dev`: the primary hook's
    /// packets name the pod side, which only the pod side's namespace tells apart from
    /// the node's interfaces. Without it (no pin, no readable process) the pod is
    /// refused, and tried again at the next look.
    pub fn attach_netkit(&mut self, primary: u32, netns: u32, pod_ifindex: u32) -> io::Result<()> {
        if self.attached.contains_key(&primary) {
            return Ok(());
        }
        let Some(primary_prog) = &self.netkit_primary_prog else {
            return Err(io::Error::other(
                "this kernel has no bpf_cast_to_kern_ctx (6.3): netkit pods are not counted",
            ));
        };
        if netns == 0 {
            return Err(io::Error::other(
                "the netkit pod's namespace is not known yet (no pin in /run/netns, no \
                 readable process): its ingress cannot be keyed",
            ));
        }
        let key = pod_side_key(netns, pod_ifindex);
        let progs = [self.ingress_prog.try_clone()?, primary_prog.try_clone()?];
        let mut links = Vec::new();
        for (fd, ty) in [
            (&progs[0], libbpf_sys::BPF_NETKIT_PEER),
            (&progs[1], libbpf_sys::BPF_NETKIT_PRIMARY),
        ] {
            // links made so far close (detach) when this returns early
            links.push(
                link_before(fd, primary, ty).map_err(|e| match e.raw_os_error() {
                    Some(libc::EACCES) => io::Error::new(
                        e.kind(),
                        "not the primary of its netkit pair (the primary is in the pod's \
                         namespace; netkit's hooks attach there only)",
                    ),
                    Some(libc::ENODEV) => io::Error::new(e.kind(), "the device is gone"),
                    _ => e,
                })?,
            );
        }
        insert_zeroed(
            &self.if_bytes,
            &primary.to_ne_bytes(),
            std::mem::size_of::<[skel::types::if_bytes; 2]>(),
        )?;
        self.nk_primary_of
            .update(&key, &primary.to_ne_bytes(), MapFlags::ANY)
            .map_err(io::Error::other)?;
        self.attached
            .insert(primary, Attachment::Netkit(links, key));
        Ok(())
    }

    /// Counts a node device (a physical NIC) per socket-owner cgroup, for
    /// hostNetwork pods.
    pub fn attach_node(&mut self, ifindex: u32) -> io::Result<()> {
        if self.attached.contains_key(&ifindex) {
            return Ok(());
        }
        let Some([ingress, egress]) = &self.node_progs else {
            return Err(io::Error::other(
                "this kernel has no bpf_rdonly_cast (6.2): hostNetwork pods' bytes are not counted",
            ));
        };
        let progs = [ingress.try_clone()?, egress.try_clone()?];
        self.attach_progs(ifindex, progs)
    }

    /// Attaches [ingress, egress] programs to an interface.
    fn attach_progs(&mut self, ifindex: u32, progs: [OwnedFd; 2]) -> io::Result<()> {
        let [ingress_prog, egress_prog] = &progs;
        let att = match self.mode {
            AttachMode::Clsact => {
                // both hooks checked before either is attached, so that a refusal
                // leaves nothing half attached
                let mut hooks = [
                    clsact_hook(ingress_prog, ifindex, libbpf_rs::TC_INGRESS, &self.programs)?,
                    clsact_hook(egress_prog, ifindex, libbpf_rs::TC_EGRESS, &self.programs)?,
                ];
                for i in 0..hooks.len() {
                    if let Err(e) = hooks[i].0.attach() {
                        for h in &mut hooks[..i] {
                            let _ = h.0.detach();
                        }
                        return Err(io::Error::other(e));
                    }
                }
                Attachment::Clsact(hooks.into())
            }
            _ => {
                let mut links = Vec::new();
                for (fd, ty) in [
                    (ingress_prog, libbpf_sys::BPF_TCX_INGRESS),
                    (egress_prog, libbpf_sys::BPF_TCX_EGRESS),
                ] {
                    links.push(link_before(fd, ifindex, ty)?);
                }
                Attachment::Tcx(links)
            }
        };
        self.attached.insert(ifindex, att);
        Ok(())
    }

    /// Stops counting an interface (gone, or no longer a pod's); forgets its counters.
    pub fn detach(&mut self, ifindex: u32) {
        match self.attached.remove(&ifindex) {
            Some(Attachment::Tcx(_links)) => {} // closing the link fds detaches
            Some(Attachment::Netkit(_links, key)) => {
                let _ = self.nk_primary_of.delete(&key);
            }
            Some(Attachment::Clsact(mut hooks)) => {
                for h in &mut hooks {
                    let _ = h.0.detach(); // fails harmlessly if the interface is gone
                }
            }
            None => {}
        }
        let _ = self.if_bytes.delete(&ifindex.to_ne_bytes());
    }

    pub fn read(&self, ifindex: u32) -> Option<IfBytes> {
        let cpus = self
            .if_bytes
            .lookup_percpu(&ifindex.to_ne_bytes(), MapFlags::ANY)
            .ok()
            .flatten()?;
        Some(sum_percpu(&cpus))
    }

    /// Bytes per socket-owner cgroup counted on node devices: (cgroup id, sent
    /// as egress, received as ingress).
    /// None when no packet was counted since the previous read (the values
    /// are as they were).
    pub fn read_cgroups(&self) -> Option<Vec<(u64, IfBytes)>> {
        if !self.touched.take(0) {
            return None;
        }
        let keys: Vec<Vec<u8>> = self.cg_bytes.keys().collect();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let Some(id) = decode::<u64>(&k) else {
                continue;
            };
            let Ok(Some(cpus)) = self.cg_bytes.lookup_percpu(&k, MapFlags::ANY) else {
                continue;
            };
            out.push((id, sum_percpu(&cpus)));
        }
        Some(out)
    }

    /// Forgets a cgroup's node-device counters (the cgroup is gone).
    pub fn forget_cgroup(&self, id: u64) {
        let _ = self.cg_bytes.delete(&id.to_ne_bytes());
    }

    /// Takes the drops counted up to the previous call: a drop reaches the
    /// agent one call after it is counted, and none is lost.
    ///
    /// A program adds to an entry through a pointer it looked up, so an entry
    /// deleted while a program holds it would take that program's drop with
    /// it. Drops are therefore counted under one of two generations: each call
    /// takes the entries of the generation retired at the previous call (no
    /// program has touched it for a whole tick), then retires the current one
    /// when it has counted anything.
    pub fn drain_drops(&mut self) -> Vec<(DropKey, u64)> {
        let Some(map) = &self.drops else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if self.retired_drops {
            let retired = self.drop_gen ^ 1;
            let keys: Vec<Vec<u8>> = map
                .keys()
                .filter(|k| drop_key_gen(k) == Some(retired))
                .collect();
            out.reserve(keys.len());
            for k in keys {
                let Ok(Some(v)) = map.lookup_and_delete(&k) else {
                    continue;
                };
                if let (Some(key), Some(n)) = (decode_drop_key(&k), decode::<u64>(&v)) {
                    out.push((key, n));
                }
            }
        }
        // cleared before the flip: a drop counted after it sets it again and
        // is retired by the next call
        self.retired_drops = self.touched.take(1);
        if self.retired_drops {
            self.drop_gen ^= 1;
            self.touched.store(2, u64::from(self.drop_gen));
        }
        out
    }

    /// Drops that could not be recorded because the drops map was full.
    pub fn overflow(&self) -> u64 {
        percpu_sum(&self.overflow, 0)
    }
}

impl Drop for TcProbe {
    fn drop(&mut self) {
        let ifs: Vec<u32> = self.attached.keys().copied().collect();
        for i in ifs {
            self.detach(i);
        }
    }
}

/// A tcx or netkit link of `prog` on `ifindex`, placed before the programs there.
fn link_before(
    prog: &OwnedFd,
    ifindex: u32,
    ty: libbpf_sys::bpf_attach_type,
) -> io::Result<OwnedFd> {
    // SAFETY: zeroed is a valid bpf_link_create_opts; sz tells libbpf its size.
    let mut opts: libbpf_sys::bpf_link_create_opts = unsafe { std::mem::zeroed() };
    opts.sz = std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as _;
    opts.flags = libbpf_sys::BPF_F_BEFORE;
    // SAFETY: plain syscall wrapper; fds are valid for the call.
    let r = unsafe { libbpf_sys::bpf_link_create(prog.as_raw_fd(), ifindex as i32, ty, &opts) };
    if r < 0 {
        return Err(io::Error::from_raw_os_error(-r));
    }
    // SAFETY: r is a new link fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// Puts a zeroed per-CPU value of `size` bytes at `key` of `map`, unless one is there (the
/// kernel's numbers so far are kept).
fn insert_zeroed(map: &MapHandle, key: &[u8], size: usize) -> io::Result<()> {
    let zero = vec![vec![0u8; size]; libbpf_rs::num_possible_cpus().map_err(io::Error::other)?];
    match map.update_percpu(key, &zero, MapFlags::NO_EXIST) {
        Err(e) if e.kind() != libbpf_rs::ErrorKind::AlreadyExists => Err(io::Error::other(e)),
        _ => Ok(()),
    }
}

/// The key of `pod_rx`: the pod-side interface's namespace inode and ifindex.
fn pod_side_key(netns: u32, ifindex: u32) -> [u8; 8] {
    (u64::from(netns) << 32 | u64::from(ifindex)).to_ne_bytes()
}

/// Attaches the socket-delivery program to the root of the cgroup2 hierarchy (a
/// link: other programs there, and below, keep running; ours allows every packet).
fn attach_delivery(prog: &libbpf_rs::ProgramMut<'_>) -> Result<Link, String> {
    let root = crate::cgroups::cgroup2_mount().map_err(|e| e.to_string())?;
    let dir = std::fs::File::open(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    prog.attach_cgroup(dir.as_raw_fd())
        .map_err(|e| format!("cgroup_skb/ingress on {}: {e}", root.display()))
}

/// Sums the per-CPU `struct if_bytes[2]` values: [0] pod egress, [1] pod ingress.
fn sum_percpu(cpus: &[Vec<u8>]) -> IfBytes {
    let mut b = IfBytes::default();
    for c in cpus {
        let mut v = [skel::types::if_bytes::default(); 2];
        if plain::copy_from_bytes(&mut v[..], c).is_err() {
            continue;
        }
        b.egress_bytes += v[0].bytes;
        b.egress_packets += v[0].packets;
        b.ingress_bytes += v[1].bytes;
        b.ingress_packets += v[1].packets;
    }
    b
}

/// The generation a drop record was counted under.
fn drop_key_gen(b: &[u8]) -> Option<u16> {
    decode::<skel::types::drop_key>(b).map(|k| k.gen)
}

fn decode_drop_key(b: &[u8]) -> Option<DropKey> {
    let k = decode::<skel::types::drop_key>(b)?;
    let addr = |a: [u8; 16]| -> Option<std::net::IpAddr> {
        let v6 = std::net::Ipv6Addr::from(a);
        match k.proto {
            0x0800 => v6.to_ipv4_mapped().map(std::net::IpAddr::V4),
            0x86DD => Some(std::net::IpAddr::V6(v6)),
            _ => None,
        }
    };
    Some(DropKey {
        cgroup_id: k.cgroup_id,
        netns: k.netns,
        ifindex: k.ifindex,
        reason: k.reason,
        saddr: addr(k.saddr),
        daddr: addr(k.daddr),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_key_layout_matches_the_c_struct() {
        let mut b = vec![0u8; 56];
        b[0..8].copy_from_slice(&42u64.to_ne_bytes());
        b[8..12].copy_from_slice(&4026531840u32.to_ne_bytes());
        b[12..16].copy_from_slice(&7u32.to_ne_bytes());
        b[16..20].copy_from_slice(&64u32.to_ne_bytes());
        b[20..22].copy_from_slice(&0x0800u16.to_ne_bytes());
        b[34] = 0xff;
        b[35] = 0xff;
        b[36..40].copy_from_slice(&[10, 1, 2, 3]);
        b[50] = 0xff;
        b[51] = 0xff;
        b[52..56].copy_from_slice(&[10, 9, 8, 7]);
        let k = decode_drop_key(&b).unwrap();
        assert_eq!(k.cgroup_id, 42);
        assert_eq!(k.netns, 4026531840);
        assert_eq!(k.ifindex, 7);
        assert_eq!(k.reason, 64);
        assert_eq!(k.saddr, Some("10.1.2.3".parse().unwrap()));
        assert_eq!(k.daddr, Some("10.9.8.7".parse().unwrap()));
        assert!(decode_drop_key(&b[..40]).is_none());
    }
}
