//! Agent configuration: TOML, default path `/etc/gpufeed/host.toml`.
//!
//! Every key is optional and documented with its default in `systemd/host.toml`.
//! A key this version does not know (one a later version removed, or a typo) is taken out and
//! named in a warning ([`Config::ignored_keys`]): a file written for another version still
//! starts the agent. Everything else is strict: the sections are `deny_unknown_fields` so that
//! the warning names every such key, and types and ranges are errors. Each section's struct, defaults and checks
//! live with the code that reads it (a watcher's in its unit under [`crate::watch`]); this
//! file composes them and names the file in errors.

use crate::discovery::DiscoveryConfig;
use crate::watch::{
    aer::AerConfig, bridge::BridgeConfig, hoststats::HostConfig, kmsg::KmsgConfig,
    pcie::PcieConfig, thunderbolt::ThunderboltConfig, vm::VmConfig,
};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub mod check;
mod unknown_keys;

pub use check::{range, Invalid};

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
    /// OTLP metrics push (`[otlp]`, see [`crate::otlp::OtlpSection`]); off without an endpoint.
    pub otlp: crate::otlp::OtlpSection,
    /// Keys of the file this version does not know (dotted paths), ignored; for a warning.
    #[serde(skip)]
    pub ignored_keys: Vec<String>,
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
            otlp: Default::default(),
            ignored_keys: Vec::new(),
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
        let (mut cfg, ignored) =
            unknown_keys::parse::<Config>(text).map_err(|e| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string().trim_end().replace('\n', " "),
            })?;
        cfg.ignored_keys = ignored;
        cfg.validate(path)?;
        Ok(cfg)
    }

    pub fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |key: &str, problem: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            key: key.to_string(),
            problem,
        };
        let section = |r: Result<(), Invalid>| r.map_err(|i| bad(&i.key, i.problem));
        section(self.pcie.validate())?;
        section(self.aer.validate())?;
        section(self.thunderbolt.validate())?;
        section(self.bridge.validate())?;
        section(self.vm.validate())?;
        section(self.host.validate())?;
        section(self.discovery.validate())?;
        section(self.otlp.validate())?;
        section(range(
            "event_capacity",
            self.event_capacity as u64,
            16,
            1 << 20,
        ))?;
        for (i, d) in self.devices.iter().enumerate() {
            if crate::discovery::normalize_bdf(d).is_none() {
                return Err(bad(
                    &format!("devices[{i}]"),
                    format!("`{d}` is not a PCI address (DDDD:BB:DD.F or BB:DD.F)"),
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
        assert_eq!(c.pcie.poll_interval_ms, 200);
        assert_eq!(c.bridge.sample_interval_ms, 200);
        assert_eq!(c.metrics_listen.port(), 9847);
    }

    #[test]
    fn unknown_keys_are_ignored_and_named() {
        let c = Config::parse(
            "removed_top = 1\n[pcie]\npoll_intervl_ms = 5\npoll_interval_ms = 500\n\
             [retired_section]\nx = 1\n[stream]\nold = 2\n[[stream.guests]]\n\
             endpoint = \"10.0.0.2:7845\"\ngone = true\n",
            Path::new("/etc/x.toml"),
        )
        .unwrap();
        assert_eq!(
            c.ignored_keys,
            [
                "removed_top",
                "pcie.poll_intervl_ms",
                "retired_section",
                "stream.old",
                "stream.guests[0].gone"
            ]
        );
        // The known keys around them still count.
        assert_eq!(c.pcie.poll_interval_ms, 500);
        assert_eq!(c.stream.unwrap().guests[0].endpoint, "10.0.0.2:7845");
        // A wrong type of a known key is still an error, at its line in the file.
        let e = Config::parse("old = 1\n[vm]\nqmp = \"yes\"\n", Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 3") && e.contains("qmp"), "{e}");
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
            (
                s.memory_events,
                s.memory_bytes,
                s.disk_max_bytes,
                s.segment_bytes
            ),
            (
                d.memory_events,
                d.memory_bytes,
                d.disk_max_bytes,
                d.segment_bytes
            )
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
