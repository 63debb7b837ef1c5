//! The host agent as a service: its doctor, logging, systemd unit and watchdog, the Debian package, OTLP push and a flood on its HTTP listener.
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

#[path = "../common/mod.rs"]
mod common;

mod doctor;
mod http_flood;
mod logging;
mod otlp_push;
mod packaging;
mod unit_hardening;
mod watchdog;
