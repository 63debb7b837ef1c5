//! The probes on the real kernel, each against the kernel's own accounting, and the agent's command line, doctor and signals around them.
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

#[path = "../common/mod.rs"]
mod common;
#[path = "../manifests/mod.rs"]
mod manifests;

mod churn_kernel;
mod cli;
mod doctor_kernel;
mod guest_truth;
mod http_slow_clients;
mod ifaces_kernel;
mod kube_names_kernel;
mod probe_failures_kernel;
mod probes_kernel;
mod selftest_kernel;
mod signals_kernel;
mod tc_kernel;
