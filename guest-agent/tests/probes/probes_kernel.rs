//! End-to-end probe tests on the real kernel: real cgroups in both kubelet
//! layouts, real workloads, the real agent binary, its real /metrics, compared
//! with the kernel's own accounting (schedstat, ss, nstat).

use crate::common;

use std::time::Duration;

use common::*;

const SCHED: &str = "ebpf_sched_latency_microseconds";
const RTT: &str = "ebpf_tcp_rtt_microseconds";
const RETRANS: &str = "ebpf_tcp_retransmissions_total";

fn pod_labels(p: &Pod) -> [(&'static str, String); 2] {
    // Without a Kubernetes API, pods are labelled by UID and short container id.
    [
        ("pod", p.uid.clone()),
        ("container", p.container_id[..12].to_string()),
    ]
}

fn sel<'a>(l: &'a [(&'static str, String); 2]) -> Vec<(&'static str, &'a str)> {
    l.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn wait_ticks() {
    // agent runs with --interval 200ms; two ticks and some slack
    std::thread::sleep(Duration::from_millis(700));
}

#[test]
fn sched_latency_from_sched_info_agrees_with_schedstat() {
    let Some(_lock) = require_root() else { return };
    sched_latency_case("sched-info", &[]);
}

#[test]
fn sched_latency_from_wakeup_stamps_agrees_with_schedstat() {
    let Some(_lock) = require_root() else { return };
    // and the fallback read path: one lookup per cgroup, as on kernels
    // without batch reads
    sched_latency_case("stamp", &["--cgroup-reads", "each"]);
}

/// A pod with more CPU-bound tasks than its one CPU can serve against an idle
/// pod; the busy pod's histogram sum against its tasks' schedstat run_delay.
/// An agent in a cgroup namespace of its own (a container without
/// `cgroupns: host`) still reads the node's whole hierarchy through its
/// mount. Kernels that find a cgroup by id only inside the caller's
/// namespace make the agent leave its batch reads out and read cgroup by
/// cgroup; others (this project's 6.18 VMs) let the batch reads through.
/// Either way the pod's numbers are the kernel's.
#[test]
fn an_agent_in_its_own_cgroup_namespace_counts_its_pods() {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;

    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    // the namespace's root: a cgroup of the sandbox, not the hierarchy's root
    let home = sb.prefix.join("agent-home");
    std::fs::create_dir(&home).unwrap();
    let procs = std::ffi::CString::new(home.join("cgroup.procs").as_os_str().as_bytes()).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"));
    cmd.args([
        "run",
        "--metrics-listen",
        "127.0.0.1:0",
        "--interval",
        "200ms",
        "--no-kube",
        "--probes",
        "sched_latency",
    ])
    .env("RUST_LOG", "info")
    .env_remove("KUBECONFIG");
    // SAFETY: between fork and exec only async-signal-safe calls (open,
    // write, close, unshare) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let wrote = libc::write(fd, b"0".as_ptr().cast(), 1);
            libc::close(fd);
            if wrote != 1 || libc::unshare(libc::CLONE_NEWCGROUP) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let agent = Agent::launch(cmd);
    let batched = !agent
        .log
        .lock()
        .unwrap()
        .contains("batch reads of cgroup storage unavailable");
    eprintln!(
        "own cgroup namespace: batch reads {}",
        if batched { "on" } else { "off" }
    );
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let cpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        - 1;
    // three spinning tasks on one CPU, created after the agent loaded: every
    // wait of theirs is counted, so the pod's sum is their whole run_delay
    for _ in 0..3 {
        pod.spawn(&format!(
            "exec taskset -c {cpu} sh -c 'while :; do :; done'"
        ));
    }
    std::thread::sleep(Duration::from_secs(2));
    pod.signal_all(libc::SIGSTOP);
    wait_ticks();
    let kernel_us = pod.run_delay_ns() as f64 / 1000.0;
    let l = pod_labels(&pod);
    let ours_us = value(&agent.scrape(), &format!("{SCHED}_sum"), &sel(&l))
        .expect("the pod has a run-queue series");
    eprintln!(
        "own cgroup namespace: pod sum {ours_us:.0} us, schedstat run_delay {kernel_us:.0} us"
    );
    assert!(
        kernel_us > 1_000_000.0,
        "three tasks on one CPU for 2 s wait for seconds: {kernel_us} us"
    );
    let err = (ours_us - kernel_us).abs() / kernel_us;
    assert!(
        err < 0.10,
        "histogram sum {ours_us} us vs schedstat {kernel_us} us: {:.1}% apart",
        err * 100.0
    );
    pod.signal_all(libc::SIGCONT);
}

fn sched_latency_case(method: &str, extra: &[&str]) {
    let sb = CgroupSandbox::new();
    let mut args = vec!["--sched-method", method];
    args.extend_from_slice(extra);
    let agent = Agent::no_kube("200ms", "sched_latency", &args);
    assert!(
        agent
            .log
            .lock()
            .unwrap()
            .contains(&method.replace('-', "_")),
        "agent uses the {method} source"
    );
    if extra.contains(&"each") {
        assert!(
            agent
                .log
                .lock()
                .unwrap()
                .contains("reading cgroup by cgroup"),
            "agent reads cgroup by cgroup"
        );
    }
    let mut busy = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let mut idle = Pod::random(&sb, Layout::Systemd, "besteffort");
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let busy_cpu = cpus - 1;
    // four spinning tasks on one CPU: each waits ~3/4 of the time
    for _ in 0..4 {
        busy.spawn(&format!(
            "exec taskset -c {busy_cpu} sh -c 'while :; do :; done'"
        ));
    }
    idle.spawn("exec taskset -c 0 sh -c 'while :; do sleep 0.02; done'");
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(busy.pids().len(), 4, "all busy tasks joined the pod cgroup");

    // Freeze the busy tasks so that neither the kernel's run_delay nor our
    // histogram moves while both are read.
    busy.signal_all(libc::SIGSTOP);
    wait_ticks();
    let bl = pod_labels(&busy);
    let s0 = agent.scrape();
    let d0 = busy.run_delay_ns();
    let sum0 = value(&s0, &format!("{SCHED}_sum"), &sel(&bl)).expect("busy pod has a series");
    busy.signal_all(libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(3));
    busy.signal_all(libc::SIGSTOP);
    wait_ticks();
    let s1 = agent.scrape();
    let d1 = busy.run_delay_ns();
    let sum1 = value(&s1, &format!("{SCHED}_sum"), &sel(&bl)).unwrap();

    let ours_us = sum1 - sum0;
    let kernel_us = (d1 - d0) as f64 / 1000.0;
    eprintln!("[{method}] busy pod: histogram sum delta {ours_us:.0} us, schedstat run_delay delta {kernel_us:.0} us");
    assert!(
        kernel_us > 3_000_000.0,
        "4 tasks on one CPU for 3 s wait for seconds, got {kernel_us} us"
    );
    let err = (ours_us - kernel_us).abs() / kernel_us;
    assert!(
        err < 0.10,
        "histogram sum {ours_us} vs schedstat {kernel_us}: {:.1}% apart",
        err * 100.0
    );

    let busy_p99 = hist_quantile(&s1, SCHED, &sel(&bl), 0.99).unwrap();
    let il = pod_labels(&idle);
    let idle_p99 = hist_quantile(&s1, SCHED, &sel(&il), 0.99).expect("idle pod has a series");
    let idle_count = value(&s1, &format!("{SCHED}_count"), &sel(&il)).unwrap();
    eprintln!("p99 busy {busy_p99} us, idle {idle_p99} us ({idle_count} idle samples)");
    let idle_mean = value(&s1, &format!("{SCHED}_sum"), &sel(&il)).unwrap() / idle_count;
    let busy_mean = ours_us
        / (value(&s1, &format!("{SCHED}_count"), &sel(&bl)).unwrap()
            - value(&s0, &format!("{SCHED}_count"), &sel(&bl)).unwrap());
    eprintln!("mean wait busy {busy_mean:.0} us, idle {idle_mean:.0} us");
    assert!(idle_count >= 50.0, "the idle pod wakes every 20 ms");
    assert!(busy_p99 >= 4_000.0, "busy p99 {busy_p99} us");
    assert!(
        busy_p99 >= 4.0 * idle_p99,
        "busy p99 {busy_p99} us not far above idle p99 {idle_p99} us"
    );
    assert!(
        busy_mean >= 10.0 * idle_mean,
        "busy mean wait {busy_mean} us vs idle {idle_mean} us"
    );
    // both layouts resolved to their pod, not to a slice
    assert!(find(&s1, &format!("{SCHED}_count"), &[("slice", "gpufeed-test")]).is_empty());
    busy.signal_all(libc::SIGCONT);
}

#[test]
fn tcp_rtt_agrees_with_ss_and_silent_pod_has_none() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (srv_ns, srv_ip, srv_if) = net.server();
    // Queueing delay on the way to the server: a 20 Mbit/s token bucket with
    // ~25 ms of queue; a bulk upload keeps it filled.
    sh(&format!(
        "tc qdisc add dev {srv_if} root tbf rate 20mbit burst 16kb latency 25ms"
    ));
    let _server = spawn_in_ns(&srv_ns, "exec iperf3 -s -1");
    let agent = Agent::no_kube("200ms", "tcp_rtt,tcp_retransmit", &[]);
    let mut talker = Pod::random(&sb, Layout::Systemd, "burstable");
    let mut silent = Pod::random(&sb, Layout::Cgroupfs, "guaranteed");
    net.join(&mut talker);
    net.join(&mut silent);
    silent.spawn("exec sleep 30");
    std::thread::sleep(Duration::from_millis(300));
    talker.spawn(&format!("exec iperf3 -c {srv_ip} -t 8 -l 16k"));
    std::thread::sleep(Duration::from_secs(2));

    let tl = pod_labels(&talker);
    let mut want = sel(&tl);
    want.push(("dst", "private"));
    let s0 = agent.scrape();
    let (sum0, cnt0) = (
        value(&s0, &format!("{RTT}_sum"), &want).expect("talker has RTT samples"),
        value(&s0, &format!("{RTT}_count"), &want).unwrap(),
    );
    let ns = talker.netns.clone().unwrap();
    let mut ss = Vec::new();
    for _ in 0..20 {
        if let Some(r) = ss_rtt_us(&ns, &srv_ip) {
            ss.push(r);
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    let s1 = agent.scrape();
    let (sum1, cnt1) = (
        value(&s1, &format!("{RTT}_sum"), &want).unwrap(),
        value(&s1, &format!("{RTT}_count"), &want).unwrap(),
    );
    let ours = (sum1 - sum0) / (cnt1 - cnt0);
    let theirs = ss.iter().sum::<f64>() / ss.len() as f64;
    eprintln!(
        "mean srtt: ours {ours:.0} us over {} samples, ss {theirs:.0} us over {} readings",
        cnt1 - cnt0,
        ss.len()
    );
    assert!(ss.len() >= 10, "ss saw the socket");
    assert!(
        theirs > 2_000.0,
        "the shaped link adds queueing delay (ss {theirs} us)"
    );
    assert!(
        (ours - theirs).abs() / theirs < 0.20,
        "ours {ours} us vs ss {theirs} us"
    );

    let sl = pod_labels(&silent);
    assert!(
        find(&s1, &format!("{RTT}_count"), &sel(&sl)).is_empty(),
        "the silent pod has no RTT series"
    );
    assert!(
        find(&s1, RETRANS, &sel(&sl)).is_empty(),
        "the silent pod has no TCP series at all"
    );
}

#[test]
fn retransmits_equal_nstat_and_clean_pod_shows_zero() {
    let Some(_lock) = require_root() else { return };
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (lossy_ns, lossy_ip, lossy_if) = net.server();
    let (clean_ns, clean_ip, _) = net.server();
    // A token bucket with almost no queue in front of the lossy server: an
    // upload overflows it and loses segments, which the pod retransmits.
    sh(&format!(
        "tc qdisc add dev {lossy_if} root tbf rate 10mbit burst 10kb limit 12kb"
    ));
    let _s1 = spawn_in_ns(&lossy_ns, "exec iperf3 -s -1");
    let _s2 = spawn_in_ns(&clean_ns, "exec iperf3 -s -1");
    let agent = Agent::no_kube("200ms", "tcp_rtt,tcp_retransmit", &[]);
    let mut lossy = Pod::random(&sb, Layout::Cgroupfs, "besteffort");
    let mut clean = Pod::random(&sb, Layout::Systemd, "guaranteed");
    net.join(&mut lossy);
    net.join(&mut clean);
    std::thread::sleep(Duration::from_millis(300));
    let (lns, cns) = (lossy.netns.clone().unwrap(), clean.netns.clone().unwrap());
    let (l0, c0) = (retrans_segs(&lns), retrans_segs(&cns));
    let lp = lossy.spawn(&format!("exec iperf3 -c {lossy_ip} -t 4"));
    let cp = clean.spawn(&format!("exec iperf3 -c {clean_ip} -t 4 -b 20M"));
    lossy.wait_exit(lp, Duration::from_secs(15));
    clean.wait_exit(cp, Duration::from_secs(15));
    // Closed sockets live on (FIN, queued data) and may still retransmit: wait
    // until only TIME_WAIT remains, then give the agent two ticks.
    let quiet = wait_for(Duration::from_secs(20), || {
        let open = sh(&format!("ip netns exec {lns} ss -Htn state all exclude time-wait; ip netns exec {cns} ss -Htn state all exclude time-wait"));
        open.trim().is_empty().then_some(())
    });
    assert!(quiet.is_some(), "pod sockets closed");
    wait_ticks();
    let (l1, c1) = (retrans_segs(&lns), retrans_segs(&cns));
    let s = agent.scrape();
    let ll = pod_labels(&lossy);
    let cl = pod_labels(&clean);
    let ours_lossy = value(&s, RETRANS, &sel(&ll)).expect("lossy pod has a retransmit series");
    let ours_clean = value(&s, RETRANS, &sel(&cl)).expect("clean pod has a retransmit series (0)");
    eprintln!(
        "lost in kernel: {:?}",
        value(
            &s,
            "gpufeed_bpf_storage_alloc_failures_total",
            &[("probe", "tcp")]
        )
    );
    eprintln!(
        "retransmits: lossy ours {ours_lossy} nstat {}, clean ours {ours_clean} nstat {}",
        l1 - l0,
        c1 - c0
    );
    assert!(
        l1 - l0 >= 10,
        "the shaped link dropped segments (nstat {})",
        l1 - l0
    );
    assert_eq!(
        ours_lossy as u64,
        l1 - l0,
        "retransmits equal the namespace's TcpRetransSegs delta"
    );
    assert_eq!(c1 - c0, 0, "the clean path did not retransmit");
    assert_eq!(ours_clean, 0.0);
    let d: Vec<_> = find(&s, RETRANS, &sel(&ll))
        .iter()
        .map(|x| x.label("dst").to_string())
        .collect();
    assert_eq!(
        d,
        ["private"],
        "10.213.x.x classifies as the default 'private' destination"
    );
}
