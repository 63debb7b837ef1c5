//! Code shared by `gpufeed-host` and `gpufeed-guest`: the wire protocol (sans-IO),
//! the host event types, configuration types, TLS helpers and the doctor's common checks;
//! with the `stream` feature, the QUIC drivers of both ends of the event stream ([`stream`]);
//! with the `cli` feature, the `certs` subcommand both agents offer; with the `http` feature,
//! the bounded HTTP listener both agents serve on ([`http`]); with the `otlp` feature, the
//! OTLP metrics push both agents offer ([`otlp`]); with the `bench` feature, what a
//! process costs, for the benchmarks ([`procstat`]).
#[cfg(feature = "stream")]
pub mod admission;
#[cfg(feature = "cli")]
pub mod certs;
pub mod clock;
pub mod doctor;
pub mod event;
pub mod exposition;
pub mod hoststate;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "otlp")]
pub mod otlp;
#[cfg(any(test, feature = "bench"))]
pub mod procstat;
pub mod proto;
pub mod ratelog;
pub mod smbios;
#[cfg(feature = "stream")]
pub mod stream;
pub mod tls;
