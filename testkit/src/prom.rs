//! The Prometheus text exposition format (version 0.0.4), parsed strictly: label values with
//! their escapes (`\\`, `\"`, `\n`), an optional timestamp, `NaN` and `±Inf`. A line that is
//! not the format is an error naming the line, never a silently skipped series: a test reading
//! a broken page must fail on the page, not on a missing value.
//!
//! One parser for every crate's tests, so that they all read a page the way Prometheus does.

use std::collections::BTreeMap;

use gpufeed_shared::exposition::parse_text;

/// One sample: a series' name, its labels and its value (the timestamp, when present, is
/// checked and dropped: the agents write none).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    /// The label's value, or "" when the sample has no such label (as PromQL treats it).
    pub fn label(&self, k: &str) -> &str {
        self.labels.get(k).map(String::as_str).unwrap_or("")
    }

    /// Whether the sample carries every `(label, value)` of `want`.
    pub fn matches(&self, want: &[(&str, &str)]) -> bool {
        want.iter().all(|(k, v)| self.label(k) == *v)
    }
}

/// Every sample of `text`; panics naming the first line that is not the format.
pub fn parse(text: &str) -> Vec<Sample> {
    try_parse(text).unwrap_or_else(|e| panic!("not the Prometheus text format: {e}"))
}

/// Every sample of `text`, or the first line that is not the format and why.
pub fn try_parse(text: &str) -> Result<Vec<Sample>, String> {
    let families = parse_text(text).map_err(|e| e.to_string())?;
    Ok(families
        .into_iter()
        .flat_map(|f| f.samples)
        .map(|s| Sample {
            name: s.name,
            labels: s.labels.into_iter().collect(),
            value: s.value,
        })
        .collect())
}

/// The `# TYPE` of each family on the page (`counter`, `gauge`, `histogram`, ...).
pub fn types(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_string(), kind.trim().to_string()))
        .collect()
}

/// Samples of `name` whose labels include all of `want`.
pub fn find<'a>(samples: &'a [Sample], name: &str, want: &[(&str, &str)]) -> Vec<&'a Sample> {
    samples
        .iter()
        .filter(|s| s.name == name && s.matches(want))
        .collect()
}

/// The sum of the samples of `name` matching `want`, or None when there is none.
pub fn value(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> Option<f64> {
    let f = find(samples, name, want);
    (!f.is_empty()).then(|| f.iter().map(|s| s.value).sum())
}

/// The sum of the samples of `name` matching `want`; 0 when there is none.
pub fn sum(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    value(samples, name, want).unwrap_or(0.0)
}

/// A histogram's `q` quantile as the upper bound of the cumulative bucket that holds it
/// (`base_bucket` series matching `want`), or None when it has no buckets.
pub fn hist_quantile(samples: &[Sample], base: &str, want: &[(&str, &str)], q: f64) -> Option<f64> {
    let mut buckets: Vec<(f64, f64)> = find(samples, &format!("{base}_bucket"), want)
        .iter()
        .map(|s| {
            let le = s.label("le").parse::<f64>().unwrap_or(f64::INFINITY);
            (le, s.value)
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    let rank = q * total;
    buckets.iter().find(|(_, c)| *c >= rank).map(|(le, _)| *le)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP a_total Things.\n\
        # TYPE a_total counter\n\
        a_total{pod=\"p1\",namespace=\"ns\"} 3\n\
        a_total{pod=\"p2\",namespace=\"ns\",} 4 1700000000000\n\
        # TYPE g gauge\n\
        g 1.5e3\n\
        g{path=\"C:\\\\x \\\"q\\\"\\nnext\"} -Inf\n\
        h_bucket{le=\"0.5\"} 1\n\
        h_bucket{le=\"1\"} 3\n\
        h_bucket{le=\"+Inf\"} 4\n\
        nan NaN\n";

    #[test]
    fn reads_labels_escapes_timestamps_and_special_values() {
        let s = parse(PAGE);
        assert_eq!(s.len(), 8);
        assert_eq!(value(&s, "a_total", &[("namespace", "ns")]), Some(7.0));
        assert_eq!(value(&s, "a_total", &[("pod", "p2")]), Some(4.0));
        assert_eq!(value(&s, "g", &[("path", "")]), Some(1500.0));
        let odd = find(&s, "g", &[])
            .into_iter()
            .find(|x| x.value.is_infinite())
            .unwrap();
        assert_eq!(odd.label("path"), "C:\\x \"q\"\nnext");
        assert!(value(&s, "nan", &[]).unwrap().is_nan());
        assert_eq!(sum(&s, "missing", &[]), 0.0);
        assert_eq!(value(&s, "missing", &[]), None);
        assert_eq!(types(PAGE)["a_total"], "counter");
        assert_eq!(types(PAGE)["g"], "gauge");
    }

    #[test]
    fn quantile_is_the_bucket_bound() {
        let s = parse(PAGE);
        assert_eq!(hist_quantile(&s, "h", &[], 0.25), Some(0.5));
        assert_eq!(hist_quantile(&s, "h", &[], 0.5), Some(1.0));
        assert_eq!(hist_quantile(&s, "h", &[], 0.99), Some(f64::INFINITY));
        assert_eq!(hist_quantile(&s, "none", &[], 0.5), None);
    }

    #[test]
    fn broken_lines_are_errors_naming_the_line() {
        let e = try_parse("ok 1\nx{a=1} 2\n").unwrap_err();
        assert!(e.starts_with("line 2:") && e.contains("quotes"), "{e}");
        let e = try_parse("ok 1\nHTTP/1.0 200 OK\n").unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
    }
}
