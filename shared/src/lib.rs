//! Code shared by `gpufeed-host` and `gpufeed-guest`: the wire protocol (sans-IO),
//! the host event types, configuration types and TLS helpers.
pub mod clock;
pub mod event;
pub mod proto;
pub mod tls;
