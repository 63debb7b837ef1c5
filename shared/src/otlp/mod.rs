//! OTLP metrics push, beside the Prometheus endpoint, for both agents.
//!
//! The source is the very text the agent's `/metrics` serves: each export renders it, parses it
//! ([`crate::exposition::parse_text`]) and turns every family into an OTLP metric of the same name with the same
//! labels ([`to_request`]), so that what a receiver stores has the names and labels a scrape
//! stores, by construction:
//!
//! * a counter is a cumulative monotonic `Sum` named as the counter, `_total` included (a
//!   receiver that appends `_total` to monotonic sums, as Prometheus 2.x does, finds it there
//!   and does not double it); a counter whose name lacks `_total` would get one appended, so
//!   it goes as a cumulative non-monotonic `Sum` and keeps its name (none of ours);
//! * a gauge (and an untyped series) is a `Gauge`;
//! * a histogram is an explicit-bounds `Histogram`, cumulative: its `le` bounds (less `+Inf`)
//!   are the explicit bounds, the bucket counts the differences of the cumulative ones, with
//!   its `_count` and `_sum`;
//! * a summary is a `Summary` with its quantiles, `_count` and `_sum`;
//! * the unit is left empty (a unit would add a suffix to the name) and the description is
//!   the family's `HELP`.
//!
//! One task exports on its own interval, with at most one request in flight and a timeout:
//! an export that fails, is refused or times out is dropped (the next one carries the
//! cumulative values again), counted in `<prefix>_otlp_exports_total{result}` and logged when
//! the state changes, never per attempt. The scrape never waits for it.
//!
//! `docs/metrics.md` ("OTLP push") documents the mapping as a receiver sees it.
//!
//! Layout: [`config`] (what to push where, from flags or a config file), [`request`] (a
//! parsed page as an OTLP request), [`export`] (the task that pushes, and its counter).

mod config;
mod export;
mod request;

pub use config::{
    default_timeout, hostname, merge_resource, parse_duration, parse_key_value, OtlpArgs,
    OtlpConfig, DEFAULT_INTERVAL, DEFAULT_TIMEOUT, MIN_INTERVAL,
};
pub use export::{spawn, OtlpMetrics, Outcome};
pub use request::to_request;
