//! Clock offset estimation against a known skew: the host stream runs with a reference clock
//! shifted by `SKEW_NS` (the production clock is the host's realtime as is); the hub's
//! `gpufeed_clock_offset_seconds{host}` must come within 1 ms of it, and the lag (which corrects
//! host timestamps with that offset) stays small.

use std::sync::Arc;
use std::time::Duration;

use gpufeed_shared::clock;
use gpufeed_shared::event::{HostEvent, Stamped};
use gpufeed_shared::stream::client;
use gpufeed_testkit::stream::*;

const SKEW_NS: i64 = -250_001_234;

/// The host's realtime, shifted.
#[derive(Debug)]
struct Skewed(i64);

impl clock::ReferenceClock for Skewed {
    fn report(&self, realtime_ns: i64) -> i64 {
        realtime_ns + self.0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_host_clock_is_estimated_within_1ms() {
    let fx = Fixture::new(&["pve1"]);
    let greg = prometheus::Registry::new();
    let hub = hub::serve(hub_config(fx.path()), &greg).await.unwrap();
    let hreg = prometheus::Registry::new();
    let h = client::start(
        fx.stream_config("pve1", hub.local_addr(), None),
        "pve1".into(),
        &hreg,
        Arc::new(Skewed(SKEW_NS)),
        None,
        None,
    )
    .unwrap();
    let offset = || metric(&greg, "gpufeed_clock_offset_seconds", &[("host", "pve1")]);
    // The initial burst is 8 probes 10 ms apart.
    assert!(wait_for(Duration::from_secs(5), || offset() != 0.0).await);
    tokio::time::sleep(Duration::from_millis(120)).await;
    let est_ns = hub.clock_offset_ns("pve1").unwrap();
    let err = (est_ns - SKEW_NS).abs();
    assert!(
        err < 1_000_000,
        "estimate {est_ns} ns vs skew {SKEW_NS} ns: error {err} ns"
    );
    eprintln!("clock: skew {SKEW_NS} ns, estimate {est_ns} ns, error {err} ns");
    assert!(
        (offset() - SKEW_NS as f64 / 1e9).abs() < 1e-3,
        "{}",
        offset()
    );
    let rtt = metric(
        &greg,
        "gpufeed_clock_round_trip_seconds",
        &[("host", "pve1")],
    );
    assert!(rtt > 0.0 && rtt < 0.01, "rtt {rtt}");

    // Events carry the skewed host time; mapped back to guest time they are close to receipt.
    h.push(&[Stamped {
        realtime_ns: clock::realtime_ns(),
        monotonic_ns: clock::monotonic_ns(),
        event: HostEvent::KmsgLost { count: 1 },
    }]);
    assert!(wait_for(Duration::from_secs(5), || !hub.recent().is_empty()).await);
    let e = &hub.recent()[0];
    assert!((e.host_realtime_ns - e.received_realtime_ns - SKEW_NS).abs() < 50_000_000);
    let guest_err = (e.guest_realtime_ns() - e.received_realtime_ns).abs();
    assert!(guest_err < 50_000_000, "mapped time off by {guest_err} ns");
    let lag = metric(&greg, "gpufeed_stream_lag_seconds", &[("host", "pve1")]);
    assert!((0.0..0.05).contains(&lag), "lag {lag}");
    h.shutdown().await;
    hub.shutdown().await;
}
