//! `gpufeed-guest explain`: the page at `/` as text for a terminal, read from a running agent's
//! `/events` and `/api/state`. Each event's picture becomes one sparkline per affected pod (its
//! signal's p99 over the minute before to the minute after) and one per link (its speed). It
//! leads with each pod's GPU feed stall by cause, from the agent's `/metrics`.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::Value;

/// Columns of a sparkline: 3 s each over a two-minute picture.
const COLUMNS: usize = 40;
const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn s(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

fn pod(v: &Value) -> String {
    let ns = s(&v["namespace"]);
    if ns.is_empty() {
        s(&v["pod"])
    } else {
        format!("{ns}/{}", s(&v["pod"]))
    }
}

fn magnitude(v: &Value) -> String {
    match v.as_f64() {
        Some(m) => format!("x{m:.1}"),
        None => "from zero".to_string(),
    }
}

/// The unit of a signal's values.
pub fn unit(signal: &str) -> &'static str {
    if signal.ends_with("_rate") {
        "/s"
    } else {
        "µs"
    }
}

/// `values` (one per column, `None` where no window fell) as a line of bars, scaled between their
/// least and largest value, logarithmically when those are a decade or more apart; returns the
/// line and whether the scale is logarithmic.
pub fn sparkline(values: &[Option<f64>]) -> (String, bool) {
    let seen: Vec<f64> = values
        .iter()
        .flatten()
        .copied()
        .filter(|v| v.is_finite())
        .collect();
    let lo = seen.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = seen.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let log = lo > 0.0 && hi / lo >= 10.0;
    let scale = |v: f64| if log { v.ln() } else { v };
    let (a, b) = (scale(lo), scale(hi));
    let line = values
        .iter()
        .map(|v| match v {
            Some(v) if v.is_finite() => {
                let x = if b > a {
                    (scale(*v) - a) / (b - a)
                } else {
                    0.0
                };
                LEVELS[((x * 7.0).round() as usize).min(7)]
            }
            _ => ' ',
        })
        .collect();
    (line, log)
}

/// The column of time `t` in a picture from `from` to `to`.
fn column(t: i64, from: i64, to: i64) -> usize {
    let span = (to - from).max(1) as f64;
    ((((t - from) as f64) / span * COLUMNS as f64) as usize).min(COLUMNS - 1)
}

/// Per column, the largest value of the points in it.
fn columns(points: &[(i64, f64)], from: i64, to: i64) -> Vec<Option<f64>> {
    let mut out = vec![None; COLUMNS];
    for &(t, v) in points {
        if t < from || t > to {
            continue;
        }
        let c = &mut out[column(t, from, to)];
        *c = Some(c.map_or(v, |x: f64| x.max(v)));
    }
    out
}

/// Per column, the link speed in force at the column's end (steps hold until the next one).
fn step_columns(steps: &[(i64, f64)], from: i64, to: i64, end: i64) -> Vec<Option<f64>> {
    let span = (to - from).max(1) as f64;
    (0..COLUMNS)
        .map(|c| {
            let t = from + ((c + 1) as f64 / COLUMNS as f64 * span) as i64;
            if t - (span / COLUMNS as f64) as i64 > end {
                return None; // not drawn yet: the picture ends now
            }
            steps.iter().rev().find(|(at, _)| *at <= t).map(|(_, v)| *v)
        })
        .collect()
}

/// The picture of the event `e` (by host, kind and time) in `/api/state`'s timelines.
fn picture_of<'a>(e: &Value, state: &'a Value) -> Option<&'a Value> {
    state["timelines"]
        .as_array()?
        .iter()
        .find(|p| p["host"] == e["host"] && p["event"] == e["event"] && p["time"] == e["time"])
}

/// (`t`, `field`) of each element of the array `v` (link steps, pod points).
fn timed(v: &Value, field: &str) -> Vec<(i64, f64)> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|x| (x["t"].as_i64().unwrap_or(0), f(&x[field])))
        .collect()
}

fn write_picture(out: &mut String, p: &Value, now_ms: i64) {
    let (from, to) = (
        p["from"].as_i64().unwrap_or(0),
        p["to"].as_i64().unwrap_or(0),
    );
    let end = to.min(now_ms);
    for l in p["links"].as_array().into_iter().flatten() {
        let steps = timed(&l["steps"], "speed_gts");
        let (line, _) = sparkline(&step_columns(&steps, from, to, end));
        // The speeds the line passes through: a step where only the width changed (the host
        // can see a speed and a width change in two polls) repeats no speed.
        let mut values: Vec<String> = steps.iter().map(|(_, v)| format!("{v}")).collect();
        values.dedup();
        let _ = writeln!(
            out,
            "        {line}  link {} {} GT/s",
            s(&l["bdf"]),
            values.join(" → ")
        );
    }
    for t in p["pods"].as_array().into_iter().flatten() {
        let points = timed(&t["points"], "p99");
        let cols = columns(&points, from, to);
        let (line, log) = sparkline(&cols);
        let seen: Vec<f64> = cols.iter().flatten().copied().collect();
        let range = if seen.is_empty() {
            "no windows held".to_string()
        } else {
            let lo = seen.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = seen.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!(
                "{lo:.0}..{hi:.0} {}{}",
                unit(&s(&t["signal"])),
                if log { ", log" } else { "" }
            )
        };
        let _ = writeln!(
            out,
            "        {line}  {} {} ({range})",
            pod(t),
            s(&t["signal"])
        );
        if let Some(link) = t["profile_url"].as_str() {
            let _ = writeln!(out, "        profiles: {link}");
        }
    }
    let time = p["time"].as_i64().unwrap_or(0);
    let mut axis: Vec<char> = " ".repeat(COLUMNS).chars().collect();
    axis[column(time, from, to)] = '^';
    let axis: String = axis.into_iter().collect();
    let _ = writeln!(
        out,
        "        {axis}  the event; {} s before to {} s after{}",
        (time - from) / 1000,
        (to - time) / 1000,
        if p["complete"] == true {
            ""
        } else {
            " (still running)"
        }
    );
}

/// `explain`: the events and spikes of the last `since`, as text for a terminal. `events` and
/// `state` are the JSON of `/events` and `/api/state`; `now_ms` is the wall clock.
/// The feed-stall series of a `/metrics` text: (pod as `namespace/pod`, cause, seconds).
fn feed_stall_samples(metrics: &str) -> Vec<(String, String, f64)> {
    let name = crate::probes::cuda::FEED_STALL;
    let mut out = Vec::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        // label="value" pairs; the values the agent writes escape only \, " and newline
        let mut map = std::collections::HashMap::new();
        let mut rest = labels;
        while let Some((key, after)) = rest.split_once("=\"") {
            let mut val = String::new();
            let mut chars = after.char_indices();
            let mut end = after.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, e)) = chars.next() {
                            val.push(if e == 'n' { '\n' } else { e });
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => val.push(c),
                }
            }
            map.insert(key.trim_start_matches(',').trim().to_string(), val);
            rest = &after[end..];
        }
        let who = pod(&serde_json::json!({
            "namespace": map.get("namespace").cloned().unwrap_or_default(),
            "pod": map.get("pod").cloned().unwrap_or_default(),
        }));
        out.push((who, map.get("cause").cloned().unwrap_or_default(), v));
    }
    out
}

/// Each pod's GPU feed stall by cause from the agent's `/metrics` text, the pods with the most
/// first: what `explain` leads with.
pub fn feed_stall(metrics: &str) -> String {
    let mut pods: Vec<(String, Vec<(String, f64)>)> = Vec::new();
    for (who, cause, v) in feed_stall_samples(metrics) {
        match pods.iter_mut().find(|(p, _)| *p == who) {
            Some((_, causes)) => causes.push((cause, v)),
            None => pods.push((who, vec![(cause, v)])),
        }
    }
    let total = |c: &[(String, f64)]| c.iter().map(|(_, v)| v).sum::<f64>();
    pods.sort_by(|a, b| total(&b.1).total_cmp(&total(&a.1)).then(a.0.cmp(&b.0)));
    let mut out = String::from(
        "\nGPU feed stall per pod since the agent started (its GPU idle while the pod fed it)\n",
    );
    if pods.is_empty() {
        out.push_str("  none measured (needs --cuda-launches and a kernel with sched_info)\n");
    }
    for (who, mut causes) in pods {
        causes.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let parts: Vec<String> = causes
            .iter()
            .map(|(c, v)| format!("{c} {v:.3} s"))
            .collect();
        let _ = writeln!(
            out,
            "  {who}: {:.3} s ({})",
            total(&causes),
            parts.join(", ")
        );
    }
    out
}

/// [`explain`] led by the pods' feed stall ([`feed_stall`]) from the agent's `/metrics` text.
pub fn explain_with_feed(
    events: &Value,
    state: &Value,
    metrics: &str,
    since: Duration,
    now_ms: i64,
) -> String {
    let rest = explain(events, state, since, now_ms);
    let (node, body) = rest.split_once('\n').unwrap_or((&rest, ""));
    format!("{node}\n{}\n{body}", feed_stall(metrics).trim_end())
}

pub fn explain(events: &Value, state: &Value, since: Duration, now_ms: i64) -> String {
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
            // the agent's reading (GPU activity included); an older agent's: by the numbers
            let verdict = match l["condition"].as_str() {
                _ if w == 0.0 || sp == 0.0 => "DOWN".to_string(),
                Some("power_saving") => format!("{sp} GT/s x{w} (power saving, GPU idle)"),
                Some("degraded") => format!("DEGRADED {sp} GT/s x{w}"),
                Some(_) => format!("{sp} GT/s x{w}"),
                None if w < mw || sp < msp => format!("DEGRADED {sp} GT/s x{w}"),
                None => format!("{sp} GT/s x{w}"),
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
        if let Some(p) = picture_of(e, state) {
            write_picture(&mut out, p, now_ms);
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
        if let Some(link) = sp["profile_url"].as_str() {
            let _ = writeln!(out, "      profiles: {link}");
        }
    }
    if n == 0 {
        let _ = writeln!(out, "  none");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        // the agent's reading of a link at full width below its maximum speed
        let saving = json!({"node": "gpu-1", "hosts": [{"host": "pve1", "connected": true, "simulated": false,
            "links": [{"bdf": "0000:0a:00.0", "vmid": "100", "speed_gts": 2.5, "width": 4.0, "max_speed_gts": 16.0,
                       "max_width": 4.0, "condition": "power_saving"}]}], "unexplained": []});
        let t = explain(&json!([]), &saving, Duration::from_secs(600), now);
        assert!(
            t.contains("0000:0a:00.0 (VM 100): 2.5 GT/s x4 (power saving, GPU idle) of 16 GT/s x4"),
            "{t}"
        );
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

    /// A picture as /api/state gives it: the link falls to 2.5 GT/s at the event (its width
    /// to x1 one poll later) and comes back 30 s later; the pod's p99 sits at 50 µs, jumps to 30000 during the drop.
    #[test]
    fn pictures_become_sparklines_with_the_event_marked() {
        let now = 1_800_000_000_000;
        let ev_t = now - 60_000;
        let points: Vec<serde_json::Value> = (-60..=60)
            .map(|s| {
                let t = ev_t + s * 1000;
                let v = if (0..30).contains(&s) { 30000.0 } else { 50.0 };
                json!({"t": t, "p99": v, "count": 900, "median": 50.0, "upper": 80.0})
            })
            .collect();
        let events = json!([{"time": ev_t, "title": "link_degraded on h", "host": "h", "event": "link_degraded",
            "count": 1, "tags": [], "affected_not_listed": 0,
            "affected": [{"namespace": "ml", "pod": "p", "signal": "run_queue_wait", "lag_ms": 200,
                          "magnitude": 600.0, "p99": 30000.0, "baseline": 50.0}]}]);
        let state = json!({"node": "n", "hosts": [], "unexplained": [],
            "timelines": [{"host": "h", "event": "link_degraded", "time": ev_t, "from": ev_t - 60_000,
                "to": ev_t + 60_000, "complete": true,
                "links": [{"bdf": "0000:0a:00.0", "max_speed_gts": 16.0, "max_width": 4.0,
                           "steps": [{"t": ev_t - 60_000, "speed_gts": 16.0, "width": 4.0},
                                     {"t": ev_t, "speed_gts": 2.5, "width": 4.0},
                                     {"t": ev_t + 200, "speed_gts": 2.5, "width": 1.0},
                                     {"t": ev_t + 30_000, "speed_gts": 16.0, "width": 4.0}]}],
                "pods": [{"namespace": "ml", "pod": "p", "signal": "run_queue_wait", "points": points,
                          "profile_url": "http://parca/?q=1"}]}]});
        let text = explain(&events, &state, Duration::from_secs(600), now);
        let line = |needle: &str| {
            text.lines()
                .find(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("{needle}: {text}"))
                .trim_start()
                .to_string()
        };
        let pod = line("ml/p run_queue_wait (");
        let bars: Vec<char> = pod.chars().take(COLUMNS).collect();
        // 40 columns of 3 s: the first 20 before the event low, 10 high, the rest low
        assert!(bars[..20].iter().all(|c| *c == '▁'), "{pod}");
        assert!(bars[20..30].iter().all(|c| *c == '█'), "{pod}");
        assert!(bars[31..].iter().all(|c| *c == '▁'), "{pod}");
        assert!(pod.contains("50..30000 µs, log"), "{pod}");
        let link = line("link 0000:0a:00.0");
        let bars: Vec<char> = link.chars().take(COLUMNS).collect();
        assert!(bars[..19].iter().all(|c| *c == '█'), "{link}");
        assert!(bars[20..29].iter().all(|c| *c == '▁'), "{link}");
        assert!(bars[31..].iter().all(|c| *c == '█'), "{link}");
        assert!(link.contains("16 → 2.5 → 16 GT/s"), "{link}");
        let axis = text.lines().find(|l| l.contains("the event;")).unwrap();
        assert_eq!(axis.find('^'), Some(8 + 20), "{axis}");
        assert!(text.contains("profiles: http://parca/?q=1"), "{text}");
    }

    /// The feed stall of a /metrics text as explain leads with it: per pod, its causes summed
    /// (the host's, `pcie_link` and `host_event`, among them), the largest cause first, the pod
    /// with the most first (ties by name); a pod without an API name by its UID.
    #[test]
    fn feed_stall_leads_per_pod_and_cause() {
        let metrics = "# HELP gpufeed_gpu_feed_stall_seconds_total x\n\
            # TYPE gpufeed_gpu_feed_stall_seconds_total counter\n\
            gpufeed_gpu_feed_stall_seconds_total{namespace=\"ml\",pod=\"vllm-0\",cause=\"cpu\"} 1.5\n\
            gpufeed_gpu_feed_stall_seconds_total{namespace=\"ml\",pod=\"vllm-0\",cause=\"unexplained\"} 0.25\n\
            gpufeed_gpu_feed_stall_seconds_total{namespace=\"ml\",pod=\"vllm-1\",cause=\"cpu\"} 0.2\n\
            gpufeed_gpu_feed_stall_seconds_total{namespace=\"ml\",pod=\"vllm-1\",cause=\"host_event\"} 0\n\
            gpufeed_gpu_feed_stall_seconds_total{namespace=\"ml\",pod=\"vllm-1\",cause=\"pcie_link\"} 1.25\n\
            gpufeed_gpu_feed_stall_seconds_total{namespace=\"ml\",pod=\"vllm-1\",cause=\"unexplained\"} 0.3\n\
            gpufeed_gpu_feed_stall_seconds_total{namespace=\"\",pod=\"2d35-uid\",cause=\"cpu\"} 4\n\
            gpufeed_gpu_feed_stall_seconds_total{namespace=\"\",pod=\"2d35-uid\",cause=\"unexplained\"} 0\n\
            ebpf_gpu_busy_estimate_seconds_total{namespace=\"ml\",pod=\"vllm-0\"} 9\n";
        let text = feed_stall(metrics);
        let lines: Vec<&str> = text.lines().skip(2).collect();
        assert_eq!(
            lines,
            [
                "  2d35-uid: 4.000 s (cpu 4.000 s, unexplained 0.000 s)",
                "  ml/vllm-0: 1.750 s (cpu 1.500 s, unexplained 0.250 s)",
                "  ml/vllm-1: 1.750 s (pcie_link 1.250 s, unexplained 0.300 s, cpu 0.200 s, host_event 0.000 s)"
            ],
            "{text}"
        );
        assert!(feed_stall("").contains("none measured"));
        let state = json!({"node": "gpu-1", "hosts": [], "unexplained": []});
        let all = explain_with_feed(&json!([]), &state, metrics, Duration::from_secs(60), 0);
        assert!(
            all.starts_with("node gpu-1\n\nGPU feed stall per pod"),
            "{all}"
        );
        assert!(all.contains("\nHost links now"), "{all}");
    }

    #[test]
    fn sparkline_scales() {
        assert_eq!(sparkline(&[Some(1.0), None, Some(2.0)]).0, "▁ █");
        let (line, log) = sparkline(&[Some(10.0), Some(100.0), Some(1000.0)]);
        assert!(log);
        assert_eq!(line, "▁▅█");
        assert_eq!(sparkline(&[Some(5.0), Some(5.0)]).0, "▁▁");
        assert_eq!(sparkline(&[None, None]).0, "  ");
    }
}
