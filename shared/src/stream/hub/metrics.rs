//! The hub's series (listed in the [module docs](super), and these three:
//! `gpufeed_stream_events_possible_duplicate_total{host}`, events delivered (or losses
//! counted) of a sequence space the guest could not tell from one it forgot;
//! `gpufeed_stream_journal_damaged_records_total`, records of the event journal found damaged
//! when it was opened; `gpufeed_stream_vm_unbound_total{host}`, connections the host ended
//! because it could not bind this guest to one of its VMs). The KVM PTP gauge is registered by
//! [`super::serve`] only where the clock exists.

use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};

pub(super) struct Metrics {
    pub(super) connected: IntGaugeVec,
    pub(super) received: IntCounterVec,
    pub(super) duplicate: IntCounterVec,
    pub(super) lost: IntCounterVec,
    pub(super) possible_duplicate: IntCounterVec,
    pub(super) journal_damaged: IntCounter,
    pub(super) lag: GaugeVec,
    pub(super) rejected: IntCounterVec,
    pub(super) unbound: IntCounterVec,
    pub(super) offset: GaugeVec,
    pub(super) rtt: GaugeVec,
    pub(super) ptp: Gauge,
}

impl Metrics {
    pub(super) fn new(r: &Registry) -> Result<Self, prometheus::Error> {
        let h = &["host"];
        let m = Metrics {
            connected: IntGaugeVec::new(
                Opts::new(
                    "gpufeed_stream_connected",
                    "Established streams from the host",
                ),
                h,
            )?,
            received: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_events_received_total",
                    "Host events received (after de-duplication)",
                ),
                h,
            )?,
            duplicate: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_events_duplicate_total",
                    "Retransmitted host events dropped by de-duplication",
                ),
                h,
            )?,
            lost: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_events_lost_total",
                    "Host events lost before reaching the guest: reported lost by the host's spool, or missing without a report (the count of events lost per host)",
                ),
                h,
            )?,
            possible_duplicate: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_events_possible_duplicate_total",
                    "Host events delivered (or counted lost) that may have been accounted before: their sequence space is one the guest cannot tell from one it forgot",
                ),
                h,
            )?,
            journal_damaged: IntCounter::new(
                "gpufeed_stream_journal_damaged_records_total",
                "Records of the event journal found damaged (skipped, or torn off the end) when it was opened",
            )?,
            lag: GaugeVec::new(
                Opts::new(
                    "gpufeed_stream_lag_seconds",
                    "Time from emission on the host to receipt by the hub, of the latest event",
                ),
                h,
            )?,
            rejected: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_frames_rejected_total",
                    "Rejected connections, frames and skipped events, by reason",
                ),
                &["host", "reason"],
            )?,
            unbound: IntCounterVec::new(
                Opts::new(
                    "gpufeed_stream_vm_unbound_total",
                    "Connections the host ended because this guest's VM identity binds it to none of the host's VMs",
                ),
                h,
            )?,
            offset: GaugeVec::new(
                Opts::new(
                    "gpufeed_clock_offset_seconds",
                    "Host realtime minus guest realtime, estimated from clock probes",
                ),
                h,
            )?,
            rtt: GaugeVec::new(
                Opts::new(
                    "gpufeed_clock_round_trip_seconds",
                    "Round trip of the clock probes used for the offset estimate",
                ),
                h,
            )?,
            ptp: Gauge::new(
                "gpufeed_clock_kvm_ptp_offset_seconds",
                "Hypervisor realtime (KVM virtual PTP) minus guest realtime",
            )?,
        };
        r.register(Box::new(m.connected.clone()))?;
        r.register(Box::new(m.received.clone()))?;
        r.register(Box::new(m.duplicate.clone()))?;
        r.register(Box::new(m.lost.clone()))?;
        r.register(Box::new(m.possible_duplicate.clone()))?;
        r.register(Box::new(m.journal_damaged.clone()))?;
        r.register(Box::new(m.lag.clone()))?;
        r.register(Box::new(m.rejected.clone()))?;
        r.register(Box::new(m.unbound.clone()))?;
        r.register(Box::new(m.offset.clone()))?;
        r.register(Box::new(m.rtt.clone()))?;
        Ok(m)
    }
}
