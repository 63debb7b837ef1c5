//! The RTT probe's cost per received segment (not a test): an unshaped iperf3 upload over
//! veth from a pod namespace, with the agent (`--probes tcp_rtt`) of this build and, when
//! `TCP_BENCH_BASELINE` names another build's binary, that one, alternated in the same run;
//! `tcp_probe`'s run time / run count from BPF_ENABLE_STATS. Needs root and iperf3.
//! `TCP_BENCH_ROUNDS` (default 7) sets the rounds.
//!
//! TCP_BENCH_BASELINE=/path/to/old/gpufeed-guest cargo bench -p gpufeed-guest --bench tcp_rtt_cost

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// ns per `tcp_probe` run over one 4 s upload with the agent `bin` attached.
fn round(bin: &str, pod: &mut Pod, server: &str) -> f64 {
    let mut cmd = Command::new(bin);
    cmd.args([
        "run",
        "--metrics-listen",
        "127.0.0.1:0",
        "--no-kube",
        "--probes",
        "tcp_rtt",
        "--interval",
        "1s",
    ])
    .env("RUST_LOG", "warn,gpufeed_guest=info")
    .env_remove("KUBECONFIG");
    let agent = Agent::launch(cmd);
    std::thread::sleep(Duration::from_millis(500));
    let stats = BpfStatsOn::new();
    let a = bpf_prog_stats("tcp_probe");
    let pid = pod.spawn(&format!("exec iperf3 -c {server} -t 4"));
    pod.wait_exit(pid, Duration::from_secs(30));
    let b = bpf_prog_stats("tcp_probe");
    drop(stats);
    drop(agent);
    (b.0 - a.0) as f64 / (b.1 - a.1).max(1) as f64
}

fn main() {
    if std::env::args().any(|a| a == "--list") || unsafe { libc::geteuid() } != 0 {
        eprintln!("tcp_probe cost benchmark: needs root; skipped");
        return;
    }
    let rounds: usize = std::env::var("TCP_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let this = env!("CARGO_BIN_EXE_gpufeed-guest").to_string();
    let mut bins = vec![("this build", this)];
    if let Ok(b) = std::env::var("TCP_BENCH_BASELINE") {
        bins.insert(0, ("baseline", b));
    }
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (srv, srv_ip, _) = net.server();
    let _s = spawn_in_ns(&srv, "exec iperf3 -s");
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    net.join(&mut pod);
    pod.spawn("exec sleep 600");
    std::thread::sleep(Duration::from_millis(300));
    let mut per: Vec<Vec<f64>> = vec![Vec::new(); bins.len()];
    for r in 0..rounds {
        // every other round in reverse order, so that neither build always goes first
        let mut order: Vec<usize> = (0..bins.len()).collect();
        if r % 2 == 1 {
            order.reverse();
        }
        for i in order {
            per[i].push(round(&bins[i].1, &mut pod, &srv_ip));
        }
    }
    println!("| agent | tcp_probe ns per received segment: median of {rounds} (all rounds) |");
    println!("|---|---|");
    for (i, (name, _)) in bins.iter().enumerate() {
        println!(
            "| {name} | {:.1} ({:.1?}) |",
            median(per[i].clone()),
            per[i]
        );
    }
}
