//! The GPU half: driver and CUDA probes, NVML, FinOps and the GPU check, with the stand-in libcuda and NVML.
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

#[path = "../common/mod.rs"]
mod common;
#[path = "../manifests/mod.rs"]
mod manifests;

mod container_kernel;
mod finops_kernel;
mod gpu_check_script;
mod gpu_kernel;
mod nvml_kernel;
