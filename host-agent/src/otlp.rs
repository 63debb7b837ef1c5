//! `[otlp]`: OTLP metrics push of the host's `/metrics`, beside it (the exporter itself is
//! [`gpufeed_shared::otlp`], shared with the guest). Off unless an endpoint is set, in the
//! file or by `run --otlp-endpoint`; the flags override the file's values (headers and
//! resource attributes are added to the file's, a flag's key replacing the file's).

use crate::config::check::{range, Invalid};
use crate::metrics::Metrics;
use gpufeed_shared::otlp::{self, OtlpArgs, OtlpConfig};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// `[otlp]`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OtlpSection {
    /// OTLP/HTTP (protobuf) URL, e.g. `http://collector:4318/v1/metrics`; off when absent.
    pub endpoint: Option<String>,
    /// Request headers (authorisation, tenant).
    pub headers: BTreeMap<String, String>,
    /// Time between exports; default 15000.
    pub interval_ms: Option<u64>,
    /// The longest one export may take; default 10000, at most the interval.
    pub timeout_ms: Option<u64>,
    /// Resource attributes added to the agent's own (`service.name`, `host.name`, ...).
    pub resource: BTreeMap<String, String>,
}

impl OtlpSection {
    pub fn validate(&self) -> Result<(), Invalid> {
        if let Some(i) = self.interval_ms {
            range("otlp.interval_ms", i, 100, 3_600_000)?;
        }
        if let Some(t) = self.timeout_ms {
            range(
                "otlp.timeout_ms",
                t,
                1,
                self.interval_ms
                    .unwrap_or(otlp::DEFAULT_INTERVAL.as_millis() as u64),
            )?;
        }
        if self.endpoint.is_some() {
            self.config(&OtlpArgs::default(), "check")
                .map_err(|problem| Invalid {
                    key: "otlp".into(),
                    problem,
                })?;
        }
        Ok(())
    }

    /// The exporter's configuration from this section and the command line's flags (`None`:
    /// no endpoint in either), checked. The resource: `service.name` `gpufeed-host`,
    /// `service.instance.id` the host id, `host.name` this machine's name, then the section's
    /// attributes, then the flags'.
    pub fn config(&self, flags: &OtlpArgs, host_id: &str) -> Result<Option<OtlpConfig>, String> {
        let Some(endpoint) = flags.otlp_endpoint.clone().or(self.endpoint.clone()) else {
            return flags.config(Vec::new());
        };
        let interval = flags.otlp_interval.unwrap_or(
            self.interval_ms
                .map_or(otlp::DEFAULT_INTERVAL, Duration::from_millis),
        );
        let timeout = flags.otlp_timeout.unwrap_or(
            self.timeout_ms
                .map_or(otlp::default_timeout(interval), Duration::from_millis),
        );
        let own = vec![
            ("service.name".to_string(), "gpufeed-host".to_string()),
            ("service.instance.id".to_string(), host_id.to_string()),
            ("host.name".to_string(), otlp::hostname()),
        ];
        let file: Vec<(String, String)> = self.resource.clone().into_iter().collect();
        let headers: Vec<(String, String)> = self.headers.clone().into_iter().collect();
        let cfg = OtlpConfig {
            endpoint,
            headers: otlp::merge_resource(headers, &flags.otlp_headers),
            interval,
            timeout,
            resource: otlp::merge_resource(otlp::merge_resource(own, &file), &flags.otlp_resource),
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }
}

/// Starts the exporter of `metrics`' registry (what `/metrics` serves), its own series
/// (`gpufeed_host_otlp_exports_total{result}`) registered there.
pub fn start(cfg: OtlpConfig, metrics: &Arc<Metrics>) -> anyhow::Result<()> {
    let series = otlp::OtlpMetrics::new(&metrics.registry, "gpufeed_host")?;
    let m = metrics.clone();
    otlp::spawn(
        cfg,
        Arc::new(move || m.render()),
        series,
        ("gpufeed-host", env!("CARGO_PKG_VERSION")),
    )
    .map_err(anyhow::Error::msg)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(toml_text: &str) -> OtlpSection {
        #[derive(Deserialize)]
        struct F {
            otlp: OtlpSection,
        }
        toml::from_str::<F>(toml_text).unwrap().otlp
    }

    #[test]
    fn the_file_and_the_flags_compose() {
        let s = section(
            "[otlp]\nendpoint = \"http://c:4318/v1/metrics\"\ninterval_ms = 5000\n\
             headers = { Authorization = \"Bearer a\" }\nresource = { \"deployment.environment\" = \"lab\" }\n",
        );
        s.validate().unwrap();
        let c = s.config(&OtlpArgs::default(), "pve-a").unwrap().unwrap();
        assert_eq!(c.interval, Duration::from_secs(5));
        assert_eq!(c.timeout, Duration::from_secs(5));
        assert_eq!(c.headers, [("Authorization".into(), "Bearer a".into())]);
        let keys: Vec<&str> = c.resource.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "service.name",
                "service.instance.id",
                "host.name",
                "deployment.environment"
            ]
        );
        let flags = OtlpArgs {
            otlp_endpoint: Some("https://other/v1/metrics".into()),
            otlp_headers: vec![("Authorization".into(), "Bearer b".into())],
            otlp_interval: Some(Duration::from_secs(1)),
            ..Default::default()
        };
        let c = s.config(&flags, "pve-a").unwrap().unwrap();
        assert_eq!(c.endpoint, "https://other/v1/metrics");
        assert_eq!(c.headers, [("Authorization".into(), "Bearer b".into())]);
        assert_eq!(c.timeout, Duration::from_secs(1));
        assert!(OtlpSection::default()
            .config(&OtlpArgs::default(), "h")
            .unwrap()
            .is_none());
    }

    #[test]
    fn shipped_example_parses_with_the_defaults() {
        let text = include_str!("../../systemd/host.toml");
        let at = text.find("\n# [otlp]\n").expect("commented [otlp] example");
        let block: String = text[at + 1..]
            .lines()
            .take_while(|l| !l.is_empty())
            .map(|l| format!("{}\n", l.trim_start_matches('#').trim_start()))
            .collect();
        let s = section(&block);
        s.validate().unwrap();
        let c = s.config(&OtlpArgs::default(), "h").unwrap().unwrap();
        assert_eq!(c.interval, otlp::DEFAULT_INTERVAL);
        assert_eq!(c.timeout, otlp::DEFAULT_TIMEOUT);
        assert_eq!(c.headers.len(), 1);
    }

    #[test]
    fn bad_sections_name_their_key() {
        let e = section("[otlp]\nendpoint = \"collector:4318\"\n")
            .validate()
            .unwrap_err();
        assert_eq!(e.key, "otlp");
        assert!(e.problem.contains("http or https"), "{e:?}");
        let e = section("[otlp]\nendpoint = \"http://c/\"\ninterval_ms = 10\n")
            .validate()
            .unwrap_err();
        assert_eq!(e.key, "otlp.interval_ms");
        let e =
            section("[otlp]\nendpoint = \"http://c/\"\ninterval_ms = 1000\ntimeout_ms = 2000\n")
                .validate()
                .unwrap_err();
        assert_eq!(e.key, "otlp.timeout_ms");
        let e = section("[otlp]\nendpoint = \"http://c/\"\nheaders = { \"a b\" = \"v\" }\n")
            .validate()
            .unwrap_err();
        assert!(e.problem.contains("header name"), "{e:?}");
    }
}
