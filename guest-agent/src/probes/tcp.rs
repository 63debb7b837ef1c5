//! TCP smoothed RTT and retransmitted segments per socket-owner cgroup and
//! destination class (`bpf/tcp.bpf.c`).

mod skel {
    include!(concat!(env!("OUT_DIR"), "/tcp.skel.rs"));
}

use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle};

use super::hist::{Hist, HIST_BYTES};
use super::{err, handle, lookup_cgroup, percpu_sum, KernelBtf, ProbeError, ProbeStatus};
use crate::dst::{DstTable, MAX_DST};

pub const RTT: &str = "tcp_rtt";
pub const RETRANS: &str = "tcp_retransmit";
const OBJ: &str = "tcp";

/// One cgroup's TCP aggregates, indexed by destination class.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TcpCgroup {
    pub rtt: Vec<Hist>,
    pub retrans_segs: Vec<u64>,
}

impl TcpCgroup {
    pub fn from_bytes(b: &[u8]) -> Option<TcpCgroup> {
        let hists = MAX_DST * HIST_BYTES;
        if b.len() < hists + MAX_DST * 8 {
            return None;
        }
        let rtt = (0..MAX_DST)
            .map(|i| Hist::from_bytes(&b[i * HIST_BYTES..]))
            .collect::<Option<Vec<_>>>()?;
        let retrans_segs = b[hists..hists + MAX_DST * 8]
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        Some(TcpCgroup { rtt, retrans_segs })
    }
}

pub struct TcpProbe {
    stats: MapHandle,
    lost: MapHandle,
    _links: Vec<Link>,
}

impl TcpProbe {
    /// Loads the object with whichever of its two hooks the kernel has; the
    /// statuses say which are up. `Ok((None, ..))` when neither is.
    pub fn load(
        btf: &KernelBtf,
        dst: &DstTable,
    ) -> Result<(Option<TcpProbe>, Vec<ProbeStatus>), ProbeError> {
        let has_rtt = btf.has_tracepoint("tcp_probe");
        let has_retrans =
            btf.has_tracepoint("tcp_retransmit_skb") && btf.has_tracepoint("tcp_destroy_sock");
        // optional: SYN-ACK retransmits of listeners
        let has_synack = has_retrans && btf.has_tracepoint("tcp_retransmit_synack");
        let missing = |name, hook: &str| ProbeStatus {
            name,
            up: false,
            reason: Some(format!("kernel has no BTF tracepoint {hook}")),
        };
        let statuses = vec![
            if has_rtt {
                ProbeStatus {
                    name: RTT,
                    up: true,
                    reason: None,
                }
            } else {
                missing(RTT, "tcp_probe")
            },
            if has_retrans {
                ProbeStatus {
                    name: RETRANS,
                    up: true,
                    reason: None,
                }
            } else {
                missing(RETRANS, "tcp_retransmit_skb/tcp_destroy_sock")
            },
        ];
        if !has_rtt && !has_retrans {
            return Ok((None, statuses));
        }
        let mut storage = MaybeUninit::uninit();
        let mut open = skel::TcpSkelBuilder::default()
            .open(&mut storage)
            .map_err(err(OBJ, "open"))?;
        open.progs.tcp_probe.set_autoload(has_rtt);
        open.progs.tcp_retransmit_skb.set_autoload(has_retrans);
        open.progs.tcp_destroy_sock.set_autoload(has_retrans);
        open.progs.tcp_retransmit_synack.set_autoload(has_synack);
        let skel = open.load().map_err(err(OBJ, "load"))?;
        let mut links = Vec::new();
        if has_rtt {
            links.push(
                skel.progs
                    .tcp_probe
                    .attach()
                    .map_err(err(RTT, "attach tcp_probe"))?,
            );
        }
        if has_retrans {
            links.push(
                skel.progs
                    .tcp_retransmit_skb
                    .attach()
                    .map_err(err(RETRANS, "attach tcp_retransmit_skb"))?,
            );
            links.push(
                skel.progs
                    .tcp_destroy_sock
                    .attach()
                    .map_err(err(RETRANS, "attach tcp_destroy_sock"))?,
            );
        }
        if has_synack {
            links.push(
                skel.progs
                    .tcp_retransmit_synack
                    .attach()
                    .map_err(err(RETRANS, "attach tcp_retransmit_synack"))?,
            );
        }
        for (key, idx) in dst.lpm_entries() {
            skel.maps
                .dst_cidrs
                .update(&key, &idx.to_ne_bytes(), MapFlags::ANY)
                .map_err(err(OBJ, "filling dst_cidrs"))?;
        }
        Ok((
            Some(TcpProbe {
                stats: handle(OBJ, &skel.maps.tcp_stats)?,
                lost: handle(OBJ, &skel.maps.tcp_lost)?,
                _links: links,
            }),
            statuses,
        ))
    }

    /// Events dropped because cgroup storage was unavailable.
    pub fn lost(&self) -> u64 {
        percpu_sum(&self.lost, 0)
    }

    pub fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<TcpCgroup> {
        lookup_cgroup(&self.stats, cgroup_dir)
            .ok()
            .flatten()
            .and_then(|b| TcpCgroup::from_bytes(&b))
    }
}
