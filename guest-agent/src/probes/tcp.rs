//! TCP smoothed RTT and retransmitted segments per socket-owner cgroup and
//! destination class (`bpf/tcp.bpf.c`).

pub(crate) mod skel {
    include!(concat!(env!("OUT_DIR"), "/tcp.skel.rs"));
}

use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle};

use super::cgroup_storage::{self, Storage};
use super::hist::{Hist, HIST_BYTES};
use super::options::OptionsSpec;
use super::per_cgroup::{CgroupReads, CgroupSeries, PerCgroup, Prepared};
use super::signal::{SignalKind, SignalSpec};
use super::status::ProbeStatus;
use super::unit::{
    self, Delta, FamilySpec, Kind, Labels, LoadContext, Loaded, MapFill, Probe, Scope, UnitSpec,
    UnitStats, Value,
};
use crate::dst::{DstTable, MAX_DST};
use crate::ebpf::{decode, err, handle, percpu_sum, set_max_entries, KernelBtf, ProbeError};

pub const RTT: &str = "tcp_rtt";
pub const RETRANS: &str = "tcp_retransmit";
const OBJ: &str = "tcp";
pub const RTT_FAMILY: &str = "ebpf_tcp_rtt_microseconds";
pub const RETRANS_FAMILY: &str = "ebpf_tcp_retransmissions_total";

// SAFETY: generated #[repr(C)] structs of integers: every bit pattern is valid.
unsafe impl plain::Plain for skel::types::tcp_cgroup {}
unsafe impl plain::Plain for skel::types::dst_key {}
const _: () = assert!(std::mem::size_of::<skel::types::hist>() == HIST_BYTES);
// the LPM key dst.rs builds: u32 prefix length, 16 address bytes, no padding
const _: () = assert!(std::mem::size_of::<skel::types::dst_key>() == 20);

pub const UNIT: UnitSpec = UnitSpec {
    names: &[RTT, RETRANS],
    reports: &[RTT, RETRANS],
    options: OptionsSpec::of::<Flags, Options>(),
    load: load_unit,
};

/// The unit's part of the command line.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "tcp options")]
pub struct Flags {
    /// Named destination networks for the `dst` label: NAME=CIDR[,CIDR...]; repeatable.
    /// Default: loopback, private, link-local, internet.
    #[arg(long = "dst", value_name = "NAME=CIDRS")]
    pub dst: Vec<String>,
}

/// The unit's options: the destination classes `--dst` names.
#[derive(Debug, Clone)]
pub struct Options {
    pub dst: DstTable,
}

impl TryFrom<Flags> for Options {
    type Error = String;

    fn try_from(f: Flags) -> Result<Options, String> {
        let dst = if f.dst.is_empty() {
            DstTable::defaults()
        } else {
            DstTable::parse(f.dst.iter().map(String::as_str)).map_err(|e| format!("--dst: {e}"))?
        };
        Ok(Options { dst })
    }
}

/// What loading takes: the named destinations (`--dst`) and the agent's
/// tick (`--interval`), which is also the shortest time
/// between two RTT samples of one socket (each weighted by the socket's busy
/// time since the previous: see `bpf/tcp.bpf.c`).
#[derive(Debug, Clone)]
pub struct Config {
    pub dst: DstTable,
    pub rtt_every: std::time::Duration,
}

static FAMILIES: [FamilySpec; 2] = [
    FamilySpec {
        name: RTT_FAMILY,
        help: "TCP smoothed RTT of the socket owner's connections, weighted by their busy time: one observation per millisecond a socket had data queued or in flight (at least one per socket sampled), each socket sampled at most once per interval",
        kind: Kind::Histogram,
        scope: Scope::Container,
        pod_labels: false,
    },
    FamilySpec {
        name: RETRANS_FAMILY,
        help: "TCP segments retransmitted (as counted by TcpRetransSegs), by socket owner",
        kind: Kind::Counter,
        scope: Scope::Container,
        pod_labels: false,
    },
];

fn load_unit(ctx: &LoadContext<'_>, names: &[&'static str]) -> Result<Loaded, ProbeError> {
    let config = Config {
        dst: ctx.options.get::<Options>().dst.clone(),
        rtt_every: ctx.interval,
    };
    let (p, statuses) = TcpProbe::load(ctx.btf, &config)?;
    Ok(Loaded {
        unit: p.map(|p| Box::new(p) as Box<dyn Probe>),
        statuses: statuses
            .into_iter()
            .filter(|s| names.contains(&s.name))
            .collect(),
    })
}

/// One cgroup's TCP aggregates, indexed by destination class.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TcpCgroup {
    pub rtt: Vec<Hist>,
    pub retrans_segs: Vec<u64>,
}

impl TcpCgroup {
    /// Decodes a `struct tcp_cgroup` (storage or drained value).
    fn decode(bytes: &[u8]) -> Option<TcpCgroup> {
        decode::<skel::types::tcp_cgroup>(bytes).map(|v| TcpCgroup::from_skel(&v))
    }

    fn from_skel(v: &skel::types::tcp_cgroup) -> TcpCgroup {
        // typed: fails to compile if the kernel's TCP_MAX_DST differs from MAX_DST
        let rtt: &[skel::types::hist; MAX_DST] = &v.rtt;
        let retrans: &[u64; MAX_DST] = &v.retrans_segs;
        TcpCgroup {
            rtt: rtt
                .iter()
                .map(|h| Hist::from_parts(&h.buckets, h.sum_ns))
                .collect(),
            retrans_segs: retrans.to_vec(),
        }
    }

    /// `self - earlier` per destination; a destination whose counters went
    /// backwards (new storage) counts its whole current value.
    fn delta_since(&self, earlier: &TcpCgroup) -> TcpCgroup {
        TcpCgroup {
            rtt: self
                .rtt
                .iter()
                .zip(&earlier.rtt)
                .map(|(now, prev)| now.delta_since(prev))
                .collect(),
            retrans_segs: self
                .retrans_segs
                .iter()
                .zip(&earlier.retrans_segs)
                .map(|(&now, &prev)| if now >= prev { now - prev } else { now })
                .collect(),
        }
    }
}

/// Which of the object's hooks this kernel has.
#[derive(Clone, Copy)]
struct Hooks {
    rtt: bool,
    retrans: bool,
    synack: bool,
    rmdir: bool,
}

pub struct TcpProbe {
    stats: PerCgroup<PerDestination>,
    lost: MapHandle,
    _links: Vec<Link>,
    /// prefixes in `dst_cidrs` (also its size)
    dst_entries: usize,
}

impl TcpProbe {
    /// Loads the object with whichever of its two hooks the kernel has; the
    /// The value of the cgroup whose directory `cgroup_dir` is, if it has one.
    pub fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<TcpCgroup> {
        self.stats.value_by_dir(cgroup_dir)
    }

    /// statuses say which are up. `Ok((None, ..))` when neither is.
    pub fn load(
        btf: &KernelBtf,
        config: &Config,
    ) -> Result<(Option<TcpProbe>, Vec<ProbeStatus>), ProbeError> {
        let has_rtt = btf.has_tracepoint("tcp_probe");
        let has_retrans =
            btf.has_tracepoint("tcp_retransmit_skb") && btf.has_tracepoint("tcp_destroy_sock");
        // optional: SYN-ACK retransmits of listeners
        let has_synack = has_retrans && btf.has_tracepoint("tcp_retransmit_synack");
        let status = |name, up: bool, hook: &str| {
            if up {
                ProbeStatus::up(name)
            } else {
                ProbeStatus::down(name, format!("kernel has no BTF tracepoint {hook}"))
            }
        };
        let statuses = vec![
            status(RTT, has_rtt, "tcp_probe"),
            status(RETRANS, has_retrans, "tcp_retransmit_skb/tcp_destroy_sock"),
        ];
        if !has_rtt && !has_retrans {
            return Ok((None, statuses));
        }
        let hooks = Hooks {
            rtt: has_rtt,
            retrans: has_retrans,
            synack: has_synack,
            rmdir: btf.has_tracepoint("cgroup_rmdir"),
        };
        let chosen =
            cgroup_storage::load_first(OBJ, |storage| TcpProbe::load_with(config, hooks, storage))?;
        let probe = chosen.loaded;
        let how = |st: ProbeStatus, hook: &str| {
            if !st.up {
                return st;
            }
            let mut with = unit::status_of(
                st.name,
                hook,
                probe.stats.storage(),
                probe.stats.batched(),
                chosen.fell_back.clone(),
            );
            with.reason = st.reason;
            with
        };
        let mut statuses = statuses.into_iter();
        let statuses = vec![
            how(statuses.next().expect("rtt status"), "tp_btf/tcp_probe"),
            how(
                statuses.next().expect("retransmit status"),
                "tp_btf/tcp_retransmit_skb,tcp_destroy_sock",
            ),
        ];
        Ok((Some(probe), statuses))
    }

    fn load_with(config: &Config, hooks: Hooks, storage: Storage) -> Result<TcpProbe, ProbeError> {
        let dst = &config.dst;
        let Hooks {
            rtt: has_rtt,
            retrans: has_retrans,
            synack: has_synack,
            rmdir: has_rmdir,
        } = hooks;
        let mut mem = MaybeUninit::uninit();
        let mut open = skel::TcpSkelBuilder::default()
            .open(&mut mem)
            .map_err(err(OBJ, "open"))?;
        let stats = Prepared::new(OBJ, "tcp_stats", storage, has_rmdir, open.open_object_mut())?;
        open.progs.tcp_probe.set_autoload(has_rtt);
        open.progs.tcp_retransmit_skb.set_autoload(has_retrans);
        open.progs.tcp_destroy_sock.set_autoload(has_retrans);
        open.progs.tcp_retransmit_synack.set_autoload(has_synack);
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.cgroup_storage_by_id = storage.by_id();
            ro.rtt_every_ns = config.rtt_every.as_nanos().min(u64::MAX as u128) as u64;
        }
        let lpm = dst.lpm_entries();
        // exactly the prefixes --dst names (an LPM trie needs at least one slot)
        set_max_entries(OBJ, &mut open.maps.dst_cidrs, lpm.len().max(1) as u32)?;
        let skel = crate::ebpf::object::load(OBJ, open)?;
        // The table before the hooks: a socket is classified once, at its
        // first segment, and keeps that class for its lifetime, so one seen
        // before the table was filled would stay `other`.
        let lpm_len = lpm.len();
        for (key, idx) in lpm {
            skel.maps
                .dst_cidrs
                .update(&key, &idx.to_ne_bytes(), MapFlags::ANY)
                .map_err(err(OBJ, "filling dst_cidrs"))?;
        }
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
        Ok(TcpProbe {
            stats: stats.reader(skel.object(), PerDestination(dst.clone()))?,
            lost: handle(OBJ, &skel.maps.tcp_lost)?,
            _links: links,
            dst_entries: lpm_len,
        })
    }
}

/// A cgroup's RTT and retransmits per destination class of `--dst`.
struct PerDestination(DstTable);

impl CgroupSeries for PerDestination {
    type Value = TcpCgroup;

    fn decode(bytes: &[u8]) -> Option<TcpCgroup> {
        TcpCgroup::decode(bytes)
    }

    fn delta(now: &TcpCgroup, prev: &TcpCgroup) -> TcpCgroup {
        now.delta_since(prev)
    }

    fn deltas(&mut self, _id: u64, _now: &TcpCgroup, d: TcpCgroup, out: &mut Vec<Delta>) {
        let dst = &self.0;
        for (i, (rtt, &retrans)) in d.rtt.into_iter().zip(&d.retrans_segs).enumerate() {
            // A socket owner with traffic to a destination gets both series,
            // so a clean pod reads 0 retransmits rather than nothing.
            if rtt.is_empty() && retrans == 0 {
                continue;
            }
            let labels = Labels::from([("dst", dst.name(i).to_string())]);
            if !rtt.is_empty() {
                out.push(Delta {
                    family: RTT_FAMILY,
                    labels: labels.clone(),
                    value: Value::Hist(rtt),
                });
            }
            out.push(Delta {
                family: RETRANS_FAMILY,
                labels,
                value: Value::Count(retrans),
            });
        }
    }
}

impl Probe for TcpProbe {
    fn families(&self) -> &'static [FamilySpec] {
        &FAMILIES
    }

    fn signals(&self) -> Vec<SignalSpec> {
        vec![
            SignalSpec {
                name: "tcp_rtt",
                family: RTT_FAMILY,
                kind: SignalKind::Latency,
            },
            SignalSpec {
                name: "tcp_retransmit_rate",
                family: RETRANS_FAMILY,
                kind: SignalKind::Rate,
            },
        ]
    }

    fn cgroup_reads(&mut self) -> Option<&mut dyn CgroupReads> {
        Some(&mut self.stats)
    }

    fn stats(&self) -> UnitStats {
        UnitStats {
            maps: vec![
                self.stats.map_fill(),
                MapFill {
                    map: "dst_cidrs",
                    entries: self.dst_entries,
                    capacity: Some(self.dst_entries.max(1) as u32),
                },
            ],
            // events dropped because cgroup storage was unavailable
            storage_failures: Some((OBJ, percpu_sum(&self.lost, 0))),
            series: Vec::new(),
            node: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dst_keys_fit_the_kernel_key_type() {
        let t = DstTable::parse(["cluster=10.42.0.0/16,fd00::/8"]).unwrap();
        let keys = t.lpm_entries();
        let k = decode::<skel::types::dst_key>(&keys[0].0).unwrap();
        assert_eq!(k.prefixlen, 16 + 96);
        assert_eq!(
            k.addr,
            "::ffff:10.42.0.0"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
        );
        let k = decode::<skel::types::dst_key>(&keys[1].0).unwrap();
        assert_eq!(k.prefixlen, 8);
        assert_eq!(k.addr[0], 0xfd);
    }

    #[test]
    fn deltas_per_destination_survive_a_storage_reset() {
        let mut before = TcpCgroup {
            rtt: vec![Hist::default(); MAX_DST],
            retrans_segs: vec![0; MAX_DST],
        };
        before.retrans_segs[2] = 10;
        before.rtt[2].buckets[5] = 4;
        before.rtt[2].count = 4;
        let mut now = before.clone();
        now.retrans_segs[2] = 13;
        now.retrans_segs[3] = 1;
        now.rtt[2].buckets[5] = 6;
        now.rtt[2].count = 6;
        let d = now.delta_since(&before);
        assert_eq!(d.retrans_segs[2], 3);
        assert_eq!(d.retrans_segs[3], 1);
        assert_eq!(d.rtt[2].count, 2);
        // new storage (the counter went backwards): the whole value is the delta
        let d = before.delta_since(&now);
        assert_eq!(d.retrans_segs[2], 10);
    }
}
