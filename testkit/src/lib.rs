//! The tools the workspace's tests share, in one place so that every crate's tests read a
//! Prometheus page, wait, take the kernel-test lock and build sandboxes the same way.
//!
//! A dev-dependency only: nothing here is linked into an agent.
//!
//! * [`prom`]: the text exposition format, parsed once, strictly (escapes, timestamps,
//!   `NaN`/`±Inf`), and the lookups tests make on it (`value`, `sum`, a histogram's quantile).
//! * [`wait`]: polling until a condition holds, blocking and async.
//! * [`root`]: tests that need root skip on a laptop and fail under `CI=true`; kernel tests
//!   serialise through one lock file shared by every checkout on the machine.
//! * [`sh`], [`http`]: shell commands that must succeed (or may fail, in cleanup) and a
//!   minimal HTTP/1.0 GET.
//! * [`sandbox`]: cgroup directories removed depth-first, even when the test fails.
//! * [`aer`]: a device's AER counter files as the kernel prints them, for recorded trees.
//! * `stream` (feature `stream`): the QUIC stream tests' fixtures: TLS deployments, hubs, the
//!   host's stream client, metric readers, log capture, a disk that fills up, child roles.
//! * `otlp_receiver` (feature `otlp_receiver`): a real OTLP metrics receiver on loopback for
//!   the agents' OTLP push tests, and the comparison of what it holds with /metrics.

pub mod aer;
pub mod http;
#[cfg(feature = "otlp_receiver")]
pub mod otlp_receiver;
pub mod prom;
pub mod root;
pub mod sandbox;
pub mod sh;
#[cfg(feature = "stream")]
pub mod stream;
pub mod wait;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// The repository root (every crate of the workspace sits one level below it).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit/ has a parent")
        .to_path_buf()
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A short tag unique on this machine while the test runs: the process id and a sequence
/// (interface names are limited to 15 bytes, so it stays short).
pub fn uniq() -> String {
    format!(
        "{}{}",
        std::process::id() % 100_000,
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A TCP port on loopback that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding an ephemeral port on 127.0.0.1")
        .port()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_is_the_workspace_root() {
        assert!(repo().join("Cargo.toml").is_file());
        assert!(repo().join("testkit/Cargo.toml").is_file());
    }

    #[test]
    fn uniq_tags_differ_and_fit_an_interface_name() {
        let (a, b) = (uniq(), uniq());
        assert_ne!(a, b);
        assert!(format!("gfveth{a}").len() <= 15, "{a}");
    }
}
