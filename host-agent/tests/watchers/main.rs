//! The watchers on recorded trees and the real kernel: PCIe links, discovery of VMs, the bridge, kmsg, uevents and tracefs, each against the truth the test provoked.
//!
//! One test binary for these files, so that a change relinks one binary, not one per file.

#[path = "../common/mod.rs"]
mod common;

mod bridge_netns;
mod discovery_vm;
mod host_truth;
mod kmsg_parse;
mod sysfs_watch;
mod tracefs_decode;
mod uevent_kernel;
