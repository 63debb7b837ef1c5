//! The per-owner families in the text format, written directly, with each series' label text
//! cached per owner.
//!
//! The output is what the prometheus crate's `TextEncoder` writes for the same series
//! (families in name order, numbers in Rust's `f64` display), which the tests check line for
//! line. Series are in the order of their label text; the registry orders by label values,
//! which differs only where a value holds a character that sorts below `"` (Prometheus takes
//! either). Several owners can map to one label set (a pod's sandbox and its pod cgroup both
//! have `container=""`): their series are merged, so no series repeats.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use crate::collect::{Owner, Store};
use crate::join::Causes;
use crate::probes::cuda::FEED_STALL;
use crate::probes::hist::{upper_bound_us, Hist, BUCKETS};
use crate::probes::unit::{FamilySpec, Kind, Labels, Scope, Value};

/// Label text of one owner's series, valid while the owner's labels stay `labels`.
struct OwnerText {
    labels: Labels,
    /// Labels only the GPU families carry (the configured pod labels: tenant, model, app).
    gpu: Labels,
    /// `a="x",b="y"` (no braces) per scope and GPU-ness ([`ix`]) and the unit's own labels.
    series: [HashMap<Labels, Arc<str>>; 4],
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

/// One series of one owner in a render: (family index, label text, value).
type Row<'a> = (usize, Arc<str>, &'a Value);

impl LabelCache {
    /// The label text of `owner`'s series of `scope` with the unit's labels `extra`; `None`
    /// for an owner not prepared in this render.
    fn text(&mut self, owner: &Owner, f: &FamilySpec, extra: &Labels) -> Option<Arc<str>> {
        let o = self.owners.get_mut(owner)?;
        let gpu = f.pod_labels;
        let i = ix(f.scope, gpu);
        if let Some(t) = o.series[i].get(extra) {
            return Some(t.clone());
        }
        let mut l = o.labels.clone();
        if f.scope == Scope::Pod {
            l.remove("container");
        }
        if gpu {
            l.extend(o.gpu.iter().map(|(k, v)| (*k, v.clone())));
        }
        l.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
        let t: Arc<str> = label_text(&l).into();
        o.series[i].insert(extra.clone(), t.clone());
        Some(t)
    }

    /// Writes the per-owner families of `families` for the owners in `shared`; `labels`
    /// gives an owner's labels (see `AgentCollector::owner_labels`) and those only its GPU
    /// series carry, asked once per owner and render and compared with the cached ones.
    /// The feed stall is written from `feed`, the join's split by cause of each pod's
    /// account (the store holds the probes' raw parts under the family).
    pub fn write(
        &mut self,
        out: &mut String,
        shared: &Store,
        families: &[&'static FamilySpec],
        feed: &HashMap<String, Causes, impl std::hash::BuildHasher>,
        mut labels: impl FnMut(&Owner) -> (Labels, Labels),
    ) {
        self.renders += 1;
        let renders = self.renders;
        if self.le.is_empty() {
            self.le = (0..BUCKETS)
                .map(|i| upper_bound_us(i).to_string())
                .collect();
        }
        let gauge_owners = shared.gauges.values().flatten().map(|g| &g.owner);
        for owner in shared.owners.keys().chain(gauge_owners) {
            match self.owners.get_mut(owner) {
                Some(o) if o.seen == renders => {}
                Some(o) => {
                    let (now, gpu) = labels(owner);
                    if o.labels != now || o.gpu != gpu {
                        // renamed or relabelled: every series' text is built again
                        o.series = Default::default();
                        o.labels = now;
                        o.gpu = gpu;
                    }
                    o.seen = renders;
                }
                None => {
                    let (labels, gpu) = labels(owner);
                    let text = OwnerText {
                        labels,
                        gpu,
                        series: Default::default(),
                        seen: renders,
                    };
                    self.owners.insert(owner.clone(), text);
                }
            }
        }
        self.owners.retain(|_, o| o.seen == renders);

        // Families by name, as the registry orders them.
        let mut fams: Vec<&'static FamilySpec> = families.to_vec();
        fams.sort_by_key(|f| f.name);
        let index: HashMap<&'static str, usize> =
            fams.iter().enumerate().map(|(i, f)| (f.name, i)).collect();
        // each pod's feed stall by cause, labelled as any of its owners' pod-scope series
        let mut feed_rows: Vec<(usize, Arc<str>, Value)> = Vec::new();
        if let Some(&fi) = index.get(FEED_STALL) {
            let mut done: std::collections::HashSet<&str> = Default::default();
            for owner in shared.owners.keys() {
                let Owner::Pod { uid, .. } = owner else {
                    continue;
                };
                let Some(c) = feed.get(&**uid) else {
                    continue;
                };
                if !done.insert(&**uid) {
                    continue;
                }
                for (cause, ns) in c.by_cause() {
                    let extra = Labels::from([("cause", cause.to_string())]);
                    if let Some(t) = self.text(owner, fams[fi], &extra) {
                        feed_rows.push((fi, t, Value::Count(ns)));
                    }
                }
            }
        }
        let mut rows: Vec<Row<'_>> = feed_rows
            .iter()
            .map(|(f, t, v)| (*f, t.clone(), v))
            .collect();
        for (owner, o) in &shared.owners {
            for ((family, extra), value) in &o.series {
                // no samples yet: no series; a family no loaded unit declares: none either;
                // the probes' raw feed-stall parts: the join's split instead (above)
                let Some(&fi) = index.get(family) else {
                    continue;
                };
                if *family == FEED_STALL {
                    continue;
                }
                if matches!(value, Value::Hist(h) if h.is_empty()) {
                    continue;
                }
                if let Some(t) = self.text(owner, fams[fi], extra) {
                    rows.push((fi, t, value));
                }
            }
        }
        // By family, then label text: owners that share a label set come together and are
        // merged, and each family's series come out in order.
        rows.sort_unstable_by(|a, b| (a.0, &*a.1).cmp(&(b.0, &*b.1)));
        let mut rows = rows.into_iter().peekable();
        for (fi, f) in fams.iter().enumerate() {
            if f.kind == Kind::Gauge {
                self.write_gauges(out, f, shared);
                continue;
            }
            let mut wrote_header = false;
            while let Some((_, text, first)) = rows.next_if(|r| r.0 == fi) {
                let mut sum = match first {
                    Value::Hist(h) => Sum::Hist(Cow::Borrowed(h)),
                    Value::Count(n) => Sum::Count(*n),
                };
                while let Some((_, _, v)) = rows.next_if(|r| r.0 == fi && r.1 == text) {
                    match (&mut sum, v) {
                        (Sum::Hist(a), Value::Hist(b)) => a.to_mut().add(b),
                        (Sum::Count(a), Value::Count(b)) => *a += b,
                        // a family has one kind; a unit mixing them is a bug, not input
                        _ => {}
                    }
                }
                if !wrote_header {
                    header(out, f);
                    wrote_header = true;
                }
                match (f.kind, sum) {
                    (Kind::Histogram, Sum::Hist(h)) => write_hist(out, f.name, &text, &h, &self.le),
                    (Kind::SecondsCounter, Sum::Count(n)) => {
                        sample(out, f.name, "", &text, n as f64 * 1e-9)
                    }
                    (_, Sum::Count(n)) => sample(out, f.name, "", &text, n as f64),
                    _ => {}
                }
            }
        }
    }

    /// A gauge family: every value its unit set, in label order.
    fn write_gauges(&mut self, out: &mut String, f: &FamilySpec, shared: &Store) {
        let Some(values) = shared.gauges.get(f.name) else {
            return;
        };
        let mut series: Vec<(Arc<str>, f64)> = values
            .iter()
            .filter_map(|g| Some((self.text(&g.owner, f, &g.labels)?, g.value)))
            .collect();
        if series.is_empty() {
            return;
        }
        series.sort_by(|a, b| a.0.cmp(&b.0));
        header(out, f);
        for (labels, v) in series {
            sample(out, f.name, "", &labels, v);
        }
    }
}

#[cfg(test)]
impl LabelCache {
    /// Owners with cached label text.
    pub fn owners(&self) -> usize {
        self.owners.len()
    }
}

/// One series' value merged over the owners that share its label set.
// One lives on the stack at a time, while its series is written.
#[allow(clippy::large_enum_variant)]
enum Sum<'a> {
    Hist(Cow<'a, Hist>),
    Count(u64),
}

fn ix(scope: Scope, gpu: bool) -> usize {
    let s = match scope {
        Scope::Container => 0,
        Scope::Pod => 1,
    };
    s + 2 * usize::from(gpu)
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
    // `name_bucket{labels,le="` once per series; most buckets repeat the one below them (0
    // below the fastest sample, the count above the slowest): their number is copied.
    let mut prefix = String::with_capacity(name.len() + labels.len() + 16);
    prefix.push_str(name);
    prefix.push_str("_bucket{");
    prefix.push_str(labels);
    if !labels.is_empty() {
        prefix.push(',');
    }
    prefix.push_str("le=\"");
    let mut last: Option<(u64, String)> = None;
    let bounds = le.iter().map(String::as_str).chain(["+Inf"]);
    for (bound, n) in bounds.zip(cum.iter().copied().chain([h.count])) {
        out.push_str(&prefix);
        out.push_str(bound);
        out.push_str("\"} ");
        match &last {
            Some((v, text)) if *v == n => out.push_str(text),
            _ => {
                let mut text = String::new();
                number(&mut text, n as f64);
                out.push_str(&text);
                last = Some((n, text));
            }
        }
        out.push('\n');
    }
    sample(out, name, "_sum", labels, h.sum_ns as f64 / 1000.0);
    sample(out, name, "_count", labels, h.count as f64);
}

/// A value as `f64`'s display writes it (what the prometheus crate's encoder writes);
/// whole numbers below 2^53, nearly all of them, the fast way.
fn number(out: &mut String, v: f64) {
    if v.fract() == 0.0 && v.abs() < 9.0e15 && !(v == 0.0 && v.is_sign_negative()) {
        let n = v as i64;
        if n < 0 {
            out.push('-');
        }
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        let mut m = n.unsigned_abs();
        loop {
            i -= 1;
            digits[i] = b'0' + (m % 10) as u8;
            m /= 10;
            if m == 0 {
                break;
            }
        }
        for d in &digits[i..] {
            out.push(*d as char);
        }
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
    }
}
