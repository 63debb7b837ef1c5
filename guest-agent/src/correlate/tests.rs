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
}

impl Sim {
    fn new() -> Self {
        Sim {
            c: Correlator::new(Config::default()),
            t: 1,
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
            .map(|(p, signal, v)| SignalWindow {
                pod: (*p).clone(),
                signal: signal.to_string(),
                at: now,
                count: 100,
                sum: 0.0,
                p50: 0.0,
                p99: v.unwrap_or(if *signal == "run_queue_wait" {
                    40.0 + (self.t % 5) as f64
                } else {
                    0.0
                }),
                max: 0.0,
            })
            .collect();
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
        export::LATENCY_SPIKES,
        &[
            ("signal", "run_queue_wait"),
            ("namespace", "ml"),
            ("pod", p),
        ],
    )
}

fn correlated(sim: &Sim, event: &str, p: &str) -> Option<f64> {
    sim.value(
        export::CORRELATED_SPIKES,
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
            export::HOST_EVENTS,
            &[("host", "pve1"), ("event", "link_degraded")]
        ),
        Some(1.0)
    );
    // Baseline median of 40..44 is 42; every window of the episode was 900.
    let impact = sim.value(
        export::EVENT_IMPACT,
        &[
            ("event", "link_degraded"),
            ("signal", "run_queue_wait"),
            ("namespace", "ml"),
            ("pod", "vllm-0"),
        ],
    );
    assert_eq!(impact, Some(900.0 / 42.0));
    assert_eq!(
        sim.value(export::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
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
        sim.value(export::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
        Some(0.0)
    );
    // The host was disconnected; its spool delivers the event now, 16 s late.
    sim.event(&degraded(), 30.5, 0.0, 0.0);
    assert_eq!(correlated(&sim, "link_degraded", "vllm-0"), Some(1.0));
    assert!(sim.c.unexplained_spikes(sim.now()).is_empty());
    assert_eq!(
        sim.value(export::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
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
        sim.value(export::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
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
    let host = |e| sim.value(export::HOST_EVENTS, &[("host", "pve1"), ("event", e)]);
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
        sim.value(export::SPIKE_EXPLAINED, &[("signal", "run_queue_wait")]),
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
        .find(|f| f.name() == export::LATENCY_SPIKES)
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
        export::CORRELATED_SPIKES,
        export::EVENT_IMPACT,
        export::LATENCY_SPIKES,
    ] {
        let f = fams.iter().find(|f| f.name() == name).unwrap();
        assert!(f.get_metric().is_empty(), "{name}");
    }
    assert_eq!(
        value(
            &fams,
            export::HOST_EVENTS,
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
    let host = |e| sim.value(export::HOST_EVENTS, &[("host", "pve1"), ("event", e)]);
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
        t: 1,
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
            export::LATENCY_SPIKES,
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
