//! `gpufeed-guest selftest`: runs the probes on this node for a while and
//! prints, per probe, the agent's figure beside the kernel's own accounting
//! of the same thing, and their ratio, so an operator can see on their own
//! machine that the numbers hold.
//!
//! | probe | agent | kernel |
//! |---|---|---|
//! | `sched_latency` | run-queue histogram sums of the owners (pods, slices) where no task came or went during the run (the same threads at both ends, and the cgroups' CPU time, `cpu.stat`, all theirs) | `run_delay` (`/proc/<tid>/schedstat`) summed over those threads |
//! | `tcp_retransmit` | retransmitted segments of every owner | `TcpRetransSegs` summed over every network namespace a process lives in |
//! | `tcp_rtt` | mean of the RTT samples | `ss -ti` srtt every 100 ms of sockets that received a segment within an interval, averaged |
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
use crate::probes::{sched, tc, tcp};

/// One line of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub probe: &'static str,
    pub unit: &'static str,
    pub agent: f64,
    pub kernel: f64,
    /// what the figures cover, when not everything
    pub over: Option<String>,
}

impl Row {
    pub fn ratio(&self) -> Option<f64> {
        (self.kernel != 0.0).then(|| self.agent / self.kernel)
    }
}

/// The kernel's figures at one moment.
#[derive(Default)]
struct Kernel {
    /// threads of each owner with their run_delay (ns)
    threads: HashMap<Owner, BTreeSet<(u64, u64)>>,
    /// per owner: CPU time of its cgroups (cpu.stat, exited tasks included)
    /// and of its present threads (schedstat), both in µs
    cpu: HashMap<Owner, (u64, u64)>,
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
    // Each kernel reading right after a tick of the agent, at both ends, so
    // that what happens while one is read cancels out.
    let snapshot = |collector: &mut Collector| {
        let _ = collector.tick();
        let threads_ours = totals(collector);
        let (threads, cpu) = owner_threads(cgroup_root);
        let _ = collector.tick();
        let ours = totals(collector);
        let kernel = Kernel {
            threads,
            cpu,
            ..counters_now()
        };
        (threads_ours.sched_by_owner, ours, kernel)
    };
    let (sched0, ours0, before) = snapshot(collector);
    let started = Instant::now();
    let mut next_tick = started + interval;
    let mut rtt_readings = Vec::new();
    // the namespaces of the start: looking them up every 100 ms would cost
    // more than the readings
    let namespaces = namespaces();
    while started.elapsed() < duration {
        rtt_readings.extend(ss_rtts(&namespaces, interval));
        std::thread::sleep(Duration::from_millis(100));
        if Instant::now() >= next_tick {
            let _ = collector.tick();
            next_tick += interval;
        }
    }
    let (sched1, ours, after) = snapshot(collector);
    // owners whose threads are the same at both ends
    let tids = |s: &BTreeSet<(u64, u64)>| s.iter().map(|(t, _)| *t).collect::<Vec<_>>();
    let delay_sum = |s: &BTreeSet<(u64, u64)>| s.iter().map(|(_, d)| *d).sum::<u64>();
    let (mut stable, mut ours_delay, mut delay) = (0, 0u64, 0u64);
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
        let ((cg0, th0), (cg1, th1)) = (cpu(&before), cpu(&after));
        let unexplained = (cg1.saturating_sub(cg0)).abs_diff(th1.saturating_sub(th0));
        if unexplained > 1000 + (cg1.saturating_sub(cg0)) / 1000 {
            continue;
        }
        stable += 1;
        delay += delay_sum(end).saturating_sub(delay_sum(start));
        let agent = |t: &HashMap<Owner, u64>| t.get(owner).copied().unwrap_or(0);
        ours_delay += agent(&sched1).saturating_sub(agent(&sched0));
    }
    let ss_mean = if rtt_readings.is_empty() {
        0.0
    } else {
        rtt_readings.iter().sum::<f64>() / rtt_readings.len() as f64
    };
    let rtt_count = ours.rtt_count - ours0.rtt_count;
    vec![
        Row {
            probe: sched::NAME,
            unit: "s",
            agent: ours_delay as f64 / 1e9,
            kernel: delay as f64 / 1e9,
            over: Some(format!("{stable} owners whose threads stayed")),
        },
        Row {
            probe: tcp::RETRANS,
            unit: "segments",
            agent: (ours.retrans - ours0.retrans) as f64,
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
                (ours.rtt_ns - ours0.rtt_ns) as f64 / rtt_count as f64 / 1e6
            },
            kernel: ss_mean,
            over: None,
        },
        Row {
            probe: "tc_bytes",
            unit: "bytes",
            agent: (ours.bytes - ours0.bytes) as f64,
            kernel: after.veth_bytes.saturating_sub(before.veth_bytes) as f64,
            over: None,
        },
        Row {
            probe: "tc_drops",
            unit: "packets",
            agent: (ours.drops - ours0.drops) as f64,
            kernel: after.qdisc_drops.saturating_sub(before.qdisc_drops) as f64,
            over: None,
        },
    ]
}

/// The report as a table.
pub fn render(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<16} {:>18} {:>18} {:>8}  unit\n",
        "probe", "agent", "kernel", "ratio"
    );
    for r in rows {
        let ratio = r
            .ratio()
            .map(|x| format!("{x:.3}"))
            .unwrap_or_else(|| "-".into());
        out.push_str(&format!(
            "{:<16} {:>18.3} {:>18.3} {:>8}  {}{}\n",
            r.probe,
            r.agent,
            r.kernel,
            ratio,
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
    let shared = c.shared.lock().unwrap_or_else(|e| e.into_inner());
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
/// and its CPU time as the cgroup counts it and as its present threads do.
#[allow(clippy::type_complexity)]
fn owner_threads(
    root: &Path,
) -> (
    HashMap<Owner, BTreeSet<(u64, u64)>>,
    HashMap<Owner, (u64, u64)>,
) {
    let mut tree = CgroupTree::new(root.to_path_buf());
    let mut threads: HashMap<Owner, BTreeSet<(u64, u64)>> = HashMap::new();
    let mut cpu: HashMap<Owner, (u64, u64)> = HashMap::new();
    if tree.refresh().is_err() {
        return (threads, cpu);
    }
    for cg in tree.cgroups.values() {
        let owner = Owner::of(classify_cgroup(&cg.path));
        let file = |name: &str| {
            std::fs::read_to_string(format!("/proc/self/fd/{}/{name}", cg.dir.as_raw_fd()))
                .unwrap_or_default()
        };
        let usage_us = file("cpu.stat")
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let set = threads.entry(owner.clone()).or_default();
        let c = cpu.entry(owner).or_default();
        c.0 += usage_us;
        for tid in file("cgroup.threads")
            .lines()
            .filter_map(|l| l.trim().parse::<u64>().ok())
        {
            let stat =
                std::fs::read_to_string(format!("/proc/{tid}/schedstat")).unwrap_or_default();
            let mut f = stat
                .split_whitespace()
                .map(|v| v.parse::<u64>().unwrap_or(0));
            let (on_cpu, delay) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
            c.1 += on_cpu / 1000;
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

/// srtt (ms) of every established socket in the given namespaces that
/// received within `interval` (the sockets the probe takes a sample of).
fn ss_rtts(namespaces: &HashMap<u64, u64>, interval: Duration) -> Vec<f64> {
    namespaces
        .values()
        .flat_map(|pid| {
            parse_ss(
                &nsenter(*pid, &["ss", "-tinH", "state", "established"]),
                interval,
            )
        })
        .collect()
}

/// `rtt:` of sockets that received a segment (`lastrcv:` data, `lastack:` an
/// ACK) within `interval` (ss prints a socket's line and its info line; -H
/// drops the header).
fn parse_ss(text: &str, interval: Duration) -> Vec<f64> {
    let field = |l: &str, key: &str| -> Option<f64> {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.split('/').next()?.parse::<f64>().ok())
    };
    text.lines()
        .filter_map(|l| {
            let rtt = field(l, "rtt:")?;
            // the probe samples on any received segment: data (lastrcv) or ACK (lastack)
            let last = ["lastrcv:", "lastack:"]
                .iter()
                .filter_map(|k| field(l, k))
                .fold(f64::INFINITY, f64::min);
            (last <= interval.as_millis() as f64).then_some(rtt)
        })
        .collect()
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
        let ss = "ESTAB 0 0 10.0.0.1:5201 10.0.0.2:4000\n\t cubic rtt:10.5/2 lastsnd:10 lastrcv:50 lastack:50\nESTAB 0 0 10.0.0.1:22 10.0.0.3:4001\n\t cubic rtt:1/0.5 lastsnd:9000 lastrcv:9000 lastack:9000\nESTAB 0 0 10.0.0.1:4002 10.0.0.3:5201\n\t cubic rtt:3/1 lastsnd:0 lastrcv:9000 lastack:20\n";
        assert_eq!(parse_ss(ss, Duration::from_millis(200)), [10.5, 3.0]);
    }
}
