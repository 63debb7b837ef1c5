//! The shipped deployment objects as their consumers read them (kubectl kustomize, Helm, Talos, the scripts), and the crates' module graph.
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

#[path = "../manifests/mod.rs"]
mod manifests;

mod dashboards_export;
mod helm_chart;
mod keda_kustomize;
mod kustomize;
mod module_graph;
mod scripts_root;
mod talos_manifests;
