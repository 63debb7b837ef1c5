//! Host CPU and memory (sysinfo) and pressure stall information (`/proc/pressure`).

use crate::metrics::Metrics;
use crate::roots::Roots;
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

    pub fn poll(&mut self, roots: &Roots, m: &Metrics) {
        self.sys.refresh_cpu_usage();
        self.sys.refresh_memory();
        m.host_cpu.set(self.sys.global_cpu_usage() as f64 / 100.0);
        m.host_mem_total.set(self.sys.total_memory() as f64);
        m.host_mem_available.set(self.sys.available_memory() as f64);
        for res in ["cpu", "memory", "io"] {
            let Ok(t) = std::fs::read_to_string(roots.proc().join("pressure").join(res)) else {
                continue;
            };
            for (kind, total) in parse_psi(&t) {
                let prev = self.psi.insert((res.to_string(), kind.clone()), total);
                let c = m.host_pressure.with_label_values(&[res, &kind]);
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

#[cfg(test)]
mod tests {
    #[test]
    fn psi() {
        let v = super::parse_psi("some avg10=0.00 avg60=0.00 avg300=0.00 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=45\n");
        assert_eq!(v, vec![("some".into(), 123), ("full".into(), 45)]);
        assert!(super::parse_psi("junk\nsome avg10=1").is_empty());
    }
}
