//! What the tests of this binary share: a TLS deployment in a temp dir, the hub's test
//! configuration, metric readers, log capture.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

pub use gpufeed_shared::stream::hub;
use gpufeed_shared::tls::{self, Deployment};

/// A deployment (CA, guest cert for 127.0.0.1, host certs) written to `dir`.
pub struct Fixture {
    pub dir: tempfile::TempDir,
}

impl Fixture {
    pub fn new(hosts: &[&str]) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let hosts: Vec<String> = hosts.iter().map(|s| s.to_string()).collect();
        let dep = Deployment::generate("127.0.0.1", &hosts).unwrap();
        dep.write_guest_dir(dir.path()).unwrap();
        dep.write_host_files(dir.path()).unwrap();
        Fixture { dir }
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
}

/// Hub configuration for tests: ephemeral port, quick reload, no PTP lookup.
pub fn hub_config(tls_dir: &Path) -> hub::HubConfig {
    let mut c = hub::HubConfig::new("127.0.0.1:0".parse().unwrap(), tls_dir);
    c.tls_reload_interval = Duration::from_millis(100);
    c.idle_timeout = Duration::from_secs(2);
    c.sysfs_root = PathBuf::from("/nonexistent");
    c
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
    gpufeed_testkit::wait::until(timeout * 5, f).await
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
