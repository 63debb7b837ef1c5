//! The hosts' own series in the guest's scrape: the last [`HostState`] of every host, exported
//! with the host agent's names, labels (its `host` label included) and values.
//!
//! A host whose stream stopped keeps its last values, with `gpufeed_stream_connected{host} 0`
//! beside them and `gpufeed_stream_host_state_age_seconds{host}` growing: never silently stale.
//!
//! One family is not forwarded: the host's `gpufeed_host_events_total{kind}` (what it emitted).
//! In the guest that name is the correlator's count of host events received, by the kind the
//! correlation uses (`event` label).

use std::collections::BTreeMap;
use std::sync::RwLock;
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};

use crate::hoststate::{HostState, StateKind};

/// Host families the guest does not re-export under the host's name (see the module docs).
const NOT_FORWARDED: &[&str] = &["gpufeed_host_events_total"];

const AGE: &str = "gpufeed_stream_host_state_age_seconds";
const SERIES: &str = "gpufeed_stream_host_state_series";

/// Last state per host.
pub struct HostStates {
    by_host: RwLock<BTreeMap<String, (HostState, Instant)>>,
    descs: Vec<Desc>,
}

impl Default for HostStates {
    fn default() -> Self {
        let descs = [
            (AGE, "Seconds since the host's state last arrived"),
            (SERIES, "Host series received in the host's last state"),
        ]
        .into_iter()
        .filter_map(|(n, h)| {
            Desc::new(n.into(), h.into(), vec!["host".into()], Default::default()).ok()
        })
        .collect();
        HostStates {
            by_host: RwLock::default(),
            descs,
        }
    }
}

impl HostStates {
    /// Replaces the state of `host`.
    pub fn update(&self, host: &str, state: HostState, now: Instant) {
        self.by_host
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(host.to_string(), (state, now));
    }

    /// The last state of `host`.
    pub fn get(&self, host: &str) -> Option<HostState> {
        self.by_host
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(host)
            .map(|(s, _)| s.clone())
    }

    /// Forgets a host (it was removed from the allowed hosts).
    pub fn remove(&self, host: &str) {
        self.by_host
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(host);
    }

    fn families(&self, now: Instant) -> Vec<MetricFamily> {
        let states = self.by_host.read().unwrap_or_else(|e| e.into_inner());
        // Families merged across hosts by name; each host's series carry its `host` label.
        let mut merged: BTreeMap<&str, MetricFamily> = BTreeMap::new();
        let mut age = Vec::new();
        let mut count = Vec::new();
        for (host, (state, at)) in states.iter() {
            let host_label = [("host".to_string(), host.clone())];
            age.push(gauge(
                &host_label,
                now.saturating_duration_since(*at).as_secs_f64(),
            ));
            count.push(gauge(&host_label, state.len() as f64));
            for fam in &state.families {
                if NOT_FORWARDED.contains(&fam.name.as_str()) {
                    continue;
                }
                let out = merged.entry(fam.name.as_str()).or_insert_with(|| {
                    let mut f = MetricFamily::default();
                    f.set_name(fam.name.clone());
                    f.set_help(fam.help.clone());
                    f.set_field_type(match fam.kind {
                        StateKind::Counter => MetricType::COUNTER,
                        StateKind::Gauge => MetricType::GAUGE,
                    });
                    f
                });
                for s in &fam.series {
                    // The host agent labels every series with its host id; a host whose
                    // certificate names it differently is still told apart by the guest.
                    let mut labels = s.labels.clone();
                    if !labels.iter().any(|(k, _)| k == "host") {
                        labels.push(("host".into(), host.clone()));
                        labels.sort();
                    }
                    let m = match fam.kind {
                        StateKind::Counter => counter(&labels, s.value),
                        StateKind::Gauge => gauge(&labels, s.value),
                    };
                    out.mut_metric().push(m);
                }
            }
        }
        let mut out: Vec<MetricFamily> = merged.into_values().collect();
        for (name, help, metrics) in [
            (AGE, "Seconds since the host's state last arrived", age),
            (
                SERIES,
                "Host series received in the host's last state",
                count,
            ),
        ] {
            let mut f = MetricFamily::default();
            f.set_name(name.into());
            f.set_help(help.into());
            f.set_field_type(MetricType::GAUGE);
            f.set_metric(metrics);
            out.push(f);
        }
        out
    }
}

/// The collector that renders [`HostStates`] into a registry.
pub struct HostStatesCollector(pub std::sync::Arc<HostStates>);

impl Collector for HostStatesCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.0.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.families(Instant::now())
    }
}

fn labels(l: &[(String, String)]) -> Vec<LabelPair> {
    l.iter()
        .map(|(k, v)| {
            let mut p = LabelPair::default();
            p.set_name(k.clone());
            p.set_value(v.clone());
            p
        })
        .collect()
}

fn gauge(l: &[(String, String)], v: f64) -> Metric {
    let mut m = Metric::default();
    m.set_label(labels(l));
    let mut g = Gauge::default();
    g.set_value(v);
    m.set_gauge(g);
    m
}

fn counter(l: &[(String, String)], v: f64) -> Metric {
    let mut m = Metric::default();
    m.set_label(labels(l));
    let mut c = Counter::default();
    c.set_value(v);
    m.set_counter(c);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hoststate::{StateFamily, StateSeries};
    use std::time::Duration;

    fn state(width: f64) -> HostState {
        HostState {
            taken_realtime_ns: 0,
            families: vec![
                StateFamily {
                    name: "gpufeed_host_pcie_link_width".into(),
                    help: "Current PCIe link width in lanes (0 = down)".into(),
                    kind: StateKind::Gauge,
                    series: vec![StateSeries {
                        labels: vec![
                            ("bdf".into(), "0000:0a:00.0".into()),
                            ("host".into(), "pve1".into()),
                            ("vmid".into(), "100".into()),
                        ],
                        value: width,
                    }],
                },
                StateFamily {
                    name: "gpufeed_host_events_total".into(),
                    help: "Events emitted by kind".into(),
                    kind: StateKind::Counter,
                    series: vec![StateSeries {
                        labels: vec![("host".into(), "pve1".into()), ("kind".into(), "x".into())],
                        value: 3.0,
                    }],
                },
            ],
            truncated_series: 0,
        }
    }

    #[test]
    fn renders_the_hosts_series_and_their_age() {
        let s = HostStates::default();
        let t0 = Instant::now();
        s.update("pve1", state(4.0), t0);
        s.update("pve2", state(1.0), t0);
        let fams = s.families(t0 + Duration::from_secs(3));
        let names: Vec<&str> = fams.iter().map(|f| f.name()).collect();
        assert_eq!(names, vec!["gpufeed_host_pcie_link_width", AGE, SERIES]);
        let width = &fams[0];
        assert_eq!(width.get_field_type(), MetricType::GAUGE);
        assert_eq!(width.get_metric().len(), 2);
        assert_eq!(width.get_metric()[1].get_gauge().get_value(), 1.0);
        // pve2's state names host pve1 (its own host id): kept as the host said
        assert_eq!(width.get_metric()[1].get_label()[1].value(), "pve1");
        assert_eq!(fams[1].get_metric()[0].get_gauge().get_value(), 3.0);
        assert_eq!(fams[2].get_metric()[0].get_gauge().get_value(), 2.0);
        s.update("pve1", state(2.0), t0);
        assert_eq!(s.get("pve1").unwrap().families[0].series[0].value, 2.0);
        s.remove("pve2");
        assert_eq!(s.families(t0)[0].get_metric().len(), 1);
    }
}
