//! Prometheus metric families built by hand (a family, a gauge, a counter with their labels):
//! what the exporter writes for the agent's own series and FinOps for the cost series; and
//! [`Rows`], a family of plain rows for series that are kept between scrapes.

use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};

use crate::probes::unit::Labels;

pub(crate) fn label_pairs(l: &Labels) -> Vec<LabelPair> {
    l.iter()
        .map(|(k, v)| {
            let mut p = LabelPair::default();
            p.set_name(k.to_string());
            p.set_value(v.clone());
            p
        })
        .collect()
}

pub(crate) fn family(name: &str, help: &str, t: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_string());
    f.set_help(help.to_string());
    f.set_field_type(t);
    f.set_metric(metrics);
    f
}

pub(crate) fn gauge(l: &Labels, v: f64) -> Metric {
    let mut g = Gauge::default();
    g.set_value(v);
    let mut m = Metric::from_gauge(g);
    m.set_label(label_pairs(l));
    m
}

pub(crate) fn counter(l: &Labels, v: f64) -> Metric {
    let mut c = Counter::default();
    c.set_value(v);
    let mut m = Metric::from_label(label_pairs(l));
    m.set_counter(c);
    m
}

/// A family of counters or gauges as plain rows (label values and a value), turned into a
/// [`MetricFamily`] when scraped. What the join publishes for the scrape is kept until the
/// next publication: a `MetricFamily` holds each label's name beside its value and a `Metric`
/// with room for every type per row, about three times the rows' own size (5,000 spike series
/// at 1,000 pods), while the family is only needed during the scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: MetricType,
    pub labels: &'static [&'static str],
    /// Label values in the order of `labels`, and the value.
    pub rows: Vec<(Box<[String]>, f64)>,
}

impl Rows {
    /// Counters (`MetricType::COUNTER`) or gauges from `(label values, value)` pairs.
    pub fn new<const N: usize>(
        name: &'static str,
        help: &'static str,
        kind: MetricType,
        labels: &'static [&'static str; N],
        rows: impl IntoIterator<Item = ([String; N], f64)>,
    ) -> Rows {
        Rows {
            name,
            help,
            kind,
            labels,
            rows: rows
                .into_iter()
                .map(|(values, v)| (Box::from(values), v))
                .collect(),
        }
    }

    /// The family for a scrape.
    pub fn family(&self) -> MetricFamily {
        let metrics = self
            .rows
            .iter()
            .map(|(values, v)| {
                let labels = self
                    .labels
                    .iter()
                    .zip(values.iter())
                    .map(|(n, value)| {
                        let mut l = LabelPair::default();
                        l.set_name(n.to_string());
                        l.set_value(value.clone());
                        l
                    })
                    .collect();
                let mut m = Metric::from_label(labels);
                if self.kind == MetricType::COUNTER {
                    let mut c = Counter::default();
                    c.set_value(*v);
                    m.set_counter(c);
                } else {
                    let mut g = Gauge::default();
                    g.set_value(*v);
                    m.set_gauge(g);
                }
                m
            })
            .collect();
        family(self.name, self.help, self.kind, metrics)
    }
}
