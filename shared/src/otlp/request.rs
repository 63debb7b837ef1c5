//! A parsed page of the text format as one OTLP request: each family an OTLP metric of the
//! same name, with the same labels as attributes (the mapping is in the module above).

use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{
    metric::Data, number_data_point, summary_data_point::ValueAtQuantile, AggregationTemporality,
    Gauge, Histogram, HistogramDataPoint, Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics,
    Sum, Summary, SummaryDataPoint,
};
use opentelemetry_proto::tonic::resource::v1::Resource;

use crate::exposition::{Family, Kind, Sample};

fn kv(k: &str, v: &str) -> KeyValue {
    KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.to_string())),
        }),
        ..Default::default()
    }
}

fn attributes(labels: &[(String, String)]) -> Vec<KeyValue> {
    labels.iter().map(|(k, v)| kv(k, v)).collect()
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The OTLP request for the families: one resource (`resource`), one scope (`scope`, the
/// agent's name and version), every point at `now`, cumulative ones starting at `start`.
pub fn to_request(
    families: &[Family],
    resource: &[(String, String)],
    scope: (&str, &str),
    start: SystemTime,
    now: SystemTime,
) -> ExportMetricsServiceRequest {
    let (start, now) = (unix_nanos(start), unix_nanos(now));
    let cumulative = AggregationTemporality::Cumulative as i32;
    let number = |s: &Sample| NumberDataPoint {
        attributes: attributes(&s.labels),
        start_time_unix_nano: start,
        time_unix_nano: now,
        value: Some(number_data_point::Value::AsDouble(s.value)),
        ..Default::default()
    };
    let mut metrics = Vec::with_capacity(families.len());
    for f in families {
        if f.samples.is_empty() {
            continue;
        }
        let data = match f.kind {
            Kind::Counter => Data::Sum(Sum {
                data_points: f.samples.iter().map(number).collect(),
                aggregation_temporality: cumulative,
                is_monotonic: f.name.ends_with("_total"),
            }),
            Kind::Gauge | Kind::Untyped => Data::Gauge(Gauge {
                data_points: f.samples.iter().map(number).collect(),
            }),
            Kind::Histogram => Data::Histogram(Histogram {
                data_points: histogram_points(f, start, now),
                aggregation_temporality: cumulative,
            }),
            Kind::Summary => Data::Summary(Summary {
                data_points: summary_points(f, start, now),
            }),
        };
        metrics.push(Metric {
            name: f.name.clone(),
            description: f.help.clone(),
            unit: String::new(),
            data: Some(data),
            ..Default::default()
        });
    }
    ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(Resource {
                attributes: resource.iter().map(|(k, v)| kv(k, v)).collect(),
                ..Default::default()
            }),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: scope.0.to_string(),
                    version: scope.1.to_string(),
                    ..Default::default()
                }),
                metrics,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

/// The samples of a histogram or summary family grouped by their labels (less `le` or
/// `quantile`), in order of first appearance.
/// Labels, and the samples that carry them.
type Group<'a> = (Vec<(String, String)>, Vec<&'a Sample>);

fn grouped<'a>(f: &'a Family, special: &str) -> Vec<Group<'a>> {
    let mut groups: Vec<Group<'a>> = Vec::new();
    for s in &f.samples {
        let key: Vec<(String, String)> = s
            .labels
            .iter()
            .filter(|(k, _)| k != special)
            .cloned()
            .collect();
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(s),
            None => groups.push((key, vec![s])),
        }
    }
    groups
}

fn histogram_points(f: &Family, start: u64, now: u64) -> Vec<HistogramDataPoint> {
    let bucket = format!("{}_bucket", f.name);
    let sum = format!("{}_sum", f.name);
    let count = format!("{}_count", f.name);
    let mut out = Vec::new();
    for (labels, samples) in grouped(f, "le") {
        let mut buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.name == bucket)
            .filter_map(|s| {
                let le = s.labels.iter().find(|(k, _)| k == "le")?;
                let bound = match le.1.as_str() {
                    "+Inf" => f64::INFINITY,
                    b => b.parse().ok()?,
                };
                Some((bound, s.value))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total = samples
            .iter()
            .find(|s| s.name == count)
            .map(|s| s.value)
            .or_else(|| buckets.last().map(|b| b.1))
            .unwrap_or(0.0);
        let mut explicit_bounds = Vec::with_capacity(buckets.len());
        let mut bucket_counts = Vec::with_capacity(buckets.len() + 1);
        let mut below = 0.0;
        for (bound, cumulative) in &buckets {
            if bound.is_infinite() {
                continue;
            }
            explicit_bounds.push(*bound);
            bucket_counts.push((cumulative - below).max(0.0) as u64);
            below = *cumulative;
        }
        bucket_counts.push((total - below).max(0.0) as u64);
        out.push(HistogramDataPoint {
            attributes: attributes(&labels),
            start_time_unix_nano: start,
            time_unix_nano: now,
            count: total as u64,
            sum: samples.iter().find(|s| s.name == sum).map(|s| s.value),
            bucket_counts,
            explicit_bounds,
            ..Default::default()
        });
    }
    out
}

fn summary_points(f: &Family, start: u64, now: u64) -> Vec<SummaryDataPoint> {
    let sum = format!("{}_sum", f.name);
    let count = format!("{}_count", f.name);
    grouped(f, "quantile")
        .into_iter()
        .map(|(labels, samples)| SummaryDataPoint {
            attributes: attributes(&labels),
            start_time_unix_nano: start,
            time_unix_nano: now,
            count: samples
                .iter()
                .find(|s| s.name == count)
                .map_or(0, |s| s.value as u64),
            sum: samples
                .iter()
                .find(|s| s.name == sum)
                .map_or(0.0, |s| s.value),
            quantile_values: samples
                .iter()
                .filter(|s| s.name == f.name)
                .filter_map(|s| {
                    let q = s.labels.iter().find(|(k, _)| k == "quantile")?;
                    Some(ValueAtQuantile {
                        quantile: q.1.parse().ok()?,
                        value: s.value,
                    })
                })
                .collect(),
            ..Default::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exposition::parse_text;
    use crate::exposition::tests::TEXT;
    use crate::otlp::OtlpMetrics;
    use prometheus::Registry;
    use std::time::Duration;

    #[test]
    fn families_become_otlp_metrics_of_the_same_names() {
        let f = parse_text(TEXT).unwrap();
        let t = UNIX_EPOCH + Duration::from_secs(100);
        let req = to_request(
            &f,
            &[("host.name".into(), "h".into())],
            ("gpufeed-test", "0"),
            t,
            t + Duration::from_secs(1),
        );
        let rm = &req.resource_metrics[0];
        assert_eq!(rm.resource.as_ref().unwrap().attributes[0].key, "host.name");
        let m = &rm.scope_metrics[0].metrics;
        let names: Vec<_> = m.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["a_total", "h_seconds", "g", "loose", "s"]);
        assert!(m.iter().all(|m| m.unit.is_empty()));
        match m[0].data.as_ref().unwrap() {
            Data::Sum(s) => {
                assert!(s.is_monotonic);
                assert_eq!(
                    s.aggregation_temporality,
                    AggregationTemporality::Cumulative as i32
                );
                assert_eq!(s.data_points.len(), 2);
                assert_eq!(s.data_points[0].start_time_unix_nano, 100_000_000_000);
                assert_eq!(s.data_points[0].time_unix_nano, 101_000_000_000);
            }
            d => panic!("{d:?}"),
        }
        match m[1].data.as_ref().unwrap() {
            Data::Histogram(h) => {
                let p = &h.data_points[0];
                assert_eq!(p.attributes.len(), 1);
                assert_eq!(p.attributes[0].key, "p");
                assert_eq!(p.explicit_bounds, [0.5, 1.0]);
                assert_eq!(p.bucket_counts, [1, 2, 1]);
                assert_eq!((p.count, p.sum), (4, Some(2.25)));
                assert_eq!(h.data_points[1].bucket_counts, [0, 0, 0]);
            }
            d => panic!("{d:?}"),
        }
        match m[4].data.as_ref().unwrap() {
            Data::Summary(s) => {
                let p = &s.data_points[0];
                assert_eq!((p.count, p.sum, p.quantile_values.len()), (5, 10.0, 2));
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn a_counter_without_total_is_a_non_monotonic_sum() {
        let f = parse_text("# TYPE c counter\nc 1\n").unwrap();
        let req = to_request(&f, &[], ("t", "0"), UNIX_EPOCH, UNIX_EPOCH);
        match req.resource_metrics[0].scope_metrics[0].metrics[0]
            .data
            .as_ref()
        {
            Some(Data::Sum(s)) => assert!(!s.is_monotonic),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn the_registry_encoders_text_parses() {
        let r = Registry::new();
        let m = OtlpMetrics::new(&r, "gpufeed_test").unwrap();
        m.exports.with_label_values(&["ok"]).inc();
        let h = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new(
            "h_seconds",
            "with \\ and\nnewline",
        ))
        .unwrap();
        r.register(Box::new(h.clone())).unwrap();
        h.observe(0.3);
        let mut text = String::new();
        prometheus::TextEncoder::new()
            .encode_utf8(&r.gather(), &mut text)
            .unwrap();
        let f = parse_text(&text).unwrap();
        assert_eq!(f[0].name, "gpufeed_test_otlp_exports_total");
        assert_eq!(f[0].samples.len(), 4);
        assert_eq!(f[1].help, "with \\ and\nnewline");
        let req = to_request(&f, &[], ("t", "0"), UNIX_EPOCH, UNIX_EPOCH);
        match req.resource_metrics[0].scope_metrics[0].metrics[1]
            .data
            .as_ref()
        {
            Some(Data::Histogram(h)) => {
                assert_eq!(h.data_points[0].count, 1);
                assert_eq!(h.data_points[0].bucket_counts.iter().sum::<u64>(), 1);
            }
            d => panic!("{d:?}"),
        }
    }
}
