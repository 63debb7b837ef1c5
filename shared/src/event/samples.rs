//! Events for tests of code that must handle every kind: the shared crate's own and, through
//! the `samples` feature (a dev-dependency's), the agents'.

use super::*;

/// A change of the link of a GPU at `bdf` (below the port `upstream_bdf`, passed through to VM
/// 100, at most 16 GT/s x4) from `old` to `new` (speed in MT/s, width), read by the poll;
/// degraded when `new` is below the maximum.
pub fn gpu_link_change(
    bdf: &str,
    upstream_bdf: &str,
    old: (Option<u32>, u8),
    new: (Option<u32>, u8),
    class: LinkChangeClass,
) -> PcieLinkChange {
    PcieLinkChange {
        bdf: bdf.into(),
        upstream_bdf: Some(upstream_bdf.into()),
        target_bdf: Some(bdf.into()),
        vmid: Some(100),
        old_speed_mts: old.0,
        new_speed_mts: new.0,
        old_width: old.1,
        new_width: new.1,
        max_speed_mts: Some(16000),
        max_width: 4,
        class,
        degraded: new.0 < Some(16000) || new.1 < 4,
        source: Source::Poll,
    }
}

/// One event of every kind (the match below has no wildcard: a new kind is a compile
/// error here until it has a sample).
pub fn one_of_each() -> Vec<HostEvent> {
    let samples = vec![
        HostEvent::PcieLinkChange(PcieLinkChange {
            bdf: "0000:0a:00.0".into(),
            upstream_bdf: Some("0000:09:01.0".into()),
            target_bdf: Some("0000:0a:00.0".into()),
            vmid: Some(100),
            old_speed_mts: Some(16000),
            new_speed_mts: Some(2500),
            old_width: 4,
            new_width: 4,
            max_speed_mts: Some(16000),
            max_width: 16,
            class: LinkChangeClass::SpeedOnly,
            degraded: true,
            source: Source::Poll,
        }),
        HostEvent::AerCounter(AerCounter {
            bdf: "0000:0a:00.0".into(),
            vmid: Some(100),
            severity: AerSeverity::Correctable,
            error: "RxErr".into(),
            delta: 2,
            total: 5,
            detail: None,
            kmsg_context: vec![],
            source: Source::Poll,
        }),
        HostEvent::AerRootPortTotal(AerRootPortTotal {
            bdf: "0000:00:1c.0".into(),
            severity: AerSeverity::Fatal,
            delta: 1,
            total: 1,
        }),
        HostEvent::AerTrace(AerDetail {
            dev_name: "0000:0a:00.0".into(),
            severity: AerSeverity::NonFatal,
            status: 0x4000,
            tlp_header: None,
            trace_ns: None,
        }),
        HostEvent::PciErrorRecovery(PciErrorRecovery {
            bdf: "0000:0a:00.0".into(),
            vmid: None,
            event: "BEGIN_RECOVERY".into(),
            device_online: Some(false),
        }),
        HostEvent::PciHotplug(PciHotplug {
            port: "0000:00:1c.0".into(),
            slot: "4".into(),
            event: "LINK_DOWN".into(),
        }),
        HostEvent::ThunderboltDevice(ThunderboltDevice {
            device: "0-1".into(),
            action: DeviceAction::Removed,
            old: Some(ThunderboltInfo::default()),
            new: None,
            vmids: vec![100],
            source: Source::Uevent,
        }),
        HostEvent::ThunderboltTunnel(ThunderboltTunnel {
            device: "0-1".into(),
            event: "activated".into(),
            details: None,
        }),
        HostEvent::Kmsg(KmsgRecord {
            seq: 1,
            usec: 2,
            level: 3,
            facility: 0,
            class: KmsgClass::Dpc,
            bdf: None,
            vmid: None,
            text: "DPC: containment event".into(),
        }),
        HostEvent::KmsgLost { count: 3 },
        HostEvent::VmState(VmStateChange {
            vmid: 100,
            old: VmRunState::Running,
            new: VmRunState::Error,
            detail: Some("internal-error".into()),
            cause: vec![],
        }),
        HostEvent::BridgePort(BridgePortChange {
            bridge: "vmbr0".into(),
            port: "tap100i0".into(),
            vmid: Some(100),
            nic: Some(0),
            action: DeviceAction::Added,
        }),
        HostEvent::DeviceMapped(DeviceMapped {
            bdf: "0000:0a:00.0".into(),
            vmid: Some(100),
            origin: "hostpci0".into(),
            path: vec!["0000:0a:00.0".into(), "0000:00:1c.0".into()],
            root_port: Some("0000:00:1c.0".into()),
            thunderbolt_router: None,
        }),
        HostEvent::WatcherDisabled {
            watcher: "aer".into(),
            reason: "no aer_dev_* files".into(),
        },
    ];
    for e in &samples {
        match e {
            HostEvent::PcieLinkChange(_)
            | HostEvent::AerCounter(_)
            | HostEvent::AerRootPortTotal(_)
            | HostEvent::AerTrace(_)
            | HostEvent::PciErrorRecovery(_)
            | HostEvent::PciHotplug(_)
            | HostEvent::ThunderboltDevice(_)
            | HostEvent::ThunderboltTunnel(_)
            | HostEvent::Kmsg(_)
            | HostEvent::KmsgLost { .. }
            | HostEvent::VmState(_)
            | HostEvent::BridgePort(_)
            | HostEvent::DeviceMapped(_)
            | HostEvent::WatcherDisabled { .. } => {}
        }
    }
    samples
}
