//! A real Prometheus (Debian's package) scrapes the real agent; the documented
//! queries return one series per busy pod, and every PromQL expression shipped
//! in docs/ and talos/ evaluates without error.

use crate::common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::*;

/// Every expression shipped to users: ```promql blocks in docs/ and talos/
/// Markdown, and every `expr` of the rule files in talos/.
fn shipped_promql() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = Vec::new();
    for dir in [
        "docs",
        "talos",
        "talos/tests",
        "talos/kubernetes/components/prometheus-operator",
    ] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(text) = std::fs::read_to_string(&p) else {
                continue;
            };
            let name = p.display().to_string();
            if name.ends_with(".yaml") || name.ends_with(".yml") {
                if !name.contains("prometheus-rules") {
                    continue;
                }
                for doc in serde_yaml::Deserializer::from_str(&text) {
                    let v: serde_yaml::Value = serde::Deserialize::deserialize(doc).unwrap();
                    collect_exprs(&v, &name, &mut out);
                }
                continue;
            }
            let mut inside = false;
            let mut cur = String::new();
            for line in text.lines() {
                if line.trim_start().starts_with("```promql") {
                    inside = true;
                    cur.clear();
                } else if inside && line.trim_start().starts_with("```") {
                    inside = false;
                    out.push((name.clone(), cur.trim().to_string()));
                } else if inside {
                    cur.push_str(line);
                    cur.push('\n');
                }
            }
        }
    }
    out
}

fn collect_exprs(v: &serde_yaml::Value, file: &str, out: &mut Vec<(String, String)>) {
    match v {
        serde_yaml::Value::Mapping(m) => {
            for (k, val) in m {
                if k.as_str() == Some("expr") {
                    if let Some(e) = val.as_str() {
                        out.push((file.to_string(), e.trim().to_string()));
                    }
                } else {
                    collect_exprs(val, file, out);
                }
            }
        }
        serde_yaml::Value::Sequence(s) => s.iter().for_each(|x| collect_exprs(x, file, out)),
        _ => {}
    }
}

#[test]
fn prometheus_scrapes_agent_and_queries_give_one_series_per_busy_pod() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    // one iperf3 server per pod: an iperf3 server runs one test at a time
    let mut servers = Vec::new();
    for _ in 0..2 {
        let (ns, ip, hif) = net.server();
        sh(&format!(
            "tc qdisc add dev {hif} root tbf rate 50mbit burst 32kb latency 10ms"
        ));
        servers.push((spawn_in_ns(&ns, "exec iperf3 -s"), ip));
    }
    let agent = Agent::start(&["--interval", "500ms", "--no-kube"], &[]);
    let prom = Prometheus::start(agent.addr);

    let mut busy = Vec::new();
    for (layout, (_, server_ip)) in [Layout::Cgroupfs, Layout::Systemd]
        .into_iter()
        .zip(&servers)
    {
        let mut p = Pod::new(&sb, layout, "burstable", &random_uid(), &random_cid());
        net.join(&mut p);
        p.spawn("exec sh -c 'while :; do :; done'");
        p.spawn(&format!("exec iperf3 -c {server_ip} -t 30 -b 5M"));
        busy.push(p);
    }
    let mut quiet = Pod::random(&sb, Layout::Cgroupfs, "besteffort");
    quiet.spawn("exec sleep 60");
    let busy_uids: BTreeSet<String> = busy.iter().map(|p| p.uid.clone()).collect();

    let rtt =
        "rate(ebpf_tcp_rtt_microseconds_sum[10s]) / rate(ebpf_tcp_rtt_microseconds_count[10s])";
    let p99 = "histogram_quantile(0.99, rate(ebpf_sched_latency_microseconds_bucket[10s]))";
    let pods_of = |res: &[serde_json::Value]| -> Vec<String> {
        res.iter()
            .filter(|s| s["value"][1].as_str().is_some_and(|v| v != "NaN"))
            .filter_map(|s| s["metric"]["pod"].as_str().map(String::from))
            .filter(|p| busy_uids.contains(p) || *p == quiet.uid)
            .collect()
    };
    // wait until both queries see both busy pods (needs a few scrapes)
    let ready = wait_for(Duration::from_secs(40), || {
        let a = pods_of(&prom.query(rtt).ok()?);
        let b = pods_of(&prom.query(p99).ok()?);
        (a.len() >= 2 && b.len() >= 2).then_some((a, b))
    });
    let (mut a, mut b) = ready.unwrap_or_else(|| {
        panic!(
            "both busy pods appear in both queries: rtt {:?}\np99 {:?}",
            prom.query(rtt),
            prom.query(p99)
        )
    });
    a.sort();
    b.sort();
    let want: Vec<String> = busy_uids.iter().cloned().collect();
    assert_eq!(
        a, want,
        "RTT query: exactly one series per busy pod (the quiet pod has none)"
    );
    for s in prom.query(rtt).unwrap() {
        if s["metric"]["pod"]
            .as_str()
            .is_some_and(|p| busy_uids.contains(p))
        {
            let v: f64 = s["value"][1].as_str().unwrap().parse().unwrap();
            assert!(v > 10.0 && v < 1_000_000.0, "mean RTT {v} us is plausible");
            assert_eq!(s["metric"]["dst"], "private");
        }
    }
    // p99 of the busy pods: one each; the quiet pod may show up only if it ran
    let busy_p99: Vec<&String> = b.iter().filter(|p| busy_uids.contains(*p)).collect();
    assert_eq!(
        busy_p99,
        want.iter().collect::<Vec<_>>(),
        "p99 query: one series per busy pod"
    );

    let shipped = shipped_promql();
    assert!(
        shipped.iter().filter(|(f, _)| f.ends_with(".md")).count() >= 2,
        "docs ship PromQL examples"
    );
    assert!(
        shipped
            .iter()
            .filter(|(f, _)| f.contains("prometheus-rules"))
            .count()
            >= 10,
        "talos rules are checked"
    );
    for (file, q) in shipped {
        if let Err(e) = prom.query(&q) {
            panic!("PromQL in {file} does not evaluate: {e}\n{q}");
        }
    }

    // The series budget of a busy pod (a CPU-bound container and one TCP upload through a
    // shaped link: run-queue latency, RTT, retransmits, tc bytes and drops), as Prometheus
    // stores them: docs/benchmarks.md sizes a node from it. A probe that adds series per pod
    // must raise this on purpose.
    const SERIES_PER_BUSY_POD: usize = 80;
    for uid in &busy_uids {
        let n = prom
            .query(&format!("count({{pod=\"{uid}\"}})"))
            .unwrap()
            .first()
            .and_then(|s| s["value"][1].as_str()?.parse::<f64>().ok())
            .unwrap_or(0.0) as usize;
        eprintln!("series budget: busy pod {uid}: {n} series");
        assert!(
            n > 0 && n <= SERIES_PER_BUSY_POD,
            "pod {uid} has {n} series (budget {SERIES_PER_BUSY_POD})"
        );
    }
}
