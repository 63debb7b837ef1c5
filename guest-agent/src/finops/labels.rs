//! Pod labels configured by name (`--pod-label tenant=team.example.com/tenant`) that become
//! series labels: on every GPU series, on the cost series, and on `gpufeed_pod_info`, which
//! joins them to every other per-pod series in PromQL.

use super::error::{ConfigError, LABEL_NAMES};
use crate::pods::PodMeta;
use crate::probes::unit::Labels;

/// Series label name → pod label key, in the order given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodLabels {
    pairs: Vec<(&'static str, String)>,
}

impl PodLabels {
    /// From `NAME=KEY` strings.
    pub fn parse(given: &[String]) -> Result<PodLabels, ConfigError> {
        let mut pairs: Vec<(&'static str, String)> = Vec::new();
        for g in given {
            let Some((name, key)) = g.split_once('=') else {
                return Err(ConfigError::PodLabelSyntax(g.clone()));
            };
            let (name, key) = (name.trim(), key.trim());
            let Some(&name) = LABEL_NAMES.iter().find(|n| **n == name) else {
                return Err(ConfigError::UnknownLabelName {
                    given: g.clone(),
                    name: name.to_string(),
                });
            };
            if !is_label_key(key) {
                return Err(ConfigError::BadLabelKey {
                    given: g.clone(),
                    key: key.to_string(),
                });
            }
            if pairs.iter().any(|(n, _)| *n == name) {
                return Err(ConfigError::DuplicateLabelName(g.clone()));
            }
            pairs.push((name, key.to_string()));
        }
        Ok(PodLabels { pairs })
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// The configured series label names.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.pairs.iter().map(|(n, _)| *n)
    }

    /// Adds every configured label: the pod's value, or "" when the pod lacks the label or is
    /// not known (yet) from the API, so that a family's label names do not depend on it.
    pub fn extend(&self, meta: Option<&PodMeta>, l: &mut Labels) {
        for (name, key) in &self.pairs {
            let v = meta.and_then(|m| m.labels.get(key)).cloned();
            l.insert(name, v.unwrap_or_default());
        }
    }

    /// The configured `tenant` of a pod ("" when not configured or not labelled).
    pub fn tenant(&self, meta: Option<&PodMeta>) -> String {
        self.pairs
            .iter()
            .find(|(n, _)| *n == "tenant")
            .and_then(|(_, key)| meta?.labels.get(key).cloned())
            .unwrap_or_default()
    }
}

/// A Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters, alphanumerics with `-`, `_`, `.` inside.
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
    });
    name_ok && prefix_ok
}

#[cfg(test)]
mod tests {

    use super::*;

    fn meta(labels: &[(&str, &str)]) -> PodMeta {
        PodMeta {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..PodMeta::named("u", "ns", "p")
        }
    }

    #[test]
    fn configured_labels_by_name_in_order() {
        let pl = PodLabels::parse(&[
            "tenant=team.example.com/tenant".into(),
            "app = app.kubernetes.io/name".into(),
        ])
        .unwrap();
        let m = meta(&[("team.example.com/tenant", "search"), ("other", "x")]);
        let mut l = Labels::new();
        pl.extend(Some(&m), &mut l);
        assert_eq!(
            l,
            Labels::from([("tenant", "search".to_string()), ("app", String::new())])
        );
        assert_eq!(pl.names().collect::<Vec<_>>(), ["tenant", "app"]);
        // an unknown pod: the names, empty
        let mut l = Labels::new();
        pl.extend(None, &mut l);
        assert_eq!(l.len(), 2);
        assert_eq!(pl.tenant(Some(&m)), "search");
        assert_eq!(pl.tenant(None), "");
    }

    #[test]
    fn label_keys() {
        for ok in ["app", "team.example.com/tenant", "a-b_c.d", "k8s.io/x1"] {
            assert!(is_label_key(ok), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "has space",
            "UPPER.com/x",
            "/x",
            "a/",
            "x/y/z",
        ] {
            assert!(!is_label_key(bad), "{bad}");
        }
    }
}
