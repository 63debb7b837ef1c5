//! Correlation cost per tick (not a test): 250 pods × 5 signals, 1 s ticks, log-normal p99
//! noise, some pods in contention and a host event every 30 s so spikes and joins happen.
//! Reports µs per tick (`Correlator::observe` of all windows, host events included) as wall
//! time and as the thread's CPU time (which a busy machine's preemptions do not inflate), and
//! the time to build the correlation metric families. Target: ≤ 1 ms per tick.
//!
//! cargo bench -p gpufeed-guest --bench correlate

#[path = "common/mod.rs"]
mod common;

use std::time::Instant;

use common::thread_cpu_ns;

use gpufeed_guest::correlate::events::Payload;
use gpufeed_guest::correlate::{Config, Correlator, HostInput, PodKey, SignalShape, SignalWindow};
use gpufeed_shared::event::{HostEvent, VmRunState, VmStateChange};

const S: i64 = 1_000_000_000;
const T0: i64 = 1_790_000_000 * S;
const PODS: usize = 250;
const SIGNALS: [&str; 5] = [
    "run_queue_wait",
    "tcp_rtt",
    "tcp_retransmit_rate",
    "tc_drop_rate",
    "gpu_ioctl_latency",
];
const WARMUP: i64 = 120;
const MEASURED: i64 = 600;

/// (p50, p99, max, mean) of `v`, sorted in place.
fn summary(v: &mut [f64]) -> (f64, f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p) as usize];
    (
        q(0.5),
        q(0.99),
        q(1.0),
        v.iter().sum::<f64>() / v.len() as f64,
    )
}

fn windows(rng: &mut fastrand::Rng, pods: &[PodKey], tick: i64) -> Vec<SignalWindow> {
    let mut out = Vec::with_capacity(pods.len() * SIGNALS.len());
    for (i, pod) in pods.iter().enumerate() {
        // Every 30 s, a tenth of the pods are hot for 5 ticks.
        let hot = tick % 30 < 5 && i % 10 == (tick / 30) as usize % 10;
        for signal in SIGNALS {
            let rate = signal == "tcp_retransmit_rate" || signal == "tc_drop_rate";
            let z = (-2.0 * rng.f64().max(1e-12).ln()).sqrt()
                * (std::f64::consts::TAU * rng.f64()).cos();
            let mut p99 = if rate { 0.0 } else { 100.0 * (0.2 * z).exp() };
            if hot {
                p99 = if rate { 20.0 } else { p99 * 10.0 };
            }
            out.push(SignalWindow {
                pod: pod.clone(),
                signal: signal.to_string(),
                at: T0 + tick * S,
                count: if rate { p99 as u64 } else { 500 },
                sum: p99 * 250.0,
                p50: p99 / 2.0,
                p99,
                max: p99 * 1.5,
                shape: if rate {
                    SignalShape::Rate
                } else {
                    SignalShape::Distribution
                },
            });
        }
    }
    out
}

fn main() {
    let mut rng = fastrand::Rng::with_seed(42);
    let pods: Vec<PodKey> = (0..PODS)
        .map(|i| PodKey::new("ml", &format!("pod-{i}"), &format!("uid-{i}")))
        .collect();
    let ticks: Vec<Vec<SignalWindow>> = (0..WARMUP + MEASURED)
        .map(|t| windows(&mut rng, &pods, t))
        .collect();
    let event = HostEvent::VmState(VmStateChange {
        vmid: 100,
        old: VmRunState::Running,
        new: VmRunState::Paused,
        detail: None,
        cause: vec![],
    });
    let mut c = Correlator::new(Config::default());
    let mut wall = Vec::with_capacity(MEASURED as usize);
    let mut cpu = Vec::with_capacity(MEASURED as usize);
    for (t, w) in ticks.iter().enumerate() {
        let t = t as i64;
        let now = T0 + t * S;
        let start = Instant::now();
        let cpu_start = thread_cpu_ns();
        if t % 30 == 0 {
            let input = HostInput {
                host: "pve1",
                host_realtime_ns: now - S / 2,
                clock_offset_ns: 0,
                payload: Payload::Known(&event),
            };
            c.host_event(input, now);
        }
        c.observe(w, now);
        if t >= WARMUP {
            cpu.push((thread_cpu_ns() - cpu_start) as f64 / 1e3);
            wall.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    let now = T0 + (WARMUP + MEASURED) * S;
    let render_start = Instant::now();
    let families = c.metric_families(now);
    let events = serde_json::to_vec(&c.recent_events()).unwrap_or_default();
    let render_us = render_start.elapsed().as_secs_f64() * 1e6;

    let series: usize = families.iter().map(|f| f.get_metric().len()).sum();
    for (what, v) in [("wall", &mut wall), ("cpu", &mut cpu)] {
        let (p50, p99, max, mean) = summary(v);
        println!(
            "correlate: {PODS} pods × {} signals, {MEASURED} ticks, {what} µs per tick: \
             p50 {p50:.0}, p99 {p99:.0}, max {max:.0}, mean {mean:.0} (target ≤ 1000)",
            SIGNALS.len()
        );
    }
    println!(
        "correlate: metric families ({series} series) + /events JSON ({} bytes): {render_us:.0} µs",
        events.len()
    );
}
