//! Deterministic timelines through the whole correlator.

use gpufeed_shared::event::{AerSeverity, HostEvent, LinkChangeClass};
use prometheus::proto::{MetricFamily, MetricType};

use super::events::tests::{aer, kmsg_link_down, link};
use super::events::Payload;
use super::*;

const S: i64 = 1_000_000_000;
/// Guest realtime of the first tick: an ordinary date, so ms-epoch output is realistic.
const T0: i64 = 1_790_000_000 * S;

fn pod(name: &str) -> PodKey {
    PodKey::new("ml", name, &format!("uid-{name}"))
}

fn degraded() -> HostEvent {
    link(
        LinkChangeClass::WidthReduction,
        (Some(16000), 4),
        (Some(2500), 1),
    )
}

/// A correlator driven one-second tick by tick. Quiet sched latency is 40..44 µs.
struct Sim {
    c: Correlator,
    /// Seconds since T0 of the next tick.
    t: i64,
    /// What the GPU does in the coming ticks (recorded each tick); `None`: nothing recorded.
    gpu: Option<Option<bool>>,
    /// Observations in each window.
    count: u64,
}

impl Sim {
    fn new() -> Self {
        Sim {
            c: Correlator::new(Config::default()),
            t: 1,
            gpu: None,
            count: 100,
        }
    }

    fn now(&self) -> i64 {
        T0 + self.t * S
    }

    /// One tick: `pods` get `value` on `signal` (None: quiet noise) for the window ending now.
    fn tick(&mut self, pods: &[(&PodKey, &str, Option<f64>)]) {
        let now = self.now();
        let windows: Vec<SignalWindow> = pods
            .iter()
            .map(|(p, signal, v)| {
                let p99 = v.unwrap_or(if *signal == "run_queue_wait" {
                    40.0 + (self.t % 5) as f64
                } else {
                    0.0
                });
                // the mean (what is tested) moves with the p99 (what is reported)
                SignalWindow {
                    pod: (*p).clone(),
                    signal: signal.to_string(),
                    at: now,
                    count: self.count,
                    sum: p99 * self.count as f64,
                    p50: 0.0,
                    p99,
                    max: 0.0,
                    // as the units declare them
                    shape: match *signal {
                        "gpu_link_throughput" => SignalShape::Level,
                        "tcp_retransmit_rate" | "tc_drop_rate" => SignalShape::Rate,
                        _ => SignalShape::Distribution,
                    },
                }
            })
            .collect();
        if let Some(busy) = self.gpu {
            self.c.gpu_window(GpuWindow {
                at: now,
                len: S,
                busy,
            });
        }
        self.c.observe(&windows, now);
        self.t += 1;
    }

    fn quiet(&mut self, pods: &[&PodKey], ticks: usize) {
        let q: Vec<_> = pods.iter().map(|p| (*p, "run_queue_wait", None)).collect();
        for _ in 0..ticks {
            self.tick(&q);
        }
    }

    /// A host event that happened at guest time `T0 + at_s`, on a host whose clock is
    /// `skew_s` ahead, with `offset_s` as measured by the hub; delivered now.
    fn event(&mut self, ev: &HostEvent, at_s: f64, skew_s: f64, offset_s: f64) {
        let host_rt = T0 + (at_s * 1e9) as i64 + (skew_s * 1e9) as i64;
        let input = HostInput {
            host: "pve1",
            host_realtime_ns: host_rt,
            clock_offset_ns: (offset_s * 1e9) as i64,
            payload: Payload::Known(ev),
        };
        let now = self.now();
        self.c.host_event(input, now);
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        value(&self.c.metric_families(self.now()), name, labels)
    }
}

/// The value of the series of `name` with exactly these labels.
fn value(fams: &[MetricFamily], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let f = fams.iter().find(|f| f.name() == name)?;
    let m = f.get_metric().iter().find(|m| {
        m.get_label().len() == labels.len()
            && labels.iter().all(|(k, v)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == *k && l.value() == *v)
            })
    })?;
    Some(if f.get_field_type() == MetricType::COUNTER {
        m.get_counter().get_value()
    } else {
        m.get_gauge().get_value()
    })
}

fn spikes_of(sim: &Sim, p: &str) -> Option<f64> {
    sim.value(
        views::LATENCY_SPIKES,
        &[
            ("signal", "run_queue_wait"),
            ("namespace", "ml"),
            ("pod", p),
        ],
    )
}

fn correlated(sim: &Sim, event: &str, p: &str) -> Option<f64> {
    sim.value(
        views::CORRELATED_SPIKES,
        &[
            ("event", event),
            ("signal", "run_queue_wait"),
            ("namespace", "ml"),
            ("pod", p),
        ],
    )
}

/// 30 quiet ticks for `pods`, then `hot` rises to 900 µs from the window ending at T0+31 s
/// for 6 ticks while the others stay quiet, then 10 quiet ticks.
fn contention(sim: &mut Sim, pods: &[&PodKey], hot: &PodKey, between: impl Fn(&mut Sim, i64)) {
    sim.quiet(pods, 30);
    for _ in 0..6 {
        let t = sim.t;
        between(sim, t);
        let row: Vec<_> = pods
            .iter()
            .map(|p| (*p, "run_queue_wait", (*p == hot).then_some(900.0)))
            .collect();
        sim.tick(&row);
    }
    sim.quiet(pods, 10);
}

#[test]
fn link_degradation_joins_the_pod_that_spiked_and_not_the_other() {
    let (a, b) = (pod("vllm-0"), pod("batch-0"));
    let mut sim = Sim::new();
    contention(&mut sim, &[&a, &b], &a, |sim, t| {
        if t == 31 {
            sim.event(&degraded(), 30.5, 0.0, 0.0);
        }
    });
    assert_eq!(spikes_of(&sim, "vllm-0"), Some(1.0));
    assert_eq!(spikes_of(&sim, "batch-0"), None);
    assert_eq!(correlated(&sim, "link_degraded", "vllm-0"), Some(1.0));
    assert_eq!(correlated(&sim, "link_degraded", "batch-0"), None);
    assert_eq!(
        sim.value(
            views::HOST_EVENTS,
            &[("host", "pve1"), ("event", "link_degraded")]
        ),
        Some(1.0)
    );
    // Baseline median of 40..44 is 42; every window of the episode was 900.
    let impact = sim.value(
        views::EVENT_IMPACT,
        &[
            ("event", "link_degraded"),
            ("signal", "run_queue_wait"),
            ("namespace", "ml"),
            ("pod", "vllm-0"),
        ],
    );
    assert_eq!(impact, Some(900.0 / 42.0));
    assert_eq!(
        sim.value(views::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
        Some(1.0)
    );
    let ev = &sim.c.recent_events()[0];
    assert_eq!(ev.event, "link_degraded");
    assert_eq!(ev.time, (T0 + 30 * S + S / 2) / 1_000_000);
    assert_eq!(ev.affected.len(), 1);
    assert_eq!(ev.affected[0].pod, "vllm-0");
    assert_eq!(ev.affected[0].lag_ms, 500);
    assert!(sim.c.unexplained_spikes(sim.now()).is_empty());
}

#[test]
fn clock_skew_of_five_seconds_either_way_is_undone_by_the_offset() {
    for skew in [5.0, -5.0] {
        let a = pod("vllm-0");
        let mut sim = Sim::new();
        contention(&mut sim, &[&a], &a, |sim, t| {
            if t == 31 {
                sim.event(&degraded(), 30.5, skew, skew);
            }
        });
        assert_eq!(
            correlated(&sim, "link_degraded", "vllm-0"),
            Some(1.0),
            "skew {skew}"
        );
        assert_eq!(
            sim.c.recent_events()[0].affected[0].lag_ms,
            500,
            "skew {skew}"
        );
        assert_eq!(sim.c.recent_events()[0].clock_offset_ms, skew * 1000.0);

        // Control: the same skew without the measured offset misses the spike.
        let mut sim = Sim::new();
        contention(&mut sim, &[&a], &a, |sim, t| {
            if t == 31 {
                sim.event(&degraded(), 30.5, skew, 0.0);
            }
        });
        assert_eq!(
            correlated(&sim, "link_degraded", "vllm-0"),
            None,
            "skew {skew}"
        );
        assert_eq!(sim.c.unexplained_spikes(sim.now()).len(), 1);
    }
}

#[test]
fn a_late_event_explains_a_spike_already_counted_as_unexplained() {
    let a = pod("vllm-0");
    let mut sim = Sim::new();
    contention(&mut sim, &[&a], &a, |_, _| {});
    // T0+47 s: past 31 + before 2 + lateness 10, so settled as unexplained.
    let un = sim.c.unexplained_spikes(sim.now());
    assert_eq!(un.len(), 1);
    assert!(!un[0].pending);
    assert_eq!(
        sim.value(views::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
        Some(0.0)
    );
    // The host was disconnected; its spool delivers the event now, 16 s late.
    sim.event(&degraded(), 30.5, 0.0, 0.0);
    assert_eq!(correlated(&sim, "link_degraded", "vllm-0"), Some(1.0));
    assert!(sim.c.unexplained_spikes(sim.now()).is_empty());
    assert_eq!(
        sim.value(views::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
        Some(1.0)
    );
}

#[test]
fn a_fresh_spike_is_pending_before_it_is_unexplained() {
    let a = pod("vllm-0");
    let mut sim = Sim::new();
    sim.quiet(&[&a], 30);
    sim.tick(&[(&a, "run_queue_wait", Some(900.0))]);
    sim.tick(&[(&a, "run_queue_wait", Some(900.0))]);
    let un = sim.c.unexplained_spikes(sim.now());
    assert_eq!(un.len(), 1);
    assert!(un[0].pending);
    // Pending spikes are not in the ratio yet.
    assert_eq!(
        sim.value(views::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
        None
    );
    assert_eq!(spikes_of(&sim, "vllm-0"), Some(1.0));
}

#[test]
fn out_of_order_events_each_join_their_own_pod() {
    let (a, b) = (pod("vllm-0"), pod("vllm-1"));
    let mut sim = Sim::new();
    sim.quiet(&[&a, &b], 30);
    for i in 0..40 {
        let hot_a = (0..5).contains(&i); // windows at 31..35
        let hot_b = (30..35).contains(&i); // windows at 61..65
        sim.tick(&[
            (&a, "run_queue_wait", hot_a.then_some(900.0)),
            (&b, "run_queue_wait", hot_b.then_some(900.0)),
        ]);
    }
    // Delivered newest first.
    sim.event(&aer(AerSeverity::Fatal), 60.5, 0.0, 0.0);
    sim.event(&degraded(), 30.5, 0.0, 0.0);
    assert_eq!(correlated(&sim, "aer_fatal", "vllm-1"), Some(1.0));
    assert_eq!(correlated(&sim, "aer_fatal", "vllm-0"), None);
    assert_eq!(correlated(&sim, "link_degraded", "vllm-0"), Some(1.0));
    assert_eq!(correlated(&sim, "link_degraded", "vllm-1"), None);
    let kinds: Vec<&str> = sim.c.recent_events().iter().map(|e| e.event).collect();
    assert_eq!(kinds, vec!["aer_fatal", "link_degraded"], "newest first");
}

#[test]
fn overlapping_events_count_a_spike_once_per_kind() {
    let a = pod("vllm-0");
    let mut sim = Sim::new();
    contention(&mut sim, &[&a], &a, |sim, t| {
        if t == 31 {
            let down = link(LinkChangeClass::LinkDown, (Some(16000), 4), (None, 0));
            sim.event(&down, 30.2, 0.0, 0.0);
            sim.event(&aer(AerSeverity::Fatal), 30.9, 0.0, 0.0);
            // Two more AER reports of the same burst (other counters, the root port).
            sim.event(&aer(AerSeverity::Fatal), 31.0, 0.0, 0.0);
            sim.event(&aer(AerSeverity::Fatal), 31.3, 0.0, 0.0);
            // A second link-down 2.3 s later (not coalesced), also in reach.
            sim.event(&down, 32.5, 0.0, 0.0);
        }
    });
    assert_eq!(spikes_of(&sim, "vllm-0"), Some(1.0));
    assert_eq!(correlated(&sim, "link_down", "vllm-0"), Some(1.0));
    assert_eq!(correlated(&sim, "aer_fatal", "vllm-0"), Some(1.0));
    let host = |e| sim.value(views::HOST_EVENTS, &[("host", "pve1"), ("event", e)]);
    assert_eq!(host("aer_fatal"), Some(3.0), "every event is counted");
    assert_eq!(host("link_down"), Some(2.0));
    let evs = sim.c.recent_events();
    assert_eq!(evs.len(), 3, "the AER burst is one listed event");
    let burst = evs.iter().find(|e| e.event == "aer_fatal").unwrap();
    assert_eq!(burst.count, 3);
    assert!(burst.text.contains("(3 events)"), "{}", burst.text);
    // Each listed event shows the pod, with its own lag.
    let lags: Vec<i64> = evs.iter().map(|e| e.affected[0].lag_ms).collect();
    assert_eq!(lags, vec![-1500, 100, 800]);
    assert_eq!(
        sim.value(views::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
        Some(1.0)
    );
}

#[test]
fn a_pod_that_appears_mid_window_is_warming_up_and_not_joined() {
    let (a, c) = (pod("vllm-0"), pod("new-0"));
    let mut sim = Sim::new();
    sim.quiet(&[&a], 28);
    sim.tick(&[
        (&a, "run_queue_wait", None),
        (&c, "run_queue_wait", Some(45.0)),
    ]);
    sim.tick(&[
        (&a, "run_queue_wait", None),
        (&c, "run_queue_wait", Some(43.0)),
    ]);
    sim.event(&degraded(), 30.5, 0.0, 0.0);
    for _ in 0..5 {
        sim.tick(&[
            (&a, "run_queue_wait", Some(900.0)),
            (&c, "run_queue_wait", Some(900.0)),
        ]);
    }
    assert_eq!(correlated(&sim, "link_degraded", "vllm-0"), Some(1.0));
    assert_eq!(correlated(&sim, "link_degraded", "new-0"), None);
    assert_eq!(spikes_of(&sim, "new-0"), None);
    let pods: Vec<String> = sim.c.recent_events()[0]
        .affected
        .iter()
        .map(|x| x.pod.clone())
        .collect();
    assert_eq!(pods, vec!["vllm-0"]);
}

#[test]
fn a_pod_deleted_mid_window_stays_in_history_without_series() {
    let (a, b) = (pod("vllm-0"), pod("vllm-1"));
    let mut sim = Sim::new();
    sim.quiet(&[&a, &b], 30);
    sim.tick(&[
        (&a, "run_queue_wait", Some(900.0)),
        (&b, "run_queue_wait", None),
    ]);
    sim.tick(&[
        (&a, "run_queue_wait", Some(900.0)),
        (&b, "run_queue_wait", None),
    ]);
    assert_eq!(spikes_of(&sim, "vllm-0"), Some(1.0));
    // The pod crashed and was deleted; the host's event arrives after that.
    sim.c.forget_pod(&a);
    assert_eq!(sim.c.pods(), 1);
    sim.event(&degraded(), 30.5, 0.0, 0.0);
    assert_eq!(spikes_of(&sim, "vllm-0"), None, "series gone with the pod");
    assert_eq!(
        correlated(&sim, "link_degraded", "vllm-0"),
        None,
        "not resurrected"
    );
    let affected = &sim.c.recent_events()[0].affected;
    assert_eq!(affected.len(), 1, "the event still names the pod it hit");
    assert_eq!(affected[0].pod, "vllm-0");
    assert!(sim.c.impact().is_empty(), "impact gauge only for live pods");
    // A new pod of the same name (new uid) starts from scratch.
    let a2 = PodKey::new("ml", "vllm-0", "uid-2");
    sim.tick(&[
        (&a2, "run_queue_wait", Some(900.0)),
        (&b, "run_queue_wait", None),
    ]);
    assert_eq!(spikes_of(&sim, "vllm-0"), None, "warming up");
}

#[test]
fn flat_zero_and_a_warming_pod_do_not_storm() {
    let (a, w) = (pod("vllm-0"), pod("warm-0"));
    let mut sim = Sim::new();
    for i in 0..60 {
        // tc drops flat zero with an odd sub-floor blip; a pod starting hot and settling.
        let blip = (i % 17 == 0).then_some(0.8);
        let warm = (i < 8).then_some(5000.0 / (i + 1) as f64);
        sim.tick(&[(&a, "tc_drop_rate", blip), (&w, "run_queue_wait", warm)]);
        if i == 5 || i == 40 {
            let t = sim.t as f64 - 0.5;
            sim.event(&degraded(), t, 0.0, 0.0);
        }
    }
    let fams = sim.c.metric_families(sim.now());
    let f = fams
        .iter()
        .find(|f| f.name() == views::LATENCY_SPIKES)
        .unwrap();
    assert!(f.get_metric().is_empty(), "{:?}", f.get_metric());
    assert!(sim.c.recent_events().iter().all(|e| e.affected.is_empty()));
}

#[test]
fn a_host_event_with_no_spike_correlates_nothing() {
    let (a, b) = (pod("vllm-0"), pod("vllm-1"));
    let mut sim = Sim::new();
    sim.quiet(&[&a, &b], 30);
    sim.event(&degraded(), 30.5, 0.0, 0.0);
    sim.quiet(&[&a, &b], 20);
    let ev = &sim.c.recent_events()[0];
    assert!(ev.affected.is_empty());
    assert!(ev.text.ends_with("no pod spiked"), "{}", ev.text);
    let fams = sim.c.metric_families(sim.now());
    for name in [
        views::CORRELATED_SPIKES,
        views::EVENT_IMPACT,
        views::LATENCY_SPIKES,
    ] {
        let f = fams.iter().find(|f| f.name() == name).unwrap();
        assert!(f.get_metric().is_empty(), "{name}");
    }
    assert_eq!(
        value(
            &fams,
            views::HOST_EVENTS,
            &[("host", "pve1"), ("event", "link_degraded")]
        ),
        Some(1.0)
    );
}

#[test]
fn an_unknown_kind_is_counted_and_listed_and_explains_nothing() {
    let a = pod("vllm-0");
    let mut sim = Sim::new();
    contention(&mut sim, &[&a], &a, |sim, t| {
        if t == 31 {
            let now = sim.now();
            sim.c.host_event(
                HostInput {
                    host: "pve1",
                    host_realtime_ns: T0 + 30 * S,
                    clock_offset_ns: 0,
                    payload: Payload::UnknownKind {
                        kind: 99,
                        seq: 3,
                        payload_len: 5,
                    },
                },
                now,
            );
            sim.event(&kmsg_link_down(), 30.0, 0.0, 0.0);
        }
    });
    let host = |e| sim.value(views::HOST_EVENTS, &[("host", "pve1"), ("event", e)]);
    assert_eq!(host("unknown"), Some(1.0));
    assert_eq!(host("kmsg"), Some(1.0));
    let evs = sim.c.recent_events();
    assert_eq!(evs.len(), 1, "unknown is listed, kernel log context is not");
    assert_eq!(evs[0].event, "unknown");
    assert_eq!(evs[0].title, "unknown on pve1");
    assert!(evs[0].affected.is_empty());
    assert_eq!(sim.c.unexplained_spikes(sim.now()).len(), 1);
}

#[test]
fn events_serve_as_grafana_annotations() {
    let a = pod("vllm-0");
    let mut sim = Sim::new();
    contention(&mut sim, &[&a], &a, |sim, t| {
        if t == 31 {
            sim.event(&degraded(), 30.5, 0.0, 0.0);
        }
    });
    let json = serde_json::to_value(sim.c.recent_events()).unwrap();
    let e = &json[0];
    assert_eq!(e["time"], (T0 + 30 * S + S / 2) / 1_000_000);
    assert_eq!(e["title"], "link_degraded on pve1");
    assert_eq!(
        e["text"],
        "PCIe link 0000:09:00.0: 16.0 GT/s x4 → 2.5 GT/s x1 (width_reduction): \
         ml/vllm-0 run_queue_wait ×21.4"
    );
    assert_eq!(
        e["tags"],
        serde_json::json!(["gpufeed", "host:pve1", "event:link_degraded"])
    );
    assert_eq!(e["affected"][0]["namespace"], "ml");
    assert_eq!(e["affected"][0]["lag_ms"], 500);
    assert_eq!(e["affected"][0]["p99"], 900.0);
    assert_eq!(e["affected"][0]["baseline"], 42.0);
}

#[test]
fn metric_family_names_are_the_contract() {
    let sim = Sim::new();
    let names: Vec<String> = sim
        .c
        .metric_families(sim.now())
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    assert_eq!(
        names,
        vec![
            "gpufeed_latency_spikes_total",
            "gpufeed_correlated_spikes_total",
            "gpufeed_host_events_total",
            "gpufeed_event_impact_ratio",
            "gpufeed_spike_explained_ratio",
        ]
    );
}

#[test]
fn the_recent_list_is_bounded_and_keeps_the_latest_of_each_kind() {
    let a = pod("vllm-0");
    let cfg = Config {
        max_events: 4,
        ..Config::default()
    };
    let mut sim = Sim {
        c: Correlator::new(cfg),
        ..Sim::new()
    };
    contention(&mut sim, &[&a], &a, |sim, t| {
        if t == 31 {
            sim.event(&degraded(), 30.5, 0.0, 0.0);
        }
    });
    for i in 0..10 {
        sim.event(
            &aer(AerSeverity::Correctable),
            50.0 + 2.0 * i as f64,
            0.0,
            0.0,
        );
    }
    let evs = sim.c.recent_events();
    assert_eq!(evs.len(), 4);
    assert_eq!(evs.iter().filter(|e| e.event == "link_degraded").count(), 1);
    assert_eq!(sim.c.impact().len(), 1, "its impact gauge survives");
}

#[test]
fn pods_without_windows_are_forgotten_after_the_idle_period() {
    let (a, b) = (pod("vllm-0"), pod("vllm-1"));
    let mut sim = Sim::new();
    sim.quiet(&[&a, &b], 5);
    assert_eq!(sim.c.pods(), 2);
    sim.quiet(&[&b], 601);
    assert_eq!(sim.c.pods(), 1);
}

#[test]
fn hostile_windows_and_times_do_not_panic() {
    let a = pod("vllm-0");
    let mut c = Correlator::new(Config::default());
    let w = |at, p99| SignalWindow {
        pod: a.clone(),
        signal: "run_queue_wait".into(),
        at,
        count: u64::MAX,
        sum: f64::NAN,
        p50: f64::NAN,
        p99,
        max: f64::INFINITY,
        shape: SignalShape::Distribution,
    };
    for (i, v) in [f64::NAN, f64::INFINITY, -1.0, 1e308, 0.0]
        .iter()
        .enumerate()
    {
        c.observe(&[w(i64::MAX - i as i64, *v), w(i64::MIN, *v)], i64::MIN);
    }
    let ev = degraded();
    for t in [i64::MIN, i64::MAX] {
        c.host_event(
            HostInput {
                host: "h",
                host_realtime_ns: t,
                clock_offset_ns: t.wrapping_neg(),
                payload: Payload::Known(&ev),
            },
            t,
        );
    }
    let _ = c.metric_families(i64::MAX);
    let _ = c.unexplained_spikes(i64::MIN);
}

#[test]
fn a_pod_named_after_its_first_windows_keeps_its_baseline() {
    // The first ticks know the pod only by its UID (the API watch answered later).
    let uid = "uid-vllm-0";
    let unnamed = PodKey::new("", uid, uid);
    let named = pod("vllm-0");
    let mut sim = Sim::new();
    sim.quiet(&[&unnamed], 30);
    // Its names arrive; contention starts in the next window.
    sim.tick(&[(&named, "run_queue_wait", Some(900.0))]);
    sim.tick(&[(&named, "run_queue_wait", Some(900.0))]);
    assert_eq!(sim.c.pods(), 1, "one pod, not two");
    assert_eq!(
        spikes_of(&sim, "vllm-0"),
        Some(1.0),
        "the baseline of the unnamed ticks holds: no second warm-up"
    );
    // Its series carry the names now, not the UID.
    assert_eq!(
        sim.value(
            views::LATENCY_SPIKES,
            &[
                ("signal", "run_queue_wait"),
                ("namespace", ""),
                ("pod", uid)
            ]
        ),
        None
    );
    // The join in the agent hands the old key to forget_pod only when the UID is gone.
    sim.c.forget_pod(&unnamed);
    assert_eq!(sim.c.pods(), 0, "a pod is its UID");
}

/// The link of a GPU that manages its power: 2.5 GT/s at full width while idle, 16 GT/s once
/// work starts, 2.5 again when it stops.
fn speed(from: u32, to: u32) -> HostEvent {
    link(LinkChangeClass::SpeedOnly, (Some(from), 4), (Some(to), 4))
}

/// A pod starts GPU work (its run-queue latency spikes as its feeder threads wake) and the idle
/// link rises; it stops and the link falls back: nothing joins, and the list shows one
/// power-managed entry. The same speed drop while the GPU keeps working is a degradation that
/// joins the pod it hit.
#[test]
fn power_managed_speed_changes_join_nothing_and_a_drop_under_load_does() {
    let a = pod("vllm-0");
    let mut sim = Sim::new();
    sim.gpu = Some(Some(false));
    sim.quiet(&[&a], 30);
    sim.gpu = Some(Some(true));
    for i in 0..6 {
        if i == 0 {
            sim.event(&speed(2500, 16000), 30.2, 0.0, 0.0);
        }
        sim.tick(&[(&a, "run_queue_wait", Some(900.0))]);
    }
    sim.gpu = Some(Some(false));
    sim.event(&speed(16000, 2500), 36.3, 0.0, 0.0);
    sim.quiet(&[&a], 20);
    assert_eq!(spikes_of(&sim, "vllm-0"), Some(1.0));
    for kind in ["link_degraded", "link_changed", "link_power_managed"] {
        assert_eq!(correlated(&sim, kind, "vllm-0"), None, "{kind}");
    }
    assert_eq!(
        sim.value(
            views::HOST_EVENTS,
            &[("host", "pve1"), ("event", "link_power_managed")]
        ),
        Some(2.0)
    );
    // one entry for both, reading what the link did last
    let evs = sim.c.recent_events();
    assert_eq!(evs.len(), 1, "{evs:?}");
    assert_eq!((evs[0].event, evs[0].count), ("link_power_managed", 2));
    assert!(evs[0].affected.is_empty());
    assert!(
        evs[0].text.contains(
            "16.0 GT/s x4 → 2.5 GT/s x4 (speed_only); at full width, GPU idle: power \
                 management, not a cause (2 events)"
        ),
        "{}",
        evs[0].text
    );
    let un = sim.c.unexplained_spikes(sim.now());
    assert_eq!(un.len(), 1, "the pod's spike is the guest's own");

    // Under load: the link drops and stays low while the GPU works; the pod suffers.
    sim.gpu = Some(Some(true));
    sim.quiet(&[&a], 15);
    sim.event(&speed(2500, 16000), 70.5, 0.0, 0.0);
    sim.quiet(&[&a], 20);
    let t = sim.t;
    for i in 0..6 {
        if i == 1 {
            sim.event(&speed(16000, 2500), (t as f64) - 0.5, 0.0, 0.0);
        }
        sim.tick(&[(&a, "run_queue_wait", Some(900.0))]);
    }
    sim.quiet(&[&a], 10);
    assert_eq!(correlated(&sim, "link_degraded", "vllm-0"), Some(1.0));
    let ev = &sim.c.recent_events()[0];
    assert_eq!(ev.event, "link_degraded");
    assert!(
        ev.text.contains(
            "16.0 GT/s x4 → 2.5 GT/s x4 (speed_only); below its maximum while the GPU works"
        ),
        "{}",
        ev.text
    );
    assert_eq!(ev.affected.len(), 1);
}

/// The speed drop arrives before the GPU windows after it: it waits for them (counted only
/// then), and is read with what is known once `lateness` has passed; a guest that cannot
/// tell what its GPU does reads such drops as power management.
#[test]
fn a_speed_drop_waits_for_the_gpu_windows_after_it() {
    let a = pod("vllm-0");
    let mut sim = Sim::new();
    sim.gpu = Some(Some(true));
    sim.quiet(&[&a], 10);
    sim.event(&speed(16000, 2500), 10.5, 0.0, 0.0);
    let count =
        |sim: &Sim, kind| sim.value(views::HOST_EVENTS, &[("host", "pve1"), ("event", kind)]);
    assert_eq!(
        count(&sim, "link_degraded"),
        None,
        "waits for [t − 1 s, t + 2 s]"
    );
    sim.quiet(&[&a], 2);
    assert_eq!(count(&sim, "link_degraded"), None);
    sim.quiet(&[&a], 1);
    assert_eq!(count(&sim, "link_degraded"), Some(1.0));

    // the agent's ticks stop reporting the GPU: read with what is known after lateness
    sim.gpu = None;
    sim.event(&speed(16000, 2500), 13.5, 0.0, 0.0);
    sim.quiet(&[&a], 10);
    assert_eq!(count(&sim, "link_power_managed"), None);
    sim.quiet(&[&a], 3);
    assert_eq!(count(&sim, "link_power_managed"), Some(1.0));
    assert!(sim.c.recent_events()[0]
        .text
        .contains("GPU activity unknown"));

    // nothing can tell: unknown at once
    sim.gpu = Some(None);
    sim.quiet(&[&a], 5);
    sim.event(&speed(16000, 2500), 25.5, 0.0, 0.0);
    sim.quiet(&[&a], 3);
    assert_eq!(count(&sim, "link_power_managed"), Some(2.0));
}

/// An idle card's link changes speed many times a minute: one listed entry a minute with its
/// count, and the flood pushes no incident out of the bounded list: power-managed entries go
/// first (before, the oldest entry superseded by one of its kind went: the older AER).
#[test]
fn a_flood_of_power_managed_changes_is_one_entry_and_keeps_incidents_listed() {
    let a = pod("vllm-0");
    let mut sim = Sim {
        c: Correlator::new(Config {
            max_events: 3,
            ..Config::default()
        }),
        ..Sim::new()
    };
    sim.gpu = Some(Some(false));
    sim.quiet(&[&a], 5);
    sim.event(&aer(AerSeverity::Correctable), 3.0, 0.0, 0.0);
    sim.event(&aer(AerSeverity::Correctable), 5.0, 0.0, 0.0);
    for i in 0..300 {
        let at = 6.0 + i as f64 * 0.4;
        while (sim.t as f64) < at {
            sim.quiet(&[&a], 1);
        }
        let (from, to) = if i % 2 == 0 {
            (2500, 16000)
        } else {
            (16000, 2500)
        };
        sim.event(&speed(from, to), at, 0.0, 0.0);
    }
    sim.quiet(&[&a], 5);
    assert_eq!(
        sim.value(
            views::HOST_EVENTS,
            &[("host", "pve1"), ("event", "link_power_managed")]
        ),
        Some(300.0)
    );
    let evs = sim.c.recent_events();
    let kinds: Vec<(&str, u64)> = evs.iter().map(|e| (e.event, e.count)).collect();
    // 120 s of changes: an entry from 6 s (the first minute's), one from 66.4 s; the older
    // one went, not the older AER entry (a kind listed twice is what went before)
    assert_eq!(kinds.len(), 3, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| k.0 == "aer_correctable").count(), 2);
    assert_eq!(kinds[0].0, "link_power_managed", "{kinds:?}");
    assert!((140..=160).contains(&kinds[0].1), "{kinds:?}");
}

/// The smallest pods that matter reach every signal's minimum count: one connection busy 1.5%
/// of each second (15 busy ms: 15 RTT observations), one thread woken 12 times a second, one
/// GPU process synchronising 6 times a second. Their spikes join the link event; with one
/// observation fewer than the minimum, windows are not tested and nothing joins.
#[test]
fn the_spikes_of_a_pod_with_one_busy_connection_thread_or_gpu_process_join() {
    let cases = [
        ("tcp_rtt", 15, 2000.0, 10_000.0),
        ("run_queue_wait", 12, 40.0, 900.0),
        ("gpu_sync_wait", 6, 3000.0, 15_000.0),
    ];
    for (signal, small, quiet, hot) in cases {
        let min = Config::default().signals[signal].min_count(1.0);
        assert!(small >= min, "{signal}: {small} < {min}");
        for (count, joins) in [(small, true), (min - 1, false)] {
            let p = pod("srv-0");
            let mut sim = Sim::new();
            sim.count = count;
            let noisy = |t: i64| quiet * (1.0 + 0.02 * (t % 5) as f64);
            for t in 0..30 {
                sim.tick(&[(&p, signal, Some(noisy(t)))]);
            }
            sim.event(&degraded(), 30.5, 0.0, 0.0);
            for _ in 0..6 {
                sim.tick(&[(&p, signal, Some(hot))]);
            }
            for t in 0..20 {
                sim.tick(&[(&p, signal, Some(noisy(t)))]);
            }
            let joined = sim.value(
                views::CORRELATED_SPIKES,
                &[
                    ("event", "link_degraded"),
                    ("signal", signal),
                    ("namespace", "ml"),
                    ("pod", "srv-0"),
                ],
            );
            assert_eq!(
                joined,
                joins.then_some(1.0),
                "{signal} with {count} observations a window"
            );
        }
    }
}

/// The GPU's side of a link event: pod A's GPU moves 8 GB/s over its link, pod B's 3 GB/s
/// over another. The link of A's GPU loses lanes at T0+30.5 s and A's throughput falls to a
/// quarter for five windows; B's stays. A's dip is a spike of `gpu_link_throughput` joined to
/// the degradation, its impact the dip's depth (0.25); B shows the absence of one.
#[test]
fn a_link_degradation_joins_the_throughput_dip_it_caused() {
    const LINK: &str = "gpu_link_throughput";
    let (a, b) = (pod("vllm-0"), pod("vllm-1"));
    let mut sim = Sim::new();
    sim.count = 1; // one reading a tick, as the nvml unit gives
    let tick = |sim: &mut Sim, a_bps: f64| {
        let wobble = 1.0 + 0.01 * (sim.t % 3) as f64;
        sim.tick(&[
            (&a, LINK, Some(a_bps * wobble)),
            (&b, LINK, Some(3e9 * wobble)),
        ]);
    };
    for _ in 0..30 {
        tick(&mut sim, 8e9);
    }
    sim.event(&degraded(), 30.5, 0.0, 0.0);
    for _ in 0..5 {
        tick(&mut sim, 2e9);
    }
    for _ in 0..10 {
        tick(&mut sim, 8e9);
    }
    let of = |name: &str, p: &str| {
        sim.value(
            name,
            &[
                ("event", "link_degraded"),
                ("signal", LINK),
                ("namespace", "ml"),
                ("pod", p),
            ],
        )
    };
    assert_eq!(of(views::CORRELATED_SPIKES, "vllm-0"), Some(1.0));
    assert_eq!(of(views::CORRELATED_SPIKES, "vllm-1"), None);
    let spikes = |p: &str| {
        sim.value(
            views::LATENCY_SPIKES,
            &[("signal", LINK), ("namespace", "ml"), ("pod", p)],
        )
    };
    assert_eq!((spikes("vllm-0"), spikes("vllm-1")), (Some(1.0), None));
    // the lowest window (2 GB/s × 1.00..1.02) against the quiet median of 8 GB/s × 1.01
    let impact = of(views::EVENT_IMPACT, "vllm-0").expect("an impact");
    assert!((impact - 2.0 / 8.08).abs() < 0.005, "{impact}");
    let ev = &sim.c.recent_events()[0];
    assert_eq!(ev.event, "link_degraded");
    let hit: Vec<_> = ev.affected.iter().map(|h| h.pod.as_str()).collect();
    assert_eq!(hit, ["vllm-0"]);
}
