//! Agent configuration: TOML, default path `/etc/gpufeed/host.toml`.
//!
//! Every key is optional and documented with its default in `systemd/host.toml`.
//! Unknown keys are errors (`deny_unknown_fields`). The host→guest stream (issue 5) will add
//! an optional `[stream]` section as `pub stream: Option<StreamConfig>` on [`Config`].

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub const DEFAULT_PATH: &str = "/etc/gpufeed/host.toml";
/// Default `/metrics` listen address (port 9847: not used by the well-known exporters).
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9847";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Host id reported with the metrics (`host` label); default: the hostname.
    pub host_id: Option<String>,
    /// Prefix for /sys, /etc/pve, /run, /proc, /dev (tests and containers).
    pub root: PathBuf,
    /// Address of the host-local `/metrics`.
    pub metrics_listen: SocketAddr,
    /// Capacity of the internal event channel.
    pub event_capacity: usize,
    /// Extra PCI devices (BDF) to watch besides those passed through to VMs.
    pub devices: Vec<String>,
    /// Watchdog/health tick and discovery rescan.
    pub discovery: DiscoveryConfig,
    pub pcie: PcieConfig,
    pub aer: AerConfig,
    pub thunderbolt: ThunderboltConfig,
    pub kmsg: KmsgConfig,
    pub bridge: BridgeConfig,
    pub vm: VmConfig,
    pub host: HostConfig,
    /// Host → guest event stream (`[stream]`, see [`crate::stream::StreamConfig`]); off when
    /// absent or without `[[stream.guests]]`.
    pub stream: Option<crate::stream::StreamConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// Re-read the Proxmox configs and sysfs topology this often.
    pub rescan_interval_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PcieConfig {
    pub enabled: bool,
    pub poll_interval_ms: u64,
    /// Use `pci:pcie_link_event` / `pci:pci_hp_event` tracepoints when the kernel has them.
    pub tracepoints: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AerConfig {
    pub enabled: bool,
    pub poll_interval_ms: u64,
    /// Use the `ras:aer_event` tracepoint when present (exact time and status detail).
    pub tracepoint: bool,
    /// Attach kmsg records for the device seen within this window to counter events.
    pub kmsg_context_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ThunderboltConfig {
    pub enabled: bool,
    /// sysfs rescan interval (uevents trigger an immediate rescan).
    pub poll_interval_ms: u64,
    /// Listen to kernel uevents (netlink) for add/remove/change.
    pub uevents: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KmsgConfig {
    pub enabled: bool,
    /// Also classify records already in the ring buffer at start.
    pub read_history: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeConfig {
    pub enabled: bool,
    /// Bridges to watch; empty = all bridges.
    pub bridges: Vec<String>,
    /// Counter sampling interval, 100..=1000 ms; the microburst window.
    pub sample_interval_ms: u64,
    /// Period over which the highest sample-window rate is kept as the microburst figure.
    pub period_ms: u64,
    /// Read the bridge of another network namespace (path such as `/run/netns/NAME`).
    pub netns: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VmConfig {
    pub enabled: bool,
    pub poll_interval_ms: u64,
    /// Ask QEMU for running/paused through `/run/qemu-server/<vmid>.qmp` (brief connections).
    pub qmp: bool,
    /// Kernel log records (AER/vfio) this recent are attached as the cause of a stop.
    pub cause_window_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    pub enabled: bool,
    pub interval_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            host_id: None,
            root: PathBuf::from("/"),
            metrics_listen: DEFAULT_METRICS_LISTEN.parse().expect("valid default"),
            event_capacity: 4096,
            devices: Vec::new(),
            discovery: DiscoveryConfig::default(),
            pcie: PcieConfig::default(),
            aer: AerConfig::default(),
            thunderbolt: ThunderboltConfig::default(),
            kmsg: KmsgConfig::default(),
            bridge: BridgeConfig::default(),
            vm: VmConfig::default(),
            host: HostConfig::default(),
            stream: None,
        }
    }
}
impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            rescan_interval_ms: 30_000,
        }
    }
}
impl Default for PcieConfig {
    fn default() -> Self {
        PcieConfig {
            enabled: true,
            poll_interval_ms: 1000,
            tracepoints: true,
        }
    }
}
impl Default for AerConfig {
    fn default() -> Self {
        AerConfig {
            enabled: true,
            poll_interval_ms: 1000,
            tracepoint: true,
            kmsg_context_ms: 5000,
        }
    }
}
impl Default for ThunderboltConfig {
    fn default() -> Self {
        ThunderboltConfig {
            enabled: true,
            poll_interval_ms: 2000,
            uevents: true,
        }
    }
}
impl Default for KmsgConfig {
    fn default() -> Self {
        KmsgConfig {
            enabled: true,
            read_history: false,
        }
    }
}
impl Default for BridgeConfig {
    fn default() -> Self {
        BridgeConfig {
            enabled: true,
            bridges: Vec::new(),
            sample_interval_ms: 200,
            period_ms: 1000,
            netns: None,
        }
    }
}
impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            enabled: true,
            poll_interval_ms: 1000,
            qmp: true,
            cause_window_ms: 10_000,
        }
    }
}
impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            enabled: true,
            interval_ms: 5000,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: key `{key}`: {problem}")]
    Invalid {
        path: PathBuf,
        key: String,
        problem: String,
    },
}

impl Config {
    /// Load from `path`. A missing file at the default path yields the defaults.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound && path == Path::new(DEFAULT_PATH) =>
            {
                return Ok(Config::default())
            }
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        Self::parse(&text, path)
    }

    /// Parse and validate TOML text; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().replace('\n', " "),
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    pub fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |key: &str, problem: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            key: key.to_string(),
            problem,
        };
        let range = |key: &str, v: u64, lo: u64, hi: u64| {
            if v < lo || v > hi {
                Err(bad(key, format!("must be between {lo} and {hi}, got {v}")))
            } else {
                Ok(())
            }
        };
        range(
            "pcie.poll_interval_ms",
            self.pcie.poll_interval_ms,
            10,
            600_000,
        )?;
        range(
            "aer.poll_interval_ms",
            self.aer.poll_interval_ms,
            10,
            600_000,
        )?;
        range("aer.kmsg_context_ms", self.aer.kmsg_context_ms, 0, 600_000)?;
        range(
            "thunderbolt.poll_interval_ms",
            self.thunderbolt.poll_interval_ms,
            10,
            600_000,
        )?;
        range(
            "bridge.sample_interval_ms",
            self.bridge.sample_interval_ms,
            100,
            1000,
        )?;
        range("bridge.period_ms", self.bridge.period_ms, 100, 3_600_000)?;
        if self.bridge.period_ms < self.bridge.sample_interval_ms {
            return Err(bad(
                "bridge.period_ms",
                format!(
                    "must be at least bridge.sample_interval_ms ({}), got {}",
                    self.bridge.sample_interval_ms, self.bridge.period_ms
                ),
            ));
        }
        range("vm.poll_interval_ms", self.vm.poll_interval_ms, 10, 600_000)?;
        range("vm.cause_window_ms", self.vm.cause_window_ms, 0, 3_600_000)?;
        range("host.interval_ms", self.host.interval_ms, 100, 3_600_000)?;
        range(
            "discovery.rescan_interval_ms",
            self.discovery.rescan_interval_ms,
            100,
            86_400_000,
        )?;
        range("event_capacity", self.event_capacity as u64, 16, 1 << 20)?;
        for (i, d) in self.devices.iter().enumerate() {
            if crate::discovery::normalize_bdf(d).is_none() {
                return Err(bad(
                    &format!("devices[{i}]"),
                    format!("`{d}` is not a PCI address (DDDD:BB:DD.F or BB:DD.F)"),
                ));
            }
        }
        for (i, b) in self.bridge.bridges.iter().enumerate() {
            if b.is_empty() || b.len() > 15 || b.contains('/') {
                return Err(bad(
                    &format!("bridge.bridges[{i}]"),
                    format!("`{b}` is not an interface name"),
                ));
            }
        }
        if !self.root.is_absolute() {
            return Err(bad(
                "root",
                format!("must be an absolute path, got {:?}", self.root),
            ));
        }
        Ok(())
    }

    pub fn host_id(&self) -> String {
        if let Some(h) = &self.host_id {
            return h.clone();
        }
        let mut buf = [0u8; 256];
        // SAFETY: gethostname writes at most buf.len() bytes into buf.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
        match std::str::from_utf8(&buf[..end]) {
            Ok(h) if rc == 0 && !h.is_empty() => h.split('.').next().unwrap_or(h).to_string(),
            _ => "unknown".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_from_empty() {
        let c = Config::parse("", Path::new("x.toml")).unwrap();
        assert_eq!(c.pcie.poll_interval_ms, 1000);
        assert_eq!(c.bridge.sample_interval_ms, 200);
        assert_eq!(c.metrics_listen.port(), 9847);
    }

    #[test]
    fn unknown_key_is_named() {
        let e = Config::parse("[pcie]\npoll_intervl_ms = 5\n", Path::new("/etc/x.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("poll_intervl_ms"), "{e}");
        assert!(e.contains("/etc/x.toml"), "{e}");
    }

    #[test]
    fn out_of_range_is_named() {
        let e = Config::parse("[bridge]\nsample_interval_ms = 50\n", Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "h.toml: key `bridge.sample_interval_ms`: must be between 100 and 1000, got 50"
        );
    }

    #[test]
    fn wrong_type_is_named() {
        let e = Config::parse("[vm]\nqmp = \"yes\"\n", Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("qmp") && e.contains("bool"), "{e}");
    }

    #[test]
    fn bad_device_is_named() {
        let e = Config::parse(
            "devices = [\"0000:01:00.0\", \"gpu0\"]\n",
            Path::new("h.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("devices[1]") && e.contains("gpu0"), "{e}");
    }

    /// The commented `[stream]` example of the shipped config, uncommented, parses; its values
    /// are `StreamConfig`'s defaults and the example guest.
    #[test]
    fn shipped_stream_example_matches_stream_config() {
        let text = include_str!("../../systemd/host.toml");
        let at = text
            .find("\n# [stream]\n")
            .expect("commented [stream] example");
        let mut t = text[..at + 1].to_string();
        for line in text[at + 1..].lines() {
            let l = line
                .strip_prefix('#')
                .expect("only comments after [stream]");
            t.push_str(l.strip_prefix(' ').unwrap_or(l));
            t.push('\n');
        }
        let c = Config::parse(&t, Path::new("host.toml")).unwrap();
        let s = c.stream.expect("[stream] parsed");
        let d = crate::stream::StreamConfig::default();
        assert_eq!((&s.ca, &s.cert, &s.key), (&d.ca, &d.cert, &d.key));
        assert_eq!(s.spool_dir, d.spool_dir);
        assert_eq!(s.spool_dir, Path::new("/var/lib/gpufeed/spool"));
        assert_eq!(
            (s.memory_events, s.disk_max_bytes, s.segment_bytes),
            (d.memory_events, d.disk_max_bytes, d.segment_bytes)
        );
        assert_eq!(
            (s.reconnect_min_ms, s.reconnect_max_ms, s.connect_timeout_ms),
            (d.reconnect_min_ms, d.reconnect_max_ms, d.connect_timeout_ms)
        );
        assert_eq!(
            (
                s.idle_timeout_ms,
                s.keep_alive_ms,
                s.batch_bytes,
                s.coalesce_us
            ),
            (
                d.idle_timeout_ms,
                d.keep_alive_ms,
                d.batch_bytes,
                d.coalesce_us
            )
        );
        assert_eq!(s.guests.len(), 1);
        let g = &s.guests[0];
        assert_eq!(
            (g.label(), g.endpoint.as_str()),
            ("talos-gpu", "10.0.0.20:7845")
        );
        assert_eq!(g.server_name(), "10.0.0.20");
        assert_eq!(
            (g.vmids.clone(), g.devices.clone()),
            (vec![100], vec!["0000:01:00.0".to_string()])
        );
        // Commented out, it is off.
        assert!(Config::parse(text, Path::new("host.toml"))
            .unwrap()
            .stream
            .is_none());
    }

    #[test]
    fn shipped_default_config_is_valid() {
        let text = include_str!("../../systemd/host.toml");
        let c = Config::parse(text, Path::new("host.toml")).unwrap();
        let d = Config::default();
        assert_eq!(c.metrics_listen, d.metrics_listen);
        assert_eq!(c.pcie.poll_interval_ms, d.pcie.poll_interval_ms);
        assert_eq!(c.bridge.period_ms, d.bridge.period_ms);
    }
}
