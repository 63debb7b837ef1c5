//! Per-pod bytes and drops at the tc layer on the real kernel: a shaped pod's
//! rate as a real Prometheus sees it, agreement with the veth's own counters,
//! qdisc drops against the qdisc's own counter, a foreign tc program that keeps
//! running and keeps its verdicts, clsact filters a killed agent left, and
//! bandwidth annotations.

use crate::common;

mod foreign {
    include!(concat!(env!("OUT_DIR"), "/tc_foreign.skel.rs"));
}

use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::fake_kube::FakeKube;
use common::*;
use libbpf_rs::skel::SkelBuilder;
use libbpf_rs::{MapCore, MapFlags};

const NODE: &str = "talos-gpu-worker-1";
const BYTES: &str = "ebpf_tc_bytes_total";
const DROPS: &str = "ebpf_tc_dropped_packets_total";

/// A pod object in the API's shape, with IP and annotations.
fn pod_json(
    ns: &str,
    name: &str,
    uid: &str,
    cid: &str,
    ip: &str,
    annotations: &[(&str, &str)],
) -> serde_json::Value {
    let ann: serde_json::Map<String, serde_json::Value> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
        .collect();
    serde_json::json!({
        "metadata": {"name": name, "namespace": ns, "uid": uid, "resourceVersion": "100",
                     "creationTimestamp": "2026-11-29T10:00:00Z", "labels": {"app": name}, "annotations": ann},
        "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "busybox"}]},
        "status": {"phase": "Running", "qosClass": "Burstable", "podIP": ip, "podIPs": [{"ip": ip}],
                   "containerStatuses": [{"name": "main", "ready": true, "restartCount": 0, "image": "busybox",
                       "imageID": "", "containerID": format!("containerd://{cid}"), "started": true,
                       "state": {"running": {"startedAt": "2026-11-29T10:00:01Z"}}}]}
    })
}

fn pod_list(items: Vec<serde_json::Value>) -> String {
    serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "100"}, "items": items})
        .to_string()
}

fn wait_attached(agent: &Agent, n: f64) {
    wait_for(Duration::from_secs(15), || {
        (value(&agent.scrape(), "gpufeed_tc_interfaces", &[])? >= n).then_some(())
    })
    .unwrap_or_else(|| panic!("tc programs attached to {n} pod interfaces"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shaped_pod_rate_in_prometheus_bytes_match_interface_counters_and_annotations() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (s1, ip1, _) = net.server();
    let (s2, ip2, _) = net.server();
    let _srv1 = spawn_in_ns(&s1, "exec iperf3 -s");
    let _srv2 = spawn_in_ns(&s2, "exec iperf3 -s");

    let (uid_a, cid_a, uid_b, cid_b) = (random_uid(), random_cid(), random_uid(), random_cid());
    let mut capped = Pod::new(&sb, Layout::Cgroupfs, "burstable", &uid_a, &cid_a);
    let mut free = Pod::new(&sb, Layout::Systemd, "burstable", &uid_b, &cid_b);
    net.join(&mut capped);
    net.join(&mut free);
    // What the CNI bandwidth plugin does for egress-bandwidth=50M: a token bucket
    // on the pod's traffic (here on the pod side of its veth).
    let ns_a = capped.netns.clone().unwrap();
    sh(&format!(
        "ip netns exec {ns_a} tc qdisc add dev eth0 root tbf rate 50mbit burst 32kb latency 50ms"
    ));
    let list = pod_list(vec![
        pod_json(
            "inference",
            "capped",
            &uid_a,
            &cid_a,
            capped.ip.as_deref().unwrap(),
            &[("kubernetes.io/egress-bandwidth", "50M")],
        ),
        pod_json(
            "inference",
            "free",
            &uid_b,
            &cid_b,
            free.ip.as_deref().unwrap(),
            &[],
        ),
        pod_json(
            "batch",
            "typo",
            &random_uid(),
            &random_cid(),
            "10.213.250.9",
            &[("kubernetes.io/ingress-bandwidth", "50X")],
        ),
    ]);
    let kube = FakeKube::start(NODE, list, vec![]).await;
    // processes that hold the pods' namespaces and cgroups until the traffic starts
    capped.spawn("exec sleep 60");
    free.spawn("exec sleep 60");

    let (agent, _kc) = agent_with_kube(
        &kube,
        &["--interval", "500ms", "--probes", "tc", "--node-name", NODE],
    )
    .await;
    wait_attached(&agent, 2.0);
    let prom = Prometheus::start(agent.addr);

    let hif_a = capped.host_if.clone().unwrap();
    let hif_b = free.host_if.clone().unwrap();
    let sel_a = [("namespace", "inference"), ("pod", "capped")];
    let sel_b = [("namespace", "inference"), ("pod", "free")];
    let metric = |s: &[Sample], sel: &[(&str, &str)], dir: &str| {
        let mut w = sel.to_vec();
        w.push(("direction", dir));
        value(s, BYTES, &w).unwrap_or(0.0)
    };
    // (interface counters, our series) for: capped egress = host rx, capped
    // ingress = host tx, and the same for the free pod
    let snapshot = || -> ([u64; 4], [f64; 4]) {
        let s = agent.scrape();
        (
            [
                if_stat(&hif_a, "rx_bytes"),
                if_stat(&hif_a, "tx_bytes"),
                if_stat(&hif_b, "rx_bytes"),
                if_stat(&hif_b, "tx_bytes"),
            ],
            [
                metric(&s, &sel_a, "egress"),
                metric(&s, &sel_a, "ingress"),
                metric(&s, &sel_b, "egress"),
                metric(&s, &sel_b, "ingress"),
            ],
        )
    };
    let (c0, m0) = snapshot();

    let t0 = Instant::now();
    let pa = capped.spawn(&format!("exec iperf3 -c {ip1} -t 8"));
    // 10x the cap, paced, so that both uploads get CPU on a small machine
    let pb = free.spawn(&format!("exec iperf3 -c {ip2} -t 8 -b 500M"));
    // rate over a window inside the upload, as Prometheus computes it
    std::thread::sleep(Duration::from_secs(2).saturating_sub(t0.elapsed()));
    let (a2, i2) = (
        metric(&agent.scrape(), &sel_a, "egress"),
        if_stat(&hif_a, "rx_bytes"),
    );
    std::thread::sleep(Duration::from_secs(7).saturating_sub(t0.elapsed()));
    let (a7, i7) = (
        metric(&agent.scrape(), &sel_a, "egress"),
        if_stat(&hif_a, "rx_bytes"),
    );
    eprintln!(
        "2..7 s: agent {:.1} Mbit/s, interface {:.1} Mbit/s",
        (a7 - a2) * 8.0 / 5e6,
        (i7 - i2) as f64 * 8.0 / 5e6
    );
    let rate_a = prom
        .scalar("rate(ebpf_tc_bytes_total{pod=\"capped\",direction=\"egress\"}[5s]) * 8")
        .expect("capped rate");
    let rate_b = prom
        .scalar("rate(ebpf_tc_bytes_total{pod=\"free\",direction=\"egress\"}[5s]) * 8")
        .expect("free rate");
    let ratio = prom
        .scalar("rate(ebpf_tc_bytes_total{pod=\"capped\",direction=\"egress\"}[5s]) * 8 / gpufeed_bandwidth_limit_bits_per_second")
        .expect("rate divided by the annotated limit");
    eprintln!(
        "egress rate: capped {:.1} Mbit/s (limit ratio {ratio:.3}), free {:.1} Mbit/s",
        rate_a / 1e6,
        rate_b / 1e6
    );
    assert!(
        (rate_a - 50e6).abs() / 50e6 < 0.10,
        "capped pod at {rate_a} bit/s, want 50 Mbit/s ± 10%"
    );
    assert!((ratio - 1.0).abs() < 0.10, "rate / limit = {ratio}");
    assert!(
        rate_b > 3.0 * 50e6,
        "uncapped pod {rate_b} bit/s is far above the cap"
    );

    capped.wait_exit(pa, Duration::from_secs(20));
    free.wait_exit(pb, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(1500));
    let (c1, m1) = snapshot();
    let s1 = agent.scrape();
    for (i, what) in [
        "capped egress (host rx)",
        "capped ingress (host tx)",
        "free egress (host rx)",
        "free ingress (host tx)",
    ]
    .iter()
    .enumerate()
    {
        let ours = m1[i] - m0[i];
        let theirs = (c1[i] - c0[i]) as f64;
        eprintln!("{what}: ours {ours} bytes, interface {theirs} bytes");
        assert!(theirs > 100_000.0, "{what}: traffic flowed");
        assert!(
            (ours - theirs).abs() / theirs < 0.01,
            "{what}: ours {ours} vs interface {theirs}"
        );
    }

    // limits from annotations, and a clear warning for the bad one
    let lim = value(
        &s1,
        "gpufeed_bandwidth_limit_bits_per_second",
        &[("pod", "capped"), ("direction", "egress")],
    );
    assert_eq!(lim, Some(50e6));
    assert!(find(
        &s1,
        "gpufeed_bandwidth_limit_bits_per_second",
        &[("pod", "typo")]
    )
    .is_empty());
    let log = agent.log.lock().unwrap().clone();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("batch/typo") && l.contains("50X")),
        "warning names the pod and the value:\n{log}"
    );
}

/// `tc -s qdisc` dropped counter of a device, inside a namespace or (None) the root one.
fn qdisc_dropped(ns: Option<&str>, dev: &str) -> u64 {
    let prefix = ns
        .map(|n| format!("ip netns exec {n} "))
        .unwrap_or_default();
    let out = sh(&format!("{prefix}tc -s qdisc show dev {dev}"));
    out.split_whitespace()
        .skip_while(|w| *w != "(dropped")
        .nth(1)
        .and_then(|v| v.trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("no dropped counter in: {out}"))
}

/// The qdisc's drop counter once a flood has ended (its queue drains within
/// milliseconds), and the agent's count read again until it reaches that (the
/// agent reports a drop a tick after it is counted; a busy machine's ticks run
/// late), for at most 10 s: the agent's last reading.
fn drops_settled(qdisc: impl Fn() -> u64, ours: impl Fn() -> f64) -> (u64, f64) {
    std::thread::sleep(Duration::from_millis(300));
    let want = qdisc();
    let mut last = 0.0;
    wait_for(Duration::from_secs(10), || {
        last = ours();
        (last >= want as f64).then_some(())
    });
    (want, last)
}

/// A pod on the test bridge whose eth0 a token bucket caps at 10 Mbit/s with a 20 kB queue,
/// so that a faster upload overflows it, and an iperf3 server beyond the bridge. (Fields
/// drop in order: the pod and the server before their bridge and sandbox.)
struct Capped {
    flooder: Pod,
    /// the pod's network namespace
    ns: String,
    srv_ip: String,
    _server: Proc,
    net: TestNet,
    sb: CgroupSandbox,
}

impl Capped {
    fn new() -> Capped {
        let sb = CgroupSandbox::new();
        let mut net = TestNet::new();
        let (srv, srv_ip, _) = net.server();
        let _server = spawn_in_ns(&srv, "exec iperf3 -s");
        let mut flooder = Pod::random(&sb, Layout::Cgroupfs, "besteffort");
        net.join(&mut flooder);
        let ns = flooder.netns.clone().unwrap();
        sh(&format!(
            "ip netns exec {ns} tc qdisc add dev eth0 root tbf rate 10mbit burst 10kb limit 20kb"
        ));
        Capped {
            flooder,
            ns,
            srv_ip,
            _server,
            net,
            sb,
        }
    }
}

/// The agent takes drop records out of the kernel's map while programs still count into it: a
/// drop counted as its record is taken must reach the next take, not vanish with the record.
/// Here the map is taken every millisecond, a hundred times as often as at the shortest tick,
/// during a flood that overflows a token bucket, and the drops taken add up to the qdisc's own
/// counter. (Taking each record as it was, the agent lost 1-3 of 65,672 drops this way in each
/// of three runs.)
#[test]
fn drops_counted_while_the_map_is_taken_are_not_lost() {
    use gpufeed_guest::probes::tc::{AttachMode, TcProbe};
    let Some(_lock) = require_root() else { return };
    let mut c = Capped::new();
    let (ns, srv_ip) = (c.ns.clone(), c.srv_ip.clone());
    // the pod's eth0, where the drops happen: every packet its qdisc drops, ARP included
    let netns = std::os::unix::fs::MetadataExt::ino(
        &std::fs::metadata(format!("/run/netns/{ns}")).unwrap(),
    ) as u32;
    let ifindex: u32 = sh(&format!(
        "ip netns exec {ns} cat /sys/class/net/eth0/ifindex"
    ))
    .trim()
    .parse()
    .unwrap();
    let btf = gpufeed_guest::probes::KernelBtf::load();
    let (mut probe, _) = TcProbe::load(&btf, AttachMode::Auto, true).expect("tc probe loads");
    let mut ours = 0u64;
    let mut takes = 0u64;
    let mut take = |probe: &mut TcProbe| {
        takes += 1;
        ours += probe
            .drain_drops()
            .iter()
            .filter(|(k, _)| (k.netns, k.ifindex) == (netns, ifindex))
            .map(|(_, n)| n)
            .sum::<u64>();
    };
    take(&mut probe);
    take(&mut probe);
    let d0 = qdisc_dropped(Some(&ns), "eth0");
    let f = c
        .flooder
        .spawn(&format!("exec iperf3 -c {srv_ip} -u -b 200M -t 4"));
    // the flood's 4 s and its start
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        take(&mut probe);
        std::thread::sleep(Duration::from_millis(1));
    }
    c.flooder.wait_exit(f, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(300));
    let d1 = qdisc_dropped(Some(&ns), "eth0");
    // a record is taken the call after its generation retires
    take(&mut probe);
    take(&mut probe);
    eprintln!(
        "drops taken {ours} in {takes} takes, the qdisc's {}",
        d1 - d0
    );
    assert!(d1 - d0 > 1000, "the token bucket overflowed ({})", d1 - d0);
    assert_eq!(ours, d1 - d0, "every drop taken once");
}

#[test]
fn qdisc_overflow_drops_match_the_qdisc_counter_for_the_right_pod() {
    let Some(_lock) = require_root() else { return };
    let mut c = Capped::new();
    let (ns, srv_ip) = (c.ns.clone(), c.srv_ip.clone());
    let mut bystander = Pod::random(&c.sb, Layout::Systemd, "burstable");
    c.net.join(&mut bystander);
    c.flooder.spawn("exec sleep 60");
    bystander.spawn("exec sleep 60");
    let root0 = root_qdiscs_dropped();
    let agent = Agent::no_kube("300ms", "tc", &[]);
    wait_attached(&agent, 2.0);
    let d0 = qdisc_dropped(Some(&ns), "eth0");
    let f = c
        .flooder
        .spawn(&format!("exec iperf3 -c {srv_ip} -u -b 100M -t 3"));
    c.flooder.wait_exit(f, Duration::from_secs(20));
    let flooders = |s: &[Sample]| -> f64 {
        find(
            s,
            DROPS,
            &[("pod", &c.flooder.uid), ("direction", "egress")],
        )
        .iter()
        .map(|x| x.value)
        .sum()
    };
    let (d1, _) = drops_settled(
        || qdisc_dropped(Some(&ns), "eth0"),
        || flooders(&agent.scrape()),
    );
    let s = agent.scrape();
    let ours = find(
        &s,
        DROPS,
        &[("pod", &c.flooder.uid), ("direction", "egress")],
    );
    let total: f64 = ours.iter().map(|x| x.value).sum();
    let reasons: Vec<&str> = ours.iter().map(|x| x.label("reason")).collect();
    eprintln!("drops: ours {total} ({reasons:?}), tc -s qdisc {}", d1 - d0);
    assert!(
        d1 - d0 > 100,
        "the token bucket overflowed ({} drops)",
        d1 - d0
    );
    assert_eq!(total as u64, d1 - d0, "drops equal the qdisc's own counter");
    assert!(
        reasons.iter().all(|r| r.starts_with("qdisc_")),
        "kernel reason names: {reasons:?}"
    );
    assert!(
        find(&s, DROPS, &[("pod", &bystander.uid)]).is_empty(),
        "no drops for the bystander"
    );
    // The flood's drops all went to the flooder (the equality above). Drops the machine's own
    // traffic takes on its own devices meanwhile (a CI runner's uplink) have no pod and are
    // rightly unattributed: they stay within what the root namespace's qdiscs counted.
    let root1 = root_qdiscs_dropped();
    let unattributed: Vec<String> = find(&s, DROPS, &[("pod", "")])
        .iter()
        .map(|x| format!("{:?} = {}", x.labels, x.value))
        .collect();
    let unattributed_total: f64 = find(&s, DROPS, &[("pod", "")])
        .iter()
        .map(|x| x.value)
        .sum();
    assert!(
        unattributed_total as u64 <= root1 - root0,
        "unattributed drops beyond the root namespace's own ({}): {unattributed:?}",
        root1 - root0
    );
}

/// Every qdisc's dropped counter in the root namespace, summed (an `mq` counts its children
/// again: an upper bound, as the check above needs).
fn root_qdiscs_dropped() -> u64 {
    let out = sh("tc -s qdisc show");
    let words: Vec<&str> = out.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[0] == "(dropped")
        .filter_map(|w| w[1].trim_end_matches(',').parse::<u64>().ok())
        .sum()
}

/// The foreign program as a clsact filter (handle 1) at `priority` on one hook
/// of an interface; detached by the caller.
fn foreign_clsact(
    skel: &foreign::TcForeignSkel<'_>,
    ifindex: u32,
    priority: u32,
    hook: libbpf_rs::TcAttachPoint,
) -> libbpf_rs::TcHook {
    let mut h = libbpf_rs::TcHookBuilder::new(skel.progs.foreign.as_fd())
        .ifindex(ifindex as i32)
        .replace(false)
        .handle(1)
        .priority(priority)
        .hook(hook);
    let _ = h.create();
    h.attach().unwrap();
    h
}

fn foreign_program_case(attach: &str) {
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (srv, srv_ip, _) = net.server();
    let _s = spawn_in_ns(&srv, "exec iperf3 -s");
    // a UDP sink on port 9 that counts what reaches it
    let sink = std::env::temp_dir().join(format!("gpufeed-sink-{}", uniq()));
    let _sink = spawn_in_ns(
        &srv,
        &format!(
            "exec python3 -c 'import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind((\"0.0.0.0\",9))\nn=0\nwhile True:\n  s.recv(2048); n+=1; open(\"{}\",\"w\").write(str(n))'",
            sink.display()
        ),
    );
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    net.join(&mut pod);
    pod.spawn("exec sleep 60");
    let hif = pod.host_if.clone().unwrap();
    let ifindex = ifindex_of(&hif);

    // someone else's program is there first (tcx, or a clsact filter)
    let mut storage = MaybeUninit::uninit();
    let open = foreign::TcForeignSkelBuilder::default()
        .open(&mut storage)
        .unwrap();
    let skel = gpufeed_guest::probes::object::load("tc_foreign", open).unwrap();
    let _link;
    let _hook_guard;
    if attach == "tcx" {
        _link = Some(attach_tcx(
            &skel.progs.foreign,
            ifindex,
            &[libbpf_sys::BPF_TCX_INGRESS],
        ));
        _hook_guard = None;
    } else {
        _link = None;
        _hook_guard = Some(foreign_clsact(&skel, ifindex, 1, libbpf_rs::TC_INGRESS));
    }
    let counts = |i: u32| -> u64 {
        let v = skel
            .maps
            .foreign_counts
            .lookup(&i.to_ne_bytes(), MapFlags::ANY)
            .unwrap()
            .unwrap();
        u64::from_ne_bytes(v[..8].try_into().unwrap())
    };

    let agent = Agent::no_kube("300ms", "tc", &["--tc-attach", attach]);
    wait_attached(&agent, 1.0);
    let seen0 = counts(0);
    let rx0 = if_stat(&hif, "rx_bytes");
    // 200 datagrams to the port the foreign program drops, then a TCP upload
    let u = pod.spawn(&format!(
        "exec bash -c 'for i in $(seq 200); do echo dropme > /dev/udp/{srv_ip}/9; done'"
    ));
    pod.wait_exit(u, Duration::from_secs(10));
    let t = pod.spawn(&format!("exec iperf3 -c {srv_ip} -t 2"));
    pod.wait_exit(t, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(900));
    let rx1 = if_stat(&hif, "rx_bytes");

    let received = std::fs::read_to_string(&sink)
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(0);
    let _ = std::fs::remove_file(&sink);
    eprintln!(
        "[{attach}] foreign program: saw {} packets, dropped {}; sink received {received}",
        counts(0) - seen0,
        counts(1)
    );
    assert_eq!(
        counts(1),
        200,
        "the foreign program still dropped every port-9 datagram"
    );
    assert_eq!(received, 0, "its drop verdict held");
    assert!(
        counts(0) - seen0 > 1000,
        "the foreign program kept running for the TCP upload too"
    );
    let ours = value(
        &agent.scrape(),
        BYTES,
        &[("pod", &pod.uid), ("direction", "egress")],
    )
    .unwrap();
    let theirs = (rx1 - rx0) as f64;
    eprintln!("[{attach}] ours {ours} bytes, interface {theirs}");
    assert!(theirs > 1_000_000.0);
    assert!(
        (ours - theirs).abs() / theirs < 0.01,
        "ours {ours} vs interface {theirs}"
    );
    drop(agent);
    if let Some(mut h) = _hook_guard {
        let _ = h.detach();
    }
}

#[test]
fn foreign_tcx_program_keeps_running_and_keeps_its_verdicts() {
    let Some(_lock) = require_root() else { return };
    foreign_program_case("tcx");
}

#[test]
fn foreign_clsact_filter_keeps_running_and_keeps_its_verdicts() {
    let Some(_lock) = require_root() else { return };
    foreign_program_case("clsact");
}

/// Our clsact priority (0xfee1) as `tc filter show` prints it.
const OUR_PREF: &str = "pref 65249 ";

/// The filters at our clsact priority on one hook of `dev`, as tc lists them
/// (the classifier's head line aside).
fn our_filters(dev: &str, hook: &str) -> Vec<String> {
    sh(&format!("tc filter show dev {dev} {hook}"))
        .lines()
        .filter(|l| l.contains(OUR_PREF) && l.contains(" handle "))
        .map(str::to_string)
        .collect()
}

/// A pod with its own namespace on the test bridge, an iperf3 server beside it
/// and something running in it (so the agent finds its interface).
fn pod_on_a_bridge(sb: &CgroupSandbox, net: &mut TestNet) -> (Pod, String, Proc) {
    let (srv, srv_ip, _) = net.server();
    let server = spawn_in_ns(&srv, "exec iperf3 -s");
    let mut pod = Pod::random(sb, Layout::Cgroupfs, "burstable");
    net.join(&mut pod);
    pod.spawn("exec sleep 60");
    (pod, srv_ip, server)
}

/// Before tcx (6.6) the byte programs are clsact filters, and a filter
/// outlives the agent that added it: one killed with SIGKILL (OOM, a forced
/// pod delete) leaves its two filters at our priority, counting into maps
/// nobody reads. The next agent replaces them (it does not fail on the taken
/// priority) and counts the pod's bytes as the interface does; stopped cleanly,
/// it leaves no filter behind.
#[test]
fn a_killed_agents_clsact_filters_are_replaced_by_the_next_agent() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (mut pod, srv_ip, _server) = pod_on_a_bridge(&sb, &mut net);
    let hif = pod.host_if.clone().unwrap();

    let killed = Agent::no_kube("300ms", "tc", &["--tc-attach", "clsact"]);
    wait_attached(&killed, 1.0);
    // SIGKILL: no chance to detach. Not reaped until the drop, so its pid
    // stays its own.
    unsafe { libc::kill(killed.child.id() as i32, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(300));
    let left: Vec<_> = ["ingress", "egress"]
        .iter()
        .flat_map(|h| our_filters(&hif, h))
        .collect();
    eprintln!("left by the killed agent: {left:#?}");
    assert_eq!(left.len(), 2, "the killed agent's filters stay: {left:?}");
    assert!(left[0].contains("tc_host_ingress") && left[1].contains("tc_host_egress"));
    drop(killed);

    let next = Agent::no_kube("300ms", "tc", &["--tc-attach", "clsact"]);
    wait_attached(&next, 1.0);
    assert!(
        next.log
            .lock()
            .unwrap()
            .contains("replacing a clsact filter an earlier agent left"),
        "the next agent says what it replaced"
    );
    for hook in ["ingress", "egress"] {
        let now = our_filters(&hif, hook);
        assert_eq!(now.len(), 1, "one filter of ours on {hook}: {now:?}");
        assert!(
            !left.contains(&now[0]),
            "the filter on {hook} is the new agent's program, not the old one: {now:?}"
        );
    }
    let rx0 = if_stat(&hif, "rx_bytes");
    let t = pod.spawn(&format!("exec iperf3 -c {srv_ip} -t 2"));
    pod.wait_exit(t, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(900));
    let theirs = (if_stat(&hif, "rx_bytes") - rx0) as f64;
    let ours = value(
        &next.scrape(),
        BYTES,
        &[("pod", &pod.uid), ("direction", "egress")],
    )
    .expect("the pod's egress bytes");
    eprintln!("after the replacement: ours {ours} bytes, interface {theirs}");
    assert!(theirs > 1_000_000.0, "the upload ran ({theirs} bytes)");
    assert!(
        (ours - theirs).abs() / theirs < 0.01,
        "ours {ours} vs interface {theirs}"
    );
    drop(next);
    for hook in ["ingress", "egress"] {
        let after = our_filters(&hif, hook);
        assert!(
            after.is_empty(),
            "a clean stop detaches on {hook}: {after:?}"
        );
    }
}

/// Our priority is only ever taken back from our own programs: another
/// filter there (here another BPF program on egress) stays, the interface is not
/// counted, the agent says why (once, though it tries again at each look), and
/// it does not leave its ingress half attached.
#[test]
fn another_filter_at_our_clsact_priority_is_left_alone() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (pod, _srv_ip, _server) = pod_on_a_bridge(&sb, &mut net);
    let hif = pod.host_if.clone().unwrap();
    // another tool's program on egress, at the priority we use
    let mut storage = MaybeUninit::uninit();
    let open = foreign::TcForeignSkelBuilder::default()
        .open(&mut storage)
        .unwrap();
    let skel = gpufeed_guest::probes::object::load("tc_foreign", open).unwrap();
    let mut theirs = foreign_clsact(&skel, ifindex_of(&hif), 0xfee1, libbpf_rs::TC_EGRESS);
    let agent = Agent::no_kube("300ms", "tc", &["--tc-attach", "clsact"]);
    wait_for(Duration::from_secs(15), || {
        agent
            .log
            .lock()
            .unwrap()
            .contains("a bpf filter of another program (foreign:[")
            .then_some(())
    })
    .expect("the agent says which filter holds its priority");
    // the agent looks at the interfaces again every 5 s and on each cgroup
    // change: it tries again, but says so once
    let mut other = Pod::random(&sb, Layout::Cgroupfs, "besteffort");
    other.spawn("exec sleep 60");
    std::thread::sleep(Duration::from_millis(5500));
    let said = agent
        .log
        .lock()
        .unwrap()
        .matches("a bpf filter of another program (foreign:[")
        .count();
    assert_eq!(said, 1, "the refusal is logged once, not at every look");
    assert_eq!(
        value(&agent.scrape(), "gpufeed_tc_attach_refusals_total", &[]),
        Some(1.0),
        "and counted once"
    );
    let egress = our_filters(&hif, "egress");
    assert_eq!(egress.len(), 1, "{egress:?}");
    assert!(egress[0].contains("foreign"), "theirs stays: {egress:?}");
    assert!(
        our_filters(&hif, "ingress").is_empty(),
        "no half attachment on ingress"
    );
    assert_eq!(
        value(&agent.scrape(), "gpufeed_tc_interfaces", &[]),
        Some(0.0),
        "the interface is not counted"
    );
    drop(agent);
    let _ = theirs.detach();
}

/// A "node device" in the root namespace (a veth whose other end is a server
/// namespace): what a hostNetwork pod's traffic leaves by.
struct NodeDevice {
    name: String,
    ns: String,
    server_ip: String,
}

impl NodeDevice {
    fn new() -> NodeDevice {
        let tag = uniq();
        let (name, ns) = (format!("gfn{tag}"), format!("gfns{tag}"));
        let net = 100 + (tag.len() as u32 * 7 + std::process::id()) % 100;
        let (local, server_ip) = (format!("10.216.{net}.1"), format!("10.216.{net}.2"));
        sh(&format!(
            "ip netns add {ns} && ip link add {name} type veth peer name eth0 netns {ns} && \
             ip addr add {local}/24 dev {name} && ip link set {name} up && \
             ip -n {ns} addr add {server_ip}/24 dev eth0 && ip -n {ns} link set eth0 up && ip -n {ns} link set lo up"
        ));
        NodeDevice {
            name,
            ns,
            server_ip,
        }
    }
}

impl Drop for NodeDevice {
    fn drop(&mut self) {
        sh_quiet(&format!(
            "ip netns pids {} | xargs -r kill -9; ip netns del {}",
            self.ns, self.ns
        ));
        sh_quiet(&format!("ip link del {}", self.name));
    }
}

#[test]
fn host_network_pod_bytes_by_socket_on_node_devices() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let node = NodeDevice::new();
    let _srv = spawn_in_ns(&node.ns, "exec iperf3 -s");
    // a hostNetwork pod: its own cgroups, the node's network namespace
    let mut hostnet = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut bystander = Pod::random(&sb, Layout::Systemd, "besteffort");
    bystander.spawn("exec sleep 60");
    let agent = Agent::no_kube("300ms", "tc", &["--node-devices", &node.name]);
    wait_for(Duration::from_secs(10), || {
        agent
            .log
            .lock()
            .unwrap()
            .contains("counting hostNetwork")
            .then_some(())
    })
    .expect("node device attached");
    let (tx0, rx0) = (
        if_stat(&node.name, "tx_bytes"),
        if_stat(&node.name, "rx_bytes"),
    );
    let up = hostnet.spawn(&format!("exec iperf3 -c {} -t 2", node.server_ip));
    hostnet.wait_exit(up, Duration::from_secs(20));
    let down = hostnet.spawn(&format!("exec iperf3 -c {} -t 2 -R", node.server_ip));
    hostnet.wait_exit(down, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(900));
    let (tx1, rx1) = (
        if_stat(&node.name, "tx_bytes"),
        if_stat(&node.name, "rx_bytes"),
    );
    let s = agent.scrape();
    let eg =
        value(&s, BYTES, &[("pod", &hostnet.uid), ("direction", "egress")]).expect("egress series");
    let ing = value(
        &s,
        BYTES,
        &[("pod", &hostnet.uid), ("direction", "ingress")],
    )
    .expect("ingress series");
    let (dev_tx, dev_rx) = ((tx1 - tx0) as f64, (rx1 - rx0) as f64);
    eprintln!("hostNetwork pod: egress ours {eg} device tx {dev_tx}; ingress ours {ing} device rx {dev_rx}");
    assert!(
        dev_tx > 10_000_000.0 && dev_rx > 10_000_000.0,
        "traffic flowed both ways"
    );
    assert!(
        (eg - dev_tx).abs() / dev_tx < 0.01,
        "egress {eg} vs device tx {dev_tx}"
    );
    assert!(
        (ing - dev_rx).abs() / dev_rx < 0.01,
        "ingress {ing} vs device rx {dev_rx}"
    );
    assert!(
        find(&s, BYTES, &[("pod", &bystander.uid)]).is_empty(),
        "the idle pod has no bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_without_socket_or_pod_device_go_by_pod_ip_else_unattributed() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (srv, srv_ip, srv_if) = net.server();
    // The cap sits on the server's side of the bridge: packets reach it
    // forwarded, without their socket, on a device that is no pod's.
    sh(&format!(
        "tc qdisc add dev {srv_if} root tbf rate 10mbit burst 10kb limit 20kb"
    ));
    let _s = spawn_in_ns(&srv, "exec iperf3 -s");
    let (uid_k, cid_k) = (random_uid(), random_cid());
    let mut known = Pod::new(&sb, Layout::Cgroupfs, "burstable", &uid_k, &cid_k);
    let mut unknown = Pod::random(&sb, Layout::Systemd, "besteffort");
    net.join(&mut known);
    net.join(&mut unknown);
    let list = pod_list(vec![pod_json(
        "inference",
        "known",
        &uid_k,
        &cid_k,
        known.ip.as_deref().unwrap(),
        &[],
    )]);
    let kube = FakeKube::start(NODE, list, vec![]).await;
    let (agent, _kc) = agent_with_kube(
        &kube,
        &[
            "--interval",
            "300ms",
            "--probes",
            "tc",
            "--node-name",
            NODE,
            "--node-devices",
            "none",
        ],
    )
    .await;
    wait_for(Duration::from_secs(15), || {
        (value(&agent.scrape(), "gpufeed_kube_synced", &[])? == 1.0).then_some(())
    })
    .expect("pod list received");

    // the qdisc's drops during a flood from `pod`, and the agent's count under `labels`
    // once it has caught up
    let flood = |pod: &mut Pod, labels: &[(&str, &str)]| -> (u64, Option<f64>) {
        let d0 = qdisc_dropped(None, &srv_if);
        let p = pod.spawn(&format!("exec iperf3 -c {srv_ip} -u -b 100M -t 2"));
        pod.wait_exit(p, Duration::from_secs(20));
        let (d1, _) = drops_settled(
            || qdisc_dropped(None, &srv_if),
            || value(&agent.scrape(), DROPS, labels).unwrap_or(0.0),
        );
        (d1 - d0, value(&agent.scrape(), DROPS, labels))
    };
    let (by_ip, ours_known) = flood(
        &mut known,
        &[
            ("namespace", "inference"),
            ("pod", "known"),
            ("direction", "egress"),
        ],
    );
    let (unattributed, ours_none) = flood(&mut unknown, &[("namespace", ""), ("pod", "")]);
    let s = agent.scrape();
    eprintln!(
        "drops at the server's cap: known pod {by_ip} (ours by IP {ours_known:?}), unknown pod {unattributed} (ours unattributed {ours_none:?})"
    );
    assert!(
        by_ip > 100 && unattributed > 100,
        "both floods overflowed the cap"
    );
    assert_eq!(
        ours_known,
        Some(by_ip as f64),
        "attributed by the packets' source IP"
    );
    assert_eq!(
        ours_none,
        Some(unattributed as f64),
        "counted with empty pod labels, not lost"
    );
    assert!(find(&s, DROPS, &[("pod", &unknown.uid)]).is_empty());
}

mod redirect {
    include!(concat!(env!("OUT_DIR"), "/redirect_keep_sk.skel.rs"));
}

mod peer {
    include!(concat!(env!("OUT_DIR"), "/redirect_peer.skel.rs"));
}

/// How a pod's traffic gets between its veth and the rest of the node.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Datapath {
    /// the pod's veth on a bridge (the stack forwards)
    Veth,
    /// tc on the pod veth's host side and on the node device redirect each way with
    /// bpf_redirect_neigh (the packet leaves by the other device's egress)
    RedirectNeigh,
    /// Cilium's BPF host routing: the pod's egress by bpf_redirect_neigh to the node
    /// device, its ingress by bpf_redirect_peer from the node device's ingress straight
    /// into the pod-side interface (the host-side veth never transmits it)
    RedirectPeer,
}

/// A counter of an interface inside a network namespace: the pod side's own count.
fn ns_if_stat(ns: &str, dev: &str, stat: &str) -> u64 {
    sh(&format!(
        "ip netns exec {ns} cat /sys/class/net/{dev}/statistics/{stat}"
    ))
    .trim()
    .parse()
    .unwrap()
}

fn iperf3_listening(ns: &str) -> Proc {
    let p = spawn_in_ns(ns, "exec iperf3 -s");
    wait_for(Duration::from_secs(10), || {
        sh(&format!("ip netns exec {ns} ss -ltnH sport = :5201"))
            .contains("5201")
            .then_some(())
    })
    .expect("iperf3 listening in its namespace");
    p
}

/// What one datapath case measured: (ours, the pod-side interface's) for egress and ingress,
/// and (ours, the qdisc's) for the drops a token bucket on the pod's interface made, with the
/// reasons the agent gave them.
struct Measured {
    egress: (f64, f64),
    ingress: (f64, f64),
    drops: (f64, f64),
    reasons: Vec<String>,
}

/// One pod on `path`: an upload and a download (iperf3, 2 s each) to a server
/// outside the node, the agent's bytes against the pod-side interface's counters.
fn datapath_case(path: Datapath) -> Measured {
    use libbpf_rs::skel::SkelBuilder;
    let sb = CgroupSandbox::new();
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut links = Vec::new();
    let mut _net = None;
    let mut _cleanup = None;
    let mut peer_skel_storage = MaybeUninit::uninit();
    let mut peer_skel = None;
    let (far_ns, far_ip, node_if, host_if);
    if path == Datapath::Veth {
        let mut net = TestNet::new();
        let (s, ip, _) = net.server();
        net.join(&mut pod);
        (far_ns, far_ip) = (s, ip);
        host_if = pod.host_if.clone().unwrap();
        node_if = None;
        _net = Some(net);
    } else {
        let tag = uniq();
        let net = 1 + (std::process::id() + tag.len() as u32 * 31) % 250;
        let (pod_ns, f_ns) = (format!("gfdp{tag}"), format!("gfdf{tag}"));
        let (p_if, n_if) = (format!("gfdh{tag}"), format!("gfdn{tag}"));
        let (pod_ip, f_ip) = (format!("10.219.{net}.2"), format!("10.220.{net}.2"));
        _cleanup = Some(ShOnDrop(format!(
            "ip netns pids {pod_ns} | xargs -r kill -9; ip netns pids {f_ns} | xargs -r kill -9; \
             ip netns del {pod_ns}; ip netns del {f_ns}; ip link del {p_if}; ip link del {n_if}"
        )));
        sh(&format!(
            "ip netns add {pod_ns} && ip netns add {f_ns} && \
             ip link add {p_if} type veth peer name eth0 netns {pod_ns} && \
             ip addr add 10.219.{net}.1/30 dev {p_if} && ip link set {p_if} up && \
             ip -n {pod_ns} addr add {pod_ip}/30 dev eth0 && ip -n {pod_ns} link set eth0 up && \
             ip -n {pod_ns} link set lo up && ip -n {pod_ns} route add default via 10.219.{net}.1 && \
             ip link add {n_if} type veth peer name eth0 netns {f_ns} && \
             ip addr add 10.220.{net}.1/30 dev {n_if} && ip link set {n_if} up && \
             ip -n {f_ns} addr add {f_ip}/30 dev eth0 && ip -n {f_ns} link set eth0 up && \
             ip -n {f_ns} link set lo up && ip -n {f_ns} route add default via 10.220.{net}.1"
        ));
        // the pod's egress: host-side veth ingress -> node device, by bpf_redirect_neigh
        let mut hops = vec![(p_if.clone(), n_if.clone())];
        if path == Datapath::RedirectNeigh {
            hops.push((n_if.clone(), p_if.clone()));
        }
        for (from, to) in hops {
            let mut storage = MaybeUninit::uninit();
            let mut open = redirect::RedirectKeepSkSkelBuilder::default()
                .open(&mut storage)
                .unwrap();
            open.maps.rodata_data.as_deref_mut().unwrap().to_ifindex = ifindex_of(&to);
            let skel = gpufeed_guest::probes::object::load("redirect_keep_sk", open).unwrap();
            links.extend(attach_tcx(
                &skel.progs.redirect_neigh_ip,
                ifindex_of(&from),
                &[libbpf_sys::BPF_TCX_INGRESS],
            ));
        }
        if path == Datapath::RedirectPeer {
            // the pod's ingress: node device ingress -> into the pod by bpf_redirect_peer
            let mut open = peer::RedirectPeerSkelBuilder::default()
                .open(&mut peer_skel_storage)
                .unwrap();
            let ro = open.maps.rodata_data.as_deref_mut().unwrap();
            ro.pod_host_ifindex = ifindex_of(&p_if);
            ro.pod_ip = u32::from_ne_bytes(pod_ip.parse::<std::net::Ipv4Addr>().unwrap().octets());
            let skel = gpufeed_guest::probes::object::load("redirect_peer", open).unwrap();
            links.extend(attach_tcx(
                &skel.progs.redirect_peer_in,
                ifindex_of(&n_if),
                &[libbpf_sys::BPF_TCX_INGRESS],
            ));
            peer_skel = Some(skel);
        }
        pod.netns = Some(pod_ns);
        pod.ip = Some(pod_ip);
        (far_ns, far_ip) = (f_ns, f_ip);
        host_if = p_if;
        node_if = Some(n_if);
    }
    let pod_ns = pod.netns.clone().unwrap();
    let uid = pod.uid.clone();
    let _srv = iperf3_listening(&far_ns);
    pod.spawn("exec sleep 60");
    let node_flag = node_if.clone().unwrap_or_else(|| "none".into());
    let agent = Agent::no_kube("300ms", "tc", &["--node-devices", &node_flag]);
    wait_attached(&agent, 1.0);
    std::thread::sleep(Duration::from_millis(500));
    let read = || {
        let s = agent.scrape();
        let m = |dir| value(&s, BYTES, &[("pod", &uid), ("direction", dir)]).unwrap_or(0.0);
        (
            m("egress"),
            m("ingress"),
            ns_if_stat(&pod_ns, "eth0", "tx_bytes"),
            ns_if_stat(&pod_ns, "eth0", "rx_bytes"),
            if_stat(&host_if, "tx_bytes"),
        )
    };
    let (eg0, in0, tx0, rx0, htx0) = read();
    let up = pod.spawn(&format!("exec iperf3 -c {far_ip} -t 2"));
    pod.wait_exit(up, Duration::from_secs(20));
    let down = pod.spawn(&format!("exec iperf3 -c {far_ip} -t 2 -R"));
    pod.wait_exit(down, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(900));
    let (eg1, in1, tx1, rx1, htx1) = read();
    let host_tx = (htx1 - htx0) as f64;
    // Drops by reason on this datapath: a token bucket on the pod's interface that a UDP
    // upload overflows; each drop the qdisc counts is the pod's, with its reason.
    sh(&format!(
        "ip netns exec {pod_ns} tc qdisc add dev eth0 root tbf rate 10mbit burst 10kb limit 20kb"
    ));
    let drops = || {
        let s = agent.scrape();
        let ours = find(&s, DROPS, &[("pod", &uid), ("direction", "egress")]);
        let reasons: Vec<String> = ours.iter().map(|x| x.label("reason").to_string()).collect();
        (ours.iter().map(|x| x.value).sum::<f64>(), reasons)
    };
    let ((ours0, _), d0) = (drops(), qdisc_dropped(Some(&pod_ns), "eth0"));
    let flood = pod.spawn(&format!("exec iperf3 -c {far_ip} -u -b 100M -t 2"));
    pod.wait_exit(flood, Duration::from_secs(20));
    let (d1, _) = drops_settled(
        || qdisc_dropped(Some(&pod_ns), "eth0"),
        || drops().0 - ours0 + d0 as f64,
    );
    let (ours1, reasons) = drops();
    let m = Measured {
        egress: (eg1 - eg0, (tx1 - tx0) as f64),
        ingress: (in1 - in0, (rx1 - rx0) as f64),
        drops: (ours1 - ours0, (d1 - d0) as f64),
        reasons,
    };
    eprintln!(
        "{path:?}: drops ours {} ({:?}), the qdisc's {}",
        m.drops.0, m.reasons, m.drops.1
    );
    eprintln!(
        "{path:?}: egress ours {} pod-side tx {} ({:+.3}%); ingress ours {} pod-side rx {} ({:+.3}%); host-side veth tx {host_tx}",
        m.egress.0,
        m.egress.1,
        100.0 * (m.egress.0 - m.egress.1) / m.egress.1,
        m.ingress.0,
        m.ingress.1,
        100.0 * (m.ingress.0 - m.ingress.1) / m.ingress.1,
    );
    let peers = value(&agent.scrape(), "gpufeed_tc_peer_redirect_interfaces", &[]);
    // the doctor names the datapath and where each direction is counted (re-evaluated
    // every 5 s from the agent's state)
    let want = if path == Datapath::RedirectPeer {
        "bpf_redirect_peer seen on 1 of 1"
    } else {
        "bpf_redirect_peer: not seen on 1 interfaces"
    };
    let datapath = wait_for(Duration::from_secs(12), || {
        let body = agent.try_get("/doctor")?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        let f = v.as_array()?.iter().find(|f| f["check"] == "datapath")?;
        let detail = f["detail"].as_str()?.to_string();
        (detail.contains(want) && f["status"] == "pass").then_some(detail)
    });
    eprintln!("{path:?}: doctor datapath: {datapath:?}");
    assert!(datapath.is_some(), "the doctor's datapath says {want:?}");
    if path == Datapath::RedirectPeer {
        let skel = peer_skel.as_ref().unwrap();
        let redirected = skel
            .maps
            .peer_counts
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .unwrap()
            .map(|v| u64::from_ne_bytes(v[..8].try_into().unwrap()))
            .unwrap_or(0);
        eprintln!("{path:?}: {redirected} packets redirected into the pod by bpf_redirect_peer");
        assert!(
            redirected > 1000,
            "the download came in by bpf_redirect_peer"
        );
        assert!(
            host_tx < 0.05 * m.ingress.1,
            "the host-side veth did not carry the download ({host_tx} bytes)"
        );
        assert_eq!(peers, Some(1.0), "the agent saw the peer redirect");
    } else {
        assert_eq!(peers, Some(0.0), "no peer redirect on {path:?}");
    }
    drop(agent);
    drop(links);
    m
}

/// A pod's bytes in both directions hold on each of the datapaths Cilium uses: a plain
/// veth, tc redirects both ways with bpf_redirect_neigh, and BPF host routing (ingress by
/// bpf_redirect_peer, which the host-side veth's egress never sees): each within 2% of
/// the pod-side interface's own counters, read inside the pod's namespace; and the drops a
/// shaped upload provokes equal the qdisc's own count, each with the kernel's reason.
#[test]
fn pod_bytes_match_the_pod_side_interface_on_each_datapath() {
    let Some(_lock) = require_root() else { return };
    for path in [
        Datapath::Veth,
        Datapath::RedirectNeigh,
        Datapath::RedirectPeer,
    ] {
        let m = datapath_case(path);
        for (dir, (ours, theirs)) in [("egress", m.egress), ("ingress", m.ingress)] {
            assert!(
                theirs > 10_000_000.0,
                "{path:?} {dir}: traffic flowed ({theirs})"
            );
            assert!(
                (ours - theirs).abs() / theirs < 0.02,
                "{path:?} {dir}: ours {ours} vs the pod-side interface {theirs}"
            );
        }
        let (ours, qdisc) = m.drops;
        assert!(
            qdisc > 100.0,
            "{path:?}: the token bucket overflowed ({qdisc} drops)"
        );
        assert_eq!(ours, qdisc, "{path:?}: drops equal the qdisc's own counter");
        assert!(
            m.reasons.iter().all(|r| r.starts_with("qdisc_")),
            "{path:?}: the kernel's reasons: {:?}",
            m.reasons
        );
    }
}
