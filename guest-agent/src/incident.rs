//! What a person looks at during an incident: the state behind the page at `/`
//! (`/api/state`: every host's link state now and the spikes no host event explains), and the
//! same as text for a terminal (`gpufeed-guest explain`), read from a running agent's
//! `/events` and `/api/state`.

use std::fmt::Write as _;
use std::time::Duration;

use gpufeed_shared::hoststate::HostState;
use serde::{Deserialize, Serialize};

use crate::correlate::export::SpikeView;

/// `/api/state`.
#[derive(Debug, Clone, Serialize)]
pub struct PageState {
    /// This node.
    pub node: String,
    pub hosts: Vec<HostView>,
    /// Spikes no host event explains, newest first.
    pub unexplained: Vec<SpikeView>,
}

/// One host agent as this guest knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostView {
    pub host: String,
    /// Its stream is connected now.
    pub connected: bool,
    /// The operator said this host is a simulation (the quickstart demo).
    pub simulated: bool,
    /// The PCIe links the host reports for this guest, from its last state.
    pub links: Vec<LinkView>,
}

/// A PCIe link as the host agent's gauges have it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkView {
    pub bdf: String,
    /// The VM the device is passed through to ("" for a bridge above it).
    pub vmid: String,
    pub speed_gts: f64,
    pub width: f64,
    pub max_speed_gts: f64,
    pub max_width: f64,
}

/// The links in a host's state, by BDF.
pub fn links_of(state: &HostState) -> Vec<LinkView> {
    let mut links: std::collections::BTreeMap<String, LinkView> = Default::default();
    for fam in &state.families {
        let field: fn(&mut LinkView) -> &mut f64 = match fam.name.as_str() {
            "gpufeed_host_pcie_link_speed_gts" => |l| &mut l.speed_gts,
            "gpufeed_host_pcie_link_width" => |l| &mut l.width,
            "gpufeed_host_pcie_link_max_speed_gts" => |l| &mut l.max_speed_gts,
            "gpufeed_host_pcie_link_max_width" => |l| &mut l.max_width,
            _ => continue,
        };
        for s in &fam.series {
            let Some(bdf) = s.label("bdf") else { continue };
            let l = links.entry(bdf.to_string()).or_insert_with(|| LinkView {
                bdf: bdf.to_string(),
                vmid: s.label("vmid").unwrap_or_default().to_string(),
                speed_gts: 0.0,
                width: 0.0,
                max_speed_gts: 0.0,
                max_width: 0.0,
            });
            *field(l) = s.value;
        }
    }
    links.into_values().collect()
}

/// `explain`: the events and spikes of the last `since`, as text for a terminal. `events` and
/// `state` are the JSON of `/events` and `/api/state`; `now_ms` is the wall clock.
pub fn explain(
    events: &serde_json::Value,
    state: &serde_json::Value,
    since: Duration,
    now_ms: i64,
) -> String {
    let from = now_ms - since.as_millis() as i64;
    let mut out = String::new();
    let ago = |t: i64| -> String {
        let s = (now_ms - t).max(0) / 1000;
        if s < 90 {
            format!("{s} s ago")
        } else if s < 5400 {
            format!("{} min ago", s / 60)
        } else {
            format!("{} h ago", s / 3600)
        }
    };
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    let pod = |v: &serde_json::Value| {
        let ns = s(&v["namespace"]);
        if ns.is_empty() {
            s(&v["pod"])
        } else {
            format!("{ns}/{}", s(&v["pod"]))
        }
    };
    let magnitude = |v: &serde_json::Value| match v.as_f64() {
        Some(m) => format!("x{m:.1}"),
        None => "from zero".to_string(),
    };

    let _ = writeln!(out, "node {}", s(&state["node"]));
    let _ = writeln!(out, "\nHost links now");
    let hosts = state["hosts"].as_array().cloned().unwrap_or_default();
    if hosts.is_empty() {
        let _ = writeln!(out, "  no host agent has connected");
    }
    for h in &hosts {
        let sim = if h["simulated"].as_bool() == Some(true) {
            " [simulated]"
        } else {
            ""
        };
        let conn = if h["connected"].as_bool() == Some(true) {
            "connected"
        } else {
            "DISCONNECTED (last values shown)"
        };
        let _ = writeln!(out, "  {}{sim}: stream {conn}", s(&h["host"]));
        for l in h["links"].as_array().into_iter().flatten() {
            let (sp, w, msp, mw) = (
                f(&l["speed_gts"]),
                f(&l["width"]),
                f(&l["max_speed_gts"]),
                f(&l["max_width"]),
            );
            let verdict = if w == 0.0 || sp == 0.0 {
                "DOWN".to_string()
            } else if w < mw || sp < msp {
                format!("DEGRADED {sp} GT/s x{w}")
            } else {
                format!("{sp} GT/s x{w}")
            };
            let vm = match s(&l["vmid"]) {
                v if v.is_empty() => String::new(),
                v => format!(" (VM {v})"),
            };
            let _ = writeln!(
                out,
                "    {}{vm}: {verdict} of {msp} GT/s x{mw}",
                s(&l["bdf"])
            );
        }
    }

    let _ = writeln!(
        out,
        "\nHost events since {} ago",
        humantime::format_duration(since)
    );
    let mut n = 0;
    for e in events.as_array().into_iter().flatten() {
        let t = e["time"].as_i64().unwrap_or(0);
        if t < from {
            continue;
        }
        n += 1;
        let count = e["count"].as_u64().unwrap_or(1);
        let burst = if count > 1 {
            format!(" ({count} events)")
        } else {
            String::new()
        };
        let sim = if e["tags"]
            .as_array()
            .is_some_and(|t| t.iter().any(|x| x == "simulated"))
        {
            " [simulated]"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  {} {}: {}{burst}{sim}",
            ago(t),
            s(&e["host"]),
            s(&e["title"])
        );
        let affected = e["affected"].as_array().cloned().unwrap_or_default();
        if affected.is_empty() {
            let _ = writeln!(out, "      no pod's latency moved");
        }
        for a in &affected {
            let _ = writeln!(
                out,
                "      {}: {} p99 {:.0} (baseline {:.0}, {}), lag {:.1} s",
                pod(a),
                s(&a["signal"]),
                f(&a["p99"]),
                f(&a["baseline"]),
                magnitude(&a["magnitude"]),
                f(&a["lag_ms"]) / 1000.0
            );
        }
        if let Some(more) = e["affected_not_listed"].as_u64().filter(|m| *m > 0) {
            let _ = writeln!(out, "      and {more} more");
        }
    }
    if n == 0 {
        let _ = writeln!(out, "  none");
    }

    let _ = writeln!(
        out,
        "\nSpikes no host event explains (look inside the guest: CPU contention, neighbours, the network)"
    );
    let mut n = 0;
    for sp in state["unexplained"].as_array().into_iter().flatten() {
        let t = sp["time"].as_i64().unwrap_or(0);
        if t < from {
            continue;
        }
        n += 1;
        let pending = if sp["pending"].as_bool() == Some(true) {
            " (a late host event may still explain it)"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  {} {}: {} p99 {:.0} (baseline {:.0}, {}){pending}",
            ago(t),
            pod(sp),
            s(&sp["signal"]),
            f(&sp["p99"]),
            f(&sp["baseline"]),
            magnitude(&sp["magnitude"])
        );
    }
    if n == 0 {
        let _ = writeln!(out, "  none");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufeed_shared::hoststate::{StateFamily, StateKind, StateSeries};
    use serde_json::json;

    #[test]
    fn links_come_from_the_hosts_gauges() {
        let series = |bdf: &str, vmid: &str, v: f64| StateSeries {
            labels: vec![
                ("bdf".into(), bdf.into()),
                ("host".into(), "pve1".into()),
                ("vmid".into(), vmid.into()),
            ],
            value: v,
        };
        let fam = |name: &str, s: Vec<StateSeries>| StateFamily {
            name: name.into(),
            help: String::new(),
            kind: StateKind::Gauge,
            series: s,
        };
        let st = HostState {
            taken_realtime_ns: 0,
            families: vec![
                fam(
                    "gpufeed_host_pcie_link_speed_gts",
                    vec![
                        series("0000:0a:00.0", "100", 2.5),
                        series("0000:09:01.0", "", 16.0),
                    ],
                ),
                fam(
                    "gpufeed_host_pcie_link_width",
                    vec![
                        series("0000:0a:00.0", "100", 1.0),
                        series("0000:09:01.0", "", 4.0),
                    ],
                ),
                fam(
                    "gpufeed_host_pcie_link_max_speed_gts",
                    vec![series("0000:0a:00.0", "100", 16.0)],
                ),
                fam(
                    "gpufeed_host_pcie_link_max_width",
                    vec![series("0000:0a:00.0", "100", 4.0)],
                ),
                fam("gpufeed_host_cpu_busy_ratio", vec![]),
            ],
            truncated_series: 0,
        };
        let links = links_of(&st);
        assert_eq!(links.len(), 2);
        assert_eq!(
            links[1],
            LinkView {
                bdf: "0000:0a:00.0".into(),
                vmid: "100".into(),
                speed_gts: 2.5,
                width: 1.0,
                max_speed_gts: 16.0,
                max_width: 4.0
            }
        );
        assert_eq!(links[0].vmid, "");
    }

    #[test]
    fn explain_reads_like_the_page() {
        let now = 1_800_000_000_000;
        let events = json!([
            {"time": now - 30_000, "title": "PCIe link 0000:0a:00.0 degraded to 2.5 GT/s x1", "host": "pve1",
             "count": 1, "tags": ["link_degraded"], "affected_not_listed": 0,
             "affected": [{"namespace": "ml", "pod": "vllm-0", "signal": "sched_latency", "lag_ms": 1200,
                           "magnitude": 41.5, "p99": 8300.0, "baseline": 200.0}]},
            {"time": now - 20_000, "title": "AER correctable", "host": "pve1", "count": 3,
             "tags": ["aer_correctable", "simulated"], "affected": [], "affected_not_listed": 0},
            {"time": now - 3_600_000, "title": "old", "host": "pve1", "count": 1, "tags": [], "affected": []}
        ]);
        let state = json!({"node": "gpu-1", "hosts": [{"host": "pve1", "connected": false, "simulated": false,
            "links": [{"bdf": "0000:0a:00.0", "vmid": "100", "speed_gts": 2.5, "width": 1.0, "max_speed_gts": 16.0, "max_width": 4.0}]}],
            "unexplained": [{"time": now - 5_000, "namespace": "ml", "pod": "loader-1", "signal": "tcp_rtt",
                             "magnitude": null, "p99": 900.0, "baseline": 0.0, "pending": true}]});
        let text = explain(&events, &state, Duration::from_secs(600), now);
        assert!(text.contains("pve1: stream DISCONNECTED"), "{text}");
        assert!(
            text.contains("0000:0a:00.0 (VM 100): DEGRADED 2.5 GT/s x1 of 16 GT/s x4"),
            "{text}"
        );
        assert!(
            text.contains("30 s ago pve1: PCIe link 0000:0a:00.0 degraded"),
            "{text}"
        );
        assert!(
            text.contains("ml/vllm-0: sched_latency p99 8300 (baseline 200, x41.5), lag 1.2 s"),
            "{text}"
        );
        assert!(text.contains("(3 events) [simulated]"), "{text}");
        assert!(text.contains("no pod's latency moved"), "{text}");
        assert!(!text.contains("old"), "outside --since: {text}");
        assert!(text.contains("ml/loader-1: tcp_rtt p99 900 (baseline 0, from zero) (a late host event may still explain it)"), "{text}");
        // nothing at all: says so instead of printing nothing
        let empty = explain(
            &json!([]),
            &json!({"node": "n", "hosts": [], "unexplained": []}),
            Duration::from_secs(60),
            now,
        );
        assert!(empty.contains("no host agent has connected"));
        assert_eq!(empty.matches("  none").count(), 2);
    }
}
