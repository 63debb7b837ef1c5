//! The guest agent on the kernels its users run: Debian 12's 6.1, trixie's 6.12 (Talos 1.11's
//! series) and the newest in trixie-backports, each with and without
//! `lockdown=confidentiality` (Talos with SecureBoot). In each VM
//! (`lab/scenarios/guest-kernel.sh`):
//!
//! * `gpufeed-guest doctor --local` says which probes will load, before the agent starts;
//! * `gpufeed-guest run` starts, every probe is up (`gpufeed_probe_up`), and what the doctor
//!   predicted is what the agent got;
//! * under contention in a kubelet-shaped pod and a lossy upload from another pod's network
//!   namespace, `gpufeed-guest selftest` puts each probe's figure beside the kernel's own
//!   accounting (schedstat, nstat, veth and qdisc counters): the suite's truth checks, in
//!   the VM, within the tolerances of the native tests plus the uncertainty the selftest
//!   measures (its ticks around the kernel's readings; TCG makes them far apart);
//! * on 6.1, `--cgroup-storage local` forces cgroup-local storage, which that kernel lacks:
//!   the units that need it are down with the kernel's reason and the others are served;
//! * on 6.1, where the tc programs are clsact filters, an agent killed with SIGKILL leaves
//!   its two filters, the next one replaces them and counts the pod's veth, and its clean
//!   stop leaves none.
//!
//! The run writes the kernel support table (kernel × lockdown × probe: hook, storage, reads)
//! and compares it with docs/kernel-support.md; `GPUFEED_LAB_UPDATE_DOCS=1` rewrites the doc.

mod common;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use gpufeed_lab::{KernelName, Payload, Variant, Vm, VmSpec};

/// The probes `--probes all` brings up.
const PROBES: [&str; 8] = [
    "sched_latency",
    "tcp_rtt",
    "tcp_retransmit",
    "tc_bytes",
    "tc_drops",
    "gpu_driver",
    "cuda",
    "nvml",
];

/// What one VM reported.
#[derive(Debug, Default)]
struct Run {
    release: String,
    lockdown: String,
    doctor: Vec<String>,
    agent: String,
    readyz: String,
    /// probe → up
    up: BTreeMap<String, bool>,
    /// probe → (hook, storage, reads)
    how: BTreeMap<String, (String, String, String)>,
    /// probe → (agent, kernel, ±)
    selftest: BTreeMap<String, (f64, f64, f64)>,
    /// with --cgroup-storage local: probe → up
    forced_up: BTreeMap<String, bool>,
    forced_reasons: Vec<String>,
    agent_log: Vec<String>,
    /// the lossy upload around the selftest's window: retransmits before and after, packets
    /// lost on arrival, iperf3's last lines
    upload: Vec<String>,
    /// the clsact restart (6.1): what each step reported, by key
    clsact: BTreeMap<String, String>,
}

/// `name{a="x",b="y"} v` → (name, labels, v).
fn series(line: &str) -> Option<(String, BTreeMap<String, String>, f64)> {
    let (head, value) = line.rsplit_once(' ')?;
    let (name, rest) = head.split_once('{')?;
    let mut labels = BTreeMap::new();
    let mut s = rest.strip_suffix('}')?;
    while let Some((k, after)) = s.split_once("=\"") {
        // values are escaped Prometheus strings: find the closing quote not preceded by \
        let mut end = 0;
        let b = after.as_bytes();
        while end < b.len() && !(b[end] == b'"' && (end == 0 || b[end - 1] != b'\\')) {
            end += 1;
        }
        labels.insert(
            k.trim_start_matches(',').to_string(),
            after[..end].replace("\\\"", "\"").replace("\\\\", "\\"),
        );
        s = after.get(end + 1..).unwrap_or("");
    }
    Some((name.to_string(), labels, value.parse().ok()?))
}

fn parse(lines: &[gpufeed_lab::port::Line]) -> Run {
    let mut r = Run::default();
    for l in lines {
        let v = l.value.as_str();
        match l.key.as_str() {
            "kernel" => r.release = v.to_string(),
            "lockdown" => r.lockdown = v.to_string(),
            "doctor" => r.doctor.push(v.to_string()),
            "agent" => r.agent = v.to_string(),
            "readyz" => r.readyz = v.to_string(),
            "agent_log" => r.agent_log.push(v.to_string()),
            k if k.starts_with("clsact_") => {
                r.clsact.insert(k.to_string(), v.to_string());
            }
            "retransmits_before_selftest"
            | "retransmits_after_selftest"
            | "lost_on_arrival"
            | "upload" => r.upload.push(format!("{} {v}", l.key)),
            "probe_up" | "forced" => {
                let Some((name, labels, value)) = series(v) else {
                    continue;
                };
                let probe = labels.get("probe").cloned().unwrap_or_default();
                match (l.key.as_str(), name.as_str()) {
                    ("probe_up", "gpufeed_probe_up") => {
                        r.up.insert(probe, value == 1.0);
                    }
                    ("probe_up", "gpufeed_probe_info") => {
                        let get = |k: &str| labels.get(k).cloned().unwrap_or_else(|| "-".into());
                        r.how
                            .insert(probe, (get("hook"), get("storage"), get("reads")));
                    }
                    ("forced", "gpufeed_probe_up") => {
                        r.forced_up.insert(probe, value == 1.0);
                    }
                    ("forced", "gpufeed_probe_info") => {
                        if let Some(reason) = labels.get("reason") {
                            r.forced_reasons.push(format!("{probe}: {reason}"));
                        }
                    }
                    _ => {}
                }
            }
            "selftest" => {
                let w: Vec<&str> = v.split_whitespace().collect();
                if let (Some(p), Some(a), Some(k), Some(s)) =
                    (w.first(), w.get(1), w.get(2), w.get(4))
                {
                    if let (Ok(a), Ok(k), Ok(s)) = (a.parse(), k.parse(), s.parse()) {
                        r.selftest.insert(p.to_string(), (a, k, s));
                    }
                }
            }
            _ => {}
        }
    }
    r
}

/// Boots one VM of the matrix and returns what it reported.
fn boot(cache: &gpufeed_lab::Cache, kernel: KernelName, lockdown: bool) -> Result<Run, String> {
    let script = std::fs::read_to_string(common::repo().join("lab/scenarios/guest-kernel.sh"))
        .map_err(|e| e.to_string())?;
    let payload = Payload::new(&script).map_err(|e| e.to_string())?;
    payload
        .copy(&common::binary("gpufeed-guest"), "gpufeed-guest")
        .map_err(|e| e.to_string())?;
    // the forced refusal: cgroup-local storage on the kernel that has none; and the
    // clsact filters a killed agent leaves, on the kernel without tcx
    if kernel == KernelName::Bookworm && !lockdown {
        for flag in ["force-local-storage", "clsact-restart"] {
            payload
                .add(flag, b"1\n", 0o644)
                .map_err(|e| e.to_string())?;
        }
    }
    if truth_checked(kernel, lockdown) {
        payload
            .add("truth", b"1\n", 0o644)
            .map_err(|e| e.to_string())?;
    }
    let name = format!("{kernel}{}", if lockdown { "-lockdown" } else { "" });
    let mut spec =
        VmSpec::new(cache, &name, kernel, Variant::Minbase).map_err(|e| e.to_string())?;
    // a boot takes about a minute under TCG on an idle 2-core machine; much more beside
    // other work
    spec.deadline = Duration::from_secs(600);
    if lockdown {
        spec.cmdline.push("lockdown=confidentiality".into());
    }
    let image = payload.image().map_err(|e| e.to_string())?;
    let mut vm = Vm::start(cache, &spec, &image).map_err(|e| e.to_string())?;
    vm.expect("done", Duration::from_secs(600))
        .map_err(|e| e.to_string())?;
    let run = parse(&vm.port.seen);
    let phases: Vec<String> = vm
        .port
        .seen
        .iter()
        .filter(|l| l.key == "phase")
        .map(|l| format!("{} at {:.0} s", l.value, l.at.as_secs_f64()))
        .collect();
    eprintln!(
        "lab: {name} done in {:.0} s ({})",
        vm.uptime().as_secs_f64(),
        phases.join(", ")
    );
    let _ = vm.wait_exit(Duration::from_secs(30));
    Ok(run)
}

/// Whether the boot runs the truth checks (selftest under load). They run where the loaded
/// programs differ: on 6.1 (values in maps by cgroup id, no batch reads) and under lockdown
/// (libbpf's downgraded helpers restored). Without lockdown on 6.12 and the newest kernel the
/// programs are instruction for instruction those of the lockdown boot of the same kernel
/// (the probe table checks the same hooks and storage), so the boot checks what loads and
/// what the doctor predicts and saves the CI two selftests under TCG.
fn truth_checked(kernel: KernelName, lockdown: bool) -> bool {
    lockdown || kernel == KernelName::Bookworm
}

/// What is wrong with one run, against what the issue of each kernel demands.
fn problems(kernel: KernelName, lockdown: bool, r: &Run) -> Vec<String> {
    let mut p = Vec::new();
    let want_mode = if lockdown { "confidentiality" } else { "none" };
    if r.lockdown != want_mode {
        p.push(format!(
            "booted with lockdown {:?}, wanted {want_mode}",
            r.lockdown
        ));
    }
    if r.agent != "running" {
        p.push(format!(
            "the agent did not run ({}):\n  {}",
            r.agent,
            r.agent_log.join("\n  ")
        ));
    }
    for probe in PROBES {
        match r.up.get(probe) {
            Some(true) => {}
            Some(false) => p.push(format!("{probe} is down")),
            None => p.push(format!("{probe} has no gpufeed_probe_up")),
        }
    }
    // the doctor said it before the agent started
    // the doctor's own line for the check (its stderr has the probes' log lines too)
    let predicted = r
        .doctor
        .iter()
        .find(|l| l.split_whitespace().nth(1) == Some("probes"));
    match predicted {
        Some(l) if l.contains(&format!("{} of {} load", PROBES.len(), PROBES.len())) => {}
        other => p.push(format!(
            "the doctor's prediction does not match the agent's 8 of 8: {other:?}"
        )),
    }
    if !r.readyz.starts_with("ready") {
        p.push(format!("/readyz: {}", r.readyz));
    }
    // the kernel's own accounting, within the native tests' tolerances plus the measured
    // uncertainty of the agent's figure
    if !truth_checked(kernel, lockdown) {
        return p;
    }
    for (probe, tolerance, slack) in [
        ("sched_latency", 0.05, 0.0),
        ("tcp_retransmit", 0.10, 1.0),
        ("tc_bytes", 0.02, 0.0),
        ("tc_drops", 0.10, 1.0),
    ] {
        match r.selftest.get(probe) {
            Some(&(agent, kernel, spread)) => {
                if kernel <= 0.0 {
                    p.push(format!(
                        "selftest {probe}: the kernel counted nothing (the upload:\n  {})",
                        r.upload.join("\n  ")
                    ));
                } else if (agent - kernel).abs() > tolerance * kernel + spread + slack {
                    p.push(format!(
                        "selftest {probe}: agent {agent} ± {spread} vs kernel {kernel}"
                    ));
                }
            }
            None => p.push(format!("selftest has no {probe} row")),
        }
    }
    // RTT is indicative on this lossy link (see selftest_kernel.rs): within a factor of 3
    if let Some(&(agent, kernel, _)) = r.selftest.get("tcp_rtt") {
        if kernel <= 0.0 || agent / kernel > 3.0 || agent / kernel < 1.0 / 3.0 {
            p.push(format!(
                "selftest tcp_rtt: agent {agent} ms vs ss {kernel} ms"
            ));
        }
    }
    if kernel == KernelName::Bookworm && !lockdown {
        // 6.1 has no cgroup-local storage: forced to it, the units keyed by cgroup are down
        // with the kernel's reason, the others still served
        for probe in ["sched_latency", "tcp_rtt", "gpu_driver", "cuda"] {
            if r.forced_up.get(probe) != Some(&false) {
                p.push(format!(
                    "--cgroup-storage local on 6.1: {probe} should be down, was {:?}",
                    r.forced_up.get(probe)
                ));
            }
        }
        for probe in ["tc_bytes", "tc_drops", "nvml"] {
            if r.forced_up.get(probe) != Some(&true) {
                p.push(format!(
                    "--cgroup-storage local on 6.1: {probe} should still run, was {:?}",
                    r.forced_up.get(probe)
                ));
            }
        }
        if !r
            .forced_reasons
            .iter()
            .any(|l| l.starts_with("sched_latency:") && l.contains("failed to create"))
        {
            p.push(format!(
                "--cgroup-storage local on 6.1: no kernel reason for sched_latency in {:?}",
                r.forced_reasons
            ));
        }
        // clsact (no tcx): the killed agent's two filters stay, the next agent replaces them
        // (still two, and it counts the veth), its clean stop removes them
        for (key, want) in [
            ("clsact_left_by_killed", "2"),
            ("clsact_next_counts", "1"),
            ("clsact_replaced", "2"),
            ("clsact_with_next", "2"),
            ("clsact_after_stop", "0"),
        ] {
            if r.clsact.get(key).map(String::as_str) != Some(want) {
                p.push(format!(
                    "clsact restart on 6.1: {key} should be {want}; the steps: {:?}",
                    r.clsact
                ));
            }
        }
    }
    p
}

/// The support table, from the runs.
fn table(runs: &[(KernelName, bool, Run)]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| kernel | lockdown | probes up | storage of the per-cgroup probes | batch reads |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|");
    for (k, lockdown, r) in runs {
        let up = PROBES
            .iter()
            .filter(|p| r.up.get(**p) == Some(&true))
            .count();
        let storages: std::collections::BTreeSet<&str> = r
            .how
            .values()
            .map(|(_, s, _)| s.as_str())
            .filter(|s| *s == "cgroup-local" || *s == "hash-by-id")
            .collect();
        let batch = r.how.values().any(|(_, _, reads)| reads == "batch");
        let _ = writeln!(
            out,
            "| {} ({}, {}) | {} | {up} of {} | {} | {} |",
            k,
            series_of(&r.release),
            k.what(),
            if *lockdown { "confidentiality" } else { "none" },
            PROBES.len(),
            storages.into_iter().collect::<Vec<_>>().join(", "),
            if batch { "yes" } else { "no" },
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| kernel | lockdown | probe | up | hook | storage | reads |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for (k, lockdown, r) in runs {
        for probe in PROBES {
            let (hook, storage, reads) = r.how.get(probe).cloned().unwrap_or_default();
            let _ = writeln!(
                out,
                "| {k} | {} | {probe} | {} | {hook} | {storage} | {reads} |",
                if *lockdown { "confidentiality" } else { "none" },
                if r.up.get(probe) == Some(&true) {
                    "yes"
                } else {
                    "no"
                },
            );
        }
    }
    out
}

fn series_of(release: &str) -> String {
    release.split('.').take(2).collect::<Vec<_>>().join(".")
}

/// The table's rows without the kernel series (a Debian update moves the newest kernel
/// along; what each probe does on it is what the comparison is about).
fn comparable(table: &str) -> Vec<String> {
    table
        .lines()
        .map(|l| {
            // a summary row's first cell names the series: keep the suite only
            let mut cells: Vec<&str> = l.split('|').collect();
            if let Some(first) = cells.get_mut(1) {
                *first = first.split(" (").next().unwrap_or(first);
            }
            cells.join("|").trim().to_string()
        })
        .collect()
}

const BEGIN: &str = "<!-- generated by lab/tests/guest_kernels.rs: begin -->";
const END: &str = "<!-- generated by lab/tests/guest_kernels.rs: end -->";

#[test]
fn every_probe_loads_and_agrees_with_the_kernel_on_each_kernel() {
    let Some((cache, _lock)) = common::lab() else {
        return;
    };
    let mut runs = Vec::new();
    let mut failures = Vec::new();
    for kernel in KernelName::ALL {
        for lockdown in [false, true] {
            match boot(&cache, kernel, lockdown) {
                Ok(run) => {
                    for p in problems(kernel, lockdown, &run) {
                        failures.push(format!(
                            "{kernel}{}: {p}",
                            if lockdown { " (lockdown)" } else { "" }
                        ));
                    }
                    runs.push((kernel, lockdown, run));
                }
                Err(e) => failures.push(format!("{kernel} lockdown={lockdown}: {e}")),
            }
        }
    }
    // where the truth checks ran only under lockdown, the boot without it ran the same
    // programs the same way
    for (k, lockdown, r) in &runs {
        if *lockdown || truth_checked(*k, *lockdown) {
            continue;
        }
        if let Some((_, _, locked)) = runs.iter().find(|(k2, l2, _)| k2 == k && *l2) {
            if r.how != locked.how {
                failures.push(format!(
                    "{k}: the probes run differently with and without lockdown: {:?} vs {:?}",
                    r.how, locked.how
                ));
            }
        }
    }
    let generated = table(&runs);
    let out = common::target_dir().join("lab");
    let _ = std::fs::create_dir_all(&out);
    let _ = std::fs::write(out.join("kernel-support.md"), &generated);
    let doc_path = common::repo().join("docs/kernel-support.md");
    let doc = std::fs::read_to_string(&doc_path).unwrap_or_default();
    if std::env::var("GPUFEED_LAB_UPDATE_DOCS").as_deref() == Ok("1") && failures.is_empty() {
        let (head, tail) = match (doc.find(BEGIN), doc.find(END)) {
            (Some(b), Some(e)) => (doc[..b].to_string(), doc[e + END.len()..].to_string()),
            _ => (String::new(), String::new()),
        };
        std::fs::write(&doc_path, format!("{head}{BEGIN}\n{generated}{END}{tail}"))
            .expect("writing docs/kernel-support.md");
    } else if failures.is_empty() {
        let committed = match (doc.find(BEGIN), doc.find(END)) {
            (Some(b), Some(e)) => doc[b + BEGIN.len()..e].trim().to_string(),
            _ => String::new(),
        };
        let (now, was) = (comparable(generated.trim()), comparable(&committed));
        if now != was {
            failures.push(format!(
                "docs/kernel-support.md no longer says what the lab found (run with \
                 GPUFEED_LAB_UPDATE_DOCS=1 and review the change); this run:\n{generated}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
