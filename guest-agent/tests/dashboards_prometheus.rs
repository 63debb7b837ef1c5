//! The Grafana dashboard shipped in `talos/kubernetes/components/grafana-dashboards/`, its every
//! panel query evaluated by a real Prometheus (Debian's package) scraping the real agent, with
//! the variables set as Grafana sets them. The test provokes what the pod rows show: a pod
//! (in its own cgroup and network namespace) with CPU-bound loops competing for the CPUs and
//! a TCP upload through a token bucket too small for it; its run-queue wait, RTT, bytes,
//! retransmissions and qdisc drops must come back for exactly that pod when `$pod` selects it, and every other
//! query (host links, AER, stream, correlation: nothing provokes them here) must evaluate.

mod common;
mod manifests;

use std::time::Duration;

use common::*;
use serde_json::Value as Json;

fn dashboard() -> Json {
    let path = manifests::kustomize_dir("components/grafana-dashboards/gpufeed.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// (panel title, refId, expr) of every query of every panel.
fn queries(d: &Json) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                p["title"].as_str().unwrap().to_string(),
                t["refId"].as_str().unwrap().to_string(),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

/// The expression as Grafana sends it: variables replaced (a multi-value variable becomes a
/// regex alternation), `$__rate_interval` a window of several scrapes.
fn expand(expr: &str, namespace: &str, pod: &str) -> String {
    expr.replace("$namespace", namespace)
        .replace("$pod", pod)
        .replace("$__rate_interval", "10s")
}

#[test]
fn dashboard_structure() {
    let d = dashboard();
    assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vars, ["datasource", "namespace", "pod"]);
    let titles: Vec<&str> = d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for want in [
        "Run-queue wait p99 per pod",
        "TCP RTT per pod and destination",
        "Bytes vs bandwidth cap",
        "TCP retransmits per pod and destination",
        "tc/qdisc drops",
        "PCIe link width",
        "PCIe link changes",
        "AER errors",
        "Stream connected",
        "Latency spikes per pod",
        "Spikes joined to host events",
        "Host events by kind",
        "Event impact (p99 ÷ baseline)",
        "Spikes explained by host events",
    ] {
        assert!(titles.contains(&want), "panel {want:?} missing: {titles:?}");
    }
    let mut ids = std::collections::BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate panel id");
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{}: no query", p["title"]);
        for t in targets {
            let e = t["expr"].as_str().unwrap();
            // every per-pod series follows the namespace and pod variables
            let per_pod = e.contains("ebpf_")
                || e.contains("gpufeed_bandwidth_limit")
                || e.contains("gpufeed_latency_spikes")
                || e.contains("gpufeed_correlated_spikes")
                || e.contains("gpufeed_event_impact");
            if per_pod {
                assert!(
                    e.contains("namespace=~\"$namespace\"") && e.contains("pod=~\"$pod\""),
                    "{}: {e} ignores the variables",
                    p["title"]
                );
            }
        }
    }
}

#[test]
fn every_panel_query_evaluates_on_the_agents_series() {
    let Some(_lock) = require_root() else { return };
    let d = dashboard();
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (server_ns, server_ip, _) = net.server();
    let _server = spawn_in_ns(&server_ns, "exec iperf3 -s");
    let agent = Agent::start(&["--interval", "500ms", "--no-kube"], &[]);
    let prom = Prometheus::start(agent.addr);

    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    net.join(&mut pod);
    // A token bucket with almost no queue on the pod's own interface: the upload overflows
    // it, the qdisc drops (pod egress) and TCP retransmits.
    let pod_ns = pod.netns.clone().unwrap();
    sh(&format!(
        "ip netns exec {pod_ns} tc qdisc add dev eth0 root tbf rate 10mbit burst 10kb limit 20kb"
    ));
    // more runnable loops than CPUs: they wait for each other on the run queue
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    for _ in 0..cpus + 1 {
        pod.spawn("exec sh -c 'while :; do :; done'");
    }
    pod.spawn(&format!("exec iperf3 -c {server_ip} -t 60"));
    let uid = pod.uid.clone();

    let provoked = [
        ("Run-queue wait p99 per pod", "A"),
        ("TCP RTT per pod and destination", "A"),
        ("Bytes vs bandwidth cap", "A"),
        ("TCP retransmits per pod and destination", "A"),
        ("tc/qdisc drops", "A"),
    ];
    let all = queries(&d);
    let of_pod = |title: &str, refid: &str| -> Option<Vec<Json>> {
        let (_, _, e) = all.iter().find(|(t, r, _)| t == title && r == refid)?;
        let res = prom.query(&expand(e, ".*", &uid)).ok()?;
        let hit: Vec<Json> = res
            .into_iter()
            .filter(|s| s["value"][1].as_str().is_some_and(|v| v != "NaN"))
            .collect();
        (!hit.is_empty()).then_some(hit)
    };
    let seen = wait_for(Duration::from_secs(45), || {
        provoked
            .iter()
            .map(|(t, r)| of_pod(t, r))
            .collect::<Option<Vec<_>>>()
    });
    let seen = seen.unwrap_or_else(|| {
        let state: Vec<String> = provoked
            .iter()
            .map(|(t, r)| format!("{t}: {:?}", of_pod(t, r).is_some()))
            .collect();
        panic!("provoked series missing for pod {uid}: {state:?}")
    });
    for ((title, _), series) in provoked.iter().zip(&seen) {
        for s in series {
            // `$pod` selects this pod and nothing else
            assert_eq!(s["metric"]["pod"].as_str(), Some(uid.as_str()), "{title}");
            let v: f64 = s["value"][1].as_str().unwrap().parse().unwrap();
            assert!(v > 0.0 && v.is_finite(), "{title}: {v}");
        }
    }
    // plausible values: RTT under a second; egress not above the 10 Mbit/s token bucket (TCP
    // backing off from the drops, and starved by the pod's own loops, sends less)
    let rtt: f64 = seen[1][0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!(rtt > 1.0 && rtt < 1_000_000.0, "RTT {rtt} µs");
    let egress = seen[2]
        .iter()
        .find(|s| s["metric"]["direction"] == "egress")
        .expect("egress bytes of the pod");
    let bits: f64 = egress["value"][1].as_str().unwrap().parse().unwrap();
    assert!(
        (1e4..1.2e7).contains(&bits),
        "egress {bits} bit/s vs the 10 Mbit/s bucket"
    );

    // Everything else evaluates, with the variables at "All" and at this pod.
    for (title, refid, e) in &all {
        for (ns, p) in [(".*", ".*"), (".*", uid.as_str())] {
            let q = expand(e, ns, p);
            if let Err(err) = prom.query(&q) {
                panic!("{title} ({refid}) does not evaluate: {err}\n{q}");
            }
        }
    }
    // The variables' label_values(SELECTOR, LABEL) list this pod.
    for v in d["templating"]["list"].as_array().unwrap() {
        let Some(q) = v["query"]["query"].as_str() else {
            continue;
        };
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|s| s.strip_suffix(')'))
            .expect("label_values(selector, label)");
        let (sel, label) = inner.rsplit_once(',').unwrap();
        let res = prom.query(&expand(sel.trim(), ".*", ".*")).unwrap();
        let values: Vec<&str> = res
            .iter()
            .filter_map(|s| s["metric"][label.trim()].as_str())
            .collect();
        if label.trim() == "pod" {
            assert!(values.contains(&uid.as_str()), "variable pod: {values:?}");
        } else {
            assert!(!res.is_empty(), "variable {}: no series", v["name"]);
        }
    }
}
