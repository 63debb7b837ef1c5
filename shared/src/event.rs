//! Typed events emitted by the host agent (`gpufeed-host`) and carried to the guest hub.
//!
//! On the wire an event travels as `(kind, postcard payload)`: [`HostEvent::kind`] gives a
//! stable numeric id per variant so that a peer that does not know a kind can skip the payload
//! and count it. **Never renumber or reuse a kind id**; add new variants with new ids and add
//! new fields only inside new variants (postcard is not self-describing).
//!
//! All types own their data (no borrows) and serialize with serde/postcard.

use serde::{Deserialize, Serialize};

/// An event with the host timestamps taken when it was emitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stamped {
    /// `CLOCK_REALTIME` in nanoseconds since the Unix epoch.
    pub realtime_ns: i64,
    /// `CLOCK_MONOTONIC` of the host in nanoseconds.
    pub monotonic_ns: u64,
    pub event: HostEvent,
}

/// Stable kind ids (wire contract).
pub mod kind {
    pub const PCIE_LINK_CHANGE: u16 = 1;
    pub const AER_COUNTER: u16 = 2;
    pub const AER_ROOT_PORT_TOTAL: u16 = 3;
    pub const AER_TRACE: u16 = 4;
    pub const PCI_ERROR_RECOVERY: u16 = 5;
    pub const PCI_HOTPLUG: u16 = 6;
    pub const THUNDERBOLT_DEVICE: u16 = 7;
    pub const THUNDERBOLT_TUNNEL: u16 = 8;
    pub const KMSG: u16 = 9;
    pub const KMSG_LOST: u16 = 10;
    pub const VM_STATE: u16 = 11;
    pub const BRIDGE_PORT: u16 = 12;
    pub const DEVICE_MAPPED: u16 = 13;
    pub const WATCHER_DISABLED: u16 = 14;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum HostEvent {
    /// Current speed and/or width of a PCIe link changed.
    PcieLinkChange(PcieLinkChange),
    /// A named AER counter of a device increased.
    AerCounter(AerCounter),
    /// `aer_rootport_total_err_*` of a root port / RCEC increased.
    AerRootPortTotal(AerRootPortTotal),
    /// A `ras:aer_event` tracepoint record for which no counter moved (e.g. no OS AER ownership).
    AerTrace(AerDetail),
    /// PCI error recovery uevent (`ERROR_EVENT=`), uncorrectable errors only.
    PciErrorRecovery(PciErrorRecovery),
    /// `pci:pci_hp_event` tracepoint record (kernels with the tracepoint).
    PciHotplug(PciHotplug),
    /// A Thunderbolt/USB4 router appeared, disappeared or changed its link.
    ThunderboltDevice(ThunderboltDevice),
    /// A Thunderbolt tunnel uevent (`TUNNEL_EVENT=`).
    ThunderboltTunnel(ThunderboltTunnel),
    /// A classified kernel log record.
    Kmsg(KmsgRecord),
    /// Kernel log records were lost (sequence gap or EPIPE).
    KmsgLost { count: u64 },
    /// VM run state changed.
    VmState(VmStateChange),
    /// A bridge port appeared or disappeared.
    BridgePort(BridgePortChange),
    /// A passed-through device was (re)discovered with its path to the root port.
    DeviceMapped(DeviceMapped),
    /// A watcher is off (missing subsystem, permission).
    WatcherDisabled { watcher: String, reason: String },
}

impl HostEvent {
    /// The variant's stable numeric id (see [`kind`]) and its short lower-case name (for logs,
    /// the `kind` label of `gpufeed_host_events_total` and `watch`). The one match over the
    /// variants: a new variant does not compile until it has both.
    pub fn kind_entry(&self) -> (u16, &'static str) {
        match self {
            HostEvent::PcieLinkChange(_) => (kind::PCIE_LINK_CHANGE, "pcie_link_change"),
            HostEvent::AerCounter(_) => (kind::AER_COUNTER, "aer_counter"),
            HostEvent::AerRootPortTotal(_) => (kind::AER_ROOT_PORT_TOTAL, "aer_rootport_total"),
            HostEvent::AerTrace(_) => (kind::AER_TRACE, "aer_trace"),
            HostEvent::PciErrorRecovery(_) => (kind::PCI_ERROR_RECOVERY, "pci_error_recovery"),
            HostEvent::PciHotplug(_) => (kind::PCI_HOTPLUG, "pci_hotplug"),
            HostEvent::ThunderboltDevice(_) => (kind::THUNDERBOLT_DEVICE, "thunderbolt_device"),
            HostEvent::ThunderboltTunnel(_) => (kind::THUNDERBOLT_TUNNEL, "thunderbolt_tunnel"),
            HostEvent::Kmsg(_) => (kind::KMSG, "kmsg"),
            HostEvent::KmsgLost { .. } => (kind::KMSG_LOST, "kmsg_lost"),
            HostEvent::VmState(_) => (kind::VM_STATE, "vm_state"),
            HostEvent::BridgePort(_) => (kind::BRIDGE_PORT, "bridge_port"),
            HostEvent::DeviceMapped(_) => (kind::DEVICE_MAPPED, "device_mapped"),
            HostEvent::WatcherDisabled { .. } => (kind::WATCHER_DISABLED, "watcher_disabled"),
        }
    }

    /// Stable numeric kind id (see [`kind`]).
    pub fn kind(&self) -> u16 {
        self.kind_entry().0
    }

    /// Short lower-case name of the kind, for logs and `watch`.
    pub fn kind_name(&self) -> &'static str {
        self.kind_entry().1
    }

    /// Whether `kind` is the id of one of this build's variants: a frame of such a kind whose
    /// payload does not decode as it is corrupt, not news from a newer host agent.
    pub fn is_known_kind(kind: u16) -> bool {
        known_kinds().contains(&kind)
    }
}

/// The kind ids of this build, from the variants themselves: postcard writes a variant as its
/// index (a varint) followed by its fields, and a run of zero bytes decodes as any field
/// (zero, empty, `None`, the first variant), so an index followed by zeros is one value of
/// that variant, whose [`HostEvent::kind`] is taken. Indices are tried until one does not
/// decode (past the last variant).
fn known_kinds() -> &'static [u16] {
    static KINDS: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    KINDS.get_or_init(|| {
        let mut bytes = [0u8; 1024];
        (0u8..0x80)
            .map_while(|i| {
                bytes[0] = i;
                postcard::from_bytes::<HostEvent>(&bytes)
                    .ok()
                    .map(|e| e.kind())
            })
            .collect()
    })
}

/// How a link change is to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkChangeClass {
    /// Only the speed changed (an idle GPU lowering its speed is normal; under load it is not).
    SpeedOnly,
    /// Fewer lanes than before (a lost lane is not normal).
    WidthReduction,
    /// More lanes than before (width restored).
    WidthIncrease,
    /// The link went down (width 0 / speed unknown).
    LinkDown,
    /// The link came back up.
    LinkUp,
    /// A Thunderbolt/USB4 tunnel hop: its speed is synthetic, not the real link.
    VirtualTunnelLink,
}

impl LinkChangeClass {
    pub fn as_str(&self) -> &'static str {
        match self {
            LinkChangeClass::SpeedOnly => "speed_only",
            LinkChangeClass::WidthReduction => "width_reduction",
            LinkChangeClass::WidthIncrease => "width_increase",
            LinkChangeClass::LinkDown => "link_down",
            LinkChangeClass::LinkUp => "link_up",
            LinkChangeClass::VirtualTunnelLink => "virtual_tunnel_link",
        }
    }
}

/// Where an observation came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Source {
    Poll,
    Tracepoint,
    Uevent,
    Kmsg,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PcieLinkChange {
    /// The device at the downstream end of the link (`DDDD:BB:DD.F`).
    pub bdf: String,
    /// The port at the upstream end of the link, if known.
    pub upstream_bdf: Option<String>,
    /// The passed-through device this link serves, and its VM.
    pub target_bdf: Option<String>,
    pub vmid: Option<u32>,
    /// Speeds in MT/s (16.0 GT/s = 16000); `None` = `Unknown` / down.
    pub old_speed_mts: Option<u32>,
    pub new_speed_mts: Option<u32>,
    pub old_width: u8,
    pub new_width: u8,
    pub max_speed_mts: Option<u32>,
    pub max_width: u8,
    pub class: LinkChangeClass,
    /// True if the new state is degraded whatever the device does: below its maximum width,
    /// or down. A speed below the maximum at full width is not flagged: GPUs lower their link
    /// speed while idle (power management), so it is a degradation only under load, which the
    /// guest knows (older hosts flagged any speed below the maximum; the guest reads the speeds).
    pub degraded: bool,
    pub source: Source,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AerSeverity {
    Correctable,
    NonFatal,
    Fatal,
}

impl AerSeverity {
    pub fn as_str(&self) -> &'static str {
        match self {
            AerSeverity::Correctable => "correctable",
            AerSeverity::NonFatal => "nonfatal",
            AerSeverity::Fatal => "fatal",
        }
    }
}

/// Detail of one AER report from the `ras:aer_event` tracepoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AerDetail {
    pub dev_name: String,
    pub severity: AerSeverity,
    /// Raw (unmasked) status register.
    pub status: u32,
    pub tlp_header: Option<[u32; 4]>,
    /// Tracepoint timestamp (trace clock of the private instance, ns).
    pub trace_ns: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AerCounter {
    pub bdf: String,
    pub vmid: Option<u32>,
    pub severity: AerSeverity,
    /// Counter name as the kernel prints it (`RxErr`, `CmpltTO`, `dev_cor_errs_bit[9]`, `TOTAL_ERR_COR`).
    pub error: String,
    pub delta: u64,
    pub total: u64,
    pub detail: Option<AerDetail>,
    /// Text of matching recent /dev/kmsg records (AER dump lines for this device).
    pub kmsg_context: Vec<String>,
    pub source: Source,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AerRootPortTotal {
    pub bdf: String,
    pub severity: AerSeverity,
    pub delta: u64,
    pub total: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PciErrorRecovery {
    pub bdf: String,
    pub vmid: Option<u32>,
    /// `BEGIN_RECOVERY`, `SUCCESSFUL_RECOVERY`, `FAILED_RECOVERY`.
    pub event: String,
    pub device_online: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PciHotplug {
    pub port: String,
    pub slot: String,
    /// `LINK_UP`, `LINK_DOWN`, `CARD_PRESENT`, `CARD_NOT_PRESENT` or the raw number.
    pub event: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceAction {
    Added,
    Removed,
    Changed,
}

impl DeviceAction {
    pub fn as_str(&self) -> &'static str {
        match self {
            DeviceAction::Added => "added",
            DeviceAction::Removed => "removed",
            DeviceAction::Changed => "changed",
        }
    }
}

/// State of one Thunderbolt/USB4 router as read from sysfs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ThunderboltInfo {
    pub vendor_name: Option<String>,
    pub device_name: Option<String>,
    pub generation: Option<u8>,
    /// 0 no, 1 yes, 2 secure key.
    pub authorized: Option<u8>,
    /// Per-lane speed in Gb/s ×10 (20.0 Gb/s = 200), to stay `Eq`-friendly.
    pub rx_speed_gbps_x10: Option<u32>,
    pub tx_speed_gbps_x10: Option<u32>,
    pub rx_lanes: Option<u8>,
    pub tx_lanes: Option<u8>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThunderboltDevice {
    /// Router name, e.g. `0-1`.
    pub device: String,
    pub action: DeviceAction,
    pub old: Option<ThunderboltInfo>,
    pub new: Option<ThunderboltInfo>,
    /// VMs whose passed-through devices this router carries.
    pub vmids: Vec<u32>,
    pub source: Source,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThunderboltTunnel {
    pub device: String,
    /// `activated`, `changed`, `deactivated`, `low bandwidth`, `insufficient bandwidth`.
    pub event: String,
    pub details: Option<String>,
}

/// What a kernel log record is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KmsgClass {
    /// `AER: ... error message received from BDF`.
    AerSource,
    /// `PCIe Bus Error: severity=...` and the status/bit lines that follow.
    AerDetail,
    /// `AER: device recovery successful|failed`, `can't recover`, `Root Port link has been reset`.
    AerRecovery,
    /// `DPC: containment event`.
    Dpc,
    LinkDown,
    LinkUp,
    CardPresent,
    CardNotPresent,
    /// `retraining non-functional downstream link`.
    Retraining,
    /// `available PCIe bandwidth, limited by ...`.
    BandwidthLimited,
    Thunderbolt,
    Vfio,
    /// QEMU/VM stop related lines.
    VmStop,
}

impl KmsgClass {
    pub fn as_str(&self) -> &'static str {
        match self {
            KmsgClass::AerSource => "aer_source",
            KmsgClass::AerDetail => "aer_detail",
            KmsgClass::AerRecovery => "aer_recovery",
            KmsgClass::Dpc => "dpc",
            KmsgClass::LinkDown => "link_down",
            KmsgClass::LinkUp => "link_up",
            KmsgClass::CardPresent => "card_present",
            KmsgClass::CardNotPresent => "card_not_present",
            KmsgClass::Retraining => "retraining",
            KmsgClass::BandwidthLimited => "bandwidth_limited",
            KmsgClass::Thunderbolt => "thunderbolt",
            KmsgClass::Vfio => "vfio",
            KmsgClass::VmStop => "vm_stop",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KmsgRecord {
    pub seq: u64,
    /// printk clock, µs since boot.
    pub usec: u64,
    /// syslog level 0..7.
    pub level: u8,
    pub facility: u8,
    pub class: KmsgClass,
    /// Device the record is about (from `DEVICE=+pci:` or the text).
    pub bdf: Option<String>,
    pub vmid: Option<u32>,
    pub text: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmRunState {
    Running,
    Paused,
    /// QEMU stopped the guest on an error (`internal-error`, `io-error`, `guest-panicked`).
    Error,
    Stopped,
    Unknown,
}

impl VmRunState {
    pub fn as_str(&self) -> &'static str {
        match self {
            VmRunState::Running => "running",
            VmRunState::Paused => "paused",
            VmRunState::Error => "error",
            VmRunState::Stopped => "stopped",
            VmRunState::Unknown => "unknown",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmStateChange {
    pub vmid: u32,
    pub old: VmRunState,
    pub new: VmRunState,
    /// QEMU's own status string when known (`internal-error`, `paused`, ...).
    pub detail: Option<String>,
    /// Kernel log records (AER / vfio) seen shortly before the stop, if any.
    pub cause: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BridgePortChange {
    pub bridge: String,
    pub port: String,
    pub vmid: Option<u32>,
    /// NIC index (`net<n>`) from the Proxmox port name.
    pub nic: Option<u32>,
    pub action: DeviceAction,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceMapped {
    pub bdf: String,
    pub vmid: Option<u32>,
    /// `hostpciN` key or `config` for devices named in the agent's config.
    pub origin: String,
    /// BDFs from the device up to its root port.
    pub path: Vec<String>,
    pub root_port: Option<String>,
    /// Thunderbolt router carrying the device, if any.
    pub thunderbolt_router: Option<String>,
}

#[cfg(any(test, feature = "samples"))]
pub mod samples;

#[cfg(test)]
mod tests {
    use super::*;

    /// The first, a middle and the last kind (kinds are numbered in declaration order).
    fn first_middle_last() -> Vec<HostEvent> {
        samples::one_of_each()
            .into_iter()
            .filter(|e| {
                matches!(
                    e,
                    HostEvent::PcieLinkChange(_)
                        | HostEvent::KmsgLost { .. }
                        | HostEvent::WatcherDisabled { .. }
                )
            })
            .collect()
    }

    #[test]
    fn kinds_are_distinct_and_stable() {
        assert_eq!(first_middle_last()[0].kind(), 1);
        assert_eq!(first_middle_last()[1].kind(), 10);
        assert_eq!(first_middle_last()[2].kind(), 14);
    }

    #[test]
    fn every_variant_is_a_known_kind_and_nothing_else_is() {
        let all = samples::one_of_each();
        for e in &all {
            assert!(HostEvent::is_known_kind(e.kind()), "{e:?}");
        }
        assert_eq!(known_kinds().len(), all.len());
        assert!(!HostEvent::is_known_kind(0));
        assert!(!HostEvent::is_known_kind(all.len() as u16 + 1));
    }

    #[test]
    fn kind_names_are_the_metric_labels() {
        let names: Vec<&str> = first_middle_last()
            .iter()
            .map(HostEvent::kind_name)
            .collect();
        assert_eq!(names, ["pcie_link_change", "kmsg_lost", "watcher_disabled"]);
    }
}
