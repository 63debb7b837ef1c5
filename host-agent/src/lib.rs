//! gpufeed host agent (library part; the binary is `src/main.rs`).
//!
//! Everything the agent observes leaves through one [`events::EventBus`]; the host→guest stream
//! subscribes to it. Watchers are units in [`watch`] (one file each: configuration section,
//! series, core and loop), started from the registry [`watch::UNITS`] by [`agent::Agent`];
//! discovery of passed-through devices is in [`discovery`]; the kernel-format parsers
//! ([`sysfs`], [`kmsg`], [`uevent`], [`tracefs`], [`rtnetlink`], [`portname`]) import no
//! watcher. All file system roots go through [`roots::Roots`] so tests run against recorded
//! trees. docs/host-architecture.md draws the whole.

pub mod agent;
pub mod attrs;
pub mod config;
pub mod discovery;
pub mod doctor;
pub mod events;
pub mod fuzzing;
pub mod heartbeat;
pub mod kmsg;
pub mod logging;
pub mod metrics;
pub mod otlp;
pub mod portname;
pub mod roots;
pub mod rtnetlink;
pub mod stream;
pub mod sysfs;
pub mod ticks;
pub mod tracefs;
pub mod uevent;
pub mod watch;
