//! The guest binary's own surfaces without probes: its stream hub, readiness, VM binding, FinOps settings and the Kubernetes watch.
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

#[path = "../common/mod.rs"]
mod common;

mod finops_cli;
mod kube_watch;
mod stream_guest_binary;
mod stream_readiness;
mod stream_vm_binding;
