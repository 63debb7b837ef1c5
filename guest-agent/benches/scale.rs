//! Scale benchmark (not a test): the agent's own cost as the node fills with
//! pods. Kubelet-shaped pods (a pod cgroup and a container cgroup each, in a
//! private subtree of the cgroup2 root): 0, 110 and 250 pods whose container
//! wakes every 20 ms, the same 250 at a 100 ms interval, 1,000 waking pods, then
//! the same 1,000 idle (their tasks gone, their cgroups left). For each, with every probe and without the GPU
//! probes: the agent (no Kubernetes API) started fresh, 3 s to settle, its CPU over a quiet window (schedstat
//! of all its threads, no scrape meanwhile), then the tick time it reports,
//! the time a /metrics request takes (median of 5) and its RSS. Needs root; takes the
//! kernel tests' lock for the whole run.
//!
//! cargo bench -p gpufeed-guest --bench scale
//!
//! `SCALE_ROWS=250,100ms` runs only the rows whose name contains one of the
//! comma-separated words (the node is still filled up to the last row run);
//! `SCALE_PERF=<dir>` records each measured row's agent with `perf record -g`
//! into `<dir>` during its CPU window (which then reads higher;
//! `SCALE_PERF_CALLGRAPH=dwarf` for call chains through Rust code, `SCALE_PERF_FREQ` for
//! another rate than 499 Hz: an agent at 0.3% of a core gives 499 Hz about 20 samples a row);
//! `SCALE_AGENT=<path>` measures another build of the agent binary;
//! `SCALE_BEFORE=<path>` measures that build too, row by row before this one
//! (interleaved, so both see the same machine), its rows marked "before".

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Killed;
use gpufeed_shared::procstat::{cpu_ns, rss_kib};
use gpufeed_testkit::sandbox::CgroupSandbox;

/// The pods, in a cgroup sandbox of their own (testkit's: removed on drop,
/// whatever still runs in it killed).
struct Node {
    // declared first, dropped first: the wakers are reaped before their
    // cgroups go
    wakers: Vec<Killed>,
    sandbox: CgroupSandbox,
    pods: usize,
}

impl Node {
    fn new() -> Node {
        let sandbox = CgroupSandbox::new();
        // the QoS level before any pod, as on a node: the 0-pod rows see the
        // same cgroups as they always did
        let qos = sandbox.prefix.join("kubepods/burstable");
        std::fs::create_dir_all(&qos).unwrap();
        Node {
            wakers: Vec::new(),
            sandbox,
            pods: 0,
        }
    }

    /// Adds a pod and container cgroup; returns the container's.
    fn add_pod(&mut self) -> PathBuf {
        self.pods += 1;
        self.sandbox.kube_pod(self.pods - 1)
    }

    /// Runs `cmd` in the container cgroup (the shell moves itself first).
    fn spawn(ctr: &Path, cmd: &str) -> Child {
        Command::new("sh")
            .arg("-c")
            .arg(format!("echo $$ > {}/cgroup.procs && {cmd}", ctr.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }

    fn add_waking(&mut self, n: usize) {
        for _ in 0..n {
            let ctr = self.add_pod();
            let c = Node::spawn(
                &ctr,
                "exec perl -e 'select(undef, undef, undef, 0.02) while 1'",
            );
            self.wakers.push(Killed(c));
        }
    }

    /// The waking pods' tasks exit; their cgroups stay (idle).
    fn quiet(&mut self) {
        self.wakers.clear();
    }
}

/// The body of a 200 answer to `GET path`.
fn get(addr: SocketAddr, path: &str) -> String {
    gpufeed_testkit::http::get(addr, path).unwrap_or_else(|| panic!("GET {path} from {addr}"))
}

/// The sample of `name` without labels.
fn metric(text: &str, name: &str) -> Option<f64> {
    let samples = gpufeed_testkit::prom::parse(text);
    gpufeed_testkit::prom::find(&samples, name, &[])
        .into_iter()
        .find(|s| s.labels.is_empty())
        .map(|s| s.value)
}

struct Row {
    name: String,
    cpu_pct: f64,
    tick_ms: f64,
    render_ms: f64,
    rss_mb: f64,
    cgroups: f64,
}

fn measure(agent_bin: &str, name: String, interval: &str, probes: &str, window: Duration) -> Row {
    let mut child = Command::new(agent_bin)
        .args([
            "run",
            "--no-kube",
            "--metrics-listen",
            "127.0.0.1:0",
            "--interval",
            interval,
            "--probes",
            probes,
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let pid = child.id();
    let agent = Killed(child);
    let addr = common::served_addr(stderr);
    std::thread::sleep(Duration::from_secs(3));
    let t0 = (Instant::now(), cpu_ns(pid));
    match std::env::var_os("SCALE_PERF") {
        Some(dir) => {
            let file: String = name
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            let data = Path::new(&dir).join(format!("{file}.data"));
            let secs = window.as_secs().to_string();
            // SCALE_PERF_CALLGRAPH=dwarf: call chains through code built
            // without frame pointers (larger files)
            let graph = std::env::var("SCALE_PERF_CALLGRAPH").unwrap_or_else(|_| "fp".into());
            let freq = std::env::var("SCALE_PERF_FREQ").unwrap_or_else(|_| "499".into());
            let status = Command::new("perf")
                .args([
                    "record",
                    "-q",
                    "--call-graph",
                    &graph,
                    "-F",
                    &freq,
                    "-p",
                    &pid.to_string(),
                    "-o",
                ])
                .arg(&data)
                .args(["--", "sleep", &secs])
                .stdout(Stdio::null())
                .status()
                .expect("perf runs");
            assert!(status.success(), "perf record");
        }
        None => std::thread::sleep(window),
    }
    let cpu_pct = (cpu_ns(pid) - t0.1) as f64 / 1e9 / t0.0.elapsed().as_secs_f64() * 100.0;
    let mut renders = Vec::new();
    let (mut tick_ms, mut cgroups) = (0.0f64, 0.0);
    for _ in 0..5 {
        let t = Instant::now();
        let text = get(addr, "/metrics");
        renders.push(t.elapsed().as_secs_f64() * 1000.0);
        tick_ms =
            tick_ms.max(metric(&text, "gpufeed_tick_duration_seconds").unwrap_or(0.0) * 1000.0);
        cgroups = metric(&text, "gpufeed_cgroups").unwrap_or(0.0);
        std::thread::sleep(Duration::from_millis(1100));
    }
    renders.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let rss_mb = rss_kib(pid) as f64 / 1024.0;
    drop(agent);
    let r = Row {
        name,
        cpu_pct,
        tick_ms,
        render_ms: renders[2],
        rss_mb,
        cgroups,
    };
    eprintln!(
        "{:<44} cpu {:>6.3}%  tick {:>6.2} ms  render {:>6.2} ms  rss {:>5.1} MB  cgroups {}",
        r.name, r.cpu_pct, r.tick_ms, r.render_ms, r.rss_mb, r.cgroups
    );
    r
}

fn main() {
    if std::env::args().any(|a| a == "--list") || unsafe { libc::geteuid() } != 0 {
        eprintln!("scale benchmark: needs root; skipped");
        return;
    }
    // one measurement at a time: the kernel tests and the other benchmarks take this lock too,
    // and an agent measured beside another run's reads that run's load
    let _lock = gpufeed_testkit::root::kernel_lock();
    let agent_bin = std::env::var("SCALE_AGENT")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_gpufeed-guest").to_string());
    let agent_bin = agent_bin.as_str();
    let before = std::env::var("SCALE_BEFORE").ok();
    let window = Duration::from_secs(15);
    let mut node = Node::new();
    let mut rows = Vec::new();
    // every probe (the default), and without the GPU probes, whose per-tick
    // work follows each pod's processes
    const NO_GPU: &str = "sched_latency,tcp_rtt,tcp_retransmit,tc";
    let only: Option<Vec<String>> = std::env::var("SCALE_ROWS")
        .ok()
        .map(|v| v.split(',').map(str::to_string).collect());
    let selected = |name: &str| {
        only.as_ref()
            .is_none_or(|words| words.iter().any(|w| name.contains(w.as_str())))
    };
    let names = |what: &str, interval: &str| {
        [("all", "all probes"), (NO_GPU, "no GPU probes")]
            .map(|(probes, label)| (probes, format!("{what}, {interval}, {label}")))
    };
    let plan: [(&str, &str); 6] = [
        ("0 pods", "1s"),
        ("110 pods waking every 20 ms", "1s"),
        ("250 pods waking every 20 ms", "1s"),
        ("250 pods waking every 20 ms", "100ms"),
        ("1,000 pods waking every 20 ms", "1s"),
        ("1,000 pods idle after waking", "1s"),
    ];
    // the last step whose rows are wanted: the node is filled up to it only
    let last = plan
        .iter()
        .rposition(|(what, interval)| names(what, interval).iter().any(|(_, n)| selected(n)))
        .unwrap_or(0);
    for (step, (what, interval)) in plan.into_iter().enumerate().take(last + 1) {
        match step {
            1 => node.add_waking(110),
            2 => node.add_waking(140),
            4 => node.add_waking(750),
            5 => node.quiet(),
            _ => {}
        }
        for (probes, name) in names(what, interval) {
            if selected(&name) {
                if let Some(bin) = &before {
                    let name = format!("{name} (before)");
                    rows.push(measure(bin, name, interval, probes, window));
                }
                rows.push(measure(agent_bin, name, interval, probes, window));
            }
        }
    }
    drop(node);

    println!("| pods (pod + container cgroup each), interval, probes | agent CPU (% of a core) | tick | /metrics request | RSS | cgroups |");
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.3}% | {:.2} ms | {:.2} ms | {:.1} MB | {} |",
            r.name, r.cpu_pct, r.tick_ms, r.render_ms, r.rss_mb, r.cgroups
        );
    }
}
