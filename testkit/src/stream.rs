//! What the stream's tests share, in one copy: the stream library's own test binaries
//! (`shared/tests/stream*`) and the host agent's stream and service tests build their
//! deployments, hubs, hosts and child processes here. A TLS deployment in a temp dir, the hub's
//! and the host's test configurations, the real stream client as the host agent drives it,
//! metric readers, log capture, a disk that fills up, re-executed child roles.
//!
//! Behind the kit's `stream` feature (the stream drivers of `gpufeed-shared`, an async runtime,
//! a log subscriber). For integration tests (`tests/`): in `gpufeed-shared`'s own unit tests
//! the kit's `gpufeed_shared` is another copy of the crate, whose types are not those under test.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use gpufeed_shared::clock::SystemClock;
use gpufeed_shared::event::Stamped;
use gpufeed_shared::proto::{self, EncodedEvent};
use gpufeed_shared::stream::client::{self, GuestEndpoint, RawEvent, StreamConfig, StreamHandle};
pub use gpufeed_shared::stream::hub;
use gpufeed_shared::tls::{self, Deployment};

/// A deployment (CA, guest cert for 127.0.0.1, host certs) written to `dir`.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub dep: Deployment,
}

impl Fixture {
    pub fn new(hosts: &[&str]) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let hosts: Vec<String> = hosts.iter().map(|s| s.to_string()).collect();
        let dep = Deployment::generate("127.0.0.1", &hosts).unwrap();
        dep.write_guest_dir(dir.path()).unwrap();
        dep.write_host_files(dir.path()).unwrap();
        Fixture { dir, dep }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn ca_pem(&self) -> Vec<u8> {
        std::fs::read(self.path().join(tls::CA_FILE)).unwrap()
    }

    pub fn host_pems(&self, host: &str) -> (Vec<u8>, Vec<u8>) {
        (
            std::fs::read(self.path().join(tls::host_cert_file(host))).unwrap(),
            std::fs::read(self.path().join(tls::host_key_file(host))).unwrap(),
        )
    }

    /// Host stream configuration for `host` streaming to `endpoint`.
    pub fn stream_config(
        &self,
        host: &str,
        endpoint: SocketAddr,
        spool: Option<&Path>,
    ) -> StreamConfig {
        stream_config_in(self.path(), host, endpoint, spool)
    }

    /// [`Fixture::stream_config`] with the defaults' reconnect and timeout timing: only the
    /// certificates, the guest and the spool differ from what a user runs.
    pub fn production_stream_config(&self, host: &str, endpoint: SocketAddr) -> StreamConfig {
        let d = StreamConfig::default();
        StreamConfig {
            reconnect_min_ms: d.reconnect_min_ms,
            reconnect_max_ms: d.reconnect_max_ms,
            idle_timeout_ms: d.idle_timeout_ms,
            keep_alive_ms: d.keep_alive_ms,
            connect_timeout_ms: d.connect_timeout_ms,
            ..self.stream_config(host, endpoint, None)
        }
    }
}

/// Host stream configuration using the certificates in `dir`; quick reconnects and timeouts.
pub fn stream_config_in(
    dir: &Path,
    host: &str,
    endpoint: SocketAddr,
    spool: Option<&Path>,
) -> StreamConfig {
    StreamConfig {
        ca: dir.join(tls::CA_FILE),
        cert: dir.join(tls::host_cert_file(host)),
        key: dir.join(tls::host_key_file(host)),
        spool_dir: spool.map(Path::to_owned).unwrap_or_default(),
        reconnect_min_ms: 20,
        reconnect_max_ms: 300,
        idle_timeout_ms: 2_000,
        keep_alive_ms: 300,
        guests: vec![GuestEndpoint {
            endpoint: endpoint.to_string(),
            name: "guest".into(),
            server_name: String::new(),
            vmids: vec![],
            devices: vec![],
        }],
        ..StreamConfig::default()
    }
}

/// Hub configuration for tests: ephemeral port, quick reload, no PTP lookup.
pub fn hub_config(tls_dir: &Path) -> hub::HubConfig {
    let mut c = hub::HubConfig::new("127.0.0.1:0".parse().unwrap(), tls_dir);
    c.tls_reload_interval = Duration::from_millis(100);
    c.idle_timeout = Duration::from_secs(2);
    c.sysfs_root = PathBuf::from("/nonexistent");
    c
}

/// A hub for `fx` keeping `recent` events, with its own registry.
pub async fn serve_hub(fx: &Fixture, recent: usize) -> (hub::Hub, prometheus::Registry) {
    serve_hub_with(fx, |hc| hc.recent_capacity = recent).await
}

/// A hub for `fx` on [`hub_config`] as `tune` changes it, with its own registry.
pub async fn serve_hub_with(
    fx: &Fixture,
    tune: impl FnOnce(&mut hub::HubConfig),
) -> (hub::Hub, prometheus::Registry) {
    let reg = prometheus::Registry::new();
    let mut hc = hub_config(fx.path());
    tune(&mut hc);
    (hub::serve(hc, &reg).await.unwrap(), reg)
}

/// Host `pve1` streaming with `cfg` on the host's realtime clock, with its own registry: the
/// stream client alone, as the host agent starts it for a guest that takes every event (no
/// routing, no host state).
pub fn start_host(cfg: StreamConfig) -> (StreamHandle, prometheus::Registry) {
    let reg = prometheus::Registry::new();
    let h = client::start(cfg, "pve1".into(), &reg, Arc::new(SystemClock), None, None).unwrap();
    (h, reg)
}

/// Events into the stream client's spool of its first guest, as the host agent gives them.
pub trait Push {
    /// Encodes each of `events` once, its realtime through the stream's reference clock
    /// (an oversized kmsg context cut, as the agent's router does), and spools them in order.
    fn push(&self, events: &[Stamped]);
    /// Spools raw events for the guest at `guest_index`, their host realtime as given.
    fn push_raw(&self, guest_index: usize, events: Vec<RawEvent>);
}

impl Push for StreamHandle {
    fn push(&self, events: &[Stamped]) {
        let clock = self.spools().clock();
        let encoded: Vec<EncodedEvent> = events
            .iter()
            .map(|ev| {
                let (e, _) =
                    proto::encode_event(clock.report(ev.realtime_ns), ev.monotonic_ns, &ev.event)
                        .unwrap();
                e
            })
            .collect();
        self.spools().push_encoded(0, &encoded);
    }

    fn push_raw(&self, guest_index: usize, events: Vec<RawEvent>) {
        self.spools().push_raw(guest_index, events);
    }
}

/// A hub (as [`serve_hub_with`]), then host `pve1` of `fx` streaming to it, spooling to
/// `spool` (memory only without): the hub, its registry, the host, the host's registry.
pub async fn hub_and_host(
    fx: &Fixture,
    spool: Option<&Path>,
    tune: impl FnOnce(&mut hub::HubConfig),
) -> (
    hub::Hub,
    prometheus::Registry,
    StreamHandle,
    prometheus::Registry,
) {
    let (hub, greg) = serve_hub_with(fx, tune).await;
    let (host, hreg) = start_host(fx.stream_config("pve1", hub.local_addr(), spool));
    (hub, greg, host, hreg)
}

/// The guest's series `name` for host `pve1`.
pub fn hub_metric(greg: &prometheus::Registry, name: &str) -> f64 {
    metric(greg, name, &[("host", "pve1")])
}

/// The host's series `name` for its guest (named `guest` in [`stream_config_in`]).
pub fn host_metric(hreg: &prometheus::Registry, name: &str) -> f64 {
    metric(hreg, name, &[("guest", "guest")])
}

/// Events the guest has received from host `pve1`.
pub fn events_received(greg: &prometheus::Registry) -> f64 {
    hub_metric(greg, "gpufeed_stream_events_received_total")
}

/// `KmsgLost { count: i }` events for `from..to`, ready for `push_raw`, stamped `i` ns.
pub fn kmsg_lost_raw(from: u64, to: u64) -> Vec<RawEvent> {
    (from..to)
        .map(|i| {
            let e = gpufeed_shared::event::HostEvent::KmsgLost { count: i };
            (i as i64, i, e.kind(), postcard::to_allocvec(&e).unwrap())
        })
        .collect()
}

/// Value of a counter or gauge with exactly these labels (0 when absent).
pub fn metric(reg: &prometheus::Registry, name: &str, labels: &[(&str, &str)]) -> f64 {
    for mf in reg.gather() {
        if mf.name() != name {
            continue;
        }
        for m in mf.get_metric() {
            let ls = m.get_label();
            let all = labels
                .iter()
                .all(|(k, v)| ls.iter().any(|l| l.name() == *k && l.value() == *v));
            if all && ls.len() == labels.len() {
                return match mf.get_field_type() {
                    prometheus::proto::MetricType::COUNTER => m.get_counter().get_value(),
                    _ => m.get_gauge().get_value(),
                };
            }
        }
    }
    0.0
}

/// Polls `f` until it holds. The timeout only bounds a failure: a two-core CI machine that is
/// also linking other test binaries can stall a task for seconds, so it is stretched fivefold
/// rather than tuned per call site. Nothing here measures latency.
pub async fn wait_for(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    crate::wait::until(timeout * 5, f).await
}

#[derive(Clone)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);
impl Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        std::io::stderr().write_all(b)?;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs (once per test binary) a subscriber that keeps every log line; returns the buffer.
pub fn capture_logs() -> Arc<Mutex<Vec<u8>>> {
    static BUF: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    BUF.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let w = LogBuf(buf.clone());
        tracing_subscriber::fmt()
            .with_env_filter("info")
            .with_ansi(false)
            .with_writer(move || w.clone())
            .init();
        buf
    })
    .clone()
}

/// Log lines containing all of `needles`.
pub fn log_lines(buf: &Arc<Mutex<Vec<u8>>>, needles: &[&str]) -> Vec<String> {
    let b = buf.lock().unwrap();
    String::from_utf8_lossy(&b)
        .lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .map(str::to_owned)
        .collect()
}

/// A raw QUIC client with the given rustls config (for hostile-peer tests).
pub fn raw_client(cfg: rustls::ClientConfig) -> (quinn::Endpoint, quinn::ClientConfig) {
    gpufeed_shared::stream::by_hand::client_endpoint(cfg).unwrap()
}

/// Copies the directory tree `from` to `to` (a spool or journal snapshot).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// A tmpfs of `size` KiB mounted on a fresh temporary directory: a disk that fills up. Needs
/// root (as every kernel test here); unmounted (lazily, so that open files cannot block it)
/// when dropped, also when the test fails.
pub struct TinyFs {
    _dir: tempfile::TempDir,
    mnt: PathBuf,
}

impl TinyFs {
    pub fn mount(size_kib: u64) -> TinyFs {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("fs");
        std::fs::create_dir(&mnt).unwrap();
        let name = format!("gpufeed-test-{}", std::process::id());
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_kib}k"), &name])
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(
            st.success(),
            "mounting a tmpfs on {} (root needed)",
            mnt.display()
        );
        TinyFs { _dir: dir, mnt }
    }

    pub fn path(&self) -> &Path {
        &self.mnt
    }

    /// Gives the file system a new size (room again, or less).
    pub fn resize(&self, size_kib: u64) {
        let st = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size_kib}k")])
            .arg(&self.mnt)
            .status()
            .unwrap();
        assert!(st.success(), "resizing the tmpfs on {}", self.mnt.display());
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.mnt)
            .status();
    }
}

/// The environment variable that makes a test binary's `child_process_entry` a child role.
pub const CHILD: &str = "GPUFEED_STREAM_TEST_CHILD";

/// A child's runtime, logging to stderr (its log file).
pub fn child_runtime() -> tokio::runtime::Runtime {
    tracing_subscriber::fmt()
        .with_env_filter("info")
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The "guest" child role: a hub on `T_ADDR` with the TLS files in `T_TLS` and the journal
/// `T_JOURNAL`, until killed. With `T_DEFAULT_IDLE` set, the hub's default idle timeout
/// instead of the tests' short one.
pub fn run_guest_child(rt: &tokio::runtime::Runtime) {
    let env = |k: &str| std::env::var(k).unwrap();
    rt.block_on(async {
        let mut c = hub_config(Path::new(&env("T_TLS")));
        c.listen = env("T_ADDR").parse().unwrap();
        c.journal = Some(env("T_JOURNAL").into());
        if std::env::var_os("T_DEFAULT_IDLE").is_some() {
            c.idle_timeout = hub::HubConfig::new(c.listen, "").idle_timeout;
        }
        let _hub = hub::serve(c, &prometheus::Registry::new()).await.unwrap();
        println!("READY");
        std::future::pending::<()>().await;
    })
}

/// A child process of a test binary: this binary re-executed with [`CHILD`] set to a role,
/// running its `child_process_entry` test.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
}

/// Starts role `role` (its stderr in `dir/ROLE-N.log`) and waits for its `READY` line.
pub fn spawn_child(role: &str, dir: &Path, n: usize, envs: &[(&str, String)]) -> Proc {
    let log = dir.join(format!("{role}-{n}.log"));
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "child_process_entry",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD, role)
    .stdout(Stdio::piped())
    .stderr(std::fs::File::create(&log).unwrap());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let t0 = Instant::now();
    while !line.contains("READY") {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 || t0.elapsed() > Duration::from_secs(20) {
            panic!(
                "{role} child did not start; log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
    }
    // Keep draining stdout so the child never blocks on it.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut out, &mut std::io::sink());
    });
    Proc { child, log }
}
