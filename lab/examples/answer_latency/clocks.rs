//! The VM's clocks on the benchmark's clock. The VM's kernel stamps its trace records with
//! `CLOCK_MONOTONIC` (the agent's tracefs instance uses the `mono` trace clock) and its log
//! records with the printk clock; the host agent stamps its events with `CLOCK_REALTIME`. The
//! scenario reads its realtime around its monotonic clock when asked (`clock`), and writes a
//! kernel log record right after a realtime reading (`kmsg_clock`). The benchmark brackets
//! the `clock` answer with its own realtime: the VM's reading lies between the question and
//! the answer, so the offset is known to within half of that round trip (less the VM's own
//! reading time). Nothing here uses the product's clock alignment.

use std::time::Duration;

use gpufeed_lab::Vm;

/// This machine's `CLOCK_REALTIME`, ns.
pub fn now_ns() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as f64
}

/// One reading of the VM's clocks against this machine's.
#[derive(Debug, Clone, Copy)]
pub struct Ping {
    /// when it was taken (this machine's realtime, ns)
    pub at: f64,
    /// this machine's realtime minus the VM's, ns (the middle of the possible range)
    pub offset: f64,
    /// half the range the offset may be in, ns
    pub error: f64,
    /// the VM's realtime minus its monotonic clock, ns
    pub mono_to_real: f64,
    /// the VM's realtime minus its printk clock, ns (None when the mark was not found)
    pub printk_to_real: Option<f64>,
}

impl Ping {
    /// The VM's realtime `ns` on this machine's clock.
    pub fn real(&self, ns: f64) -> f64 {
        ns + self.offset
    }

    /// The VM's `CLOCK_MONOTONIC` `ns` on this machine's clock.
    pub fn mono(&self, ns: f64) -> f64 {
        ns + self.mono_to_real + self.offset
    }

    /// The VM's printk clock `us` (a kernel log record's stamp) on this machine's clock.
    pub fn printk(&self, us: f64) -> Option<f64> {
        Some(us * 1e3 + self.printk_to_real? + self.offset)
    }
}

fn secs_ns(s: &str) -> f64 {
    s.parse::<f64>().unwrap_or(f64::NAN) * 1e9
}

/// One `clock` exchange with the scenario.
pub fn ping(vm: &mut Vm) -> Ping {
    let h0 = now_ns();
    vm.send("clock").unwrap();
    let v = vm.expect("clock", Duration::from_secs(30)).unwrap();
    let h1 = now_ns();
    let w: Vec<&str> = v.split_whitespace().collect();
    let (r0, mono, r1) = (secs_ns(w[0]), w[1].parse::<f64>().unwrap(), secs_ns(w[2]));
    // r0 + offset >= h0 and r1 + offset <= h1
    let (lo, hi) = (h0 - r0, h1 - r1);
    let k = vm.expect("kmsg_clock", Duration::from_secs(30)).unwrap();
    let mut k = k.split_whitespace();
    let printk_to_real = match (k.next(), k.next()) {
        (Some(real), Some(stamp)) => Some(secs_ns(real) - secs_ns(stamp)),
        _ => None,
    };
    Ping {
        at: h0,
        offset: (lo + hi) / 2.0,
        error: (hi - lo).abs() / 2.0,
        mono_to_real: (r0 + r1) / 2.0 - mono,
        printk_to_real,
    }
}

/// The tightest of `n` readings.
pub fn best_of(vm: &mut Vm, n: usize) -> Ping {
    (0..n)
        .map(|_| ping(vm))
        .min_by(|a, b| a.error.total_cmp(&b.error))
        .unwrap()
}
