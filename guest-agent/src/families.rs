//! Prometheus metric families built by hand (a family, a gauge, a counter with their labels):
//! what the exporter writes for the agent's own series and FinOps for the cost series.

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
