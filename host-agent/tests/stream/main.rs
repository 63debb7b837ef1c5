//! The host agent's own parts of the stream, with the real agent code: its binary, the
//! certificate bundles of its `certs` command, its `--check-config`, and its series sent to a
//! guest as host state. The stream library's behaviour (delivery, spool, faults, floods,
//! restarts, TLS admission, the clock) is tested in `shared/tests/stream*`, whose fixtures
//! these tests share (`gpufeed_testkit::stream`).
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

mod stream_binary;
mod stream_certs;
mod stream_check_config;
mod stream_host_state;
