//! The per-owner families in the text format, written directly, with each series' label text
//! cached per owner.
//!
//! The output is what the prometheus crate's `TextEncoder` writes for the same series
//! (families in name order, series in label-value order, numbers in Rust's `f64` display),
//! which the tests check line for line. Several owners can map to one label set (a pod's
//! sandbox and its pod cgroup both have `container=""`): their series are merged, so no series
//! repeats.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write as _;

use crate::collect::{Owner, Shared};
use crate::probes::hist::{upper_bound_us, Hist, BUCKETS};
use crate::probes::unit::{FamilySpec, Kind, Labels, Scope, Value};

/// Label text of one owner's series, valid while the owner's labels stay `labels`.
struct OwnerText {
    labels: Labels,
    /// `a="x",b="y"` (no braces) per scope ([`ix`]) and the unit's own labels.
    series: [HashMap<Labels, String>; 2],
    /// The render that last saw the owner (owners not seen in one are dropped).
    seen: u64,
}

/// Label text per owner and series, kept between scrapes.
#[derive(Default)]
pub struct LabelCache {
    owners: HashMap<Owner, OwnerText>,
    renders: u64,
    /// `le` values of the finite buckets as the text format writes them.
    le: Vec<String>,
}

#[cfg(test)]
impl LabelCache {
    /// Owners with cached label text.
    pub fn owners(&self) -> usize {
        self.owners.len()
    }
}

/// One series' value merged over the owners that share its label set.
enum Sum<'a> {
    Hist(Cow<'a, Hist>),
    Count(u64),
}

impl LabelCache {
    /// The label text of `owner`'s series of `scope` with `extra` labels; `labels` are the
    /// owner's labels now (built by the caller, compared with the cached ones).
    fn prepare(&mut self, owner: &Owner, labels: impl FnOnce() -> Labels) {
        let renders = self.renders;
        let now = labels();
        match self.owners.get_mut(owner) {
            Some(o) if o.labels == now => o.seen = renders,
            _ => {
                self.owners.insert(
                    owner.clone(),
                    OwnerText {
                        labels: now,
                        series: Default::default(),
                        seen: renders,
                    },
                );
            }
        }
    }

    /// Makes sure the label text of `owner`'s series of `scope` with the unit's labels
    /// `extra` is cached.
    fn fill(&mut self, owner: &Owner, scope: Scope, extra: &Labels) {
        let Some(o) = self.owners.get_mut(owner) else {
            return;
        };
        if o.series[ix(scope)].contains_key(extra) {
            return;
        }
        let mut l = o.labels.clone();
        if scope == Scope::Pod {
            l.remove("container");
        }
        l.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
        o.series[ix(scope)].insert(extra.clone(), label_text(&l));
    }

    fn text(&self, owner: &Owner, scope: Scope, extra: &Labels) -> Option<&str> {
        self.owners.get(owner)?.series[ix(scope)]
            .get(extra)
            .map(String::as_str)
    }

    /// Writes the per-owner families of `families` for the owners in `shared`; `labels`
    /// gives an owner's labels (see `AgentCollector::owner_labels`).
    pub fn write(
        &mut self,
        out: &mut String,
        shared: &Shared,
        families: &[&'static FamilySpec],
        mut labels: impl FnMut(&Owner) -> Labels,
    ) {
        self.renders += 1;
        if self.le.is_empty() {
            self.le = (0..BUCKETS)
                .map(|i| upper_bound_us(i).to_string())
                .collect();
        }
        let scope_of: HashMap<&'static str, Scope> =
            families.iter().map(|f| (f.name, f.scope)).collect();
        let gauge_owners = shared.gauges.values().flatten().map(|g| &g.owner);
        for owner in shared.owners.keys().chain(gauge_owners) {
            if self
                .owners
                .get(owner)
                .is_none_or(|o| o.seen != self.renders)
            {
                self.prepare(owner, || labels(owner));
            }
        }
        let renders = self.renders;
        self.owners.retain(|_, o| o.seen == renders);
        // Label texts are filled in (mutably) first, then borrowed for the merge.
        for (owner, o) in &shared.owners {
            for (family, extra) in o.series.keys() {
                if let Some(&scope) = scope_of.get(family) {
                    self.fill(owner, scope, extra);
                }
            }
        }
        for (family, values) in &shared.gauges {
            if let Some(&scope) = scope_of.get(family) {
                for g in values {
                    self.fill(&g.owner, scope, &g.labels);
                }
            }
        }
        let cache = &*self;
        let get = |owner: &Owner, scope: Scope, extra: &Labels| cache.text(owner, scope, extra);
        let mut merged: HashMap<&'static str, HashMap<&str, Sum<'_>>> = HashMap::new();
        for (owner, o) in &shared.owners {
            for ((family, extra), value) in &o.series {
                let Some(&scope) = scope_of.get(family) else {
                    continue; // a family no loaded unit declares
                };
                let Some(text) = get(owner, scope, extra) else {
                    continue;
                };
                let m = merged.entry(family).or_default();
                match value {
                    // no samples yet: no series
                    Value::Hist(h) if h.is_empty() => {}
                    Value::Hist(h) => match m.get_mut(text) {
                        Some(Sum::Hist(sum)) => sum.to_mut().add(h),
                        _ => {
                            m.insert(text, Sum::Hist(Cow::Borrowed(h)));
                        }
                    },
                    Value::Count(n) => match m.get_mut(text) {
                        Some(Sum::Count(sum)) => *sum += n,
                        _ => {
                            m.insert(text, Sum::Count(*n));
                        }
                    },
                }
            }
        }
        let mut sorted: Vec<&&'static FamilySpec> = families.iter().collect();
        sorted.sort_by_key(|f| f.name);
        for f in sorted {
            match f.kind {
                Kind::Histogram | Kind::Counter | Kind::SecondsCounter => {
                    let Some(series) = merged.remove(f.name) else {
                        continue;
                    };
                    if series.is_empty() {
                        continue;
                    }
                    header(out, f);
                    for (labels, sum) in series_in_order(series) {
                        match (f.kind, sum) {
                            (Kind::Histogram, Sum::Hist(h)) => {
                                write_hist(out, f.name, labels, &h, &cache.le)
                            }
                            (Kind::SecondsCounter, Sum::Count(n)) => {
                                sample(out, f.name, "", labels, n as f64 * 1e-9)
                            }
                            (_, Sum::Count(n)) => sample(out, f.name, "", labels, n as f64),
                            // a family has one kind; a unit mixing them is a bug, not input
                            _ => {}
                        }
                    }
                }
                Kind::Gauge => {
                    let Some(values) = shared.gauges.get(f.name) else {
                        continue;
                    };
                    let mut series: Vec<(&str, f64)> = values
                        .iter()
                        .filter_map(|g| Some((get(&g.owner, f.scope, &g.labels)?, g.value)))
                        .collect();
                    if series.is_empty() {
                        continue;
                    }
                    series.sort_by(|a, b| by_values(a.0, b.0));
                    header(out, f);
                    for (labels, v) in series {
                        sample(out, f.name, "", labels, v);
                    }
                }
            }
        }
    }
}

fn ix(scope: Scope) -> usize {
    match scope {
        Scope::Container => 0,
        Scope::Pod => 1,
    }
}

/// The series of a family in the order the registry sorts them: by label values.
fn series_in_order<'a, 'b>(series: HashMap<&'a str, Sum<'b>>) -> Vec<(&'a str, Sum<'b>)> {
    let mut v: Vec<(&str, Sum<'_>)> = series.into_iter().collect();
    v.sort_by(|a, b| by_values(a.0, b.0));
    v
}

/// Compares two label texts of one family by their values in order, as the registry compares
/// label pairs (the values escaped: the order differs from the registry's only where a value
/// holds a quote, backslash or newline).
fn by_values(a: &str, b: &str) -> std::cmp::Ordering {
    values(a).cmp(values(b))
}

/// The (escaped) values of a label text, in order: what stands between `="` and the next
/// unescaped `"`.
fn values(text: &str) -> impl Iterator<Item = &str> + '_ {
    let mut rest = text;
    std::iter::from_fn(move || {
        let start = rest.find("=\"")? + 2;
        let b = rest.as_bytes();
        let mut i = start;
        while i < b.len() && b[i] != b'"' {
            i += if b[i] == b'\\' { 2 } else { 1 };
        }
        let end = i.min(b.len());
        let v = &rest[start..end];
        rest = &rest[(end + 1).min(rest.len())..];
        Some(v)
    })
}

/// `name="value",...` with values escaped as the text format wants them.
fn label_text(l: &Labels) -> String {
    let mut s = String::new();
    for (i, (k, v)) in l.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(k);
        s.push_str("=\"");
        escape_into(&mut s, v, true);
        s.push('"');
    }
    s
}

fn escape_into(out: &mut String, v: &str, quote: bool) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quote => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

fn header(out: &mut String, f: &FamilySpec) {
    let t = match f.kind {
        Kind::Histogram => "histogram",
        Kind::Counter | Kind::SecondsCounter => "counter",
        Kind::Gauge => "gauge",
    };
    if !f.help.is_empty() {
        out.push_str("# HELP ");
        out.push_str(f.name);
        out.push(' ');
        escape_into(out, f.help, false);
        out.push('\n');
    }
    out.push_str("# TYPE ");
    out.push_str(f.name);
    out.push(' ');
    out.push_str(t);
    out.push('\n');
}

/// One line: `name{labels} value` (no braces without labels).
fn sample(out: &mut String, name: &str, suffix: &str, labels: &str, v: f64) {
    out.push_str(name);
    out.push_str(suffix);
    if !labels.is_empty() {
        out.push('{');
        out.push_str(labels);
        out.push('}');
    }
    out.push(' ');
    number(out, v);
    out.push('\n');
}

fn write_hist(out: &mut String, name: &str, labels: &str, h: &Hist, le: &[String]) {
    let cum = h.cumulative();
    let sep = if labels.is_empty() { "" } else { "," };
    for (i, bound) in le.iter().enumerate() {
        bucket(out, name, labels, sep, bound, cum[i]);
    }
    bucket(out, name, labels, sep, "+Inf", h.count);
    sample(out, name, "_sum", labels, h.sum_ns as f64 / 1000.0);
    sample(out, name, "_count", labels, h.count as f64);
}

fn bucket(out: &mut String, name: &str, labels: &str, sep: &str, le: &str, n: u64) {
    out.push_str(name);
    out.push_str("_bucket{");
    out.push_str(labels);
    out.push_str(sep);
    out.push_str("le=\"");
    out.push_str(le);
    out.push_str("\"} ");
    number(out, n as f64);
    out.push('\n');
}

/// A value as `f64`'s display writes it (what the prometheus crate's encoder writes);
/// whole numbers below 2^53, nearly all of them, the fast way.
fn number(out: &mut String, v: f64) {
    if v.fract() == 0.0 && v.abs() < 9.0e15 && !(v == 0.0 && v.is_sign_negative()) {
        let _ = write!(out, "{}", v as i64);
    } else {
        let _ = write!(out, "{v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_f64_displays_them() {
        for v in [
            0.0,
            -0.0,
            1.0,
            1e9,
            8.9e15,
            9.1e15,
            1e300,
            0.5,
            1.024,
            1e-9,
            123.456,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            -3.0,
        ] {
            let mut s = String::new();
            number(&mut s, v);
            assert_eq!(s, v.to_string(), "{v}");
        }
    }

    #[test]
    fn label_text_escapes_as_the_text_format_wants() {
        let l = Labels::from([("a", "x\"y\\z\nw".to_string()), ("b", String::new())]);
        assert_eq!(label_text(&l), r#"a="x\"y\\z\nw",b="""#);
        assert_eq!(
            values(&label_text(&l)).collect::<Vec<_>>(),
            [r#"x\"y\\z\nw"#, ""]
        );
        let commas = Labels::from([("a", "1,b=\"2".to_string()), ("c", "3".to_string())]);
        assert_eq!(
            values(&label_text(&commas)).collect::<Vec<_>>(),
            [r#"1,b=\"2"#, "3"]
        );
    }
}
