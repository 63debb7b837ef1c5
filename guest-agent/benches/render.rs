//! The join and /metrics at node scale (not a test): synthetic owners for 250 and 1,000 pods
//! with series in every probe family, pods named by the API, the correlator on.
//!
//! Per pod: a container and the pod-level cgroup as owners; the scheduler histogram, TCP RTT
//! histograms and retransmit counters for two destinations, tc bytes (two directions) and
//! drops, GPU ioctl histograms for two commands, GPU compute seconds, CUDA launches and PCIe
//! bytes; gauges for the bandwidth limit, VRAM and the duty cycle. Every tick, each pod's
//! signal windows (run queue, RTT and retransmits per destination, tc drops, GPU ioctl: five
//! signals, seven windows) with log-normal noise; a tenth of the pods are hot for 5 ticks
//! every 30 s and a host event arrives every 30 s, so spikes and joins happen. The join's clock
//! moves a second a tick (the default interval) and 150 ticks warm it up, past the page's kept
//! span (122 s): its rings are full and old spikes expire, as in an agent that has run a while.
//!
//! Reports, per pod count: `JoinOwner::tick` (the collector's windows merged per pod and signal,
//! then the correlator) in µs per tick, wall and thread CPU; the time to render /metrics
//! (`Exposition::render`: the agent's series and the correlator's); the process RSS; then,
//! apart, FinOps' booking of a tick (the store's GPU totals, then `FinOps::book` with an hourly
//! rate and a configured capacity) in µs of thread CPU.
//! Targets: tick ≤ 1 ms at 250 pods, render ≤ 20 ms at 250 and 1,000 pods, RSS ≤ 40 MB.
//!
//! cargo bench -p gpufeed-guest --bench render [-- PODS...]

#[path = "common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::thread_cpu_ns;
use gpufeed_guest::collect::{GpuTotals, Owner, OwnerStats, Store, TickReport};
use gpufeed_guest::correlate::Config;
use gpufeed_guest::exporter::{AgentCollector, Exposition};
use gpufeed_guest::finops::{self, FinOps};
use gpufeed_guest::hub::ReceivedEvent;
use gpufeed_guest::join::{JoinOwner, Settings};
use gpufeed_guest::pods::{PodMeta, PodStore};
use gpufeed_guest::probes::hist::Hist;
use gpufeed_guest::probes::signal::{SignalWindow, WindowValue};
use gpufeed_guest::probes::unit::{FamilySpec, GaugeValue, Kind, Labels, Scope, Value};
use gpufeed_guest::probes::{cuda, gpu_compute, gpu_driver, sched, tc, tcp, ProbeStatus};
use gpufeed_shared::event::{samples, HostEvent, LinkChangeClass};

/// The families the loaded units declare, as they declare them.
static FAMILIES: [FamilySpec; 12] = [
    spec(sched::FAMILY, Kind::Histogram, Scope::Container, false),
    spec(tcp::RTT_FAMILY, Kind::Histogram, Scope::Container, false),
    spec(tcp::RETRANS_FAMILY, Kind::Counter, Scope::Container, false),
    spec(tc::BYTES_FAMILY, Kind::Counter, Scope::Pod, false),
    spec(tc::DROPS_FAMILY, Kind::Counter, Scope::Pod, false),
    spec(tc::BW_LIMIT_FAMILY, Kind::Gauge, Scope::Pod, false),
    spec(gpu_driver::IOCTL, Kind::Histogram, Scope::Container, true),
    spec(
        gpu_compute::COMPUTE,
        Kind::SecondsCounter,
        Scope::Container,
        true,
    ),
    spec(gpu_compute::DUTY, Kind::Gauge, Scope::Container, true),
    spec(cuda::VRAM, Kind::Gauge, Scope::Container, true),
    spec(cuda::PCIE, Kind::Counter, Scope::Pod, true),
    spec(cuda::LAUNCHES, Kind::Counter, Scope::Container, true),
];

const fn spec(name: &'static str, kind: Kind, scope: Scope, pod_labels: bool) -> FamilySpec {
    FamilySpec {
        name,
        help: "synthetic",
        kind,
        scope,
        pod_labels,
    }
}

const DSTS: [&str; 2] = ["kv-store", "internet"];
const WARMUP: usize = 150;
const MEASURED: usize = 300;
const RENDERS: usize = 30;

fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

/// (p50, p99, max) of `v`, sorted in place.
fn summary(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p) as usize];
    (q(0.5), q(0.99), q(1.0))
}

fn uid(i: usize) -> String {
    format!("{:08x}-5f60-4718-9a2b-{:012x}", i, i)
}

fn cid(i: usize) -> String {
    format!("{:064x}", i + 1)
}

fn hist(rng: &mut fastrand::Rng) -> Hist {
    let mut h = Hist::default();
    for b in h.buckets.iter_mut().take(12) {
        *b = rng.u64(0..1000);
    }
    h.count = h.buckets.iter().sum();
    h.sum_ns = h.count * 20_000;
    h
}

fn l(pairs: &[(&'static str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// The shared state after some time with `pods` pods.
fn shared(pods: usize, store: &PodStore, rng: &mut fastrand::Rng) -> Store {
    let mut s = Store::default();
    for i in 0..pods {
        let (uid, cid) = (uid(i), cid(i));
        store.upsert(PodMeta {
            uid: uid.clone(),
            namespace: "inference".into(),
            name: format!("vllm-{i}"),
            labels: BTreeMap::from([
                ("app".into(), "vllm".into()),
                ("pod-template-hash".into(), "5d8f7c9b6".into()),
            ]),
            annotations: BTreeMap::new(),
            containers: HashMap::from([(cid.clone(), "server".into())]),
            ips: vec![],
            host_network: false,
            deleted_at: None,
        });
        let container = Owner::Pod {
            uid: uid.as_str().into(),
            container_id: Some(cid.into()),
        };
        let mut series = BTreeMap::new();
        series.insert((sched::FAMILY, Labels::new()), Value::Hist(hist(rng)));
        for d in DSTS {
            series.insert((tcp::RTT_FAMILY, l(&[("dst", d)])), Value::Hist(hist(rng)));
            series.insert(
                (tcp::RETRANS_FAMILY, l(&[("dst", d)])),
                Value::Count(rng.u64(..1000)),
            );
        }
        for cmd in ["submit", "alloc"] {
            series.insert(
                (gpu_driver::IOCTL, l(&[("cmd", cmd)])),
                Value::Hist(hist(rng)),
            );
        }
        series.insert(
            (gpu_compute::COMPUTE, Labels::new()),
            Value::Count(rng.u64(..1 << 40)),
        );
        series.insert(
            (cuda::LAUNCHES, Labels::new()),
            Value::Count(rng.u64(..1 << 30)),
        );
        s.owners.insert(
            container.clone(),
            OwnerStats {
                series,
                live_cgroups: 1,
                gone_since: None,
            },
        );
        let pod = container.pod_level();
        let mut series = BTreeMap::new();
        series.insert((sched::FAMILY, Labels::new()), Value::Hist(hist(rng)));
        for dir in ["egress", "ingress"] {
            series.insert(
                (tc::BYTES_FAMILY, l(&[("direction", dir)])),
                Value::Count(rng.u64(..1 << 40)),
            );
            series.insert(
                (cuda::PCIE, l(&[("direction", dir)])),
                Value::Count(rng.u64(..1 << 40)),
            );
        }
        series.insert(
            (
                tc::DROPS_FAMILY,
                l(&[("direction", "egress"), ("reason", "tc_egress")]),
            ),
            Value::Count(rng.u64(..100)),
        );
        s.owners.insert(
            pod.clone(),
            OwnerStats {
                series,
                live_cgroups: 1,
                gone_since: None,
            },
        );
        let gauge = |owner: &Owner, labels: Labels, value: f64| GaugeValue {
            owner: owner.clone(),
            labels: labels.into(),
            value,
        };
        s.gauges.entry(tc::BW_LIMIT_FAMILY).or_default().push(gauge(
            &pod,
            l(&[("direction", "egress")]),
            1e9,
        ));
        s.gauges
            .entry(cuda::VRAM)
            .or_default()
            .push(gauge(&container, Labels::new(), 8e9));
        s.gauges
            .entry(gpu_compute::DUTY)
            .or_default()
            .push(gauge(&container, Labels::new(), 0.5));
    }
    // the owners with GPU series, as the collector keeps them
    gpufeed_guest::collect::index_gpu_owners(&mut s);
    s
}

/// One tick's windows: five signals per pod, two of them per destination.
fn windows(pods: usize, tick: usize, rng: &mut fastrand::Rng) -> Vec<SignalWindow> {
    let at = Instant::now();
    let mut out = Vec::with_capacity(pods * 7);
    for i in 0..pods {
        let owner = Owner::Pod {
            uid: uid(i).into(),
            container_id: Some(cid(i).into()),
        };
        let hot = tick % 30 < 5 && i % 10 == (tick / 30) % 10;
        let latency = |rng: &mut fastrand::Rng| {
            let z = (-2.0 * rng.f64().max(1e-12).ln()).sqrt()
                * (std::f64::consts::TAU * rng.f64()).cos();
            let p99 = 100.0 * (0.2 * z).exp() * if hot { 10.0 } else { 1.0 };
            WindowValue::Latency {
                count: 500,
                sum_us: p99 * 250.0,
                p50_us: p99 / 2.0,
                p99_us: p99,
                max_us: p99 * 1.5,
            }
        };
        let rate = |hot: bool| WindowValue::Rate {
            count: if hot { 20 } else { 0 },
            per_second: if hot { 20.0 } else { 0.0 },
        };
        // windows carry no labels: one per destination, as the collector makes them
        let w = |signal, value| SignalWindow {
            owner: owner.clone(),
            signal,
            at,
            window: Duration::from_secs(1),
            value,
        };
        out.push(w("run_queue_wait", latency(rng)));
        for _ in DSTS {
            out.push(w("tcp_rtt", latency(rng)));
            out.push(w("tcp_retransmit_rate", rate(hot)));
        }
        out.push(w("tc_drop_rate", rate(hot)));
        out.push(w("gpu_ioctl", latency(rng)));
    }
    out
}

fn link_event(seq: u64, now: i64) -> ReceivedEvent {
    let (old, new) = if seq.is_multiple_of(2) {
        ((Some(16000), 4), (Some(2500), 1))
    } else {
        ((Some(2500), 1), (Some(16000), 4))
    };
    ReceivedEvent {
        host: "pve1".into(),
        boot_id: 1,
        seq,
        kind: gpufeed_shared::event::kind::PCIE_LINK_CHANGE,
        host_realtime_ns: now,
        host_monotonic_ns: 0,
        received_realtime_ns: now,
        clock_offset_ns: Some(0),
        event: HostEvent::PcieLinkChange(samples::gpu_link_change(
            "0000:0a:00.0",
            "0000:09:01.0",
            old,
            new,
            if seq.is_multiple_of(2) {
                LinkChangeClass::WidthReduction
            } else {
                LinkChangeClass::WidthIncrease
            },
        )),
    }
}

fn run(pods: usize) {
    let mut rng = fastrand::Rng::with_seed(42);
    let store = PodStore::default();
    let shared = Arc::new(Mutex::new(shared(pods, &store, &mut rng)));
    // the pods the collector has: every pod of the store's owners
    let live = shared.lock().expect("shared").pod_uids();
    let mut join = JoinOwner::new(
        Settings {
            correlate: Config::default(),
            node: "node-1".into(),
            ..Settings::default()
        },
        store.clone(),
    );
    let registry = prometheus::Registry::new();
    let probes = [
        "sched_latency",
        "tcp_rtt",
        "tcp_retransmit",
        "tc",
        "gpu_driver",
        "cuda",
    ]
    .map(ProbeStatus::up)
    .to_vec();
    let finops = FinOps::new(
        finops::Settings {
            hourly_rate: Some(3.6),
            capacity: finops::CapacityInput {
                memory_bytes: Some(80 << 30),
                link_bytes_per_second: Some(32_000_000_000),
                gpus: Some(8),
            },
            ..finops::Settings::default()
        }
        .validate()
        .expect("FinOps settings"),
        store.clone(),
    );
    let agent = AgentCollector::new(shared.clone(), store, FAMILIES.iter().collect(), probes);

    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    // ticks a second apart on the join's clock, as the agent's default interval: the page's
    // rings fill to their kept span and old spikes expire, as they do in a running agent
    // (ticks as fast as the loop runs would fall in a few seconds and hold a few points)
    let start_ns = now_ns();
    let clock = |t: usize| start_ns + t as i64 * 1_000_000_000;
    for t in 0..WARMUP + MEASURED {
        let w = windows(pods, t, &mut rng);
        if t % 30 == 1 {
            join.host_event(&link_event(t as u64, clock(t)), clock(t));
        }
        let input = TickReport {
            windows: w,
            live: live.clone(),
            gpu_busy: Some(true),
            ..TickReport::default()
        };
        let (start, cpu_start) = (Instant::now(), thread_cpu_ns());
        join.tick(&input, Instant::now(), clock(t));
        if t >= WARMUP {
            cpu.push((thread_cpu_ns() - cpu_start) as f64 / 1e3);
            wall.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    // the scrape reads the series the join published after its last tick
    registry
        .register(Box::new(Published(join.series(clock(WARMUP + MEASURED)))))
        .expect("register");
    let exposition = Exposition::new(registry, Arc::new(agent));
    let (mut render, mut render_cpu) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    for _ in 0..RENDERS {
        let (start, cpu_start) = (Instant::now(), thread_cpu_ns());
        bytes = exposition.render().len();
        render_cpu.push((thread_cpu_ns() - cpu_start) as f64 / 1e6);
        render.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let text = exposition.render();
    let series = text.lines().filter(|l| !l.starts_with('#')).count();
    let spikes = text
        .lines()
        .filter(|l| l.starts_with("gpufeed_latency_spikes_total{"))
        .count();
    let windows = pods * 7;
    for (what, v) in [("wall", &mut wall), ("cpu", &mut cpu)] {
        let (p50, p99, max) = summary(v);
        println!(
            "scale: {pods} pods, {windows} windows/tick: JoinOwner::tick {what} µs: p50 {p50:.0}, p99 {p99:.0}, max {max:.0} (target ≤ 1000 at 250 pods)"
        );
    }
    for (what, v) in [("wall", &mut render), ("cpu", &mut render_cpu)] {
        let (p50, p99, max) = summary(v);
        println!(
            "scale: {pods} pods: /metrics render {what} ms: p50 {p50:.1}, p99 {p99:.1}, max {max:.1} ({series} samples, {bytes} bytes, {spikes} pod signals with spikes; target ≤ 20)"
        );
    }
    println!("scale: {pods} pods: RSS {:.1} MB (target ≤ 40)", rss_mb());
    // FinOps after the rest (its state and its work between the join's ticks would move the
    // figures above): at each tick the collector takes the GPU totals, FinOps books them
    let mut book_cpu = Vec::new();
    for t in 0..WARMUP + MEASURED {
        let cpu_start = thread_cpu_ns();
        let totals = GpuTotals::of(&shared.lock().expect("shared"));
        finops.book(totals, Instant::now());
        if t >= WARMUP {
            book_cpu.push((thread_cpu_ns() - cpu_start) as f64 / 1e3);
        }
    }
    let (p50, p99, max) = summary(&mut book_cpu);
    println!(
        "scale: {pods} pods: GPU totals + FinOps::book cpu µs: p50 {p50:.0}, p99 {p99:.0}, max {max:.0}"
    );
}

/// The join's series as its driver publishes them: a scrape builds the families from the
/// published rows.
struct Published(Vec<gpufeed_guest::families::Rows>);

impl prometheus::core::Collector for Published {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        Vec::new()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.0
            .iter()
            .map(gpufeed_guest::families::Rows::family)
            .collect()
    }
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn main() {
    let counts: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let counts = if counts.is_empty() {
        vec![250, 1000]
    } else {
        counts
    };
    for pods in counts {
        run(pods);
    }
}
