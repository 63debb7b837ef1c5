//! What a real Prometheus (and the pages and receivers beside it) makes of the agent: dashboards, alerts, KEDA's query, the join end to end, the incident page, OTLP.
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

#[path = "../common/mod.rs"]
mod common;
#[path = "../manifests/mod.rs"]
mod manifests;

mod dashboards_prometheus;
mod finops_prometheus;
mod fleet_prometheus;
mod incident_page;
mod join_e2e;
mod keda_prometheus;
mod otlp_push;
mod podmonitor_operator;
mod prometheus_kernel;
