//! What to push where: the endpoint, headers, interval, timeout and resource attributes, from
//! the agents' flags or the host's config file, checked before anything starts.

use std::time::Duration;

/// Where and how to push.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpConfig {
    /// The full URL the request is POSTed to, e.g. `http://collector:4318/v1/metrics`.
    pub endpoint: String,
    /// Extra request headers (authorisation, tenant).
    pub headers: Vec<(String, String)>,
    /// Time between exports.
    pub interval: Duration,
    /// The longest one export may take (connect, send, answer); at most `interval`.
    pub timeout: Duration,
    /// Resource attributes (`service.name`, `host.name`, `k8s.node.name`, ...).
    pub resource: Vec<(String, String)>,
}

/// The shortest export interval accepted.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
/// The default export interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(15);
/// The default timeout of one export.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

impl OtlpConfig {
    /// Checks the endpoint (an `http` or `https` URL), the headers (valid names and values),
    /// the interval and the timeout; the error says which and why.
    pub fn validate(&self) -> Result<(), String> {
        let url = reqwest::Url::parse(&self.endpoint)
            .map_err(|e| format!("OTLP endpoint {:?} is not a URL: {e}", self.endpoint))?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(format!(
                "OTLP endpoint {:?}: the scheme must be http or https (OTLP over HTTP, protobuf)",
                self.endpoint
            ));
        }
        if url.host_str().is_none() {
            return Err(format!("OTLP endpoint {:?} has no host", self.endpoint));
        }
        for (k, v) in &self.headers {
            reqwest::header::HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| format!("OTLP header name {k:?} is not a valid HTTP header name"))?;
            reqwest::header::HeaderValue::from_str(v)
                .map_err(|_| format!("OTLP header {k:?}: its value is not a valid header value"))?;
        }
        if self.interval < MIN_INTERVAL {
            return Err(format!(
                "OTLP interval {:?} is below the minimum {MIN_INTERVAL:?}",
                self.interval
            ));
        }
        if self.timeout.is_zero() || self.timeout > self.interval {
            return Err(format!(
                "OTLP timeout {:?} must be above zero and at most the interval ({:?})",
                self.timeout, self.interval
            ));
        }
        Ok(())
    }
}

/// `KEY=VALUE` (a header, or a resource attribute): the key must not be empty.
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// A duration as the command lines take them (`15s`, `500ms`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))
}

/// The flags both agents take (the host agent's `[otlp]` section says the same).
#[cfg(feature = "cli")]
#[derive(clap::Args, Debug, Clone, Default)]
pub struct OtlpArgs {
    /// Push metrics over OTLP (HTTP, protobuf) to this URL too, beside /metrics, e.g.
    /// http://collector:4318/v1/metrics or Prometheus's http://prom:9090/api/v1/otlp/v1/metrics.
    /// Off when not given.
    #[arg(long, value_name = "URL", env = "GPUFEED_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// A header for each OTLP request (authorisation, tenant). Repeatable.
    #[arg(long = "otlp-header", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub otlp_headers: Vec<(String, String)>,
    /// Time between OTLP exports [default: 15s].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub otlp_interval: Option<Duration>,
    /// The longest one OTLP export may take; a slower one is dropped and counted
    /// [default: 10s, at most the interval].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub otlp_timeout: Option<Duration>,
    /// A resource attribute added to the agent's own (`service.name`, `host.name`, ...).
    /// Repeatable.
    #[arg(long = "otlp-resource", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub otlp_resource: Vec<(String, String)>,
}

#[cfg(feature = "cli")]
impl OtlpArgs {
    /// The configuration the flags ask for (`None` without `--otlp-endpoint`), checked, with
    /// `resource` first and the `--otlp-resource` attributes after (a key given twice: the
    /// flag's value).
    pub fn config(&self, resource: Vec<(String, String)>) -> Result<Option<OtlpConfig>, String> {
        let Some(endpoint) = self.otlp_endpoint.clone() else {
            if self.otlp_interval.is_some()
                || self.otlp_timeout.is_some()
                || !self.otlp_headers.is_empty()
                || !self.otlp_resource.is_empty()
            {
                return Err("--otlp-header, --otlp-interval, --otlp-timeout and --otlp-resource need --otlp-endpoint".into());
            }
            return Ok(None);
        };
        let interval = self.otlp_interval.unwrap_or(DEFAULT_INTERVAL);
        let cfg = OtlpConfig {
            endpoint,
            headers: self.otlp_headers.clone(),
            interval,
            timeout: self.otlp_timeout.unwrap_or(default_timeout(interval)),
            resource: merge_resource(resource, &self.otlp_resource),
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }
}

/// `base` with `extra` added, a key in both taking `extra`'s value.
pub fn merge_resource(
    mut base: Vec<(String, String)>,
    extra: &[(String, String)],
) -> Vec<(String, String)> {
    for (k, v) in extra {
        match base.iter_mut().find(|(b, _)| b == k) {
            Some(e) => e.1 = v.clone(),
            None => base.push((k.clone(), v.clone())),
        }
    }
    base
}

/// This machine's host name (`host.name`), from the kernel.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// The timeout for an interval when none is given: [`DEFAULT_TIMEOUT`], at most the interval.
pub fn default_timeout(interval: Duration) -> Duration {
    DEFAULT_TIMEOUT.min(interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_checked() {
        let ok = OtlpConfig {
            endpoint: "http://127.0.0.1:4318/v1/metrics".into(),
            headers: vec![("Authorization".into(), "Bearer x".into())],
            interval: DEFAULT_INTERVAL,
            timeout: DEFAULT_TIMEOUT,
            resource: vec![],
        };
        ok.validate().unwrap();
        let bad = |f: &dyn Fn(&mut OtlpConfig)| {
            let mut c = ok.clone();
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert!(bad(&|c| c.endpoint = "collector:4318".into()).contains("scheme"));
        assert!(bad(&|c| c.endpoint = "not a url".into()).contains("not a URL"));
        assert!(bad(&|c| c.headers = vec![("bad name".into(), "v".into())]).contains("name"));
        assert!(bad(&|c| c.headers = vec![("k".into(), "a\nb".into())]).contains("value"));
        assert!(bad(&|c| c.interval = Duration::from_millis(10)).contains("minimum"));
        assert!(bad(&|c| c.timeout = Duration::from_secs(60)).contains("at most"));
        assert_eq!(
            parse_key_value("X-Scope-OrgID=a=b").unwrap(),
            ("X-Scope-OrgID".to_string(), "a=b".to_string())
        );
        assert!(parse_key_value("novalue").is_err());
        assert!(parse_key_value("=v").is_err());
        assert_eq!(
            default_timeout(Duration::from_secs(1)),
            Duration::from_secs(1)
        );
    }
}
