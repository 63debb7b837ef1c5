//! Test fixtures on the real kernel: kubelet-shaped cgroups, network
//! namespaces joined by veth pairs to a bridge, processes placed in both, the
//! agent binary, and a /metrics scraper.
//!
//! Everything a test creates carries a unique name and is removed by Drop, also
//! when the test fails. Traffic only flows between namespaces the test created.
#![allow(dead_code)]

pub mod chromium;
pub mod fake_kube;
pub mod gpu;
pub mod host_agent;
pub mod logs;

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

// The tools every crate's tests share; re-exported so that this crate's tests name them as
// `common::...` (each test binary uses some of them).
#[allow(unused_imports)]
pub use gpufeed_testkit::{
    free_port,
    http::{get as http_get, get_status as http_get_status},
    prom::{find, hist_quantile, parse as parse_metrics, value, Sample},
    root::{kernel_lock, require_root, KernelLock},
    sandbox::{cgroup2_root, remove_cgroup_tree, CgroupSandbox},
    sh::{sh, sh_quiet},
    uniq,
    wait::wait_for,
};

/// GET returning the body whatever the status (Prometheus reports query errors with 400).
pub fn http_get_any(addr: SocketAddr, path: &str) -> String {
    http_get_status(addr, path)
        .map(|(_, body)| body)
        .unwrap_or_else(|| panic!("GET {path} from {addr}: no answer"))
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// The index of a network interface of this namespace.
pub fn ifindex_of(ifname: &str) -> u32 {
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/ifindex"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// /kubepods/{burstable,besteffort}/pod<uid>/<cid>, Guaranteed at /kubepods/pod<uid>/<cid>
    Cgroupfs,
    /// /kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_>.slice/cri-containerd-<cid>.scope
    Systemd,
}

/// A thread's `schedstat` (`/proc/<pid>/task/<tid>/schedstat`): the kernel's own accounting.
#[derive(Debug, Clone, Copy, Default)]
pub struct Schedstat {
    /// Time on a CPU, ns.
    pub run_ns: u64,
    /// Time runnable but waiting for a CPU, ns.
    pub run_delay_ns: u64,
    /// Times it was switched in.
    pub runs: u64,
}

/// The schedstat of the thread whose `/proc` task directory is `task`; `None` if it is gone.
pub fn schedstat(task: &Path) -> Option<Schedstat> {
    let text = std::fs::read_to_string(task.join("schedstat")).ok()?;
    let f: Vec<u64> = text
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    (f.len() == 3).then(|| Schedstat {
        run_ns: f[0],
        run_delay_ns: f[1],
        runs: f[2],
    })
}

/// A pod: a container cgroup in one of kubelet's layouts, optionally with its own
/// network namespace attached to a test network.
pub struct Pod {
    pub uid: String,
    pub container_id: String,
    /// Absolute path of the container cgroup.
    pub cgroup: PathBuf,
    /// Absolute path of the pod cgroup.
    pub pod_cgroup: PathBuf,
    pub netns: Option<String>,
    pub ip: Option<String>,
    /// host-side veth
    pub host_if: Option<String>,
    children: Vec<Child>,
}

pub fn random_uid() -> String {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

pub fn random_cid() -> String {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Pod {
    /// Creates the cgroups of a pod (`qos`: "burstable", "besteffort" or "guaranteed").
    pub fn new(sb: &CgroupSandbox, layout: Layout, qos: &str, uid: &str, cid: &str) -> Pod {
        let (pod_dir, ctr_dir) = match layout {
            Layout::Cgroupfs => {
                let base = sb.prefix.join("kubepods");
                let pod = if qos == "guaranteed" {
                    base.join(format!("pod{uid}"))
                } else {
                    base.join(qos).join(format!("pod{uid}"))
                };
                let ctr = pod.join(cid);
                (pod, ctr)
            }
            Layout::Systemd => {
                let u = uid.replace('-', "_");
                let base = sb.prefix.join("kubepods.slice");
                let pod = if qos == "guaranteed" {
                    base.join(format!("kubepods-pod{u}.slice"))
                } else {
                    base.join(format!("kubepods-{qos}.slice"))
                        .join(format!("kubepods-{qos}-pod{u}.slice"))
                };
                let ctr = pod.join(format!("cri-containerd-{cid}.scope"));
                (pod, ctr)
            }
        };
        std::fs::create_dir_all(&ctr_dir).unwrap();
        Pod {
            uid: uid.to_string(),
            container_id: cid.to_string(),
            cgroup: ctr_dir,
            pod_cgroup: pod_dir,
            netns: None,
            ip: None,
            host_if: None,
            children: Vec::new(),
        }
    }

    /// A pod with a fresh random UID and container id.
    pub fn random(sb: &CgroupSandbox, layout: Layout, qos: &str) -> Pod {
        Pod::new(sb, layout, qos, &random_uid(), &random_cid())
    }

    /// Runs `cmd` (a shell command) inside the container cgroup (and the pod's
    /// netns, if any). The process moves itself into the cgroup before exec, so
    /// the test harness needs no unsafe pre_exec code.
    pub fn spawn(&mut self, cmd: &str) -> u32 {
        let procs = self.cgroup.join("cgroup.procs");
        let inner = match &self.netns {
            Some(ns) => format!(
                "exec ip netns exec {ns} sh -c '{}'",
                cmd.replace('\'', "'\\''")
            ),
            None => format!("exec sh -c '{}'", cmd.replace('\'', "'\\''")),
        };
        let script = format!("echo $$ > {} && {inner}", procs.display());
        let child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut child = child;
        // the shell moves itself into the cgroup before it execs the command
        // (same pid throughout): return once it is there (or already done)
        let procs_path = self.cgroup.join("cgroup.procs");
        let joined = wait_for(Duration::from_secs(5), || {
            let there = std::fs::read_to_string(&procs_path)
                .ok()?
                .lines()
                .any(|l| l.trim() == pid.to_string());
            (there || matches!(child.try_wait(), Ok(Some(_)))).then_some(())
        });
        self.children.push(child);
        assert!(
            joined.is_some(),
            "spawned process {pid} joined {}",
            procs_path.display()
        );
        pid
    }

    /// Waits for a process started with `spawn` to exit.
    pub fn wait_exit(&mut self, pid: u32, timeout: Duration) {
        let child = self
            .children
            .iter_mut()
            .find(|c| c.id() == pid)
            .expect("a child of this pod");
        let done = wait_for(timeout, || child.try_wait().ok().flatten().map(|_| ()));
        assert!(done.is_some(), "process {pid} exited within {timeout:?}");
    }

    /// All pids currently in the container cgroup.
    pub fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.cgroup.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Sum of run_delay (ns) over every thread of every process in the cgroup.
    pub fn run_delay_ns(&self) -> u64 {
        let mut total = 0;
        for pid in self.pids() {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                continue;
            };
            for t in tasks.flatten() {
                total += schedstat(&t.path()).map_or(0, |s| s.run_delay_ns);
            }
        }
        total
    }

    pub fn signal_all(&self, sig: i32) {
        for pid in self.pids() {
            unsafe { libc::kill(pid, sig) };
        }
    }

    pub fn kill_all(&mut self) {
        self.signal_all(libc::SIGKILL);
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
    }

    /// Removes the pod's cgroups (after killing what runs in them).
    pub fn remove(&mut self) {
        self.kill_all();
        remove_cgroup_tree(&self.pod_cgroup);
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.kill_all();
        if let Some(ns) = &self.netns {
            sh_quiet(&format!("ip netns del {ns}"));
        }
        if let Some(h) = &self.host_if {
            sh_quiet(&format!("ip link del {h}"));
        }
        remove_cgroup_tree(&self.pod_cgroup);
    }
}

/// A test network: a bridge in the root namespace (like a CNI bridge) with
/// server namespaces and pod namespaces attached by veth pairs. Addresses live
/// only inside the namespaces the test created; the root namespace has none.
pub struct TestNet {
    pub bridge: String,
    pub subnet: u8,
    next_host: u8,
    namespaces: Vec<String>,
    links: Vec<String>,
}

impl TestNet {
    pub fn new() -> TestNet {
        let tag = uniq();
        let bridge = format!("gfb{tag}");
        // a /24 per test network inside 10.213.0.0/16
        let subnet = (SEQ.fetch_add(1, Ordering::Relaxed) % 250) as u8 + 1;
        sh(&format!(
            "ip link add {bridge} type bridge && ip link set {bridge} up"
        ));
        TestNet {
            bridge,
            subnet,
            next_host: 1,
            namespaces: Vec::new(),
            links: vec![],
        }
    }

    fn attach(&mut self, ns: &str) -> (String, String) {
        let host = self.next_host;
        self.next_host += 1;
        let ip = format!("10.213.{}.{host}", self.subnet);
        let hif = format!("gfh{}", uniq());
        sh(&format!(
            "ip link add {hif} type veth peer name eth0 netns {ns} && \
             ip link set {hif} master {b} up && \
             ip -n {ns} addr add {ip}/24 dev eth0 && ip -n {ns} link set eth0 up && ip -n {ns} link set lo up",
            b = self.bridge
        ));
        self.links.push(hif.clone());
        (ip, hif)
    }

    /// A namespace acting as a server host; returns (namespace, ip, host-side veth).
    pub fn server(&mut self) -> (String, String, String) {
        let ns = format!("gfs{}", uniq());
        sh(&format!("ip netns add {ns}"));
        self.namespaces.push(ns.clone());
        let (ip, hif) = self.attach(&ns);
        (ns, ip, hif)
    }

    /// Gives the pod its own network namespace joined to the bridge.
    pub fn join(&mut self, pod: &mut Pod) {
        let ns = format!("gfp{}", uniq());
        sh(&format!("ip netns add {ns}"));
        let (ip, hif) = self.attach(&ns);
        pod.netns = Some(ns);
        pod.ip = Some(ip);
        pod.host_if = Some(hif);
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            sh_quiet(&format!(
                "ip netns pids {ns} | xargs -r kill -9; ip netns del {ns}"
            ));
        }
        for l in &self.links {
            sh_quiet(&format!("ip link del {l}"));
        }
        sh_quiet(&format!("ip link del {}", self.bridge));
    }
}

/// A long-running process started by a test, killed on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `cmd` inside namespace `ns` as a background process.
pub fn spawn_in_ns(ns: &str, cmd: &str) -> Proc {
    Proc(
        Command::new("ip")
            .args(["netns", "exec", ns, "sh", "-c", cmd])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// The agent binary running with the given extra arguments.
pub struct Agent {
    pub child: Child,
    pub addr: SocketAddr,
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Agent {
    /// The agent without a Kubernetes API (pods labelled by UID), reading
    /// every `interval`, with `probes` and any further flags.
    pub fn no_kube(interval: &str, probes: &str, extra: &[&str]) -> Agent {
        let mut args = vec!["--interval", interval, "--no-kube", "--probes", probes];
        args.extend_from_slice(extra);
        Agent::start(&args, &[])
    }

    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Agent {
        // port 0: the agent picks a free port and logs it, so no other process
        // can take the port between choosing and binding it
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"));
        cmd.arg("run")
            .arg("--metrics-listen")
            .arg("127.0.0.1:0")
            .args(args);
        cmd.env("RUST_LOG", "info").env_remove("KUBECONFIG");
        for (k, v) in env {
            cmd.env(k, v);
        }
        Agent::launch(cmd)
    }

    /// Runs any command that starts the agent with its log on stderr (the binary itself, or a
    /// container runtime running the image) and waits until it serves `/healthz` at the
    /// address its log names.
    pub fn launch(mut cmd: Command) -> Agent {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[agent] {line}");
                l2.lock().unwrap().push_str(&line);
                l2.lock().unwrap().push('\n');
            }
        });
        let listening = |log: &str| -> Option<SocketAddr> {
            let line = log.lines().find(|l| l.contains("serving /metrics"))?;
            line.split_whitespace()
                .find_map(|w| w.strip_prefix("addr=")?.parse().ok())
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            if let Some(a) = listening(&log.lock().unwrap()) {
                break a;
            }
            if let Ok(Some(status)) = child.try_wait() {
                std::thread::sleep(Duration::from_millis(100)); // let the log reader catch up
                panic!("agent exited ({status}); log:\n{}", log.lock().unwrap());
            }
            assert!(
                Instant::now() < deadline,
                "agent did not start listening; log:\n{}",
                log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let agent = Agent { child, addr, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut agent = agent;
        while Instant::now() < deadline {
            if agent.try_get("/healthz").is_some() {
                return agent;
            }
            if let Ok(Some(status)) = agent.child.try_wait() {
                std::thread::sleep(Duration::from_millis(100)); // let the log reader catch up
                panic!(
                    "agent exited ({status}); log:\n{}",
                    agent.log.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "agent did not become healthy; log:\n{}",
            agent.log.lock().unwrap()
        );
    }

    pub fn try_get(&self, path: &str) -> Option<String> {
        http_get(self.addr, path)
    }

    pub fn scrape(&self) -> Vec<Sample> {
        parse_metrics(&self.try_get("/metrics").expect("scrape /metrics"))
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

/// `gpufeed-guest certs init` into `out` for a guest at `guest` and host `host`, with
/// `extra` flags, as a user runs it.
pub fn certs_init(out: &Path, guest: &str, host: &str, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args(["certs", "init", "--out"])
        .arg(out)
        .args(["--guest-addr", guest, "--host", host])
        .args(extra)
        .output()
        .unwrap()
}

/// [`certs_init`] that must succeed (its error output in the failure).
pub fn certs_init_ok(out: &Path, guest: &str, host: &str) {
    let o = certs_init(out, guest, host, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Flags for [`agent_with_kube`]: the scheduler probe at a 200 ms tick on node `node`, a
/// pod's series kept for `grace` after it is gone.
pub fn sched_on_node<'a>(node: &'a str, grace: &'a str) -> [&'a str; 8] {
    [
        "--interval",
        "200ms",
        "--probes",
        "sched_latency",
        "--node-name",
        node,
        "--pod-grace",
        grace,
    ]
}

/// The agent pointed at a fake API server (its kubeconfig lives in the
/// returned directory, which must outlive the agent).
pub async fn agent_with_kube(
    kube: &fake_kube::FakeKube,
    args: &[&str],
) -> (Agent, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let kc = kube
        .write_kubeconfig(dir.path())
        .to_str()
        .unwrap()
        .to_string();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let agent = tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        Agent::start(&a, &[("KUBECONFIG", &kc)])
    })
    .await
    .unwrap();
    (agent, dir)
}

impl Drop for Agent {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// TcpRetransSegs of a network namespace (nstat, absolute counters).
pub fn retrans_segs(ns: &str) -> u64 {
    let out = sh(&format!("ip netns exec {ns} nstat -az TcpRetransSegs"));
    out.lines()
        .find(|l| l.starts_with("TcpRetransSegs"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no TcpRetransSegs in nstat output: {out}"))
}

/// A real Prometheus (Debian's package) on loopback scraping `target` every second.
pub struct Prometheus {
    _proc: Proc,
    addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    pub fn start(target: std::net::SocketAddr) -> Prometheus {
        Prometheus::start_with(|_| {
            format!(
                "scrape_configs:\n  - job_name: gpufeed-guest\n    static_configs:\n      - targets: ['{target}']\n"
            )
        })
    }

    /// Prometheus (1 s global interval) with the `scrape_configs:` document that `configure`
    /// returns; `configure` gets Prometheus's own directory, for any files the document names.
    pub fn start_with(configure: impl FnOnce(&Path) -> String) -> Prometheus {
        let p = Prometheus::spawn(configure, &[]);
        // Prometheus takes a few seconds after "ready" before its first scrape:
        // wait for it, so that later rate() windows hold a sample every second
        wait_for(Duration::from_secs(30), || {
            let up = p.query("up").ok()?;
            up.iter().any(|s| s["value"][1] == "1").then_some(())
        })
        .expect("prometheus scraped the agent");
        p
    }

    /// A Prometheus that scrapes nothing and takes what others write to it (remote write,
    /// `--web.enable-remote-write-receiver`, at `/api/v1/write`): a long-term store's stand-in.
    pub fn receiver() -> Prometheus {
        Prometheus::spawn(|_| String::new(), &["--web.enable-remote-write-receiver"])
    }

    /// Its address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Started with the configuration `configure` returns and `extra` flags; ready.
    fn spawn(configure: impl FnOnce(&Path) -> String, extra: &[&str]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let scrape_configs = configure(dir.path());
        let cfg = dir.path().join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n{scrape_configs}"),
        )
        .unwrap();
        let port = free_port();
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus (Debian package) is installed");
        let p = Prometheus {
            _proc: Proc(child),
            addr,
            _dir: dir,
        };
        wait_for(Duration::from_secs(30), || http_get(p.addr, "/-/ready"))
            .expect("prometheus ready");
        p
    }

    /// Instant query; returns the result vector, or the error Prometheus gave.
    pub fn query(&self, q: &str) -> Result<Vec<serde_json::Value>, String> {
        let body = http_get_any(
            self.addr,
            &format!(
                "/api/v1/query?query={}",
                gpufeed_testkit::http::query_encode(q)
            ),
        );
        let v: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if v["status"] != "success" {
            return Err(v["error"].to_string());
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }
}

impl Prometheus {
    /// A GET of Prometheus's HTTP API (`/api/v1/rules`, ...) as JSON.
    pub fn api(&self, path: &str) -> serde_json::Value {
        let body = http_get_any(self.addr, path);
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
    }

    /// The single value of an instant query that must return exactly one series.
    pub fn scalar(&self, q: &str) -> Option<f64> {
        let r = self.query(q).ok()?;
        if r.len() != 1 {
            return None;
        }
        r[0]["value"][1].as_str()?.parse().ok()
    }
}

/// Interface counter of a device in the root namespace.
pub fn if_stat(dev: &str, stat: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/class/net/{dev}/statistics/{stat}"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Attaches a tc program with tcx (the way another agent, say Cilium, would:
/// appended, no flags) to the given hooks of an interface; the links detach
/// when dropped.
pub fn attach_tcx(
    prog: &libbpf_rs::ProgramMut<'_>,
    ifindex: u32,
    hooks: &[libbpf_sys::bpf_attach_type],
) -> Vec<std::os::fd::OwnedFd> {
    use std::os::fd::{AsFd, AsRawFd, FromRawFd};
    hooks
        .iter()
        .map(|&ty| {
            // SAFETY: zeroed is a valid bpf_link_create_opts; sz tells libbpf its size.
            let mut opts: libbpf_sys::bpf_link_create_opts = unsafe { std::mem::zeroed() };
            opts.sz = std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as _;
            // SAFETY: a plain syscall wrapper; the program fd is valid for the call.
            let r = unsafe {
                libbpf_sys::bpf_link_create(prog.as_fd().as_raw_fd(), ifindex as i32, ty, &opts)
            };
            assert!(
                r >= 0,
                "tcx attach: {}",
                std::io::Error::from_raw_os_error(-r)
            );
            // SAFETY: r is a new link fd we own.
            unsafe { std::os::fd::OwnedFd::from_raw_fd(r) }
        })
        .collect()
}

/// Compiles a C fixture from tests/fixtures with the system compiler into
/// `out` (extra arguments go after the source: libraries, `-shared`, ...).
pub fn compile_c(fixture: &str, out: &Path, extra: &[&str]) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let status = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(out)
        .arg(&src)
        .args(extra)
        .status()
        .expect("running cc");
    assert!(status.success(), "cc {} failed", src.display());
}

/// The `rtt:` (smoothed RTT) ss reports for the busiest socket to `dst`, in us.
pub fn ss_rtt_us(ns: &str, dst: &str) -> Option<f64> {
    let out = sh(&format!("ip netns exec {ns} ss -tin dst {dst}"));
    // pick the socket with the most bytes_acked (the data connection)
    let mut best: Option<(u64, f64)> = None;
    for line in out.lines() {
        let rtt = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("rtt:"))
            .and_then(|r| r.split('/').next()?.parse::<f64>().ok());
        let acked = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("bytes_acked:"))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        if let Some(r) = rtt {
            if best.is_none_or(|(a, _)| acked > a) {
                best = Some((acked, r * 1000.0));
            }
        }
    }
    best.map(|(_, r)| r)
}

/// Runs a shell command (quietly) when dropped: cleanup of what a test built
/// by hand (namespaces, links), also when the test fails.
pub struct ShOnDrop(pub String);

impl Drop for ShOnDrop {
    fn drop(&mut self) {
        sh_quiet(&self.0);
    }
}

/// `gpufeed-guest explain --since SINCE` against the agent at `addr`: its exit status and text.
pub fn explain(addr: SocketAddr, since: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .args([
            "explain",
            "--since",
            since,
            "--url",
            &format!("http://{addr}"),
        ])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// (run time ns, run count) of the loaded programs whose names start with `prefix`,
/// from the kernel's program info (kernel.bpf_stats_enabled on).
pub fn bpf_prog_stats(prefix: &str) -> (u64, u64) {
    let mut t = (0, 0);
    let mut id = 0u32;
    // SAFETY: plain syscall wrappers; each fd is closed after its info is read, and the
    // info struct is zeroed and sized for the kernel.
    unsafe {
        while libbpf_sys::bpf_prog_get_next_id(id, &mut id) == 0 {
            let fd = libbpf_sys::bpf_prog_get_fd_by_id(id);
            if fd < 0 {
                continue;
            }
            let mut info: libbpf_sys::bpf_prog_info = std::mem::zeroed();
            let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
            if libbpf_sys::bpf_obj_get_info_by_fd(fd, &mut info as *mut _ as *mut _, &mut len) == 0
            {
                let name: Vec<u8> = info
                    .name
                    .iter()
                    .take_while(|c| **c != 0)
                    .map(|c| *c as u8)
                    .collect();
                if name.starts_with(prefix.as_bytes()) {
                    t.0 += info.run_time_ns;
                    t.1 += info.run_cnt;
                }
            }
            libc::close(fd);
        }
    }
    t
}

/// BPF run-time statistics on while this lives (`BPF_ENABLE_STATS`: counted per holder, so
/// another process writing `kernel.bpf_stats_enabled=0` meanwhile does not turn them off).
pub struct BpfStatsOn(std::os::fd::OwnedFd);

impl BpfStatsOn {
    pub fn new() -> BpfStatsOn {
        use std::os::fd::FromRawFd;
        // SAFETY: a plain syscall wrapper; the returned fd is ours.
        let fd = unsafe { libbpf_sys::bpf_enable_stats(libbpf_sys::BPF_STATS_RUN_TIME) };
        assert!(
            fd >= 0,
            "BPF_ENABLE_STATS: {}",
            std::io::Error::from_raw_os_error(-fd)
        );
        // SAFETY: fd is a new descriptor we own.
        BpfStatsOn(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }
}
