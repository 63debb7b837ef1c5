//! The hub: the guest end of the host → guest event stream (`--quic-listen`, `--tls-dir`). It
//! lives in the stream library, [`gpufeed_shared::stream::hub`], next to the host end, which
//! documents it (its metrics: `gpufeed_stream_connected{host}`,
//! `gpufeed_stream_events_received_total{host}`, `gpufeed_stream_events_duplicate_total{host}`,
//! `gpufeed_stream_events_lost_total{host}`, `gpufeed_stream_lag_seconds{host}`,
//! `gpufeed_stream_frames_rejected_total{host,reason}`, `gpufeed_clock_offset_seconds{host}`,
//! `gpufeed_clock_round_trip_seconds{host}`, `gpufeed_clock_kvm_ptp_offset_seconds`).

pub use gpufeed_shared::stream::hub::*;
