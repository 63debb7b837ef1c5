//! The host's end of the stream with the real agent code: its binary, certificates, config check, clock alignment, end to end, host-state series and TLS. (Fault, flood and restart tests have binaries of their own: a log capture, their own process's memory, a child re-exec.)
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

#[path = "../stream_support/mod.rs"]
mod stream_support;

mod stream_binary;
mod stream_certs;
mod stream_check_config;
mod stream_clock;
mod stream_e2e;
mod stream_host_state;
mod stream_tls;
