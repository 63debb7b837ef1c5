//! tc byte-counting cost (not a test): iperf3 over veth between a pod
//! namespace and a server namespace, with and without gpufeed's tc programs on
//! the pod's host-side veth, alternated in the same run; then BPF ns per packet
//! from BPF_ENABLE_STATS: the tc programs' and, beside them, the socket-delivery
//! program's (`pod_deliver`, cgroup_skb/ingress on the cgroup2 root, which counts a
//! pod's ingress where bpf_redirect_peer goes around its veth). Needs root and iperf3. `TC_BENCH_ROUNDS` (default 7) sets the rounds.
//!
//! cargo bench -p gpufeed-guest --bench tc_throughput

mod empty {
    include!(concat!(env!("OUT_DIR"), "/bench_empty.skel.rs"));
}

#[path = "../tests/common/mod.rs"]
mod common;

use std::mem::MaybeUninit;
use std::time::Duration;

use libbpf_rs::skel::SkelBuilder;

use common::*;

fn rounds() -> usize {
    std::env::var("TC_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7)
}

fn iperf_gbps(pod: &mut Pod, server: &str) -> f64 {
    let out = std::env::temp_dir().join(format!("gpufeed-iperf-{}.json", uniq()));
    let pid = pod.spawn(&format!(
        "exec iperf3 -c {server} -t 4 -J > {}",
        out.display()
    ));
    pod.wait_exit(pid, Duration::from_secs(30));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap()
        / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") || unsafe { libc::geteuid() } != 0 {
        eprintln!("tc throughput benchmark: needs root; skipped");
        return;
    }
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (srv, srv_ip, _) = net.server();
    let _s = spawn_in_ns(&srv, "exec iperf3 -s");
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    net.join(&mut pod);
    pod.spawn("exec sleep 600");
    std::thread::sleep(Duration::from_millis(300));

    let hif = pod.host_if.clone().unwrap();
    let ifindex = ifindex_of(&hif);
    let mut storage = MaybeUninit::uninit();
    let open = empty::BenchEmptySkelBuilder::default()
        .open(&mut storage)
        .unwrap();
    let skel = gpufeed_guest::probes::object::load("bench_empty", open).unwrap();

    let (mut without, mut with, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    let mut per_packet = Vec::new();
    let mut deliver_per_packet = Vec::new();
    let rounds = rounds();
    for _ in 0..rounds {
        without.push(iperf_gbps(&mut pod, &srv_ip));
        {
            let _links = attach_tcx(
                &skel.progs.empty_tc,
                ifindex,
                &[libbpf_sys::BPF_TCX_INGRESS, libbpf_sys::BPF_TCX_EGRESS],
            );
            floor.push(iperf_gbps(&mut pod, &srv_ip));
        }
        let agent = Agent::start(
            &["--no-kube", "--probes", "tc", "--node-devices", "none"],
            &[],
        );
        wait_for(Duration::from_secs(10), || {
            (value(&agent.scrape(), "gpufeed_tc_interfaces", &[])? >= 1.0).then_some(())
        })
        .expect("attached");
        with.push(iperf_gbps(&mut pod, &srv_ip));
        // BPF cost per packet, measured separately (the accounting itself costs)
        let stats = BpfStatsOn::new();
        let (a, da) = (bpf_prog_stats("tc_host_"), bpf_prog_stats("pod_deliver"));
        iperf_gbps(&mut pod, &srv_ip);
        let (b, db) = (bpf_prog_stats("tc_host_"), bpf_prog_stats("pod_deliver"));
        drop(stats);
        per_packet.push((b.0 - a.0) as f64 / (b.1 - a.1).max(1) as f64);
        deliver_per_packet.push((db.0 - da.0) as f64 / (db.1 - da.1).max(1) as f64);
        drop(agent);
    }
    let (w, o, f) = (
        median(with.clone()),
        median(without.clone()),
        median(floor.clone()),
    );
    println!("| configuration | iperf3 over veth, Gbit/s: median of {rounds} (all runs, 4 s each) | of without |");
    println!("|---|---|---|");
    println!("| without tc programs | {o:.2} ({without:.2?}) | 100% |");
    println!(
        "| empty tcx programs (floor) | {f:.2} ({floor:.2?}) | {:.1}% |",
        f / o * 100.0
    );
    println!(
        "| with gpufeed tc programs | {w:.2} ({with:.2?}) | {:.1}% |",
        w / o * 100.0
    );
    println!();
    println!(
        "BPF ns per packet (both directions, run time / run count): {:.0}",
        median(per_packet)
    );
    println!(
        "BPF ns per packet delivered to a socket (pod_deliver, cgroup_skb/ingress): {:.0}",
        median(deliver_per_packet)
    );
}
