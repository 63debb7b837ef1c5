//! The join in the running agent: the pods' signal windows and the hub's host events go into
//! the correlator and the incident page's timeline; its series go to /metrics and its views to
//! `/events`, `/api/state` and the page at `/` (served by [`crate::web`]).
//!
//! One owner ([`JoinOwner`]) holds all of it and is fed by one channel of [`Input`]s: a tick's
//! report (which the tick thread hands over by value: the join holds no lock of the
//! collector's), a host event, the page's question for an older picture. Its driver
//! ([`Join`]) publishes the owner's answers after each batch of inputs, so a scrape and the
//! page read those and never wait for the correlator. [`merge`] turns the collector's windows
//! into one per (pod, signal).

mod driver;
pub mod feed_stall;
pub mod merge;
mod owner;

pub use driver::{Answers, Busy, Join, JoinSeries, BATCH, QUEUE, STATE_EVERY};
pub use feed_stall::{Causes, FeedStallShare};
pub use owner::{Input, JoinOwner, Settings};

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use gpufeed_shared::event::LinkChangeClass;
    use rustc_hash::FxHashSet;

    use super::*;
    use crate::collect::{Owner, TickReport};
    use crate::correlate::events::tests::link;
    use crate::hub::{Delivery, ReceivedEvent};
    use crate::pods::PodStore;
    use crate::probes::signal::{SignalWindow, WindowValue};
    use prometheus::core::Collector;

    fn event(seq: u64) -> ReceivedEvent {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64;
        ReceivedEvent {
            host: "pve1".into(),
            boot_id: 1,
            seq,
            kind: 0,
            host_realtime_ns: now,
            host_monotonic_ns: seq,
            received_realtime_ns: now,
            clock_offset_ns: Some(0),
            event: link(
                LinkChangeClass::WidthReduction,
                (Some(16), 4),
                (Some(16), 1),
            ),
        }
    }

    fn report(uid: &str) -> TickReport {
        TickReport {
            windows: vec![SignalWindow {
                owner: Owner::Pod {
                    uid: uid.into(),
                    container_id: Some("c1".into()),
                },
                signal: "run_queue_wait",
                at: Instant::now(),
                window: Duration::from_secs(1),
                value: WindowValue::Latency {
                    count: 3,
                    sum_us: 30.0,
                    p50_us: 10.0,
                    p99_us: 10.0,
                    max_us: 10.0,
                },
            }],
            live: std::sync::Arc::new(FxHashSet::from_iter([std::sync::Arc::from(uid)])),
            ..TickReport::default()
        }
    }

    fn host_events(join: &Join) -> f64 {
        join.series()
            .collect()
            .iter()
            .filter(|f| f.name() == crate::correlate::views::HOST_EVENTS)
            .flat_map(|f| f.get_metric().iter().map(|m| m.get_counter().get_value()))
            .sum()
    }

    /// While the join's owner is busy (held), the scrape's series, `/events` and the page's
    /// state answer at once from what it published; the inputs sent meanwhile wait in its
    /// queue and are all joined once it is free, a host event within one batch.
    #[test]
    fn the_page_and_the_scrape_do_not_wait_for_the_join() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let join = Join::start(Settings::default(), PodStore::default()).unwrap();
        // the page asked once: the join renders its state from then on
        let first = Instant::now();
        assert!(rt.block_on(join.page_state()).timelines.is_empty());
        assert!(first.elapsed() <= STATE_EVERY * 2, "{:?}", first.elapsed());
        let (release, held) = std::sync::mpsc::channel::<()>();
        join.tx_for_tests().send(Input::Hold(held)).unwrap();
        join.tick(report("u1"));
        for seq in 1..=3 {
            join.tx_for_tests()
                .send(Input::Host(Box::new(Delivery::Event(event(seq)))))
                .unwrap();
        }
        let asked = Instant::now();
        for _ in 0..20 {
            assert!(join.answers().events.is_empty());
            assert_eq!(host_events(&join), 0.0);
            let state = rt.block_on(join.page_state());
            assert!(state.timelines.is_empty());
        }
        assert!(
            asked.elapsed() < Duration::from_millis(500),
            "20 reads of each answer took {:?} with the join held",
            asked.elapsed()
        );
        let freed = Instant::now();
        drop(release);
        while host_events(&join) < 3.0 {
            assert!(
                freed.elapsed() < BATCH * 10,
                "the queued host events were not joined"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            join.answers().events.len(),
            1,
            "one burst of one kind listed once"
        );
        assert_eq!(join.answers().events[0].count, 3);
    }

    /// The owner splits each pod's feed stall from the tick's raw account and the page leads
    /// with it, the most stalled pod first, named by the pod store (by UID until then); the
    /// scrape's share has the same totals.
    #[test]
    fn the_page_leads_with_each_pods_feed_stall_by_cause() {
        use crate::collect::FeedRaw;
        let settings = Settings::default();
        let share = settings.feed_stall.clone();
        let pods = PodStore::default();
        let mut owner = JoinOwner::new(settings, pods.clone());
        let raw = |cpu: u64, all: u64| FeedRaw {
            cpu_ns: cpu,
            all_ns: all,
            ..FeedRaw::default()
        };
        let tick = |uids: &[(&str, FeedRaw)]| TickReport {
            live: std::sync::Arc::new(uids.iter().map(|(u, _)| std::sync::Arc::from(*u)).collect()),
            feed: uids.iter().map(|(u, f)| (u.to_string(), *f)).collect(),
            ..TickReport::default()
        };
        pods.upsert(crate::pods::PodMeta::named("u2", "ml", "vllm-0"));
        let report = tick(&[
            ("u1", raw(1_000_000_000, 1_500_000_000)),
            ("u2", raw(500_000_000, 3_000_000_000)),
        ]);
        owner.tick(&report, Instant::now(), 1_000_000_000);
        let page = owner.page_state(1_000_000_000).feed_stall;
        assert_eq!(page.len(), 2);
        assert_eq!(
            (page[0].namespace.as_str(), page[0].pod.as_str()),
            ("ml", "vllm-0")
        );
        assert_eq!(page[0].seconds, 3.0);
        assert_eq!(page[0].causes[0], ("unexplained".to_string(), 2.5));
        assert_eq!(page[0].causes[1], ("cpu".to_string(), 0.5));
        assert_eq!(
            (page[1].namespace.as_str(), page[1].pod.as_str()),
            ("", "u1")
        );
        assert_eq!(page[1].seconds, 1.5);
        assert_eq!(share.snapshot()["u2"].total(), 3_000_000_000);
    }

    /// The owner alone (as the benchmark drives it): a tick's window reaches the merge, and a
    /// pod the collector no longer has leaves it.
    #[test]
    fn the_owner_merges_a_tick_and_forgets_gone_pods() {
        let mut owner = JoinOwner::new(Settings::default(), PodStore::default());
        owner.tick(&report("u1"), Instant::now(), 1_000_000_000);
        assert_eq!(owner.pods_merged(), 1);
        owner.tick(&TickReport::default(), Instant::now(), 2_000_000_000);
        assert_eq!(owner.pods_merged(), 0);
    }
}
