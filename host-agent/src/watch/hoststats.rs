//! Host CPU and memory (sysinfo) and pressure stall information (`/proc/pressure`).

use super::unit::{Cx, Outcome, Starting, Unit, Watcher};
use crate::config::check::{range, Invalid};
use crate::metrics;
use crate::roots::Roots;
use prometheus::{CounterVec, Gauge, Registry};
use serde::Deserialize;
use std::collections::HashMap;

/// Parse a PSI file: `some avg10=0.00 avg60=0.00 avg300=0.00 total=12345` (+ `full ...`).
/// Returns (kind, total µs).
pub fn parse_psi(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let kind = it.next()?;
            if kind != "some" && kind != "full" {
                return None;
            }
            let total = it.find_map(|f| f.strip_prefix("total="))?.parse().ok()?;
            Some((kind.to_string(), total))
        })
        .collect()
}

pub struct HostStats {
    sys: sysinfo::System,
    psi: HashMap<(String, String), u64>,
}

impl Default for HostStats {
    fn default() -> Self {
        Self::new()
    }
}

impl HostStats {
    pub fn new() -> Self {
        HostStats {
            sys: sysinfo::System::new(),
            psi: HashMap::new(),
        }
    }

    pub fn poll(&mut self, roots: &Roots, m: &HostMetrics) {
        self.sys.refresh_cpu_usage();
        self.sys.refresh_memory();
        m.cpu.set(self.sys.global_cpu_usage() as f64 / 100.0);
        m.mem_total.set(self.sys.total_memory() as f64);
        m.mem_available.set(self.sys.available_memory() as f64);
        for res in ["cpu", "memory", "io"] {
            let Ok(t) = std::fs::read_to_string(roots.proc().join("pressure").join(res)) else {
                continue;
            };
            for (kind, total) in parse_psi(&t) {
                let prev = self.psi.insert((res.to_string(), kind.clone()), total);
                let c = m.pressure.with_label_values(&[res, &kind]);
                let d = match prev {
                    Some(p) if total >= p => total - p,
                    Some(_) => 0,
                    None => total,
                };
                c.inc_by(d as f64 / 1e6);
            }
        }
    }
}

// ---- The unit: configuration, series, loop. ----

/// `[host]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    pub enabled: bool,
    pub interval_ms: u64,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            enabled: true,
            interval_ms: 5000,
        }
    }
}

impl HostConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        range("host.interval_ms", self.interval_ms, 100, 3_600_000)
    }
}

pub struct HostMetrics {
    pub cpu: Gauge,
    pub mem_total: Gauge,
    pub mem_available: Gauge,
    pub pressure: CounterVec,
}

impl HostMetrics {
    pub fn new(r: &Registry) -> HostMetrics {
        HostMetrics {
            cpu: metrics::gauge(r, "gpufeed_host_cpu_usage_ratio", "Host CPU usage 0..1"),
            mem_total: metrics::gauge(r, "gpufeed_host_memory_total_bytes", "Host memory"),
            mem_available: metrics::gauge(
                r,
                "gpufeed_host_memory_available_bytes",
                "Host memory available",
            ),
            pressure: metrics::counter_vec(
                r,
                "gpufeed_host_pressure_stall_seconds_total",
                "PSI stall time",
                &["resource", "kind"],
            ),
        }
    }
}

pub const UNIT: Unit = Unit {
    name: "host",
    // Series only, no events.
    describe: |_| None,
};

/// Builds the unit from its section `[host]`, registering its series in `r`.
pub fn watcher(r: &Registry, cfg: HostConfig) -> Box<dyn Watcher> {
    Box::new(HostWatcher {
        metrics: HostMetrics::new(r),
        cfg,
    })
}

struct HostWatcher {
    metrics: HostMetrics,
    cfg: HostConfig,
}

impl Watcher for HostWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            let cfg = self.cfg;
            let m = self.metrics;
            let mut hs = HostStats::new();
            hs.poll(&a.roots, &m);
            Outcome::On(vec![tokio::spawn(async move {
                let mut iv = a.ticker(cfg.interval_ms);
                let beat = a.heartbeat("host", cfg.interval_ms);
                loop {
                    beat.now();
                    iv.tick().await;
                    hs.poll(&a.roots, &m);
                }
            })])
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn psi() {
        let v = super::parse_psi("some avg10=0.00 avg60=0.00 avg300=0.00 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=45\n");
        assert_eq!(v, vec![("some".into(), 123), ("full".into(), 45)]);
        assert!(super::parse_psi("junk\nsome avg10=1").is_empty());
    }
}
