//! The shipped KEDA ScaledObject's query (`talos/kubernetes/components/keda`, which the Helm
//! chart renders too) on a real Prometheus (Debian's package), turned into the replica count
//! the HPA sets as KEDA hands it the value: for a busy app, an idle one, and two whose GPUs the
//! host starves (a degraded link: `pcie_link` feed stall; a host event: `host_event`). The
//! series are real samples: Prometheus scrapes an exposition, written here, of what the agent
//! exports for such pods (duty cycle gauges, feed-stall counters growing at set rates). No
//! root, no kernel.

use crate::common;
use crate::manifests;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use manifests::{shipped_scaler, Scaler};

impl Scaler {
    /// The replica count the HPA sets from the trigger's `value` with `current` replicas (the
    /// Kubernetes HPA algorithm for the External metric KEDA serves). AverageValue: usage
    /// ratio = value ÷ (threshold × current); Value: value ÷ threshold. Within the HPA's
    /// default tolerance (0.1) of 1 the count stays; otherwise ceil(current × ratio) (for
    /// AverageValue, ceil(value ÷ threshold)); within the ScaledObject's bounds.
    fn replicas(&self, value: f64, current: u32) -> u32 {
        let ratio = match self.metric_type.as_str() {
            "AverageValue" => value / (self.threshold * current as f64),
            "Value" => value / self.threshold,
            other => panic!("metricType {other}"),
        };
        let desired = if (ratio - 1.0).abs() <= 0.1 {
            current
        } else {
            (current as f64 * ratio).ceil() as u32
        };
        desired.clamp(self.min, self.max)
    }
}

/// One pod of an app as the agent exports it: its duty cycle and its feed stall's growth per
/// cause (seconds a second).
struct PodSeries {
    app: &'static str,
    pod: &'static str,
    duty: f64,
    stall: [(&'static str, f64); 4],
}

const fn pod(app: &'static str, pod: &'static str, duty: f64, stall: [f64; 4]) -> PodSeries {
    PodSeries {
        app,
        pod,
        duty,
        stall: [
            ("cpu", stall[0]),
            ("pcie_link", stall[1]),
            ("host_event", stall[2]),
            ("unexplained", stall[3]),
        ],
    }
}

/// The apps: (name, its replicas now, what it should get, what it means).
const APPS: [(&str, u32, u32, &str); 4] = [
    ("busy", 2, 3, "two pods at 90%: a third"),
    ("idle", 2, 1, "two pods at 5% and 2%: one"),
    (
        "starved-link",
        2,
        2,
        "GPUs idle behind a degraded link: held at two",
    ),
    (
        "starved-event",
        3,
        3,
        "GPUs idle through a host event: held at three",
    ),
];

const PODS: [PodSeries; 9] = [
    // fed at full speed; a stall of their own CPU work, and a pcie_link counter that stays
    pod("busy", "busy-0", 0.9, [0.02, 0.0, 0.0, 0.03]),
    pod("busy", "busy-1", 0.9, [0.01, 0.0, 0.0, 0.04]),
    pod("idle", "idle-0", 0.05, [0.001, 0.0, 0.0, 0.0]),
    pod("idle", "idle-1", 0.02, [0.0, 0.0, 0.0, 0.001]),
    pod("starved-link", "link-0", 0.1, [0.01, 0.5, 0.0, 0.1]),
    pod("starved-link", "link-1", 0.15, [0.01, 0.0, 0.0, 0.1]),
    pod("starved-event", "event-0", 0.05, [0.0, 0.0, 0.0, 0.05]),
    pod("starved-event", "event-1", 0.05, [0.0, 0.0, 0.3, 0.05]),
    pod("starved-event", "event-2", 0.05, [0.0, 0.0, 0.0, 0.05]),
];

/// The exposition at `secs` seconds: gauges as set, counters grown at their rates.
fn exposition(secs: f64) -> String {
    let mut out = String::from("# TYPE ebpf_gpu_active_compute_duty_cycle gauge\n");
    for p in &PODS {
        out += &format!(
            "ebpf_gpu_active_compute_duty_cycle{{namespace=\"ml\",pod=\"{}\",gpu=\"0\",app=\"{}\"}} {}\n",
            p.pod, p.app, p.duty
        );
    }
    out += "# TYPE gpufeed_gpu_feed_stall_seconds_total counter\n";
    for p in &PODS {
        for (cause, rate) in p.stall {
            out += &format!(
                "gpufeed_gpu_feed_stall_seconds_total{{namespace=\"ml\",pod=\"{}\",cause=\"{cause}\",app=\"{}\"}} {}\n",
                p.pod,
                p.app,
                rate * secs
            );
        }
    }
    out
}

/// Serves [`exposition`] on loopback until dropped.
struct Exporter {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exporter {
    fn start() -> Exporter {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let began = Instant::now();
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok((mut s, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let body = exposition(began.elapsed().as_secs_f64());
                let _ = write!(
                    s,
                    "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                     Content-Length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        Exporter {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The duty cycle alone, as the ScaledObject asked before it held for host causes.
const DUTY_ALONE: &str = "sum(max by (namespace, pod) (sum by (namespace, pod, gpu) (ebpf_gpu_active_compute_duty_cycle{app=\"inference-server\"})))";

#[test]
fn the_scaler_holds_while_the_host_starves_the_gpu_and_scales_on_duty_otherwise() {
    let exporter = Exporter::start();
    let target = exporter.addr;
    let prom = Prometheus::start_with(|_| {
        format!(
            "scrape_configs:\n  - job_name: gpufeed-guest\n    static_configs:\n      \
             - targets: ['{target}']\n"
        )
    });
    let scaler = shipped_scaler();
    let of = |q: &str, app: &str| q.replace("\"inference-server\"", &format!("\"{app}\""));
    // KEDA's prometheus trigger: one value; none (ignoreNullValues) reads as 0
    let value = |q: &str| -> f64 {
        let r = prom.query(q).unwrap_or_else(|e| panic!("{q}: {e}"));
        assert!(r.len() <= 1, "{q}: KEDA takes one value: {r:?}");
        r.first()
            .map_or(0.0, |s| s["value"][1].as_str().unwrap().parse().unwrap())
    };
    // the rate window holds two samples of every counter
    wait_for(Duration::from_secs(30), || {
        let q = "count(rate(gpufeed_gpu_feed_stall_seconds_total[1m]) > 0)";
        (prom.scalar(q)? >= 15.0).then_some(())
    })
    .expect("prometheus has the counters' rates");

    let mut failures = Vec::new();
    for (app, current, want, what) in APPS {
        let v = value(&of(&scaler.query, app));
        let alone = value(&of(DUTY_ALONE, app));
        let got = scaler.replicas(v, current);
        eprintln!(
            "{app}: {current} replicas, query {v:.3} -> {got} (duty cycle alone {alone:.3} -> {}); \
             {what}",
            scaler.replicas(alone, current)
        );
        if got != want {
            failures.push(format!(
                "{app}: {got} replicas, want {want} ({what}; query {v})"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    // what the hold spares: the duty cycle alone would have scaled both starved apps to one
    for (app, current) in [("starved-link", 2), ("starved-event", 3)] {
        let alone = value(&of(DUTY_ALONE, app));
        assert_eq!(scaler.replicas(alone, current), 1, "{app}: {alone}");
    }
}
