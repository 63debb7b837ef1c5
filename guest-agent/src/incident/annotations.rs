//! The host events as a series Grafana can annotate its time axis with:
//! `gpufeed_host_event_timestamp_seconds{host,event,summary}` is the guest time of the latest
//! listed event with that host, kind and summary. Grafana's Prometheus annotations with "series
//! value as timestamp" (the expression times 1000: Grafana counts in ms) put one mark per value
//! the series took, so every event that was listed while Prometheus scraped gets its mark, with
//! its summary as the text, although each series holds only the latest time.
//!
//! One series per distinct (host, kind, summary), at most as many as the correlator lists
//! events (128 by default); a summary names a device and its state, not a counter, so a link
//! that drops to the same state every minute stays one series.

use std::collections::BTreeMap;

use prometheus::proto::{MetricFamily, MetricType};

use crate::families::Rows;

use crate::correlate::pairing::EventRecord;

pub const HOST_EVENT_TIMESTAMP: &str = "gpufeed_host_event_timestamp_seconds";
pub const HELP: &str =
    "Guest time of the latest listed host event of each host, kind and summary (Grafana annotations)";

/// The family for the listed events.
pub fn family<'a>(events: impl Iterator<Item = &'a EventRecord>) -> MetricFamily {
    rows(events).family()
}

/// The listed events' series as rows (what the join keeps between scrapes).
pub fn rows<'a>(events: impl Iterator<Item = &'a EventRecord>) -> Rows {
    let mut latest: BTreeMap<(&str, &str, &str), i64> = BTreeMap::new();
    for e in events {
        let t = latest
            .entry((e.host.as_str(), e.kind.as_str(), e.summary.as_str()))
            .or_insert(e.at);
        *t = (*t).max(e.at);
    }
    Rows::new(
        HOST_EVENT_TIMESTAMP,
        HELP,
        MetricType::GAUGE,
        &["host", "event", "summary"],
        latest.into_iter().map(|((host, event, summary), at)| {
            // whole seconds and the fraction apart: an f64 of ns since 1970 loses the fraction
            let secs =
                at.div_euclid(1_000_000_000) as f64 + at.rem_euclid(1_000_000_000) as f64 / 1e9;
            (
                [host.to_string(), event.to_string(), summary.to_string()],
                secs,
            )
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::correlate::EventKind;

    fn record(id: u64, at: i64, kind: EventKind, summary: &str) -> EventRecord {
        EventRecord {
            id,
            host: "pve1".into(),
            kind,
            host_kind: "pcie_link_change",
            summary: summary.into(),
            at,
            host_realtime_ns: at,
            clock_offset_ns: 0,
            count: 1,
            hits: vec![],
            hits_dropped: 0,
        }
    }

    #[test]
    fn one_series_per_host_kind_and_summary_holding_the_latest_time() {
        let drop = "PCIe link 0000:0a:00.0: 16.0 GT/s x4 → 2.5 GT/s x1 (width_reduction)";
        let events = [
            record(0, 1_700_000_000_500_000_000, EventKind::LinkDegraded, drop),
            record(
                1,
                1_700_000_030_000_000_000,
                EventKind::LinkChanged,
                "restored",
            ),
            record(2, 1_700_000_060_250_000_000, EventKind::LinkDegraded, drop),
        ];
        let f = family(events.iter());
        assert_eq!(f.name(), HOST_EVENT_TIMESTAMP);
        let got: Vec<(Vec<String>, f64)> = f
            .get_metric()
            .iter()
            .map(|m| {
                (
                    m.get_label()
                        .iter()
                        .map(|l| l.value().to_string())
                        .collect(),
                    m.get_gauge().get_value(),
                )
            })
            .collect();
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].0, ["pve1", "link_changed", "restored"]);
        assert_eq!(got[1].0, ["pve1", "link_degraded", drop]);
        assert_eq!(got[1].1, 1_700_000_060.25);
    }
}
