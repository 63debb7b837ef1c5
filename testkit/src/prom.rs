//! The Prometheus text exposition format (version 0.0.4), parsed strictly: label values with
//! their escapes (`\\`, `\"`, `\n`), an optional timestamp, `NaN` and `±Inf`. A line that is
//! not the format is an error naming the line, never a silently skipped series: a test reading
//! a broken page must fail on the page, not on a missing value.
//!
//! One parser for every crate's tests, so that they all read a page the way Prometheus does.

use std::collections::BTreeMap;

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
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(sample(line).map_err(|why| format!("line {}: {why}: {line:?}", i + 1))?);
    }
    Ok(out)
}

/// The `# TYPE` of each family on the page (`counter`, `gauge`, `histogram`, ...).
pub fn types(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_string(), kind.trim().to_string()))
        .collect()
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn sample(line: &str) -> Result<Sample, &'static str> {
    let end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
    let name = &line[..end];
    if !name.starts_with(is_name_start) {
        return Err("no metric name");
    }
    let mut rest = &line[end..];
    let mut labels = BTreeMap::new();
    if let Some(body) = rest.strip_prefix('{') {
        rest = label_set(body, &mut labels)?;
    }
    let mut fields = rest.split_ascii_whitespace();
    if !rest.starts_with([' ', '\t']) {
        return Err("no space before the value");
    }
    let value = match fields.next().ok_or("no value")? {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().map_err(|_| "the value is not a number")?,
    };
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| "the timestamp is not an integer")?;
    }
    if fields.next().is_some() {
        return Err("text after the timestamp");
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Reads `name="value",...}` into `labels`; returns what follows the closing brace.
fn label_set<'a>(
    mut s: &'a str,
    labels: &mut BTreeMap<String, String>,
) -> Result<&'a str, &'static str> {
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok(rest);
        }
        let end = s
            .find(|c: char| !is_name_char(c))
            .ok_or("unclosed labels")?;
        let key = &s[..end];
        if key.is_empty() || key.contains(':') || !key.starts_with(is_name_start) {
            return Err("a label name is not a name");
        }
        s = s[end..]
            .trim_start()
            .strip_prefix('=')
            .ok_or("no '=' after a label name")?;
        s = s
            .trim_start()
            .strip_prefix('"')
            .ok_or("a label value is not quoted")?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let close = loop {
            match chars.next().ok_or("unclosed label value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("unclosed label value")?.1 {
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    'n' => value.push('\n'),
                    _ => return Err("an unknown escape in a label value"),
                },
                (_, c) => value.push(c),
            }
        };
        if labels.insert(key.to_string(), value).is_some() {
            return Err("a label given twice");
        }
        s = s[close + 1..].trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err("no ',' or '}' after a label");
        }
    }
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
        for (bad, why) in [
            ("x{a=\"1\" 2", "no ',' or '}'"),
            ("x{a=1} 2", "not quoted"),
            ("x{a=\"1} 2", "unclosed label value"),
            ("x{a=\"\\t\"} 2", "unknown escape"),
            ("x{a=\"1\",a=\"2\"} 2", "given twice"),
            ("x two", "not a number"),
            ("x 1 2 3", "after the timestamp"),
            ("x 1 soon", "timestamp"),
            ("x", "no space"),
            ("{a=\"1\"} 2", "no metric name"),
        ] {
            let e = try_parse(&format!("ok 1\n{bad}\n")).unwrap_err();
            assert!(e.starts_with("line 2:") && e.contains(why), "{bad}: {e}");
        }
    }
}
