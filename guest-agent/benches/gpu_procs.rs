//! GPU processes benchmark (not a test; root; needs cc and /dev/ttyS0): what
//! the GPU units (`nvml`, `gpu_driver`, `cuda`) cost the agent per tick as a
//! node's GPU processes grow, and whether processes that do nothing cost
//! anything. Kubelet-shaped pods (a pod cgroup and a container cgroup each,
//! in a private subtree of the cgroup2 root), 50 of them, hold:
//!
//! * no process (the peer: the same cgroups, the same GPUs, nothing on them);
//! * 200 idle GPU processes, 4 per pod (fixtures/gpu/gpu_proc.c): each loaded
//!   the stand-in libcuda, allocated device memory and opened the stand-in
//!   GPU device, then waits; the stand-in NVML lists each on one of its 4
//!   GPUs with its memory and no utilisation;
//! * the same 200 active: each makes a copy, a synchronisation and a driver
//!   call every 100 ms, and NVML samples it at 10% SM.
//!
//! For each population and each agent build, the agent (no Kubernetes API,
//! the three GPU units only, 1 s ticks, `gpu_driver` on its per-syscall
//! tracepoints) started fresh, 4 s to settle, its CPU
//! over a 10 s window (schedstat of all its threads, no scrape meanwhile),
//! then its RSS and one scrape that checks it saw the processes. Rounds
//! interleave every (population, build) pair, every other round in reverse
//! order; each figure is the median of the rounds, with their range.
//!
//! Why not `gpu_driver`'s default uprobes: they are attached per GPU
//! process, and an agent that exits takes each out of the running processes
//! again, which the kernel does slowly: with 200 processes its exit took
//! minutes here (about 3.5 when it closed them one after another), which a
//! benchmark that starts the agent afresh for every row cannot wait for. The
//! units' per-tick work in user space is the same in both modes but for the
//! uprobe mode's second look at processes the kernel says mapped something
//! (none of these do after they start).
//!
//! cargo bench -p gpufeed-guest --bench gpu_procs
//!
//! `GPU_PROCS_BEFORE=<path>` measures another build of the agent binary in
//! the same rounds (the one before a change); `GPU_PROCS_ROUNDS=<n>` (default
//! 5); `GPU_PROCS_UNITS=<probes>` loads other units than the three;
//! `GPU_PROCS_PERF=<dir>` records each measured agent with `perf record
//! --call-graph dwarf -F 39999` into `<dir>` during its window (which then
//! reads higher; an idle agent's window at 1 kHz held a few samples).

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{cc, Killed};
use gpufeed_shared::procstat::{cpu_ns, rss_kib};
use gpufeed_testkit::sandbox::CgroupSandbox;

const PODS: usize = 50;
const PER_POD: usize = 4;
const GPUS: usize = 4;
const SETTLE: Duration = Duration::from_secs(4);
const WINDOW: Duration = Duration::from_secs(10);

/// The stand-ins in a scratch directory: NVML with 4 GPUs answering for the
/// processes file, libcuda, the GPU device node and the process program.
struct StandIns {
    dir: tempfile::TempDir,
}

impl StandIns {
    fn new() -> StandIns {
        let dir = tempfile::tempdir().unwrap();
        let s = StandIns { dir };
        let d = s.dir.path();
        std::fs::write(s.procs(), "").unwrap();
        std::fs::write(d.join("nvml-control"), format!("count {GPUS}\n")).unwrap();
        let define = |name: &str, p: PathBuf| format!("-D{name}=\"{}\"", p.display());
        let nvml_args = [
            "-shared".to_string(),
            "-fPIC".into(),
            "-Wl,-soname,libnvidia-ml.so.1".into(),
            define("STANDIN_PROCS", s.procs()),
            define("STANDIN_CONTROL", d.join("nvml-control")),
        ];
        let nvml_args: Vec<&str> = nvml_args.iter().map(String::as_str).collect();
        cc("nvml/fake_nvml.c", &s.nvml(), &nvml_args);
        std::fs::create_dir(d.join("lib")).unwrap();
        cc(
            "cuda/fake_libcuda.c",
            &d.join("lib/libcuda.so.1"),
            &["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1"],
        );
        cc("gpu/gpu_proc.c", &d.join("gpu_proc"), &["-ldl"]);
        let uart = std::fs::metadata("/dev/ttyS0").expect("needs /dev/ttyS0 (an 8250 UART)");
        let node = std::ffi::CString::new(s.device().to_str().unwrap()).unwrap();
        // SAFETY: a valid C string path; mknod creates a device node there.
        let rc = unsafe { libc::mknod(node.as_ptr(), libc::S_IFCHR | 0o600, uart.rdev()) };
        assert_eq!(rc, 0, "mknod: {}", std::io::Error::last_os_error());
        s
    }

    fn procs(&self) -> PathBuf {
        self.dir.path().join("nvml-procs")
    }

    fn nvml(&self) -> PathBuf {
        self.dir.path().join("libnvidia-ml.so.1")
    }

    fn device(&self) -> PathBuf {
        self.dir.path().join("nvidia0")
    }

    /// What NVML lists from now on: each pid on a GPU in turn, 1 GiB, `sm` %.
    fn set_processes(&self, pids: &[u32], sm: u32) {
        let text: String = pids
            .iter()
            .enumerate()
            .map(|(i, pid)| format!("{pid} {} {} {sm}\n", i % GPUS, 1u64 << 30))
            .collect();
        let tmp = self.procs().with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, self.procs()).unwrap();
    }
}

/// The pods, in a cgroup sandbox of their own (testkit's: removed on drop,
/// whatever still runs in it killed).
struct Node {
    _sandbox: CgroupSandbox,
    containers: Vec<PathBuf>,
}

impl Node {
    fn new() -> Node {
        let sandbox = CgroupSandbox::new();
        let containers = (0..PODS).map(|n| sandbox.kube_pod(n)).collect();
        Node {
            _sandbox: sandbox,
            containers,
        }
    }

    /// 200 GPU processes, 4 in each container; they are ready (library
    /// loaded, memory allocated, device open) when this returns.
    fn populate(&self, s: &StandIns, mode: &str) -> Vec<Killed> {
        let mut procs = Vec::new();
        for ctr in &self.containers {
            for _ in 0..PER_POD {
                let c = Command::new("sh")
                    .arg("-c")
                    .arg(format!(
                        "echo $$ > {}/cgroup.procs && LD_LIBRARY_PATH={} exec {} {} {mode}",
                        ctr.display(),
                        s.dir.path().join("lib").display(),
                        s.dir.path().join("gpu_proc").display(),
                        s.device().display(),
                    ))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap();
                procs.push(Killed(c));
            }
        }
        let device = s.device();
        let deadline = Instant::now() + Duration::from_secs(30);
        for p in &procs {
            let holds = || {
                std::fs::read_dir(format!("/proc/{}/fd", p.0.id()))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == device))
            };
            while !holds() {
                assert!(Instant::now() < deadline, "a GPU process opened the device");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        procs
    }
}

/// The sample of `name` without labels.
fn metric(text: &str, name: &str) -> Option<f64> {
    let samples = gpufeed_testkit::prom::parse(text);
    gpufeed_testkit::prom::find(&samples, name, &[])
        .into_iter()
        .find(|s| s.labels.is_empty())
        .map(|s| s.value)
}

/// How many samples `name` has.
fn series(text: &str, name: &str) -> usize {
    let samples = gpufeed_testkit::prom::parse(text);
    gpufeed_testkit::prom::find(&samples, name, &[]).len()
}

struct Measured {
    cpu_ms_per_s: f64,
    rss_mb: f64,
}

/// One agent run: its CPU per second over the window, its RSS; checks that
/// it saw the GPU processes (NVML's 4 GPUs and every container's memory;
/// with `active`, every container's driver time).
fn measure(
    agent_bin: &str,
    units: &str,
    s: &StandIns,
    (procs, active): (usize, bool),
    label: &str,
) -> Measured {
    let mut child = Command::new(agent_bin)
        .args(["run", "--no-kube", "--metrics-listen", "127.0.0.1:0"])
        .args(["--interval", "1s", "--probes", units])
        .arg("--nvml-library")
        .arg(s.nvml())
        .arg("--gpu-device-prefix")
        .arg(s.dir.path().join("nvidia"))
        .args(["--gpu-driver-name", "ttyS", "--gpu-driver-hook", "syscalls"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let pid = child.id();
    let agent = Killed(child);
    let addr = common::served_addr(stderr);
    std::thread::sleep(SETTLE);
    let (t0, c0) = (Instant::now(), cpu_ns(pid));
    match std::env::var_os("GPU_PROCS_PERF") {
        Some(dir) => {
            let data = Path::new(&dir).join(format!("{label}.data"));
            let status = Command::new("perf")
                .args([
                    "record",
                    "-q",
                    "--call-graph",
                    "dwarf",
                    "-F",
                    "39999",
                    "-p",
                    &pid.to_string(),
                    "-o",
                ])
                .arg(&data)
                .args(["--", "sleep", &WINDOW.as_secs().to_string()])
                .stdout(Stdio::null())
                .status()
                .expect("perf runs");
            assert!(status.success(), "perf record");
        }
        None => std::thread::sleep(WINDOW),
    }
    let cpu_ms_per_s = (cpu_ns(pid) - c0) as f64 / 1e6 / t0.elapsed().as_secs_f64();
    let rss_mb = rss_kib(pid) as f64 / 1024.0;
    let text = gpufeed_testkit::http::get(addr, "/metrics").expect("GET /metrics");
    if units.contains("gpu_driver") && active {
        let containers = series(&text, "ebpf_gpu_driver_time_seconds_total");
        assert_eq!(containers, PODS, "driver time, one series per container");
    }
    if units.contains("nvml") {
        assert_eq!(metric(&text, "gpufeed_nvml_gpus"), Some(GPUS as f64));
        let pods_with_memory = series(&text, "gpufeed_nvml_process_memory_bytes");
        let want = if procs > 0 { PODS } else { 0 };
        assert_eq!(
            pods_with_memory, want,
            "NVML memory series, one per container"
        );
    }
    drop(agent);
    Measured {
        cpu_ms_per_s,
        rss_mb,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn range(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split(':')
                .nth(1)
                .map(str::trim)
                .map(String::from)
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpus} CPUs ({model}), Linux {}", kernel.trim())
}

fn main() {
    if std::env::args().any(|a| a == "--list") || unsafe { libc::geteuid() } != 0 {
        eprintln!("gpu_procs benchmark: needs root; skipped");
        return;
    }
    // the agents load BPF and their CPU is the figure: no kernel test beside them
    let _lock = gpufeed_testkit::root::kernel_lock();
    let rounds: usize = std::env::var("GPU_PROCS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let units = std::env::var("GPU_PROCS_UNITS").unwrap_or_else(|_| "nvml,gpu_driver,cuda".into());
    let mut agents = vec![(
        "this build".to_string(),
        env!("CARGO_BIN_EXE_gpufeed-guest").to_string(),
    )];
    if let Ok(before) = std::env::var("GPU_PROCS_BEFORE") {
        agents.push(("before (GPU_PROCS_BEFORE)".to_string(), before));
    }
    let stand_ins = StandIns::new();
    let node = Node::new();
    let populations: [(&str, Option<(&str, u32)>); 3] = [
        ("0 GPU processes (50 empty pods)", None),
        ("200 idle GPU processes", Some(("idle", 0))),
        ("200 active GPU processes", Some(("active", 10))),
    ];
    let load_before = loadavg();
    eprintln!("machine: {}; load average {load_before}", machine());
    // cpu[population][agent] over the rounds
    let mut cpu = vec![vec![Vec::new(); agents.len()]; populations.len()];
    let mut rss = vec![vec![Vec::new(); agents.len()]; populations.len()];
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..populations.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for p in order {
            let (name, mode) = populations[p];
            let procs = match mode {
                Some((mode, sm)) => {
                    let procs = node.populate(&stand_ins, mode);
                    let pids: Vec<u32> = procs.iter().map(|k| k.0.id()).collect();
                    stand_ins.set_processes(&pids, sm);
                    procs
                }
                None => {
                    stand_ins.set_processes(&[], 0);
                    Vec::new()
                }
            };
            let mut agent_order: Vec<usize> = (0..agents.len()).collect();
            if (round + p) % 2 == 1 {
                agent_order.reverse();
            }
            for a in agent_order {
                let active = mode.is_some_and(|(m, _)| m == "active");
                let label = format!("r{round}-p{p}-a{a}");
                let m = measure(
                    &agents[a].1,
                    &units,
                    &stand_ins,
                    (procs.len(), active),
                    &label,
                );
                eprintln!(
                    "round {round}: {name}, {}: {:.3} ms/s, RSS {:.1} MB",
                    agents[a].0, m.cpu_ms_per_s, m.rss_mb
                );
                cpu[p][a].push(m.cpu_ms_per_s);
                rss[p][a].push(m.rss_mb);
            }
            drop(procs);
            stand_ins.set_processes(&[], 0);
        }
    }
    drop(node);

    println!(
        "## GPU units ({units}) against 200 GPU processes (median of {rounds} rounds, interleaved; range in brackets)\n"
    );
    println!(
        "machine: {}; load average {load_before} before, {} after\n",
        machine(),
        loadavg()
    );
    println!("| GPU processes | agent | agent CPU, ms per 1 s tick | vs 0 processes, same agent | RSS MB |");
    println!("|---|---|---|---|---|");
    for (p, (name, _)) in populations.iter().enumerate() {
        for (a, (agent, _)) in agents.iter().enumerate() {
            let m = median(cpu[p][a].clone());
            let (lo, hi) = range(&cpu[p][a]);
            let peer = median(cpu[0][a].clone());
            let r = median(rss[p][a].clone());
            println!(
                "| {name} | {agent} | {m:.3} [{lo:.3} – {hi:.3}] | {:+.3} ms ({:.2}×) | {r:.1} |",
                m - peer,
                m / peer
            );
        }
    }
}
