//! Benchmark (not a test): idle CPU, wake-ups and RSS of the release binary at default
//! intervals, and link change → event latency. Writes nothing; prints a Markdown table.
//! `BENCH_BIN=path` measures another build of the binary; `BENCH_KMSG=device` makes the agent
//! read the machine's `/dev/kmsg` instead of the recorded file; the bridge sampler reads a
//! `vmbr0` with three Proxmox-named ports in a network namespace made for the run (root and
//! iproute2), or the machine's own links with `BENCH_BRIDGE=host`.
//!
//!   cargo build --release -p gpufeed-host
//!   cargo run --release -p gpufeed-host --example bench_host -- [IDLE_SECONDS] [SAMPLES]
//!
//! The agent reads the recorded TB4-eGPU + plain-slot tree (`--root`, 18 PCI devices, AER
//! files, a Thunderbolt router, 2 VMs) at the default intervals, while the bridge sampler runs
//! on a live rtnetlink every 100 ms.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpufeed_shared::procstat::{cpu_ns, cpu_ticks, rss_kib, switches};

/// A network namespace with a Proxmox-like `vmbr0` and three ports (a VM tap, a firewall
/// port, a container veth), removed on drop.
struct BenchNetns(String);

impl BenchNetns {
    fn new() -> Option<BenchNetns> {
        let ns = format!("gpufeed-bench-{}", std::process::id());
        let ip = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !ip(&["netns", "add", &ns]) {
            return None;
        }
        let me = BenchNetns(ns.clone());
        let ok = ip(&["-n", &ns, "link", "add", "vmbr0", "type", "bridge"])
            && ip(&["-n", &ns, "link", "set", "vmbr0", "up"])
            && [
                ("tap100i0", "p100"),
                ("fwpr101p0", "p101"),
                ("veth102i0", "p102"),
            ]
            .iter()
            .all(|(port, peer)| {
                ip(&[
                    "-n", &ns, "link", "add", port, "type", "veth", "peer", "name", peer,
                ]) && ip(&["-n", &ns, "link", "set", port, "master", "vmbr0", "up"])
                    && ip(&["-n", &ns, "link", "set", peer, "up"])
            });
        ok.then_some(me)
    }
}

impl Drop for BenchNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let idle_s: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(60);
    let samples: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(10);
    let target = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| format!("{}/../target", env!("CARGO_MANIFEST_DIR")));
    let bin = std::env::var("BENCH_BIN").unwrap_or(format!("{target}/release/gpufeed-host"));
    assert!(std::path::Path::new(&bin).exists(), "build {bin} first");
    let t = common::Tree::new();
    common::topology(&t);
    common::pve_basic(&t);
    // BENCH_KMSG=device: read the machine's /dev/kmsg (a character device, as on a real host)
    // instead of the recorded file.
    if std::env::var("BENCH_KMSG").as_deref() == Ok("device") {
        std::fs::remove_file(t.p("dev/kmsg")).unwrap();
        std::os::unix::fs::symlink("/dev/kmsg", t.p("dev/kmsg")).unwrap();
    }
    let cfg = t.p("host.toml");
    // The bridge sampler reads vmbr0 with three ports in a network namespace of its own (as
    // on a Proxmox host); BENCH_BRIDGE=host: the machine's own links instead (no bridge on a
    // plain machine, so the sampler only looks for one once per period).
    let netns = match std::env::var("BENCH_BRIDGE").as_deref() {
        Ok("host") => None,
        _ => Some(BenchNetns::new().expect("ip netns with vmbr0 (root and iproute2 needed)")),
    };
    // BENCH_SAMPLE_MS: another bridge sample interval than the default.
    let sample = std::env::var("BENCH_SAMPLE_MS")
        .map(|ms| format!("sample_interval_ms = {ms}\n"))
        .unwrap_or_default();
    let bridge = match &netns {
        Some(n) => format!("[bridge]\nnetns = \"/run/netns/{}\"\n{sample}", n.0),
        None => format!("[bridge]\n{sample}"),
    };
    std::fs::write(
        &cfg,
        format!("host_id = \"testnode\"\n[thunderbolt]\nuevents = false\n{bridge}"),
    )
    .unwrap();

    // Idle CPU and RSS at default intervals.
    let child = Kill(
        Command::new(&bin)
            .args(["run", "--metrics-listen", "127.0.0.1:0", "--config"])
            .arg(&cfg)
            .arg("--root")
            .arg(t.root())
            .env("RUST_LOG", "error")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    std::thread::sleep(Duration::from_secs(5));
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let c0 = cpu_ticks(pid);
    let (ns0, sw0) = (cpu_ns(pid), switches(pid));
    let t0 = Instant::now();
    let mut rss_max = 0;
    while t0.elapsed() < Duration::from_secs(idle_s) {
        std::thread::sleep(Duration::from_secs(1));
        rss_max = rss_max.max(rss_kib(pid));
    }
    let cpu = (cpu_ticks(pid) - c0) as f64 / hz / t0.elapsed().as_secs_f64();
    let wall = t0.elapsed().as_secs_f64();
    let cpu_exact = (cpu_ns(pid) - ns0) as f64 / 1e9 / wall;
    let wakeups = (switches(pid) - sw0) as f64 / wall;
    drop(child);

    // Link change → event latency at the default 1000 ms poll.
    let mut w = Kill(
        Command::new(&bin)
            .args(["watch", "--json", "--config"])
            .arg(&cfg)
            .arg("--root")
            .arg(t.root())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let out = w.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if l.contains("PcieLinkChange") {
                let _ = tx.send(Instant::now());
            }
        }
    });
    std::thread::sleep(Duration::from_secs(2));
    let gpu = format!("sys/devices/{}/current_link_speed", common::GPU);
    let mut lat = Vec::new();
    let mut seed = 0x1234_5678_9abc_def0u64;
    for i in 0..samples {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_millis(300 + seed % 1000));
        let speed = if i % 2 == 0 {
            "2.5 GT/s PCIe\n"
        } else {
            "16.0 GT/s PCIe\n"
        };
        let start = Instant::now();
        t.write(&gpu, speed);
        let got = rx.recv_timeout(Duration::from_secs(5)).expect("event");
        lat.push(got.duration_since(start).as_secs_f64() * 1000.0);
    }
    drop(w);
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    println!("| figure | value |");
    println!("|---|---|");
    println!(
        "| idle CPU, default intervals, {idle_s} s (utime+stime, 100 Hz ticks) | {:.3}% of one core |",
        cpu * 100.0
    );
    println!(
        "| idle CPU, default intervals, {idle_s} s (schedstat run time, ns) | {:.3}% of one core |",
        cpu_exact * 100.0
    );
    println!("| context switches (wake-ups) per second | {wakeups:.1} |");
    println!(
        "| peak RSS during idle run | {:.1} MiB |",
        rss_max as f64 / 1024.0
    );
    println!("| link change → event (pcie.poll_interval_ms = 1000), n={} | min {:.0} ms, mean {:.0} ms, max {:.0} ms |", lat.len(), lat[0], mean, lat[lat.len() - 1]);
}
