//! gpufeed-guest as a library: the probes, the tick that reads them, the pod
//! store, the exporter and the hub. The binary (`main.rs`) is the command line
//! and start-up around it; tests and benchmarks use these modules directly.

pub mod bandwidth;
pub mod certs;
pub mod cgroups;
pub mod collect;
pub mod correlate;
pub mod doctor;
pub mod dst;
pub mod ebpf;
pub mod exporter;
pub mod families;
pub mod finops;
pub mod host_stream;
pub mod hub;
pub mod ifaces;
pub mod incident;
pub mod join;
pub mod netlink;
pub mod nvml;
pub mod owner;
pub mod pods;
pub mod privileges;
pub mod probes;
pub mod readiness;
pub mod selftest;
pub mod tick_loop;
pub mod web;
