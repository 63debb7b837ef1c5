//! The real host agent (`gpufeed-host`, built beside the guest's binary) on a recorded
//! Thunderbolt eGPU tree (scripts/demo-egpu.sh, in the kernel's sysfs formats), streaming to
//! a guest on loopback with certificates made by `gpufeed-guest certs init`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{certs_init_ok, free_port, http_get, wait_for, Proc};

/// The GPU of the recorded tree.
pub const GPU: &str = "0000:0a:00.0";
/// The host agent's identity.
pub const HOST: &str = "demo-egpu";

use gpufeed_testkit::repo;

/// `scripts/demo-egpu.sh ARGS...`.
pub fn demo(args: &[&str]) {
    let st = Command::new(repo().join("scripts/demo-egpu.sh"))
        .args(args)
        .status()
        .unwrap();
    assert!(st.success(), "demo-egpu.sh {args:?}");
}

/// The host agent binary, built beside the guest's (`cargo build --workspace`, or
/// `--release` for benchmarks).
pub fn host_binary() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_gpufeed-guest"))
        .parent()
        .unwrap()
        .join("gpufeed-host");
    assert!(
        p.exists(),
        "{} missing: build the workspace first (cargo build --workspace)",
        p.display()
    );
    p
}

/// How the host agent polls.
pub struct HostIntervals {
    /// `pcie.poll_interval_ms`; `None`: the agent's default.
    pub pcie_poll_ms: Option<u64>,
    /// `stream.state_interval_ms`; `None`: the agent's default.
    pub state_ms: Option<u64>,
}

impl HostIntervals {
    /// A link poll and state interval of 200 ms: for a scenario whose subject is not the
    /// defaults' timing.
    pub const FAST: HostIntervals = HostIntervals {
        pcie_poll_ms: Some(200),
        state_ms: Some(200),
    };
}

pub struct HostAgent {
    pub proc: Proc,
    pub metrics: SocketAddr,
}

/// `certs init` into `dir/certs`, the recorded tree in `dir/root` (written by the caller with
/// `demo(&["tree", ...])`), and the host agent on it streaming to `127.0.0.1:quic`; returns
/// once it serves /metrics.
pub fn start_host(dir: &Path, quic: u16, iv: HostIntervals) -> HostAgent {
    start_host_with(dir, quic, iv, "enabled = false\n")
}

/// [`start_host`] with `bridge` as the body of the config's `[bridge]` section (the default
/// reads no bridge: this machine's own are not the test's).
pub fn start_host_with(dir: &Path, quic: u16, iv: HostIntervals, bridge: &str) -> HostAgent {
    start_host_named(dir, HOST, quic, iv, bridge)
}

/// [`start_host_with`] for a host agent named `host` (a fleet of several).
pub fn start_host_named(
    dir: &Path,
    host: &str,
    quic: u16,
    iv: HostIntervals,
    bridge: &str,
) -> HostAgent {
    certs_init_ok(&dir.join("certs"), &format!("127.0.0.1:{quic}"), host);
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let certs = dir.join("certs");
    let line = |k: &str, v: Option<u64>| v.map(|v| format!("{k} = {v}\n")).unwrap_or_default();
    // The recorded tree as root, the GPU to watch, a memory spool, and no watcher that would
    // read this machine's own bridges or uevents.
    let cfg = format!(
        r#"host_id = "{host}"
root = "{root}"
metrics_listen = "{metrics}"
devices = ["{GPU}"]

[pcie]
{poll}
[bridge]
{bridge}
[host]
enabled = false

[thunderbolt]
uevents = false

[stream]
ca = "{ca}"
cert = "{cert}"
key = "{key}"
spool_dir = ""
{state}
[[stream.guests]]
name = "guest"
endpoint = "127.0.0.1:{quic}"
"#,
        root = dir.join("root").display(),
        bridge = bridge,
        poll = line("poll_interval_ms", iv.pcie_poll_ms),
        state = line("state_interval_ms", iv.state_ms),
        ca = certs.join("hosts").join(host).join("tls/ca.pem").display(),
        cert = certs
            .join("hosts")
            .join(host)
            .join("tls/host.pem")
            .display(),
        key = certs
            .join("hosts")
            .join(host)
            .join("tls/host-key.pem")
            .display(),
    );
    std::fs::write(dir.join("host.toml"), &cfg).unwrap();
    let child = Command::new(host_binary())
        .args(["run", "--config"])
        .arg(dir.join("host.toml"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let h = HostAgent {
        proc: Proc(child),
        metrics,
    };
    wait_for(Duration::from_secs(30), || http_get(metrics, "/metrics"))
        .unwrap_or_else(|| panic!("host agent did not serve /metrics; config:\n{cfg}"));
    h
}

/// The guest agent (`--no-kube`, `interval`, `probes`) accepting the stream of the host agent
/// that [`start_host`] started in `dir` (its certificates) on `127.0.0.1:quic`, with `extra`
/// flags; returns once the stream is connected and the host's link state is in its scrape.
pub fn guest_of_host(
    dir: &Path,
    quic: u16,
    interval: &str,
    probes: &str,
    extra: &[&str],
) -> super::Agent {
    guest_of_host_named(dir, HOST, quic, interval, probes, extra)
}

/// [`guest_of_host`] of the host agent named `host` ([`start_host_named`]).
pub fn guest_of_host_named(
    dir: &Path,
    host: &str,
    quic: u16,
    interval: &str,
    probes: &str,
    extra: &[&str],
) -> super::Agent {
    let tls = dir.join("certs/guest");
    let listen = format!("127.0.0.1:{quic}");
    let mut args = vec!["--quic-listen", &listen, "--tls-dir", tls.to_str().unwrap()];
    args.extend_from_slice(extra);
    let agent = super::Agent::no_kube(interval, probes, &args);
    wait_for(Duration::from_secs(30), || {
        let s = agent.scrape();
        (super::value(&s, "gpufeed_stream_connected", &[("host", host)]) == Some(1.0)
            && super::value(&s, "gpufeed_host_pcie_link_width", &[("bdf", GPU)]) == Some(4.0))
        .then_some(())
    })
    .expect("stream connected and host state received");
    agent
}
