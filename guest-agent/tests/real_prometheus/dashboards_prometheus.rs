//! The Grafana dashboard shipped in `talos/kubernetes/components/grafana-dashboards/`, and the
//! dashboards per purpose in grafana.com's format beside it (`grafana.com/`: node, host,
//! FinOps; derived from it, dashboards_export.rs), their every panel, variable and annotation
//! query evaluated by a real Prometheus (Debian's package) scraping the real agent, with the
//! variables set as Grafana sets them. A panel of an export shows what the same panel of the
//! sidecar dashboard shows here: its queries are the same, checked wherever a row's values are. Each test provokes what a group of
//! rows shows and checks that exactly the provoked series come back:
//! * the pod rows: a pod (in its own cgroup and network namespace) with CPU-bound loops
//!   competing for the CPUs and a TCP upload through a token bucket too small for it: its
//!   run-queue wait, RTT, bytes, retransmissions and qdisc drops, for exactly that pod when
//!   `$pod` selects it; every other query must evaluate;
//! * the feed row, first on the dashboard: a pod's thread feeding the stand-in device while CPU
//!   hogs share its CPU: its feed stall by cause against its GPU busy, the `cpu` cause's
//!   counter in Prometheus equal to the stand-in's own record of the thread's run-queue wait
//!   in the device's idle gaps;
//! * the GPU FinOps row: a tenant's pod using the stand-in GPU device and libcuda.so.1 (its
//!   VRAM and copies known to the test), its cost, duty cycle, compute time and MPS advice;
//! * the host rows and the annotations: the real host agent on a recorded Thunderbolt eGPU tree
//!   with its Thunderbolt routers, a process shaped like the VM's QEMU whose vCPU threads wait
//!   on a contended CPU, a bridge in a network namespace with the VM's port carrying an upload, and
//!   a link drop: each row's series for that host, VM and router, and the link drop as an
//!   annotation with its summary.

use crate::common;
use crate::manifests;

use std::fs::File;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::fake_kube::FakeKube;
use common::gpu::*;
use common::host_agent::*;
use common::*;
use serde_json::Value as Json;

fn dashboard() -> Json {
    let path = manifests::kustomize_dir("components/grafana-dashboards/gpufeed.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The grafana.com exports (file name, dashboard).
fn exports() -> Vec<(String, Json)> {
    let dir = manifests::kustomize_dir("components/grafana-dashboards/grafana.com");
    let mut out: Vec<(String, Json)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (
                name,
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        out.len(),
        3,
        "node, host and FinOps: {:?}",
        out.iter().map(|e| &e.0).collect::<Vec<_>>()
    );
    out
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
/// regex alternation, "All" `.*`), `$__rate_interval` a window of several scrapes.
fn expand(expr: &str, namespace: &str, pod: &str) -> String {
    expand_all(expr, &[("namespace", namespace), ("pod", pod)])
}

/// [`expand`] with any variables; those not given are "All".
fn expand_all(expr: &str, vars: &[(&str, &str)]) -> String {
    let mut e = expr.replace("$__rate_interval", "10s");
    for name in ["namespace", "pod", "tenant", "host"] {
        let v = vars
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(".*", |(_, v)| *v);
        e = e.replace(&format!("${name}"), v);
    }
    e
}

/// The annotation queries (name, expr) of the dashboard.
fn annotation_queries(d: &Json) -> Vec<(String, String)> {
    d["annotations"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["expr"].is_string())
        .map(|a| {
            (
                a["name"].as_str().unwrap().to_string(),
                a["expr"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The series a panel's query returns, with values that are numbers.
fn panel(prom: &Prometheus, d: &Json, title: &str, vars: &[(&str, &str)]) -> Vec<Json> {
    let all = queries(d);
    let (_, r, e) = all
        .iter()
        .find(|(t, _, _)| t == title)
        .unwrap_or_else(|| panic!("no panel {title:?}"));
    // the exports that show this panel show these values: the same query
    let mut shown = 0;
    for (name, x) in exports() {
        for (t, xr, xe) in queries(&x) {
            if t == title && xr == *r {
                assert_eq!(&xe, e, "{name}: {title}");
                shown += 1;
            }
        }
    }
    assert_eq!(shown, 1, "{title}: in one export");
    prom.query(&expand_all(e, vars))
        .unwrap_or_else(|err| panic!("{title}: {err}"))
        .into_iter()
        .filter(|s| s["value"][1].as_str().is_some_and(|v| v != "NaN"))
        .collect()
}

fn num(s: &Json) -> f64 {
    s["value"][1].as_str().unwrap().parse().unwrap()
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
    assert_eq!(
        vars,
        [
            "datasource",
            "namespace",
            "pod",
            "tenant",
            "host",
            "parca_url"
        ]
    );
    let titles: Vec<&str> = d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    // the first row answers the product's question
    let first: Vec<&str> = titles.iter().take(2).copied().collect();
    assert_eq!(
        first,
        [
            "Is the GPU getting fed?",
            "GPU feed stall per pod and cause"
        ]
    );
    for want in [
        "GPU feed stall per pod and cause",
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
        "GPU cost per tenant",
        "Idle share of the GPU cost",
        "MPS advice (active thread %)",
        "GPU duty cycle per pod",
        "GPU compute time per pod",
        "VRAM reserved per pod",
        "Host↔GPU bytes per pod",
        "Thunderbolt link bandwidth",
        "Thunderbolt routers authorized",
        "VM state",
        "vCPU run delay",
        "Bridge traffic per VM",
        "Bridge microbursts per VM",
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
                || e.contains("gpufeed_gpu_feed_stall")
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
            // the GPU series carry the tenant label, and follow its variable
            if e.contains("ebpf_gpu_") || e.contains("gpufeed_gpu_cost_total") {
                assert!(e.contains("tenant=~\"$tenant\""), "{}: {e}", p["title"]);
            }
            // every host series follows the host variable
            for (i, _) in e
                .match_indices("gpufeed_host_")
                .chain(e.match_indices("gpufeed_stream_"))
            {
                let sel = &e[i..];
                let name_end = sel
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(sel.len());
                assert!(
                    sel[name_end..].starts_with("{host=~\"$host\""),
                    "{}: {} ignores $host in {e}",
                    p["title"],
                    &sel[..name_end]
                );
            }
        }
    }
}

/// The host events are annotations from the host event series, with the event's summary as
/// text and its time as the series' value (Grafana counts in ms).
#[test]
fn host_events_annotate_the_time_axis() {
    let d = dashboard();
    let list = d["annotations"]["list"].as_array().unwrap();
    let a = list
        .iter()
        .find(|a| a["name"] == "Host events")
        .expect("the host events annotation");
    assert_eq!(a["datasource"]["uid"], "${datasource}");
    assert_eq!(a["useValueForTime"], true);
    assert_eq!(a["textFormat"], "{{summary}}");
    assert_eq!(a["titleFormat"], "{{event}} on {{host}}");
    let e = a["expr"].as_str().unwrap();
    assert!(
        e.contains("gpufeed_host_event_timestamp_seconds{host=~\"$host\"") && e.ends_with("* 1000"),
        "{e}"
    );
}

/// The profile links (the dashboard's and the run-queue panel's) open Parca's query page for
/// the selected pods over the dashboard's time range, as Grafana fills them in.
#[test]
fn profile_links_name_the_pods_and_the_time_range() {
    let d = dashboard();
    let fill = |u: &str| {
        u.replace("${parca_url}", "http://parca.example:7070")
            .replace("${namespace:regex}", "(ml)")
            .replace("${pod:regex}", "(vllm-0|vllm-1)")
            .replace("${__field.labels.namespace}", "ml")
            .replace("${__field.labels.pod}", "vllm-0")
            .replace("${__from}", "1800000000000")
            .replace("${__to}", "1800003600000")
    };
    let query = |u: &str| -> std::collections::BTreeMap<String, String> {
        let filled = fill(u);
        assert!(
            !filled.contains("${"),
            "a variable Grafana would not fill: {filled}"
        );
        let q = filled.split_once('?').unwrap().1;
        q.split('&')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                let mut out = Vec::new();
                let b = v.as_bytes();
                let mut i = 0;
                while i < b.len() {
                    if b[i] == b'%' {
                        out.push(u8::from_str_radix(&v[i + 1..i + 3], 16).unwrap());
                        i += 3;
                    } else {
                        out.push(b[i]);
                        i += 1;
                    }
                }
                (k.to_string(), String::from_utf8(out).unwrap())
            })
            .collect()
    };
    let dash = &d["links"].as_array().unwrap()[0];
    let q = query(dash["url"].as_str().unwrap());
    assert_eq!(
        q["expression_a"],
        "parca_agent:samples:count:cpu:nanoseconds:delta{namespace=~\"(ml)\",pod=~\"(vllm-0|vllm-1)\"}"
    );
    assert_eq!(
        (q["from_a"].as_str(), q["to_a"].as_str()),
        ("1800000000000", "1800003600000")
    );
    assert_eq!(
        q["time_selection_a"],
        "absolute:1800000000000-1800003600000"
    );
    let rq = d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["title"] == "Run-queue wait p99 per pod")
        .unwrap();
    let link = &rq["fieldConfig"]["defaults"]["links"][0];
    let q = query(link["url"].as_str().unwrap());
    assert_eq!(
        q["expression_a"],
        "parca_agent:samples:count:cpu:nanoseconds:delta{namespace=\"ml\",pod=\"vllm-0\"}"
    );
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
    let annotations = annotation_queries(&d);
    let every = all
        .iter()
        .map(|(t, r, e)| (format!("{t} ({r})"), e.clone()))
        .chain(
            annotations
                .iter()
                .map(|(n, e)| (format!("annotation {n}"), e.clone())),
        );
    for (what, e) in every {
        for (ns, p) in [(".*", ".*"), (".*", uid.as_str())] {
            let q = expand(&e, ns, p);
            if let Err(err) = prom.query(&q) {
                panic!("{what} does not evaluate: {err}\n{q}");
            }
        }
    }
    // The same for each grafana.com export: its panels, annotations and variables.
    for (name, x) in exports() {
        let every = queries(&x)
            .into_iter()
            .map(|(t, r, e)| (format!("{t} ({r})"), e))
            .chain(
                annotation_queries(&x)
                    .into_iter()
                    .map(|(n, e)| (format!("annotation {n}"), e)),
            );
        let mut n = 0;
        for (what, e) in every {
            for (ns, p) in [(".*", ".*"), (".*", uid.as_str())] {
                let q = expand(&e, ns, p);
                if let Err(err) = prom.query(&q) {
                    panic!("{name}: {what} does not evaluate: {err}\n{q}");
                }
            }
            n += 1;
        }
        assert!(n > 0, "{name}: no query");
        for v in x["templating"]["list"].as_array().unwrap() {
            if v["type"] == "query" {
                variable_values(&prom, &x, v["name"].as_str().unwrap());
            }
        }
        // the node's pod rows show this pod, as the sidecar's do
        if name == "gpufeed-node.json" {
            assert!(variable_values(&prom, &x, "pod").contains(&uid));
            for (title, _) in &provoked {
                let (_, _, e) = queries(&x)
                    .into_iter()
                    .find(|(t, _, _)| t == title)
                    .unwrap();
                let hit = prom.query(&expand(&e, ".*", &uid)).unwrap();
                assert!(
                    hit.iter()
                        .any(|s| s["metric"]["pod"].as_str() == Some(uid.as_str())),
                    "{name}: {title}"
                );
            }
        }
    }
    // The variables' label_values(SELECTOR, LABEL) list this pod.
    assert!(variable_values(&prom, &d, "pod").contains(&uid));
    // (without an API a pod has no namespace: the namespace variable's query evaluates, and
    // lists the namespaces of named pods only)
    variable_values(&prom, &d, "namespace");
}

/// What the variable `name`'s `label_values(SELECTOR, LABEL)` lists, the other variables at All.
fn variable_values(prom: &Prometheus, d: &Json, name: &str) -> Vec<String> {
    let v = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("variable {name}"));
    let q = v["query"]["query"].as_str().unwrap();
    let inner = q
        .strip_prefix("label_values(")
        .and_then(|s| s.strip_suffix(')'))
        .expect("label_values(selector, label)");
    let (sel, label) = inner.rsplit_once(',').unwrap();
    let res = prom.query(&expand_all(sel.trim(), &[])).unwrap();
    let mut values: Vec<String> = res
        .iter()
        .filter_map(|s| s["metric"][label.trim()].as_str().map(String::from))
        .collect();
    values.sort();
    values.dedup();
    values
}

/// The feed row: one thread of a pod feeds the stand-in device 1 ms kernels for 12 s while two
/// CPU hogs in a neighbour pod share its CPU. The panel shows, for exactly that pod, the four
/// causes of its feed stall (the `cpu` one above 0) and its GPU busy; once the loop ends, the `cpu`
/// counter in Prometheus is the thread's run-queue wait inside the device's idle gaps by the
/// stand-in's own record and schedstat (within 10%).
#[test]
fn feed_row_shows_the_provoked_stall_by_cause() {
    let Some(_lock) = require_root() else { return };
    let d = dashboard();
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let cuda = StandInCuda::with_gaps(dir);
    let client = FeedClient::new(dir);
    let (ctl, gaps) = (dir.join("feed-ctl"), dir.join("gaps"));
    std::fs::create_dir(&ctl).unwrap();
    let agent = Agent::no_kube("200ms", "cuda", &["--cuda-launches"]);
    let prom = Prometheus::start(agent.addr);
    let sb = CgroupSandbox::new();
    let mut feeder = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut hogs = Pod::random(&sb, Layout::Cgroupfs, "besteffort");
    let uid = feeder.uid.clone();
    feeder.spawn(&client.command(&cuda, &ctl, &gaps, 0, 1, 12_000, 1000));
    assert!(
        wait_for(Duration::from_secs(10), || {
            value(&agent.scrape(), "gpufeed_cuda_libraries", &[]).filter(|v| *v == 1.0)
        })
        .is_some(),
        "the agent attached to the library"
    );
    for _ in 0..2 {
        hogs.spawn("exec taskset -c 0 sh -c 'while :; do :; done'");
    }
    File::create(ctl.join("go0")).unwrap();
    let title = "GPU feed stall per pod and cause";
    let stall = wait_for(Duration::from_secs(20), || {
        let r = panel(&prom, &d, title, &[("pod", &uid)]);
        let cpu = r.iter().find(|s| s["metric"]["cause"] == "cpu").map(num)?;
        (r.len() == 4 && r.iter().all(|s| s["metric"]["pod"] == uid.as_str()) && cpu > 0.0)
            .then_some(r)
    })
    .unwrap_or_else(|| panic!("{title}: {:?}", panel(&prom, &d, title, &[("pod", &uid)])));
    let (_, _, busy_expr) = queries(&d)
        .into_iter()
        .find(|(t, r, _)| t == title && r == "B")
        .expect("the panel's GPU busy query");
    let busy = wait_for(Duration::from_secs(10), || {
        let r = prom.query(&expand(&busy_expr, ".*", &uid)).ok()?;
        (r.len() == 1 && num(&r[0]) > 0.5).then(|| num(&r[0]))
    });
    eprintln!("feed panel: {stall:?}; GPU busy {busy:?}");
    assert!(
        busy.is_some(),
        "{title}: the pod's GPU busy under its stall"
    );
    wait_file(&ctl.join("paused0"), "the feeding loop");
    hogs.kill_all();
    let truth: u64 = FeedGap::read_all(&gaps)
        .iter()
        .map(|g| g.run_delay_ns)
        .sum();
    let q = format!("max(gpufeed_gpu_feed_stall_seconds_total{{pod=\"{uid}\",cause=\"cpu\"}})");
    let cpu = wait_for(Duration::from_secs(10), || {
        prom.scalar(&q)
            .filter(|v| (v * 1e9 - truth as f64).abs() <= 0.1 * truth as f64)
    });
    assert!(
        cpu.is_some(),
        "cpu stall in Prometheus {:?} s vs the stand-in's record {truth} ns",
        prom.scalar(&q)
    );
    eprintln!("cpu stall in Prometheus {cpu:?} s, truth {truth} ns");
}

const NODE: &str = "gpu-node-dashboards";
const TENANT_KEY: &str = "team.example.com/tenant";

/// The GPU FinOps row on a tenant's pod using the stand-in GPU: its VRAM and copies are what the
/// stand-in client made (known here), its duty cycle and compute time come from the stand-in
/// device's calls, its cost goes to its tenant, and the MPS advice and idle share evaluate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_finops_rows_show_the_provoked_gpu_use() {
    let Some(_lock) = require_root() else { return };
    let d = dashboard();
    let stand_ins = StandIns::new();
    let sb = CgroupSandbox::new();
    let (pods, list) = labelled_pods(
        &sb,
        NODE,
        &[("server-0", Layout::Cgroupfs, &[(TENANT_KEY, "team-a")])],
    );
    let [mut server]: [Pod; 1] = pods.try_into().ok().unwrap();
    let kube = FakeKube::start(NODE, list, vec![]).await;
    // A one-GPU node at 3.6 an hour: 16 MiB of VRAM and 100 kB/s of link are its whole
    // capacity, so the stand-in's small figures are shares that show.
    let flags = [
        ("--interval", "200ms"),
        ("--node-name", NODE),
        ("--gpu-duty-window", "2s"),
        ("--pod-label", "tenant=team.example.com/tenant"),
        ("--gpu-hourly-rate", "3.6"),
        ("--gpu-memory-bytes", "16MiB"),
        ("--gpu-link-bytes-per-second", "100000"),
    ];
    let mut args: Vec<String> = flags
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.to_string()])
        .collect();
    args.extend(stand_ins.probe_flags());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (agent, _kc) = agent_with_kube(&kube, &args).await;
    let target = agent.addr;
    let prom = tokio::task::spawn_blocking(move || Prometheus::start(target))
        .await
        .unwrap();

    // The server loads a model (VRAM) and copies to and from the GPU, twice (two processes,
    // so that the copy counters exist before the second one's bytes: a rate needs an increase
    // between two scrapes)...
    let (dir, dev, cuda) = (stand_ins.dir(), &stand_ins.dev, &stand_ins.cuda);
    let mut clients = Vec::new();
    for (i, ctl) in [dir.join("ctl-a"), dir.join("ctl-b")]
        .into_iter()
        .enumerate()
    {
        std::fs::create_dir(&ctl).unwrap();
        clients.push((server.spawn(&cuda.host_command_in(&ctl, 1)), ctl.clone()));
        for n in 0..2 {
            File::create(ctl.join(format!("go{n}"))).unwrap();
            wait_file(&ctl.join(format!("done{n}")), "cuda_app phase");
            if n == 0 && i == 0 {
                assert!(
                    wait_for(Duration::from_secs(5), || {
                        value(&agent.scrape(), "gpufeed_cuda_libraries", &[]).filter(|v| *v == 1.0)
                    })
                    .is_some(),
                    "the agent attached to the library"
                );
            }
        }
        if i == 0 {
            // the first client's copies are scraped before the second one copies
            let first = wait_for(Duration::from_secs(10), || {
                prom.scalar("max(ebpf_gpu_pcie_bytes_total{pod=\"server-0\",direction=\"h2d\"})")
                    .filter(|v| *v > 0.0)
            });
            assert!(
                first.is_some(),
                "the first client's copies reached Prometheus"
            );
        }
    }
    let want = Expect { s: 1 };
    let of_pod = [("pod", "server-0"), ("tenant", "team-a")];
    let wait_panel = |title: &str, vars: &[(&str, &str)], ok: &dyn Fn(&[Json]) -> bool| {
        wait_for(Duration::from_secs(20), || {
            let r = panel(&prom, &d, title, vars);
            ok(&r).then_some(r)
        })
        .unwrap_or_else(|| panic!("{title}: {:?}", panel(&prom, &d, title, vars)))
    };
    let one_pod = |r: &[Json]| r.len() == 1 && r[0]["metric"]["pod"] == "server-0";
    let copies = wait_panel("Host↔GPU bytes per pod", &of_pod, &|r| {
        r.len() == 2 && r.iter().all(|s| num(s) > 0.0)
    });
    assert!(copies.iter().any(|s| s["metric"]["direction"] == "h2d"));
    // the counters behind the rate are the clients' own copies
    let h2d = prom
        .scalar("max(ebpf_gpu_pcie_bytes_total{pod=\"server-0\",direction=\"h2d\"})")
        .unwrap();
    assert_eq!(h2d, 2.0 * want.h2d() as f64);
    let vram = wait_panel("VRAM reserved per pod", &of_pod, &|r| {
        one_pod(r) && num(&r[0]) == 2.0 * want.after_alloc() as f64
    });
    eprintln!("VRAM panel: {}", num(&vram[0]));

    // ...then keeps the device busy: 40 driver calls of 100 ms
    let (go, out) = (dir.join("go-busy"), dir.join("busy.out"));
    server.spawn(&dev.command(40, 1, &go, &out, ""));
    wait_probed(&agent, 1);
    File::create(&go).unwrap();
    let duty = wait_panel("GPU duty cycle per pod", &of_pod, &|r| {
        one_pod(r) && num(&r[0]) > 0.5 && num(&r[0]) <= 1.0
    });
    let compute = wait_panel("GPU compute time per pod", &of_pod, &|r| {
        one_pod(r) && num(&r[0]) > 0.3 && num(&r[0]) <= 1.05
    });
    eprintln!("duty {} compute {} s/s", num(&duty[0]), num(&compute[0]));
    let cost = wait_panel("GPU cost per tenant", &[("tenant", "team-a")], &|r| {
        r.len() == 1 && r[0]["metric"]["tenant"] == "team-a" && num(&r[0]) > 0.0
    });
    // at most the node's rate: 3.6 per hour
    assert!(num(&cost[0]) <= 3.6 * 1.05, "{cost:?}");
    let idle = wait_panel("Idle share of the GPU cost", &[], &|r| {
        r.len() == 1 && (0.0..1.0).contains(&num(&r[0]))
    });
    eprintln!(
        "cost team-a {}/h, idle share {}",
        num(&cost[0]),
        num(&idle[0])
    );
    wait_panel("MPS advice (active thread %)", &of_pod, &|r| {
        one_pod(r) && (10.0..=100.0).contains(&num(&r[0]))
    });
    // another tenant selected: none of this pod's series
    assert!(panel(&prom, &d, "VRAM reserved per pod", &[("tenant", "team-b")]).is_empty());
    assert_eq!(variable_values(&prom, &d, "tenant"), ["team-a"]);
    wait_file(&out, "the busy client");
    for (pid, ctl) in clients {
        File::create(ctl.join("go2")).unwrap();
        // SAFETY: kill(2) on a child this test spawned and has not reaped.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        server.wait_exit(pid, Duration::from_secs(10));
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Σ run_delay (ns) over the threads named like vCPUs of process `pid` (their schedstat).
fn vcpu_wait_ns(pid: u32) -> u64 {
    let mut total = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim_end().ends_with("/KVM") {
            total += schedstat(&t.path()).map_or(0, |s| s.run_delay_ns);
        }
    }
    total
}

/// A network namespace that goes with the value.
struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        sh_quiet(&format!("ip netns del {}", self.0));
    }
}

/// The host rows and the annotations. The real host agent watches a recorded Thunderbolt eGPU
/// tree (kernel formats) with its routers, this machine's /proc for a process shaped like the
/// VM's QEMU, and a bridge in a namespace of the test's; it streams to the guest, which
/// Prometheus scrapes. What each row shows is what the test made: the routers' recorded
/// speeds, the vCPU threads' waits as their schedstat counts them, the bytes of the upload
/// through the VM's port as the VM's interface counts them, the link drop as an annotation.
#[test]
fn host_rows_and_annotations_show_the_provoked_host() {
    let Some(_lock) = require_root() else { return };
    let d = dashboard();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    demo(&["tree", root.to_str().unwrap()]);
    // The enclosure's Thunderbolt routers, as the thunderbolt driver lists them.
    let tb = "sys/devices/pci0000:00/0000:00:0d.2/domain0/0-0";
    for (path, name, attrs) in [
        (
            tb.to_string(),
            "0-0",
            vec![
                ("authorized", "1"),
                ("generation", "4"),
                ("vendor_name", "Intel"),
                ("device_name", "Host router"),
            ],
        ),
        (
            format!("{tb}/0-1"),
            "0-1",
            vec![
                ("authorized", "1"),
                ("generation", "4"),
                ("vendor_name", "Razer"),
                ("device_name", "Core X Chroma"),
                ("rx_speed", "20.0 Gb/s"),
                ("tx_speed", "20.0 Gb/s"),
                ("rx_lanes", "2"),
                ("tx_lanes", "2"),
            ],
        ),
    ] {
        let dev = root.join(&path);
        std::fs::create_dir_all(&dev).unwrap();
        for (k, v) in attrs {
            std::fs::write(dev.join(k), format!("{v}\n")).unwrap();
        }
        let bus = root.join("sys/bus/thunderbolt/devices");
        std::fs::create_dir_all(&bus).unwrap();
        std::os::unix::fs::symlink(&dev, bus.join(name)).unwrap();
    }
    // The VM: a process with its QEMU's command line and vCPU threads, on one CPU with a hog,
    // its pid where Proxmox writes it; the agent reads this machine's /proc.
    let vmid = 20_000 + fastrand::u32(0..40_000);
    let qemu_bin = dir.path().join("vcpu_threads");
    compile_c("vm/vcpu_threads.c", &qemu_bin, &["-pthread"]);
    let qemu = Proc(
        Command::new("taskset")
            .args(["-c", "0"])
            .arg(&qemu_bin)
            .args(["2", "-id", &vmid.to_string()])
            .spawn()
            .unwrap(),
    );
    let _hog = Proc(
        Command::new("taskset")
            .args(["-c", "0", "sh", "-c", "while :; do :; done"])
            .spawn()
            .unwrap(),
    );
    std::fs::remove_dir(root.join("proc")).unwrap();
    std::os::unix::fs::symlink("/proc", root.join("proc")).unwrap();
    std::fs::create_dir_all(root.join("run/qemu-server")).unwrap();
    std::fs::write(
        root.join(format!("run/qemu-server/{vmid}.pid")),
        format!("{}\n", qemu.0.id()),
    )
    .unwrap();
    // The bridge: vmbr0 in a namespace, the VM's port tap<vmid>i0, its NIC in another.
    let tag = uniq();
    let (br_ns, vm_ns) = (Netns(format!("gfdb{tag}")), Netns(format!("gfdv{tag}")));
    let port = format!("tap{vmid}i0");
    sh(&format!(
        "ip netns add {br} && ip netns add {vm} && \
         ip netns exec {vm} sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 && \
         ip netns exec {br} sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 && \
         ip -n {br} link add vmbr0 type bridge && ip -n {br} link set vmbr0 up && \
         ip -n {br} addr add 10.201.7.1/24 dev vmbr0 && \
         ip -n {br} link add {port} type veth peer name eth0 netns {vm} && \
         ip -n {br} link set {port} master vmbr0 up && \
         ip -n {vm} addr add 10.201.7.2/24 dev eth0 && ip -n {vm} link set eth0 up && ip -n {vm} link set lo up",
        br = br_ns.0,
        vm = vm_ns.0
    ));
    let quic = free_port();
    let _host = start_host_with(
        dir.path(),
        quic,
        HostIntervals::FAST,
        &format!(
            "enabled = true\nbridges = [\"vmbr0\"]\nnetns = \"/run/netns/{}\"\n",
            br_ns.0
        ),
    );
    let agent = guest_of_host(dir.path(), quic, "1s", "sched_latency", &[]);
    let prom = Prometheus::start(agent.addr);
    let vm = vmid.to_string();
    let of_host = [("host", HOST)];
    let wait_panel = |title: &str, vars: &[(&str, &str)], ok: &dyn Fn(&[Json]) -> bool| {
        wait_for(Duration::from_secs(40), || {
            let r = panel(&prom, &d, title, vars);
            ok(&r).then_some(r)
        })
        .unwrap_or_else(|| panic!("{title}: {:?}", panel(&prom, &d, title, vars)))
    };
    wait_panel("Stream connected", &of_host, &|r| {
        r.len() == 1 && num(&r[0]) == 1.0
    });
    assert!(variable_values(&prom, &d, "host").contains(&HOST.to_string()));

    // Thunderbolt: the router's recorded 20 Gb/s × 2 lanes each way, authorized.
    let tbw = wait_panel("Thunderbolt link bandwidth", &of_host, &|r| {
        r.iter().filter(|s| s["metric"]["device"] == "0-1").count() == 2
    });
    for s in tbw.iter().filter(|s| s["metric"]["device"] == "0-1") {
        assert_eq!(num(s), 40.0, "{s}");
    }
    let auth = wait_panel("Thunderbolt routers authorized", &of_host, &|r| {
        r.iter().any(|s| s["metric"]["device"] == "0-1")
    });
    assert!(auth.iter().all(|s| num(s) == 1.0), "{auth:?}");

    // The VM: running, its vCPUs waiting as their schedstat says.
    let state = wait_panel("VM state", &of_host, &|r| {
        r.iter().any(|s| s["metric"]["vmid"] == vm.as_str())
    });
    let mine: Vec<&Json> = state
        .iter()
        .filter(|s| s["metric"]["vmid"] == vm.as_str())
        .collect();
    assert_eq!(mine.len(), 1, "one state at a time: {state:?}");
    assert_eq!(mine[0]["metric"]["state"], "running");
    // over 20 s of the contention: the panel's rate against the threads' own schedstat
    wait_panel("vCPU run delay", &of_host, &|r| {
        r.iter().any(|s| s["metric"]["vmid"] == vm.as_str())
    });
    let (w0, t0) = (vcpu_wait_ns(qemu.0.id()), Instant::now());
    std::thread::sleep(Duration::from_secs(22));
    let (w1, dt) = (vcpu_wait_ns(qemu.0.id()), t0.elapsed());
    let truth = (w1 - w0) as f64 / 1e9 / dt.as_secs_f64();
    let (_, _, e) = queries(&d)
        .into_iter()
        .find(|(t, _, _)| t == "vCPU run delay")
        .unwrap();
    let q = expand_all(&e.replace("$__rate_interval", "20s"), &of_host);
    let got = prom
        .query(&q)
        .unwrap()
        .into_iter()
        .find(|s| s["metric"]["vmid"] == vm.as_str())
        .map(|s| num(&s))
        .unwrap();
    eprintln!("vCPU run delay: panel {got:.3} s/s, schedstat {truth:.3} s/s");
    assert!(truth > 0.2, "the vCPUs waited: {truth}");
    assert!(
        (got - truth).abs() <= 0.3 * truth,
        "panel {got} vs schedstat {truth}"
    );

    // The bridge: an upload from the VM through its port; the VM-side bytes are its NIC's.
    let nic = |stat: &str| -> u64 {
        sh(&format!(
            "ip netns exec {} cat /sys/class/net/eth0/statistics/{stat}",
            vm_ns.0
        ))
        .trim()
        .parse()
        .unwrap()
    };
    let series = |dir: &str| -> f64 {
        prom.scalar(&format!(
            "max(gpufeed_host_bridge_bytes_total{{host=\"{HOST}\",vmid=\"{vm}\",direction=\"{dir}\"}})"
        ))
        .unwrap_or(0.0)
    };
    // settled: the counters stand still (nothing but the test's upload crosses the port)
    std::thread::sleep(Duration::from_secs(3));
    let before = (series("tx"), series("rx"), nic("tx_bytes"), nic("rx_bytes"));
    // 300 kB uploaded from the VM to a server behind the bridge (TCP: data one way, acks back)
    let _server = spawn_in_ns(&br_ns.0, "exec iperf3 -s -1 -B 10.201.7.1");
    let sent = wait_for(Duration::from_secs(10), || {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &vm_ns.0,
                "iperf3",
                "-c",
                "10.201.7.1",
                "-n",
                "300K",
            ])
            .output()
            .ok()
            .filter(|o| o.status.success())
    });
    assert!(sent.is_some(), "iperf3 through the VM's port");
    // iperf3 returns when its data is written, not when the last segments (the tail of the
    // send queue, FIN, ACKs) have crossed the NIC: its counters once two reads 300 ms apart
    // agree (a single read right away once found 231,689 of the 300 kB, under load)
    let (nic_tx, nic_rx) = wait_for(Duration::from_secs(10), || {
        let a = (nic("tx_bytes"), nic("rx_bytes"));
        std::thread::sleep(Duration::from_millis(300));
        let b = (nic("tx_bytes"), nic("rx_bytes"));
        (a == b).then_some((b.0 - before.2, b.1 - before.3))
    })
    .expect("the VM's NIC counters stand still after the upload");
    assert!(
        nic_tx >= 300 * 1024,
        "the upload left the VM's NIC: {nic_tx}"
    );
    let settled = wait_for(Duration::from_secs(20), || {
        let (tx, rx) = (series("tx") - before.0, series("rx") - before.1);
        (tx == nic_tx as f64 && rx == nic_rx as f64).then_some(())
    });
    assert!(
        settled.is_some(),
        "VM-side bridge bytes tx {} rx {} vs the VM's NIC tx {nic_tx} rx {nic_rx}",
        series("tx") - before.0,
        series("rx") - before.1
    );
    let traffic = panel(&prom, &d, "Bridge traffic per VM", &of_host);
    let mine: Vec<&Json> = traffic
        .iter()
        .filter(|s| s["metric"]["vmid"] == vm.as_str())
        .collect();
    assert_eq!(mine.len(), 2, "{traffic:?}");
    assert!(
        mine.iter()
            .all(|s| num(s) > 0.0 && s["metric"]["bridge"] == "vmbr0"),
        "{mine:?}"
    );
    let bursts = panel(&prom, &d, "Bridge microbursts per VM", &of_host);
    assert!(
        bursts.iter().any(|s| s["metric"]["vmid"] == vm.as_str()),
        "{bursts:?}"
    );

    // The link drops: the PCIe panels follow, and the annotation marks it with its summary.
    let t_drop = now_ms();
    demo(&["link", root.to_str().unwrap(), "2.5 GT/s PCIe", "1"]);
    let t_drop_done = now_ms();
    wait_panel("PCIe link width", &of_host, &|r| {
        r.iter().any(|s| s["metric"]["bdf"] == GPU && num(s) == 1.0)
    });
    let (_, anno) = annotation_queries(&d)
        .into_iter()
        .find(|(n, _)| n == "Host events")
        .unwrap();
    let marks = wait_for(Duration::from_secs(20), || {
        let r = prom.query(&expand_all(&anno, &of_host)).ok()?;
        let drop: Vec<Json> = r
            .into_iter()
            .filter(|s| s["metric"]["event"] == "link_degraded")
            .collect();
        (!drop.is_empty()).then_some(drop)
    })
    .expect("the link drop as an annotation");
    for m in &marks {
        let summary = m["metric"]["summary"].as_str().unwrap();
        assert!(
            summary.starts_with("PCIe link 0000:0a:00.0")
                || summary.starts_with("PCIe link 0000:09:01.0"),
            "{summary}"
        );
        assert!(summary.contains("2.5 GT/s"), "{summary}");
        let t = num(m) as i64;
        assert!(
            t >= t_drop - 1000 && t <= t_drop_done + 2000,
            "annotation at {t}, drop {t_drop}..{t_drop_done}"
        );
    }
    // every host-row query and the annotation evaluate with a host and with All
    for (t, r, e) in queries(&d) {
        for vars in [&of_host[..], &[]] {
            if let Err(err) = prom.query(&expand_all(&e, vars)) {
                panic!("{t} ({r}): {err}");
            }
        }
    }
    drop(qemu);
}
