//! The guest agent on the datapaths this project's CI kernel is built without (no netkit, no
//! `sch_fq`), in a VM on Debian trixie's own kernel (6.12, which has both), following
//! `lab/scenarios/guest-datapaths.sh`:
//!
//! * netkit pairs in L3 and L2 mode, a CNI's programs in netkit's hooks on each primary (as
//!   Cilium attaches its own): the agent finds them by link kind and counts each pod's bytes
//!   both ways within 2% of the pod-side interface's own counters, read in the pod's
//!   namespace; the CNI's programs, after the agent's, still see every packet the interface
//!   counts;
//! * a netkit pod routed as Cilium's host routing does (`bpf_redirect_neigh` from the peer
//!   hook to the node device, which the primary then never receives) and shaped there by
//!   EDT with fq (Cilium's bandwidth manager): a TCP upload's bytes by the agent's
//!   `ebpf_tc_bytes_total` are the pod side's own count within 2% (from the quiet before it
//!   to the quiet after it), and the pod is held to the set rate (at most 5% over; an emulated VM on a busy
//!   host sends below it, its timers late); with fq's horizon at 50 ms a UDP
//!   upload at twice the rate is dropped there, and the pod's `ebpf_tc_dropped_packets_total`
//!   equals the qdisc's own count;
//! * the doctor's `datapath` check names netkit and `EDT/fq: on node0`;
//! * a netkit pair the wrong way round (its primary in the pod's namespace) is one logged,
//!   counted refusal and no bytes for anyone; a pod whose namespace goes away takes its
//!   pair along, and the agent goes on.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use gpufeed_lab::{KernelName, Payload, Variant, Vm, VmSpec};

/// `name{a="x",b="y"} v` → (name, labels, v).
fn series(line: &str) -> Option<(String, BTreeMap<String, String>, f64)> {
    let (head, value) = line.rsplit_once(' ')?;
    let (name, labels) = match head.split_once('{') {
        Some((n, rest)) => (n, rest.strip_suffix('}')?),
        None => (head, ""),
    };
    let mut out = BTreeMap::new();
    for pair in labels.split("\",").filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once("=\"")?;
        out.insert(k.to_string(), v.trim_end_matches('"').to_string());
    }
    Some((name.to_string(), out, value.parse().ok()?))
}

/// What the VM reported, by phase where it is a snapshot.
#[derive(Debug, Default)]
struct Run {
    /// pod name → uid
    pods: BTreeMap<String, String>,
    /// (phase, pod) → [tx_bytes, rx_bytes, tx_packets, rx_packets] of the pod side
    iface: BTreeMap<(String, String), [f64; 4]>,
    /// (phase, pod) → seconds since boot when `iface` was read
    iface_at: BTreeMap<(String, String), f64>,
    /// (phase, pod, hook) → (packets, bytes) the CNI's program saw
    cni: BTreeMap<(String, String, String), (f64, f64)>,
    /// phase → metric lines
    metrics: BTreeMap<String, Vec<String>>,
    /// phase → `tc -s qdisc` lines of node0
    qdisc: BTreeMap<String, Vec<String>>,
    /// phase → seconds since boot
    clock: BTreeMap<String, f64>,
    /// phase → the netkit primary's rx_bytes of the redirected pod
    host_rx: BTreeMap<String, f64>,
    other: BTreeMap<String, Vec<String>>,
}

fn parse(lines: &[gpufeed_lab::port::Line]) -> Run {
    let mut r = Run::default();
    for l in lines {
        let w: Vec<&str> = l.value.split_whitespace().collect();
        let num = |i: usize| w.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(-1.0);
        let s = |i: usize| w.get(i).map(|v| v.to_string()).unwrap_or_default();
        match l.key.as_str() {
            "pod" => {
                r.pods.insert(s(0), s(1));
            }
            "iface" => {
                r.iface
                    .insert((s(0), s(1)), [num(2), num(3), num(4), num(5)]);
                r.iface_at.insert((s(0), s(1)), num(6));
            }
            "cni" => {
                r.cni.insert((s(0), s(1), s(2)), (num(3), num(4)));
            }
            "metric" | "qdisc" => {
                let rest = l.value.split_once(' ').map_or("", |x| x.1).to_string();
                let m = if l.key == "metric" {
                    &mut r.metrics
                } else {
                    &mut r.qdisc
                };
                m.entry(s(0)).or_default().push(rest);
            }
            "clock" => {
                r.clock.insert(s(0), num(1));
            }
            "host_rx" => {
                r.host_rx.insert(s(0), num(1));
            }
            k => r
                .other
                .entry(k.to_string())
                .or_default()
                .push(l.value.clone()),
        }
    }
    r
}

impl Run {
    fn one(&self, key: &str) -> String {
        self.other
            .get(key)
            .and_then(|v| v.last())
            .cloned()
            .unwrap_or_default()
    }

    /// The sum of `family`'s series of pod `name` in `phase` whose labels include `want`.
    fn agent(&self, phase: &str, family: &str, name: &str, want: &[(&str, &str)]) -> f64 {
        let uid = self.pods.get(name).cloned().unwrap_or_default();
        self.metrics
            .get(phase)
            .into_iter()
            .flatten()
            .filter_map(|l| series(l))
            .filter(|(n, labels, _)| {
                n == family
                    && labels.get("pod").is_some_and(|p| *p == uid)
                    && want
                        .iter()
                        .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, v)| v)
            .sum()
    }

    /// What the pod side's counter `i` ([tx_bytes, rx_bytes, tx_packets, rx_packets]) of `pod`
    /// grew by from snapshot `from` to `to`, and the seconds between the two reads; -1 and 0
    /// when either read is missing.
    fn grown(&self, pod: &str, from: &str, to: &str, i: usize) -> (f64, f64) {
        let key = |phase: &str| (phase.to_string(), pod.to_string());
        let read = |phase: &str| {
            self.iface
                .get(&key(phase))
                .zip(self.iface_at.get(&key(phase)))
        };
        match (read(to), read(from)) {
            (Some((a, ta)), Some((b, tb))) => (a[i] - b[i], ta - tb),
            _ => (-1.0, 0.0),
        }
    }

    /// A number that follows `word` in node0's `tc -s qdisc` in `phase`.
    fn qdisc(&self, phase: &str, word: &str) -> f64 {
        let text = self
            .qdisc
            .get(phase)
            .map(|l| l.join(" "))
            .unwrap_or_default();
        let words: Vec<&str> = text.split_whitespace().collect();
        words
            .windows(2)
            .find(|w| w[0].trim_start_matches('(') == word)
            .and_then(|w| w[1].trim_end_matches(',').parse().ok())
            .unwrap_or(-1.0)
    }
}

/// `|ours - truth| <= tol * truth`, with the figures for the message.
fn within(what: &str, ours: f64, truth: f64, tol: f64, p: &mut Vec<String>) {
    let off = if truth > 0.0 {
        (ours - truth) / truth
    } else {
        f64::INFINITY
    };
    eprintln!(
        "lab: {what}: agent {ours:.0} vs {truth:.0} ({:+.3}%)",
        off * 100.0
    );
    if truth <= 0.0 || off.abs() > tol {
        p.push(format!(
            "{what}: agent {ours} vs {truth} ({:+.3}%, allowed ±{}%)",
            off * 100.0,
            tol * 100.0
        ));
    }
}

/// What these datapaths must show, against the independent counters.
fn problems(r: &Run) -> Vec<String> {
    let mut p = Vec::new();
    if r.one("interfaces") != "3" || r.one("netkit_interfaces") != "3" {
        p.push(format!(
            "the agent counts {} pod interfaces ({} netkit), wanted the 3 netkit pods",
            r.one("interfaces"),
            r.one("netkit_interfaces")
        ));
    }
    let delta = |pod: &str, i: usize| r.grown(pod, "before", "after", i).0;
    for pod in ["nkl3", "nkl2"] {
        for (dir, i) in [("egress", 0), ("ingress", 1)] {
            let ours = r.agent("after", "ebpf_tc_bytes_total", pod, &[("direction", dir)])
                - r.agent("before", "ebpf_tc_bytes_total", pod, &[("direction", dir)]);
            within(
                &format!("{pod} {dir} bytes vs its eth0's"),
                ours,
                delta(pod, i),
                0.02,
                &mut p,
            );
        }
        // the CNI's programs run after ours and see every packet the interface counts
        for (hook, i) in [("peer", 2), ("primary", 3)] {
            let seen = |phase: &str| {
                r.cni
                    .get(&(phase.into(), pod.into(), hook.into()))
                    .map_or(-1.0, |v| v.0)
            };
            let (cni, iface) = (seen("after") - seen("before"), delta(pod, i));
            eprintln!("lab: {pod} CNI {hook} hook saw {cni} packets, eth0 counted {iface}");
            if cni != iface || cni <= 0.0 {
                p.push(format!(
                    "{pod}: the CNI's {hook} program saw {cni} packets, its eth0 counted {iface}"
                ));
            }
        }
    }

    // EDT: the agent counts what the shaped pod sent, and that is held to the set rate
    let rate = 500_000.0;
    let egress = |phase: &str| {
        r.agent(
            phase,
            "ebpf_tc_bytes_total",
            "nkedt",
            &[("direction", "egress")],
        )
    };
    // the whole upload, between quiet snapshots (before it and after it drained): the
    // agent's bytes against the pod side's own counter
    let agent_bytes = egress("edt_done") - egress("after");
    let (sent, _) = r.grown("nkedt", "after", "edt_done", 0);
    within(
        "nkedt egress bytes of the upload under EDT vs its eth0's",
        agent_bytes,
        sent,
        0.02,
        &mut p,
    );
    // the rate over the window in the upload's middle, by the pod side's counter timed at
    // its reads (the agent's /metrics serves its last tick, up to 200 ms behind)
    let (moved, secs) = r.grown("nkedt", "edt_start", "edt_end", 0);
    let wire = moved / secs.max(1e-9);
    eprintln!(
        "lab: nkedt under EDT: eth0 {wire:.0} bytes/s over {secs:.1} s (the agent {:.0}), the \
         set rate {rate:.0}",
        (egress("edt_end") - egress("edt_start")) / secs.max(1e-9)
    );
    let iperf = r.other.get("iperf_edt").cloned().unwrap_or_default();
    // the bandwidth manager holds the pod to the rate: never above it. Below it, the emulated
    // VM's late timers lose departure slots: the same scenario read the rate within 5% in
    // some runs and 8% to 89% under in others on a 2-core TCG host, so the floor only says
    // the upload ran
    if !(0.05 * rate..=1.05 * rate).contains(&wire) {
        p.push(format!(
            "nkedt under EDT: the pod sent {wire:.0} bytes/s over {secs:.1} s, the set rate is \
             {rate:.0} (allowed up to 5% over; iperf3: {iperf:?})"
        ));
    }
    // the redirect held: the primary received (next to) nothing of the upload
    let host_rx =
        r.host_rx.get("edt_end").unwrap_or(&-1.0) - r.host_rx.get("edt_start").unwrap_or(&0.0);
    eprintln!("lab: nk5 (the redirected pod's primary) received {host_rx} bytes during the upload");
    if !(0.0..100_000.0).contains(&host_rx) {
        p.push(format!(
            "the redirected pod's primary received {host_rx} bytes during the upload: the \
             CNI's redirect did not hold"
        ));
    }

    // fq's horizon drops, the pod's and the qdisc's
    let drops = r.agent("drops_after", "ebpf_tc_dropped_packets_total", "nkedt", &[])
        - r.agent(
            "drops_before",
            "ebpf_tc_dropped_packets_total",
            "nkedt",
            &[],
        );
    let (qdropped, horizon) = (
        r.qdisc("drops_after", "dropped") - r.qdisc("drops_before", "dropped"),
        r.qdisc("drops_after", "horizon_drops") - r.qdisc("drops_before", "horizon_drops"),
    );
    let reasons: Vec<String> = r
        .metrics
        .get("drops_after")
        .into_iter()
        .flatten()
        .filter(|l| l.starts_with("ebpf_tc_dropped_packets_total"))
        .cloned()
        .collect();
    eprintln!(
        "lab: fq dropped {qdropped} ({horizon} beyond its horizon); the agent: {drops} for the \
         pod ({reasons:?})"
    );
    if horizon <= 0.0 || drops != qdropped {
        p.push(format!(
            "fq dropped {qdropped} packets ({horizon} beyond its horizon), the agent counted \
             {drops} for the pod: {reasons:?}\nqdisc: {:?}",
            r.qdisc.get("drops_after")
        ));
    }

    let doctor = r
        .other
        .get("doctor")
        .cloned()
        .unwrap_or_default()
        .join("\n");
    // four netkit devices here lead into other namespaces: three primaries and the
    // wrong-way pair's peer, which is not counted
    for want in [
        "netkit: 4 into other namespaces, 3 of them pods' and counted",
        "EDT/fq: on node0 (fq)",
    ] {
        if !doctor.contains(want) {
            p.push(format!(
                "the doctor's datapath check does not say {want:?}:\n{doctor}"
            ));
        }
    }

    // the pair the wrong way round: one refusal, logged once; no bytes in its pod's name
    let log = r.other.get("agent_log").cloned().unwrap_or_default();
    let refused: Vec<&String> = log
        .iter()
        .filter(|l| l.contains("cannot attach tc programs"))
        .collect();
    eprintln!("lab: refusals {}: {refused:?}", r.one("refusals"));
    if r.one("refusals") != "1" || refused.len() != 1 {
        p.push(format!(
            "the wrong-way pair: {} refusals counted, logged {refused:?}",
            r.one("refusals")
        ));
    }
    let bad = r.agent("drops_after", "ebpf_tc_bytes_total", "nkbad", &[]);
    if bad != 0.0 {
        p.push(format!("the wrong-way pair's pod has {bad} bytes"));
    }
    if r.one("interfaces_after_gone") != "2" || r.one("agent") != "running" {
        p.push(format!(
            "after a pod's namespace went away: {} interfaces counted, agent {}:\n  {}",
            r.one("interfaces_after_gone"),
            r.one("agent"),
            log.join("\n  ")
        ));
    }
    p
}

#[test]
fn netkit_and_edt_fq_bytes_and_drops_match_the_kernels_counters() {
    let Some((cache, _lock)) = common::lab() else {
        return;
    };
    let script = std::fs::read_to_string(common::repo().join("lab/scenarios/guest-datapaths.sh"))
        .expect("the scenario");
    let payload = Payload::new(&script).expect("payload");
    payload
        .copy(&common::binary("gpufeed-guest"), "gpufeed-guest")
        .expect("the agent");
    payload
        .copy(&common::binary("examples/lab_datapath"), "lab_datapath")
        .expect("the CNI fixture (cargo build -p gpufeed-guest --example lab_datapath)");
    let mut spec =
        VmSpec::new(&cache, "datapaths", KernelName::Trixie, Variant::Minbase).expect("spec");
    spec.deadline = Duration::from_secs(600);
    let image = payload.image().expect("payload image");
    let mut vm = Vm::start(&cache, &spec, &image).expect("boot");
    let done = vm.expect("done", Duration::from_secs(600));
    let run = parse(&vm.port.seen);
    let phases: Vec<String> = vm
        .port
        .seen
        .iter()
        .filter(|l| l.key == "phase")
        .map(|l| format!("{} at {:.0} s", l.value, l.at.as_secs_f64()))
        .collect();
    eprintln!(
        "lab: datapaths done in {:.0} s ({})",
        vm.uptime().as_secs_f64(),
        phases.join(", ")
    );
    let _ = vm.wait_exit(Duration::from_secs(30));
    if let Err(e) = done {
        panic!("{e}\nreported: {:?}", run.other);
    }
    let errors = run.other.get("error").cloned().unwrap_or_default();
    let mut p = problems(&run);
    p.extend(errors.into_iter().map(|e| format!("scenario: {e}")));
    assert!(p.is_empty(), "{}", p.join("\n"));
}
