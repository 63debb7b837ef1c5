//! The host stream's series (listed in [`crate::stream::client`]'s docs): registered once
//! ([`Metrics`]), and the handles of one guest's ([`GuestMetrics`]).

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

pub(super) struct Metrics {
    pub(super) connected: IntGaugeVec,
    pub(super) spooled: IntCounterVec,
    pub(super) sent: IntCounterVec,
    pub(super) dropped: IntCounterVec,
    pub(super) spool_events: IntGaugeVec,
    pub(super) spool_disk: IntGaugeVec,
    pub(super) acked: IntGaugeVec,
    pub(super) connects: IntCounterVec,
    pub(super) lagged: IntCounter,
}

impl Metrics {
    pub(super) fn new(r: &Registry) -> Result<Self, prometheus::Error> {
        let g = |n: &str, h: &str| IntGaugeVec::new(Opts::new(n, h), &["guest"]);
        let c = |n: &str, h: &str| IntCounterVec::new(Opts::new(n, h), &["guest"]);
        let m = Metrics {
            connected: g(
                "gpufeed_host_stream_connected",
                "1 while the stream to the guest is established",
            )?,
            spooled: c(
                "gpufeed_host_stream_events_spooled_total",
                "Events put into the guest's spool",
            )?,
            sent: c(
                "gpufeed_host_stream_events_sent_total",
                "Event frames written to the guest (retransmissions included)",
            )?,
            dropped: c(
                "gpufeed_host_stream_events_dropped_total",
                "Events the full spool dropped (oldest first) before the guest had them",
            )?,
            spool_events: g(
                "gpufeed_host_stream_spool_events",
                "Events in the spool not yet acknowledged",
            )?,
            spool_disk: g(
                "gpufeed_host_stream_spool_disk_bytes",
                "Bytes of spool segment files",
            )?,
            acked: g(
                "gpufeed_host_stream_acked_seq",
                "Highest sequence number the guest acknowledged",
            )?,
            connects: IntCounterVec::new(
                Opts::new(
                    "gpufeed_host_stream_connects_total",
                    "Connection attempts by result (ok, error, rejected by the guest, unbound: the guest's VM identity binds it to none of this host's VMs)",
                ),
                &["guest", "result"],
            )?,
            lagged: IntCounter::new(
                "gpufeed_host_stream_bus_lagged_total",
                "Events the stream missed because it fell behind the agent's event bus",
            )?,
        };
        r.register(Box::new(m.connected.clone()))?;
        r.register(Box::new(m.spooled.clone()))?;
        r.register(Box::new(m.sent.clone()))?;
        r.register(Box::new(m.dropped.clone()))?;
        r.register(Box::new(m.spool_events.clone()))?;
        r.register(Box::new(m.spool_disk.clone()))?;
        r.register(Box::new(m.acked.clone()))?;
        r.register(Box::new(m.connects.clone()))?;
        r.register(Box::new(m.lagged.clone()))?;
        Ok(m)
    }
}

/// Per-guest metric handles.
pub(super) struct GuestMetrics {
    pub(super) connected: IntGauge,
    pub(super) spooled: IntCounter,
    pub(super) sent: IntCounter,
    pub(super) dropped: IntCounter,
    pub(super) spool_events: IntGauge,
    pub(super) spool_disk: IntGauge,
    pub(super) acked: IntGauge,
    pub(super) connects_ok: IntCounter,
    pub(super) connects_err: IntCounter,
    pub(super) connects_rejected: IntCounter,
    pub(super) connects_unbound: IntCounter,
}
