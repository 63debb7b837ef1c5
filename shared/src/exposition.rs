//! The Prometheus text exposition format (0.0.4), parsed strictly, as the `prometheus` crate's
//! encoder and the agents write it: `# HELP` / `# TYPE` then the family's samples; label values
//! with `\\`, `\"` and `\n` escaped; an optional timestamp; `NaN` and `±Inf`. A line that is not
//! the format is an error naming the line, never a sample silently skipped.
//!
//! One parser for the workspace: the OTLP push reads the agent's own page through it, and the
//! tests read every page through it (the test kit's `prom` module).

/// A metric type as `# TYPE` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Untyped,
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// A metric family: its `# HELP`, `# TYPE` and the samples that follow.
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    pub name: String,
    pub help: String,
    pub kind: Kind,
    pub samples: Vec<Sample>,
}

/// A line of the exposition that is not the text format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {what}")]
pub struct ParseError {
    pub line: usize,
    pub what: String,
}

/// Parses the Prometheus text exposition format (0.0.4) as the `prometheus` crate's encoder
/// and the agents write it: `# HELP`/`# TYPE` then the family's samples; label values with
/// `\\`, `\"` and `\n` escaped. A sample whose name does not belong to the family before it
/// starts an untyped family of its own.
pub fn parse_text(text: &str) -> Result<Vec<Family>, ParseError> {
    let mut out: Vec<Family> = Vec::new();
    let mut help: Option<(String, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let err = |what: &str| ParseError {
            line: i + 1,
            what: what.to_string(),
        };
        let line = line.trim_end();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let rest = rest.trim_start();
            if let Some(h) = rest.strip_prefix("HELP ") {
                let (name, text) = h.split_once(' ').unwrap_or((h, ""));
                help = Some((name.to_string(), unescape_help(text)));
            } else if let Some(t) = rest.strip_prefix("TYPE ") {
                let (name, kind) = t
                    .split_once(' ')
                    .ok_or_else(|| err("TYPE without a type"))?;
                let kind = match kind.trim() {
                    "counter" => Kind::Counter,
                    "gauge" => Kind::Gauge,
                    "histogram" => Kind::Histogram,
                    "summary" => Kind::Summary,
                    "untyped" | "unknown" => Kind::Untyped,
                    other => return Err(err(&format!("unknown type {other:?}"))),
                };
                let help = match help.take() {
                    Some((n, h)) if n == name => h,
                    _ => String::new(),
                };
                out.push(Family {
                    name: name.to_string(),
                    help,
                    kind,
                    samples: Vec::new(),
                });
            }
            continue;
        }
        let sample = parse_sample(line).map_err(|w| err(&w))?;
        let belongs = out.last().is_some_and(|f| belongs_to(f, &sample.name));
        if !belongs {
            let help = match help.take() {
                Some((n, h)) if n == sample.name => h,
                _ => String::new(),
            };
            out.push(Family {
                name: sample.name.clone(),
                help,
                kind: Kind::Untyped,
                samples: Vec::new(),
            });
        }
        out.last_mut().expect("a family").samples.push(sample);
    }
    Ok(out)
}

fn belongs_to(f: &Family, sample: &str) -> bool {
    if sample == f.name {
        return f.kind != Kind::Histogram;
    }
    let Some(suffix) = sample.strip_prefix(f.name.as_str()) else {
        return false;
    };
    match f.kind {
        Kind::Histogram => matches!(suffix, "_bucket" | "_sum" | "_count"),
        Kind::Summary => matches!(suffix, "_sum" | "_count"),
        _ => false,
    }
}

fn unescape_help(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\\' {
            match it.next() {
                Some('n') => out.push('\n'),
                Some(o) => out.push(o),
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
    let name = &line[..end];
    if !name.starts_with(is_name_start) {
        return Err("a sample without a metric name".into());
    }
    let mut rest = &line[end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        rest = label_set(body, &mut labels)?;
    }
    if !rest.starts_with([' ', '\t']) {
        return Err("no space before the value".into());
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = match fields.next().ok_or("a sample without a value")? {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v
            .parse()
            .map_err(|_| format!("value {v:?} is not a number"))?,
    };
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("timestamp {ts:?} is not an integer"))?;
    }
    if fields.next().is_some() {
        return Err("text after the timestamp".into());
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Reads `name="value",...}` into `labels`; returns what follows the closing brace.
fn label_set<'a>(mut s: &'a str, labels: &mut Vec<(String, String)>) -> Result<&'a str, String> {
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
            return Err("a label name is not a name".into());
        }
        s = s[end..]
            .trim_start()
            .strip_prefix('=')
            .ok_or("a label without '='")?;
        s = s
            .trim_start()
            .strip_prefix('"')
            .ok_or("a label value without quotes")?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let close = loop {
            match chars.next().ok_or("an unterminated label value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("an unterminated label value")?.1 {
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    'n' => value.push('\n'),
                    c => return Err(format!("an unknown escape \\{c} in a label value")),
                },
                (_, c) => value.push(c),
            }
        };
        if labels.iter().any(|(k, _)| k == key) {
            return Err(format!("label {key} given twice"));
        }
        labels.push((key.to_string(), value));
        s = s[close + 1..].trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err("no ',' or '}' after a label".into());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A page with every kind of family, escapes and a sample of no family.
    pub(crate) const TEXT: &str = r#"# HELP a_total Things "done".\nSecond line
# TYPE a_total counter
a_total{x="1",y="q\"uo\\te\nnl"} 3
a_total{x="2"} 4.5
# HELP h_seconds A histogram
# TYPE h_seconds histogram
h_seconds_bucket{p="a",le="0.5"} 1
h_seconds_bucket{p="a",le="1"} 3
h_seconds_bucket{p="a",le="+Inf"} 4
h_seconds_sum{p="a"} 2.25
h_seconds_count{p="a"} 4
h_seconds_bucket{p="b",le="0.5"} 0
h_seconds_bucket{p="b",le="1"} 0
h_seconds_bucket{p="b",le="+Inf"} 0
h_seconds_sum{p="b"} 0
h_seconds_count{p="b"} 0
# HELP g A gauge
# TYPE g gauge
g NaN
loose{a="b"} 7
# TYPE s summary
s{quantile="0.5"} 1
s{quantile="0.9"} 2
s_sum 10
s_count 5
"#;

    #[test]
    fn parses_the_text_format() {
        let f = parse_text(TEXT).unwrap();
        let names: Vec<_> = f.iter().map(|f| (f.name.as_str(), f.kind)).collect();
        assert_eq!(
            names,
            [
                ("a_total", Kind::Counter),
                ("h_seconds", Kind::Histogram),
                ("g", Kind::Gauge),
                ("loose", Kind::Untyped),
                ("s", Kind::Summary)
            ]
        );
        assert_eq!(f[0].help, "Things \"done\".\nSecond line");
        assert_eq!(
            f[0].samples[0].labels,
            [
                ("x".to_string(), "1".to_string()),
                ("y".to_string(), "q\"uo\\te\nnl".to_string())
            ]
        );
        assert_eq!(f[0].samples[1].value, 4.5);
        assert_eq!(f[1].samples.len(), 10);
        assert!(f[2].samples[0].value.is_nan());
        assert_eq!(f[3].samples[0].value, 7.0);
    }

    #[test]
    fn bad_lines_are_errors_with_their_number() {
        for (bad, why) in [
            ("a{x=\"1\" 2", "no ',' or '}'"),
            ("a{x=1} 2", "without quotes"),
            ("a{x=\"1} 2", "unterminated"),
            ("a{x=\"\\t\"} 2", "unknown escape"),
            ("a{x=\"1\",x=\"2\"} 2", "given twice"),
            ("a{x=\"1\"} two", "not a number"),
            ("a 1 2 3", "after the timestamp"),
            ("a 1 soon", "timestamp"),
            ("a", "no space"),
            ("{x=\"1\"} 2", "metric name"),
            ("# TYPE a nonsense", "unknown type"),
        ] {
            let e = parse_text(&format!("ok 1\n{bad}\n")).unwrap_err();
            assert_eq!(e.line, 2, "{bad:?}: {e}");
            assert!(e.what.contains(why), "{bad:?}: {e}");
        }
        // a timestamp is read and dropped
        let f = parse_text("t 1 1700000000000\n").unwrap();
        assert_eq!(f[0].samples[0].value, 1.0);
    }
}
