//! The host's series that concern one guest ([`HostState`]), taken from the agent's own
//! registry, so that the guest exports exactly what the host's /metrics says.
//!
//! Which series concern a guest: everything host-wide (no `vmid`, `bdf` or `guest` label:
//! host CPU, memory, pressure, the kernel log), the series of its VMs (`vmid` in its filter),
//! of its devices (`bdf` in its filter), of PCI devices no other guest claims (the bridges
//! between the root port and its GPU carry no `vmid`), and the stream series of its own
//! connection (`guest` = its name). A series that names another guest's VM, device or
//! connection is left out. A guest whose filter is empty gets every series but other
//! guests' connection series.

use gpufeed_shared::hoststate::{HostState, StateFamily, StateKind, StateSeries};
use gpufeed_shared::proto::MAX_FRAME_LEN;
use prometheus::proto::MetricType;
use prometheus::Registry;

use super::route::Filter;

/// Room left in a frame for the message around the families.
const FRAME_SLACK: usize = 1024;

/// Whether a series with these labels concerns guest `me` (index into `filters`, whose names
/// are `names`).
fn concerns(labels: &[(String, String)], me: usize, filters: &[Filter], names: &[String]) -> bool {
    let get = |k: &str| {
        labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    };
    if let Some(g) = get("guest") {
        return names.get(me).is_some_and(|n| n == g);
    }
    let mine = &filters[me];
    if let Some(v) = get("vmid").and_then(|v| v.parse::<u32>().ok()) {
        if mine.vmids.contains(&v) || mine.is_catch_all() {
            return true;
        }
        // another guest's VM, or a VM nobody named: only a catch-all guest sees it
        return false;
    }
    if let Some(bdf) = get("bdf") {
        let listed_by = |f: &Filter| f.devices.iter().any(|d| d.eq_ignore_ascii_case(bdf));
        if listed_by(mine) || mine.is_catch_all() {
            return true;
        }
        return !filters
            .iter()
            .enumerate()
            .any(|(i, f)| i != me && listed_by(f));
    }
    true
}

/// The snapshot for guest `me`, at `now_realtime_ns`. Families are kept in the registry's
/// order (sorted by name) and series in its order; what would not fit one frame is counted
/// in `truncated_series` instead.
pub fn snapshot(
    registry: &Registry,
    me: usize,
    filters: &[Filter],
    names: &[String],
    now_realtime_ns: i64,
) -> HostState {
    let mut out = HostState {
        taken_realtime_ns: now_realtime_ns,
        ..HostState::default()
    };
    let mut budget = MAX_FRAME_LEN - FRAME_SLACK;
    for mf in registry.gather() {
        let kind = match mf.get_field_type() {
            MetricType::COUNTER => StateKind::Counter,
            MetricType::GAUGE => StateKind::Gauge,
            // the host agent exports no untyped series, histograms or summaries
            _ => continue,
        };
        let mut fam = StateFamily {
            name: mf.name().to_string(),
            help: mf.help().to_string(),
            kind,
            series: Vec::new(),
        };
        for m in mf.get_metric() {
            let labels: Vec<(String, String)> = m
                .get_label()
                .iter()
                .map(|l| (l.name().to_string(), l.value().to_string()))
                .collect();
            if !concerns(&labels, me, filters, names) {
                continue;
            }
            let value = match kind {
                StateKind::Counter => m.get_counter().get_value(),
                StateKind::Gauge => m.get_gauge().get_value(),
            };
            // postcard sizes: varint lengths + bytes; 8 bytes per value
            let size: usize = labels
                .iter()
                .map(|(k, v)| k.len() + v.len() + 2)
                .sum::<usize>()
                + 10;
            if size > budget {
                out.truncated_series += 1;
                continue;
            }
            budget -= size;
            fam.series.push(StateSeries { labels, value });
        }
        let head = fam.name.len() + fam.help.len() + 4;
        if !fam.series.is_empty() && head <= budget {
            budget -= head;
            out.families.push(fam);
        } else if !fam.series.is_empty() {
            out.truncated_series += fam.series.len() as u32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{GaugeVec, IntCounterVec, Opts};

    fn f(vmids: &[u32], devices: &[&str]) -> Filter {
        Filter {
            vmids: vmids.to_vec(),
            devices: devices.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn registry() -> Registry {
        let r = Registry::new_custom(
            None,
            Some([("host".to_string(), "pve1".to_string())].into()),
        )
        .unwrap();
        let speed = GaugeVec::new(
            Opts::new("gpufeed_host_pcie_link_speed_gts", "speed"),
            &["bdf", "vmid"],
        )
        .unwrap();
        r.register(Box::new(speed.clone())).unwrap();
        speed.with_label_values(&["0000:0a:00.0", "100"]).set(16.0);
        speed.with_label_values(&["0000:09:01.0", ""]).set(16.0); // bridge above it
        speed.with_label_values(&["0000:01:00.0", "101"]).set(8.0); // the other VM's GPU
        speed.with_label_values(&["0000:02:00.0", ""]).set(2.5); // claimed by guest b
        let conn = IntCounterVec::new(
            Opts::new("gpufeed_host_stream_events_sent_total", "sent"),
            &["guest"],
        )
        .unwrap();
        r.register(Box::new(conn.clone())).unwrap();
        conn.with_label_values(&["a"]).inc_by(7);
        conn.with_label_values(&["b"]).inc_by(9);
        let cpu = prometheus::Gauge::new("gpufeed_host_cpu_busy_ratio", "cpu").unwrap();
        r.register(Box::new(cpu.clone())).unwrap();
        cpu.set(0.25);
        r
    }

    #[test]
    fn a_guest_gets_its_vm_its_bridges_and_host_wide_series() {
        let r = registry();
        let filters = [f(&[100], &["0000:0a:00.0"]), f(&[101], &["0000:02:00.0"])];
        let names = ["a".to_string(), "b".to_string()];
        let s = snapshot(&r, 0, &filters, &names, 42);
        assert_eq!(s.taken_realtime_ns, 42);
        let pairs: Vec<(String, String, f64)> = s
            .families
            .iter()
            .flat_map(|fam| {
                fam.series.iter().map(move |x| {
                    let key = x
                        .label("bdf")
                        .or(x.label("guest"))
                        .unwrap_or("-")
                        .to_string();
                    (fam.name.clone(), key, x.value)
                })
            })
            .collect();
        assert_eq!(
            pairs,
            vec![
                ("gpufeed_host_cpu_busy_ratio".into(), "-".into(), 0.25),
                (
                    "gpufeed_host_pcie_link_speed_gts".into(),
                    "0000:09:01.0".into(),
                    16.0
                ),
                (
                    "gpufeed_host_pcie_link_speed_gts".into(),
                    "0000:0a:00.0".into(),
                    16.0
                ),
                (
                    "gpufeed_host_stream_events_sent_total".into(),
                    "a".into(),
                    7.0
                ),
            ]
        );
        // every series keeps the host label the host's own /metrics has
        assert!(s
            .families
            .iter()
            .all(|fam| fam.series.iter().all(|x| x.label("host") == Some("pve1"))));
        assert_eq!(s.families[2].kind, StateKind::Counter);
        assert_eq!(s.truncated_series, 0);

        // a catch-all guest gets every VM and device, but not the other connection's series
        let filters = [f(&[], &[]), f(&[101], &[])];
        let s = snapshot(&r, 0, &filters, &names, 0);
        assert_eq!(s.len(), 6);
    }

    #[test]
    fn what_does_not_fit_a_frame_is_counted() {
        let r = Registry::new();
        let g = GaugeVec::new(Opts::new("gpufeed_host_bridge_microburst", "m"), &["port"]).unwrap();
        r.register(Box::new(g.clone())).unwrap();
        for i in 0..4000 {
            g.with_label_values(&[&format!("tap{i:05}i0-with-a-long-port-name")])
                .set(1.0);
        }
        let s = snapshot(&r, 0, &[f(&[], &[])], &["a".into()], 0);
        assert!(s.truncated_series > 0);
        assert_eq!(s.len() + s.truncated_series as usize, 4000);
        let bytes = postcard::to_stdvec(&s).unwrap();
        assert!(bytes.len() <= MAX_FRAME_LEN - 256, "{} bytes", bytes.len());
    }
}
