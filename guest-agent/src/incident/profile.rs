//! The hand-off to a profiler: from a pod's latency spike to the call stacks of that pod at that
//! time. `--profile-url` is a link template for a profiler's query page (Parca, Pyroscope, ...)
//! with placeholders for the pod's names and the spike's time range; the page, `/events` and
//! `/api/state` carry the filled link for every affected pod and unexplained spike.
//!
//! Placeholders: `{namespace}`, `{pod}`, `{node}`, `{from_ms}`, `{to_ms}`, `{from_s}`, `{to_s}`.
//! Other braces are text (a PromQL-style selector such as `{namespace="{namespace}"}` is the
//! usual case). Values are percent-encoded where they go, so a name cannot add query
//! parameters; the filled link must be an http(s) URL, or the template is refused at start.
//! docs/profiles.md has templates for Parca and Pyroscope.

use std::fmt;
use std::str::FromStr;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// Everything but the unreserved characters of RFC 3986 is encoded in a value.
const VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Longest template accepted.
const MAX_LEN: usize = 2048;

/// A profile covers the spike from this long before its start...
pub const BEFORE_MS: i64 = 30_000;
/// ...to this long after it (an episode's first minute).
pub const AFTER_MS: i64 = 60_000;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TemplateError {
    #[error(
        "unknown placeholder {{{0}}} (known: {{namespace}} {{pod}} {{node}} {{from_ms}} {{to_ms}} {{from_s}} {{to_s}})"
    )]
    Unknown(String),
    #[error("the template is longer than {MAX_LEN} bytes")]
    TooLong,
    #[error("filled in, the template is not a URL ({0}): {1}")]
    NotUrl(url::ParseError, String),
    #[error("filled in, the template is a {0}: URL; only http and https links are made")]
    Scheme(String),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Var {
    Namespace,
    Pod,
    Node,
    FromMs,
    ToMs,
    FromS,
    ToS,
}

/// The placeholders by name.
const VARS: [(&str, Var); 7] = [
    ("namespace", Var::Namespace),
    ("pod", Var::Pod),
    ("node", Var::Node),
    ("from_ms", Var::FromMs),
    ("to_ms", Var::ToMs),
    ("from_s", Var::FromS),
    ("to_s", Var::ToS),
];

impl Var {
    fn parse(name: &str) -> Option<Var> {
        VARS.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }

    fn name(self) -> &'static str {
        VARS.iter().find(|(_, v)| *v == self).map_or("", |(n, _)| n)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    Var(Var),
}

/// A parsed `--profile-url`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileTemplate {
    parts: Vec<Part>,
}

/// What a link is made for: a pod and a time range (guest realtime, ms).
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub namespace: &'a str,
    pub pod: &'a str,
    pub node: &'a str,
    pub from_ms: i64,
    pub to_ms: i64,
}

impl<'a> Target<'a> {
    /// The range around a spike that started at `spike_ms`.
    pub fn spike(namespace: &'a str, pod: &'a str, node: &'a str, spike_ms: i64) -> Self {
        Target {
            namespace,
            pod,
            node,
            from_ms: spike_ms.saturating_sub(BEFORE_MS),
            to_ms: spike_ms.saturating_add(AFTER_MS),
        }
    }
}

impl FromStr for ProfileTemplate {
    type Err = TemplateError;

    fn from_str(s: &str) -> Result<Self, TemplateError> {
        if s.len() > MAX_LEN {
            return Err(TemplateError::TooLong);
        }
        let mut parts = Vec::new();
        let mut text = String::new();
        let mut rest = s;
        while let Some(i) = rest.find('{') {
            text.push_str(&rest[..i]);
            let after = &rest[i + 1..];
            // `{name}` with a name made of lower-case letters and `_` is a placeholder
            let name_len = after
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(after.len());
            if name_len > 0 && after[name_len..].starts_with('}') {
                let name = &after[..name_len];
                let var = Var::parse(name).ok_or_else(|| TemplateError::Unknown(name.into()))?;
                if !text.is_empty() {
                    parts.push(Part::Text(std::mem::take(&mut text)));
                }
                parts.push(Part::Var(var));
                rest = &after[name_len + 1..];
            } else {
                text.push('{');
                rest = after;
            }
        }
        text.push_str(rest);
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        let t = ProfileTemplate { parts };
        // Checked once with example values: a template that makes no http(s) URL is refused
        // at start rather than rendering broken links during an incident.
        t.url(&Target {
            namespace: "ns",
            pod: "pod",
            node: "node",
            from_ms: 1_700_000_000_000,
            to_ms: 1_700_000_090_000,
        })?;
        Ok(t)
    }
}

impl ProfileTemplate {
    fn url(&self, t: &Target<'_>) -> Result<url::Url, TemplateError> {
        let mut s = String::new();
        for p in &self.parts {
            match p {
                Part::Text(x) => s.push_str(x),
                Part::Var(v) => {
                    let value = match v {
                        Var::Namespace => t.namespace.to_string(),
                        Var::Pod => t.pod.to_string(),
                        Var::Node => t.node.to_string(),
                        Var::FromMs => t.from_ms.to_string(),
                        Var::ToMs => t.to_ms.to_string(),
                        Var::FromS => t.from_ms.div_euclid(1000).to_string(),
                        Var::ToS => t.to_ms.div_euclid(1000).to_string(),
                    };
                    s.extend(utf8_percent_encode(&value, VALUE));
                }
            }
        }
        let u = url::Url::parse(&s).map_err(|e| TemplateError::NotUrl(e, s.clone()))?;
        match u.scheme() {
            "http" | "https" => Ok(u),
            other => Err(TemplateError::Scheme(other.to_string())),
        }
    }

    /// The link for `t`; `None` only if the names make it no URL (they cannot: they are
    /// encoded), never a link of another scheme.
    pub fn render(&self, t: &Target<'_>) -> Option<String> {
        self.url(t).ok().map(String::from)
    }
}

impl fmt::Display for ProfileTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for p in &self.parts {
            match p {
                Part::Text(x) => f.write_str(x)?,
                Part::Var(v) => write!(f, "{{{}}}", v.name())?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARCA: &str = "http://parca.parca.svc:7070/?expression_a=parca_agent:samples:count:cpu:nanoseconds:delta{namespace=\"{namespace}\",pod=\"{pod}\"}&from_a={from_ms}&to_a={to_ms}&time_selection_a=absolute:{from_ms}-{to_ms}";

    fn query(u: &str) -> Vec<(String, String)> {
        url::Url::parse(u)
            .unwrap()
            .query_pairs()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect()
    }

    #[test]
    fn a_parca_link_carries_the_pod_and_the_spikes_range() {
        let t: ProfileTemplate = PARCA.parse().unwrap();
        let link = t
            .render(&Target::spike("ml", "vllm-0", "gpu-1", 1_800_000_060_000))
            .unwrap();
        let q = query(&link);
        let get = |k: &str| q.iter().find(|(n, _)| n == k).unwrap().1.clone();
        assert_eq!(
            get("expression_a"),
            "parca_agent:samples:count:cpu:nanoseconds:delta{namespace=\"ml\",pod=\"vllm-0\"}"
        );
        assert_eq!(get("from_a"), "1800000030000");
        assert_eq!(get("to_a"), "1800000120000");
        assert_eq!(
            get("time_selection_a"),
            "absolute:1800000030000-1800000120000"
        );
    }

    #[test]
    fn hostile_names_stay_inside_their_value() {
        let t: ProfileTemplate =
            "https://p.example/explore?query=cpu{pod=\"{pod}\"}&from={from_s}&until={to_s}"
                .parse()
                .unwrap();
        let link = t
            .render(&Target::spike("ns", "a&until=0#x", "n", 10_000_000))
            .unwrap();
        let q = query(&link);
        assert_eq!(q.len(), 3, "{link}");
        assert_eq!(q[0].1, "cpu{pod=\"a&until=0#x\"}");
        assert_eq!(q[1].1, "9970");
        assert_eq!(q[2].1, "10060");
        assert!(!link.contains('#'), "{link}");
    }

    #[test]
    fn bad_templates_are_refused_with_the_reason() {
        assert_eq!(
            "http://p/?q={podname}".parse::<ProfileTemplate>(),
            Err(TemplateError::Unknown("podname".into()))
        );
        assert!(matches!(
            "javascript:alert({pod})".parse::<ProfileTemplate>(),
            Err(TemplateError::Scheme(s)) if s == "javascript"
        ));
        assert!(matches!(
            "parca/?q={pod}".parse::<ProfileTemplate>(),
            Err(TemplateError::NotUrl(..))
        ));
        assert_eq!(
            "x".repeat(3000).parse::<ProfileTemplate>(),
            Err(TemplateError::TooLong)
        );
        // braces that are no placeholder are text, and the template prints back as given
        let t: ProfileTemplate = PARCA.parse().unwrap();
        assert_eq!(t.to_string(), PARCA);
    }
}
