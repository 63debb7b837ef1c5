//! `gpufeed-guest selftest`: runs the probes on this node for a while and
//! prints, per probe, the agent's figure beside the kernel's own accounting
//! of the same thing, and their ratio, so an operator can see on their own
//! machine that the numbers hold.
//!
//! | probe | agent | kernel |
//! |---|---|---|
//! | `sched_latency` | run-queue histogram sums of the owners (pods, slices) where no task came or went during the run (the same threads at both ends, and the cgroups' CPU time, `cpu.stat`, all theirs) | `run_delay` (`/proc/<tid>/schedstat`) summed over those threads |
//! | `tcp_retransmit` | retransmitted segments of every owner | `TcpRetransSegs` summed over every network namespace a process lives in |
//! | `tcp_rtt` | mean of the RTT histogram (busy-time weighted) | `ss -ti` srtt every 100 ms, each reading weighted by the busy time (`busy:`) its socket gained since the previous one; a socket that received a segment within an interval and was not busy weighs what the probe gives it (1 ms per interval) |
//! | `tc_bytes` | bytes of every pod, both directions | rx + tx bytes of every veth in this namespace whose peer is in another |
//! | `tc_drops` | tc/qdisc drops | `dropped` of every root qdisc (`tc -s qdisc`) in every namespace |
//!
//! A thread that exits takes its run_delay with it, so run-queue waits are
//! compared only where no thread came or went (the row says over how many
//! owners). Sockets and namespaces that go during the run are in the agent's
//! figures but no longer in the kernel's: on a busy node those ratios sit
//! slightly above 1.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::cgroups::CgroupTree;
use crate::collect::{Collector, Owner};
use crate::pods::classify_cgroup;
use crate::probes::unit::Value;
use crate::probes::{sched, tc, tcp, UnitOptions};

/// The units' options for the selftest: every default, counting pod interfaces only
/// (their veths' counters are the kernel's side of the bytes it compares).
pub fn unit_options() -> UnitOptions {
    let mut options = UnitOptions::defaults();
    tc::pod_interfaces_only(&mut options);
    options
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub probe: &'static str,
    pub unit: &'static str,
    pub agent: f64,
    /// how far the agent's figure may be off because its reads are ticks apart from the
    /// kernel's (half the growth between the ticks around each kernel reading)
    pub spread: f64,
    pub kernel: f64,
    /// what the figures cover, when not everything
    pub over: Option<String>,
}

impl Row {
    pub fn ratio(&self) -> Option<f64> {
        (self.kernel != 0.0).then(|| self.agent / self.kernel)
    }
}

/// An owner's CPU time in µs: its cgroups' (`cpu.stat`, exited tasks included) and its
/// present threads' (schedstat) read just before and just after the cgroups'.
#[derive(Default, Clone, Copy)]
struct Cpu {
    cgroup: u64,
    threads_before: u64,
    threads_after: u64,
}

/// The kernel's figures at one moment.
#[derive(Default)]
struct Kernel {
    /// threads of each owner with their run_delay (ns)
    threads: HashMap<Owner, BTreeSet<(u64, u64)>>,
    /// per owner: CPU time of its cgroups and of its present threads
    cpu: HashMap<Owner, Cpu>,
    /// `TcpRetransSegs` per network namespace (by inode): a namespace made or gone between
    /// the two reads would otherwise add or remove its whole history
    retrans: HashMap<u64, u64>,
    veth_bytes: u64,
    qdisc_drops: u64,
}

/// Runs the collector's probes for `duration`, ticking every `interval`, and
/// returns the report. The collector must be freshly loaded.
pub fn run(
    collector: &mut Collector,
    cgroup_root: &Path,
    duration: Duration,
    interval: Duration,
) -> Vec<Row> {
    // Each kernel reading between two ticks of the agent, at both ends: the agent's figure
    // for the run is taken between the midpoints, and half the ticks' difference is its
    // uncertainty (`Row::spread`), which holds however slowly the machine reads (a busy
    // node, an emulated VM).
    let snapshot = |collector: &mut Collector| {
        let _ = collector.tick();
        let lo = totals(collector);
        let (threads, cpu) = owner_threads(cgroup_root);
        let kernel = Kernel {
            threads,
            cpu,
            ..counters_now()
        };
        let _ = collector.tick();
        let hi = totals(collector);
        (Bracket { lo, hi }, kernel)
    };
    let (ours0, before) = snapshot(collector);
    let started = Instant::now();
    let mut next_tick = started + interval;
    let mut rtt_truth = RttTruth::default();
    // the namespaces of the start: looking them up every 100 ms would cost
    // more than the readings
    let namespaces = namespaces();
    while started.elapsed() < duration {
        rtt_truth.read(&namespaces, interval, Duration::from_millis(100));
        std::thread::sleep(Duration::from_millis(100));
        if Instant::now() >= next_tick {
            let _ = collector.tick();
            next_tick += interval;
        }
    }
    let (ours1, after) = snapshot(collector);
    // owners whose threads are the same at both ends
    let tids = |s: &BTreeSet<(u64, u64)>| s.iter().map(|(t, _)| *t).collect::<Vec<_>>();
    let delay_sum = |s: &BTreeSet<(u64, u64)>| s.iter().map(|(_, d)| *d).sum::<u64>();
    let (mut stable, mut ours_delay, mut delay) = (0, Between::default(), 0u64);
    for (owner, end) in &after.threads {
        let Some(start) = before.threads.get(owner) else {
            continue;
        };
        if end.is_empty() || tids(start) != tids(end) {
            continue;
        }
        // The same threads at both ends, and no CPU time the cgroup counted
        // that they did not: no task came and went in between.
        let cpu = |k: &Kernel| k.cpu.get(owner).copied().unwrap_or_default();
        let (c0, c1) = (cpu(&before), cpu(&after));
        // what the threads ran between the two readings lies between these; the cgroup's
        // own count must too, or a task came and went
        let grew = c1.cgroup.saturating_sub(c0.cgroup);
        let least = c1.threads_before.saturating_sub(c0.threads_after);
        let most = c1.threads_after.saturating_sub(c0.threads_before);
        let slack = 1000 + grew / 1000;
        if grew + slack < least || grew > most + slack {
            continue;
        }
        stable += 1;
        delay += delay_sum(end).saturating_sub(delay_sum(start));
        let of = |t: &Totals| t.sched_by_owner.get(owner).copied().unwrap_or(0);
        ours_delay.add(ours0.map(of), ours1.map(of));
    }
    let ss_mean = rtt_truth.mean();
    let (rtt_ns, rtt_count) = (
        ours1.hi.rtt_ns - ours0.hi.rtt_ns,
        ours1.hi.rtt_count - ours0.hi.rtt_count,
    );
    let counter = |f: fn(&Totals) -> u64| {
        let mut b = Between::default();
        b.add(ours0.map(f), ours1.map(f));
        b
    };
    let (sched_s, retrans, bytes, drops) = (
        ours_delay.scaled(1e-9),
        counter(|t| t.retrans),
        counter(|t| t.bytes),
        counter(|t| t.drops),
    );
    vec![
        Row {
            probe: sched::NAME,
            unit: "s",
            agent: sched_s.0,
            spread: sched_s.1,
            kernel: delay as f64 / 1e9,
            over: Some(format!("{stable} owners whose threads stayed")),
        },
        Row {
            probe: tcp::RETRANS,
            unit: "segments",
            agent: retrans.value(),
            spread: retrans.spread(),
            // over the namespaces that exist at both reads
            kernel: after
                .retrans
                .iter()
                .filter_map(|(ns, n)| Some(n.saturating_sub(*before.retrans.get(ns)?)))
                .sum::<u64>() as f64,
            over: None,
        },
        Row {
            probe: tcp::RTT,
            unit: "ms mean",
            agent: if rtt_count == 0 {
                0.0
            } else {
                rtt_ns as f64 / rtt_count as f64 / 1e6
            },
            spread: 0.0,
            kernel: ss_mean,
            over: None,
        },
        Row {
            probe: "tc_bytes",
            unit: "bytes",
            agent: bytes.value(),
            spread: bytes.spread(),
            kernel: after.veth_bytes.saturating_sub(before.veth_bytes) as f64,
            over: None,
        },
        Row {
            probe: "tc_drops",
            unit: "packets",
            agent: drops.value(),
            spread: drops.spread(),
            kernel: after.qdisc_drops.saturating_sub(before.qdisc_drops) as f64,
            over: None,
        },
    ]
}

/// The agent's totals at the ticks just before and just after a kernel reading.
struct Bracket {
    lo: Totals,
    hi: Totals,
}

impl Bracket {
    fn map(&self, f: impl Fn(&Totals) -> u64) -> (u64, u64) {
        (f(&self.lo), f(&self.hi))
    }
}

/// The agent's growth between two kernel readings: between the midpoints of the ticks that
/// bracket each, with half their differences as the uncertainty.
#[derive(Default)]
struct Between {
    /// doubled, to stay in integers: (lo1 + hi1) - (lo0 + hi0)
    twice: i128,
    /// doubled: (hi1 - lo1) + (hi0 - lo0)
    twice_spread: u128,
}

impl Between {
    fn add(&mut self, start: (u64, u64), end: (u64, u64)) {
        self.twice += (end.0 as i128 + end.1 as i128) - (start.0 as i128 + start.1 as i128);
        self.twice_spread +=
            u128::from(end.1.saturating_sub(end.0)) + u128::from(start.1.saturating_sub(start.0));
    }
    fn value(&self) -> f64 {
        self.twice as f64 / 2.0
    }
    fn spread(&self) -> f64 {
        self.twice_spread as f64 / 2.0
    }
    fn scaled(&self, k: f64) -> (f64, f64) {
        (self.value() * k, self.spread() * k)
    }
}

/// The report as a table.
pub fn render(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<16} {:>18} {:>18} {:>8} {:>14}  unit\n",
        "probe", "agent", "kernel", "ratio", "±"
    );
    for r in rows {
        let ratio = r
            .ratio()
            .map(|x| format!("{x:.3}"))
            .unwrap_or_else(|| "-".into());
        out.push_str(&format!(
            "{:<16} {:>18.3} {:>18.3} {:>8} {:>14.3}  {}{}\n",
            r.probe,
            r.agent,
            r.kernel,
            ratio,
            r.spread,
            r.unit,
            r.over
                .as_deref()
                .map(|o| format!(" (over {o})"))
                .unwrap_or_default()
        ));
    }
    out
}

#[derive(Default)]
struct Totals {
    sched_by_owner: HashMap<Owner, u64>,
    rtt_ns: u64,
    rtt_count: u64,
    retrans: u64,
    bytes: u64,
    drops: u64,
}

/// The agent's cumulative figures, summed over every owner.
fn totals(c: &Collector) -> Totals {
    let mut t = Totals::default();
    let shared = c.store.lock().unwrap_or_else(|e| e.into_inner());
    for (owner, o) in &shared.owners {
        for ((family, _), v) in &o.series {
            match (*family, v) {
                (sched::FAMILY, Value::Hist(h)) => {
                    *t.sched_by_owner.entry(owner.clone()).or_default() += h.sum_ns
                }
                (tcp::RTT_FAMILY, Value::Hist(h)) => {
                    t.rtt_ns += h.sum_ns;
                    t.rtt_count += h.count;
                }
                (tcp::RETRANS_FAMILY, Value::Count(n)) => t.retrans += n,
                (tc::BYTES_FAMILY, Value::Count(n)) => t.bytes += n,
                (tc::DROPS_FAMILY, Value::Count(n)) => t.drops += n,
                _ => {}
            }
        }
    }
    t
}

/// The kernel's counters (without the threads, see `owner_threads`).
fn counters_now() -> Kernel {
    let mut k = Kernel::default();
    let mut netns = HashSet::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return k;
    };
    for p in procs.flatten() {
        let name = p.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u64>().ok()) else {
            continue;
        };
        if let Ok(m) = std::fs::metadata(p.path().join("ns/net")) {
            if netns.insert(m.ino()) {
                let segs = std::fs::read_to_string(p.path().join("net/snmp"))
                    .ok()
                    .and_then(|s| snmp_value(&s, "Tcp:", "RetransSegs"))
                    .unwrap_or(0);
                k.retrans.insert(m.ino(), segs);
                k.qdisc_drops += root_qdisc_drops(&nsenter(pid, &["tc", "-s", "qdisc", "show"]));
            }
        }
    }
    k.veth_bytes = veth_bytes();
    k
}

/// Each owner's threads (cgroup.threads of its cgroups) with their run_delay,
/// and its CPU time as the cgroup counts it and as its present threads do. The threads are
/// read before and after the cgroup's `cpu.stat`, so that the cgroup's figure can be checked
/// against a range that holds however slowly the reads go (a busy or emulated machine).
#[allow(clippy::type_complexity)]
fn owner_threads(root: &Path) -> (HashMap<Owner, BTreeSet<(u64, u64)>>, HashMap<Owner, Cpu>) {
    let mut tree = CgroupTree::new(root.to_path_buf());
    let mut threads: HashMap<Owner, BTreeSet<(u64, u64)>> = HashMap::new();
    let mut cpu: HashMap<Owner, Cpu> = HashMap::new();
    if tree.refresh().is_err() {
        return (threads, cpu);
    }
    // (on-CPU µs, run delay ns) of a thread
    let schedstat = |tid: u64| {
        let stat = std::fs::read_to_string(format!("/proc/{tid}/schedstat")).unwrap_or_default();
        let mut f = stat
            .split_whitespace()
            .map(|v| v.parse::<u64>().unwrap_or(0));
        (f.next().unwrap_or(0) / 1000, f.next().unwrap_or(0))
    };
    for cg in tree.cgroups.values() {
        let owner = Owner::of(classify_cgroup(&cg.path));
        let file = |name: &str| {
            std::fs::read_to_string(format!("/proc/self/fd/{}/{name}", cg.dir.as_raw_fd()))
                .unwrap_or_default()
        };
        let tids: Vec<u64> = file("cgroup.threads")
            .lines()
            .filter_map(|l| l.trim().parse::<u64>().ok())
            .collect();
        let before: u64 = tids.iter().map(|t| schedstat(*t).0).sum();
        let usage_us = file("cpu.stat")
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let set = threads.entry(owner.clone()).or_default();
        let c = cpu.entry(owner).or_default();
        c.cgroup += usage_us;
        c.threads_before += before;
        for tid in tids {
            let (on_cpu, delay) = schedstat(tid);
            c.threads_after += on_cpu;
            set.insert((tid, delay));
        }
    }
    (threads, cpu)
}

/// A counter from /proc/net/snmp's header/value line pairs.
fn snmp_value(text: &str, prefix: &str, field: &str) -> Option<u64> {
    let mut lines = text.lines().filter(|l| l.starts_with(prefix));
    let (names, values) = (lines.next()?, lines.next()?);
    let i = names.split_whitespace().position(|n| n == field)?;
    values.split_whitespace().nth(i)?.parse().ok()
}

/// Sum of `dropped` over root qdiscs (a root's count includes its children's).
fn root_qdisc_drops(text: &str) -> u64 {
    let mut total = 0;
    let mut in_root = false;
    for line in text.lines() {
        if line.starts_with("qdisc ") {
            in_root = line.split_whitespace().any(|w| w == "root");
        } else if in_root {
            if let Some(rest) = line.split("(dropped ").nth(1) {
                total += rest
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
                in_root = false;
            }
        }
    }
    total
}

/// rx + tx bytes of this namespace's veths whose peer lives in another
/// namespace (pods' host sides).
fn veth_bytes() -> u64 {
    let out = run_cmd(&["ip", "-o", "-d", "link", "show", "type", "veth"]);
    out.lines()
        .filter(|l| l.contains("link-netns"))
        .filter_map(|l| {
            let name = l.split(": ").nth(1)?.split('@').next()?;
            Some(
                ["rx_bytes", "tx_bytes"]
                    .iter()
                    .filter_map(|s| {
                        std::fs::read_to_string(format!("/sys/class/net/{name}/statistics/{s}"))
                            .ok()?
                            .trim()
                            .parse::<u64>()
                            .ok()
                    })
                    .sum::<u64>(),
            )
        })
        .sum()
}

/// One process per network namespace (the namespace's inode → a pid in it).
fn namespaces() -> HashMap<u64, u64> {
    let mut out = HashMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u64>().ok()) else {
            continue;
        };
        if let Ok(m) = std::fs::metadata(p.path().join("ns/net")) {
            out.entry(m.ino()).or_insert(pid);
        }
    }
    out
}

/// One socket as `ss -tinH state established` shows it.
#[derive(Debug, Clone, PartialEq)]
struct SsSocket {
    /// Its addresses (the socket's own line).
    id: String,
    rtt_ms: f64,
    /// `busy:`, the kernel's busy time of the socket (absent until it was busy).
    busy_ms: f64,
    /// ms since it last received a segment: data (`lastrcv:`) or an ACK (`lastack:`).
    last_received_ms: f64,
}

/// The kernel's RTT mean weighted as the probe weighs it: every reading of a socket's srtt
/// counts the busy time the socket gained since its previous reading; a socket that received
/// within an interval and was not busy counts what the probe gives it (1 ms per interval).
#[derive(Debug, Default)]
struct RttTruth {
    /// (namespace's pid, socket) → busy ms at the previous reading
    busy: HashMap<(u64, String), f64>,
    sum: f64,
    weight: f64,
}

impl RttTruth {
    fn read(&mut self, namespaces: &HashMap<u64, u64>, interval: Duration, every: Duration) {
        for pid in namespaces.values() {
            let text = nsenter(*pid, &["ss", "-tinH", "state", "established"]);
            self.add(*pid, &parse_ss(&text), interval, every);
        }
    }

    fn add(&mut self, pid: u64, sockets: &[SsSocket], interval: Duration, every: Duration) {
        let idle_weight = every.as_secs_f64() / interval.as_secs_f64();
        for s in sockets {
            let before = self.busy.insert((pid, s.id.clone()), s.busy_ms);
            let gained = before.map_or(0.0, |b| (s.busy_ms - b).max(0.0));
            let w = if gained > 0.0 {
                gained
            } else if s.last_received_ms <= interval.as_millis() as f64 {
                idle_weight
            } else {
                0.0
            };
            self.sum += s.rtt_ms * w;
            self.weight += w;
        }
    }

    fn mean(&self) -> f64 {
        if self.weight > 0.0 {
            self.sum / self.weight
        } else {
            0.0
        }
    }
}

/// The sockets of an `ss -tinH` text: each socket's line, then its info line.
fn parse_ss(text: &str) -> Vec<SsSocket> {
    let field = |l: &str, key: &str| -> Option<f64> {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| {
                v.trim_end_matches("ms")
                    .split('/')
                    .next()?
                    .parse::<f64>()
                    .ok()
            })
    };
    let mut id = String::new();
    let mut out = Vec::new();
    for l in text.lines() {
        let Some(rtt_ms) = field(l, "rtt:") else {
            if !l.starts_with(char::is_whitespace) {
                id = l.split_whitespace().collect::<Vec<_>>().join(" ");
            }
            continue;
        };
        let last_received_ms = ["lastrcv:", "lastack:"]
            .iter()
            .filter_map(|k| field(l, k))
            .fold(f64::INFINITY, f64::min);
        out.push(SsSocket {
            id: id.clone(),
            rtt_ms,
            busy_ms: field(l, "busy:").unwrap_or(0.0),
            last_received_ms,
        });
    }
    out
}

fn nsenter(pid: u64, cmd: &[&str]) -> String {
    let net = format!("--net=/proc/{pid}/ns/net");
    let mut args = vec!["nsenter", net.as_str()];
    args.extend_from_slice(cmd);
    run_cmd(&args)
}

fn run_cmd(args: &[&str]) -> String {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernels_formats() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\nTcp: RtoAlgorithm RtoMin RetransSegs InErrs\nTcp: 1 200 17 0\n";
        assert_eq!(snmp_value(snmp, "Tcp:", "RetransSegs"), Some(17));
        let qdisc = "qdisc tbf 8001: root refcnt 2 rate 10Mbit burst 10Kb lat 1ms\n Sent 100 bytes 2 pkt (dropped 5, overlimits 9 requeues 0)\n backlog 0b 0p requeues 0\nqdisc bfifo 0: parent 8001: limit 10Kb\n Sent 100 bytes 2 pkt (dropped 5, overlimits 0 requeues 0)\nqdisc noqueue 0: dev lo root refcnt 2\n Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0)\n";
        assert_eq!(
            root_qdisc_drops(qdisc),
            5,
            "children are inside the root's count"
        );
        let ss = |busy: u32| {
            format!(
                "0 0 10.0.0.1:5201 10.0.0.2:4000\n\t cubic rtt:10.5/2 lastsnd:10 lastrcv:50 lastack:50 busy:{busy}ms\n\
                 0 0 10.0.0.1:22 10.0.0.3:4001\n\t cubic rtt:1/0.5 lastsnd:9000 lastrcv:9000 lastack:9000\n\
                 0 0 10.0.0.1:4002 10.0.0.3:5201\n\t cubic rtt:3/1 lastsnd:0 lastrcv:9000 lastack:20\n"
            )
        };
        let socks = parse_ss(&ss(400));
        assert_eq!(socks.len(), 3);
        assert_eq!(socks[0].id, "0 0 10.0.0.1:5201 10.0.0.2:4000");
        assert_eq!((socks[0].rtt_ms, socks[0].busy_ms), (10.5, 400.0));
        assert_eq!((socks[1].busy_ms, socks[2].last_received_ms), (0.0, 20.0));
        // weighted as the probe weighs: the busy socket by the busy time it gained, the
        // idle one that received lately by 1 ms per 200 ms interval, the silent one not
        let (interval, every) = (Duration::from_millis(200), Duration::from_millis(100));
        let mut t = RttTruth::default();
        t.add(7, &socks, interval, every);
        t.add(7, &parse_ss(&ss(500)), interval, every);
        // (the busy socket's first reading has no busy time to compare: it weighs as idle)
        let want = (10.5 * (0.5 + 100.0) + 3.0 * 0.5 * 2.0) / (100.5 + 0.5 * 2.0);
        assert!((t.mean() - want).abs() < 1e-9, "{} vs {want}", t.mean());
    }
}
