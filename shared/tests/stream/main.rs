//! The stream library's behaviour, in one test binary (a change relinks this one, not one per
//! file): the whole stream in memory on both sans-IO cores (`sim`), the frame decoder on
//! random and mutated input (`frames_random`), the real hub against hostile frames from an
//! authenticated host over QUIC (`frames`), and the real stream client against the real hub
//! over loopback: delivery, acks and spool overflow (`e2e`), the clock offset estimate
//! (`clock`), TLS admission and reload (`tls`).
//!
//! Four stream tests are binaries of their own, each for the reason at its top:
//! `stream_faults` (its host restarts can cut a frame and so log the truncation warnings whose
//! number `frames` checks in the same log capture), `stream_flood` (it measures its process's
//! memory), `stream_reconnect` and `stream_restart` (this binary's tests re-executed as the
//! guest's and the host's processes). What needs the host agent (its binary, its
//! configuration, its certificate bundles, its routing of the event bus, its series as host
//! state) stays in `host-agent/tests/stream/`. Both use the same fixtures, the test kit's
//! `stream` module (`gpufeed_testkit::stream`).

mod clock;
mod e2e;
mod frames;
mod frames_random;
mod sim;
mod tls;
