//! What the correlator shows: the `gpufeed_*` correlation series and the recent host events
//! as JSON that Grafana's JSON data sources take as annotations (`time` in ms since the
//! epoch, `title`, `text`, `tags`).

use std::collections::BTreeMap;

use prometheus::proto::{MetricFamily, MetricType};
use serde::Serialize;

use super::pairing::{magnitude, EventRecord, SpikeRecord};
use super::{ns, Correlator, EventKind};
use crate::families::Rows;

pub const LATENCY_SPIKES: &str = "gpufeed_latency_spikes_total";
pub const CORRELATED_SPIKES: &str = "gpufeed_correlated_spikes_total";
pub const HOST_EVENTS: &str = "gpufeed_host_events_total";
pub const EVENT_IMPACT: &str = "gpufeed_event_impact_ratio";
pub const SPIKE_EXPLAINED: &str = "gpufeed_spike_explained_ratio";

/// A pod signal that spiked near an event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Affected {
    pub namespace: String,
    pub pod: String,
    pub signal: String,
    /// Spike time minus event time (negative: the spike showed first).
    pub lag_ms: i64,
    /// p99 ÷ baseline median; null when the baseline was zero.
    pub magnitude: Option<f64>,
    pub p99: f64,
    pub baseline: f64,
}

/// One host event, shaped as a Grafana annotation plus the join's details.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventView {
    /// Guest realtime, ms since the epoch.
    pub time: i64,
    pub title: String,
    pub text: String,
    pub tags: Vec<String>,
    pub host: String,
    pub event: &'static str,
    pub host_kind: &'static str,
    /// Events coalesced into this one.
    pub count: u64,
    /// Host minus guest clock offset applied, ms.
    pub clock_offset_ms: f64,
    pub affected: Vec<Affected>,
    /// Affected pod signals beyond the per-event cap.
    pub affected_not_listed: u64,
}

/// A spike no host event explains (yet, while `pending`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SpikeView {
    pub time: i64,
    pub namespace: String,
    pub pod: String,
    pub signal: String,
    pub magnitude: Option<f64>,
    pub p99: f64,
    pub baseline: f64,
    /// Still within reach of a late host event.
    pub pending: bool,
}

fn ms(t: i64) -> i64 {
    t.div_euclid(1_000_000)
}

fn event_view(e: &EventRecord) -> EventView {
    let affected: Vec<Affected> = e
        .hits
        .iter()
        .map(|h| Affected {
            namespace: h.pod.namespace.to_string(),
            pod: h.pod.pod.to_string(),
            signal: h.signal.clone(),
            lag_ms: ms(h.lag_ns),
            magnitude: magnitude(h.value, h.baseline),
            p99: h.value,
            baseline: h.baseline,
        })
        .collect();
    let pods: Vec<String> = affected
        .iter()
        .map(|a| match a.magnitude {
            Some(m) => format!("{}/{} {} ×{m:.1}", a.namespace, a.pod, a.signal),
            None => format!("{}/{} {} from 0", a.namespace, a.pod, a.signal),
        })
        .collect();
    let hit = if pods.is_empty() {
        "no pod spiked".to_string()
    } else {
        pods.join(", ")
    };
    let burst = if e.count > 1 {
        format!(" ({} events)", e.count)
    } else {
        String::new()
    };
    EventView {
        time: ms(e.at),
        title: format!("{} on {}", e.kind.as_str(), e.host),
        text: format!("{}{burst}: {hit}", e.summary),
        tags: vec![
            "gpufeed".to_string(),
            format!("host:{}", e.host),
            format!("event:{}", e.kind.as_str()),
        ],
        host: e.host.clone(),
        event: e.kind.as_str(),
        host_kind: e.host_kind,
        count: e.count,
        clock_offset_ms: e.clock_offset_ns as f64 / 1e6,
        affected,
        affected_not_listed: e.hits_dropped,
    }
}

fn spike_view(s: &SpikeRecord, pending: bool) -> SpikeView {
    SpikeView {
        time: ms(s.at),
        namespace: s.pod.namespace.to_string(),
        pod: s.pod.pod.to_string(),
        signal: s.signal.clone(),
        magnitude: s.magnitude(),
        p99: s.value,
        baseline: s.baseline,
        pending,
    }
}

impl Correlator {
    /// The listed host events as the joiner keeps them, in arrival order (the incident page
    /// draws each one's pods).
    pub fn event_records(&self) -> impl Iterator<Item = &EventRecord> {
        self.joiner.events()
    }

    /// What the retained spikes and events are, cheaply: equal stamps, the same records.
    pub fn records_stamp(&self) -> [Option<u64>; 4] {
        self.joiner.stamp()
    }

    /// The retained spikes in detection order (ascending ids), joined or not.
    pub fn spike_records(&self) -> impl Iterator<Item = &SpikeRecord> {
        self.joiner.spikes()
    }

    /// Recent host events, newest first.
    pub fn recent_events(&self) -> Vec<EventView> {
        let mut v: Vec<&EventRecord> = self.joiner.events().collect();
        v.sort_by_key(|e| std::cmp::Reverse((e.at, e.id)));
        v.into_iter().map(event_view).collect()
    }

    /// Retained spikes that joined no host event, newest first; `pending` ones may still be
    /// explained by a late event.
    pub fn unexplained_spikes(&self, now: i64) -> Vec<SpikeView> {
        let late = ns(self.cfg.lateness);
        let mut v: Vec<SpikeView> = self
            .joiner
            .spikes()
            .filter(|s| s.events.is_empty())
            .map(|s| spike_view(s, !self.joiner.is_unexplained(s, now, late)))
            .collect();
        v.sort_by_key(|s| std::cmp::Reverse(s.time));
        v
    }

    /// Share of the retained spikes of each signal that joined a host event; pending spikes
    /// are left out until they are settled. Signals without settled spikes have no ratio.
    pub fn explained_ratio(&self, now: i64) -> BTreeMap<String, f64> {
        let late = ns(self.cfg.lateness);
        let mut tally: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for s in self.joiner.spikes() {
            let explained = !s.events.is_empty();
            if explained || self.joiner.is_unexplained(s, now, late) {
                let t = tally.entry(s.signal.as_str()).or_default();
                t.0 += explained as u64;
                t.1 += 1;
            }
        }
        tally
            .into_iter()
            .map(|(s, (e, n))| (s.to_string(), e as f64 / n as f64))
            .collect()
    }

    /// p99 ÷ baseline per (event kind, signal, namespace, pod) for the latest event of each
    /// kind; +Inf where the baseline was zero. Live pods only.
    pub fn impact(&self) -> BTreeMap<[String; 4], f64> {
        let mut latest: BTreeMap<EventKind, &EventRecord> = BTreeMap::new();
        for e in self.joiner.events().filter(|e| e.kind.joins()) {
            let slot = latest.entry(e.kind).or_insert(e);
            if (e.at, e.id) > (slot.at, slot.id) {
                *slot = e;
            }
        }
        let mut out = BTreeMap::new();
        for (kind, e) in latest {
            for h in &e.hits {
                let Some(pod) = self.live_key(&h.pod.uid) else {
                    continue;
                };
                let m = magnitude(h.value, h.baseline).unwrap_or(f64::INFINITY);
                let key = [
                    kind.as_str().to_string(),
                    h.signal.clone(),
                    pod.namespace.to_string(),
                    pod.pod.to_string(),
                ];
                let v = out.entry(key).or_insert(m);
                *v = v.max(m);
            }
        }
        out
    }

    /// The five correlation families, ready for a prometheus `Collector`.
    pub fn metric_families(&self, now: i64) -> Vec<MetricFamily> {
        self.series_rows(now).iter().map(Rows::family).collect()
    }

    /// The five correlation families as rows (what the join keeps between scrapes).
    pub fn series_rows(&self, now: i64) -> Vec<Rows> {
        let c = &self.counters;
        // Series are per (namespace, pod): two pod objects of one name (a StatefulSet pod
        // re-created) add up.
        let mut spikes: BTreeMap<[String; 3], f64> = BTreeMap::new();
        for ((uid, s), n) in &c.spikes {
            let Some(p) = self.live_key(uid) else {
                continue;
            };
            *spikes
                .entry([s.clone(), p.namespace.to_string(), p.pod.to_string()])
                .or_default() += *n as f64;
        }
        let mut correlated: BTreeMap<[String; 4], f64> = BTreeMap::new();
        for ((uid, s, k), n) in &c.correlated {
            let Some(p) = self.live_key(uid) else {
                continue;
            };
            let key = [
                k.as_str().to_string(),
                s.clone(),
                p.namespace.to_string(),
                p.pod.to_string(),
            ];
            *correlated.entry(key).or_default() += *n as f64;
        }
        let host_events = c
            .host_events
            .iter()
            .map(|((h, e), n)| ([h.clone(), e.to_string()], *n as f64));
        let explained = self.explained_ratio(now).into_iter().map(|(s, r)| ([s], r));
        vec![
            Rows::new(
                LATENCY_SPIKES,
                "Latency spikes detected, per pod signal",
                MetricType::COUNTER,
                &["signal", "namespace", "pod"],
                spikes,
            ),
            Rows::new(
                CORRELATED_SPIKES,
                "Latency spikes within reach of a host event, per event kind",
                MetricType::COUNTER,
                &["event", "signal", "namespace", "pod"],
                correlated,
            ),
            Rows::new(
                HOST_EVENTS,
                "Host events received, by correlation kind",
                MetricType::COUNTER,
                &["host", "event"],
                host_events,
            ),
            Rows::new(
                EVENT_IMPACT,
                "p99 after the latest event of each kind divided by the pod signal's baseline",
                MetricType::GAUGE,
                &["event", "signal", "namespace", "pod"],
                self.impact(),
            ),
            Rows::new(
                SPIKE_EXPLAINED,
                "Share of settled spikes of the retention period joined to a host event",
                MetricType::GAUGE,
                &["signal"],
                explained,
            ),
        ]
    }
}
