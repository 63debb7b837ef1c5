//! Code shared by `gpufeed-host` and `gpufeed-guest`: the wire protocol (sans-IO),
//! the host event types, configuration types, TLS helpers and the doctor's common checks; with the `stream`
//! feature, the QUIC drivers of both ends of the event stream ([`stream`]).
pub mod clock;
pub mod doctor;
pub mod event;
pub mod hoststate;
pub mod proto;
#[cfg(feature = "stream")]
pub mod stream;
pub mod tls;
