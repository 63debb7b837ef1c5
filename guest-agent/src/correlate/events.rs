//! Host events as the correlator sees them: each `HostEvent` is classified into a
//! correlation kind (what happened to this VM's hardware path) or into context.
//!
//! * Incident kinds (`link_degraded`, `link_down`, `aer_fatal`, ...) are kept in the recent
//!   list and joined to pod spikes.
//! * Context (kernel log lines, device inventory, watcher status, bridge port add/remove)
//!   carries no incident of its own, or repeats one that a typed event already reports;
//!   it is counted under the host's kind name and not joined.
//! * `unknown`: a wire kind this guest cannot decode (a newer host). Counted and kept in the
//!   recent list, never joined: a spike is not "explained" by something nobody can read.
//! * `link_power_managed`: a PCIe link's speed changing at full width the way GPUs manage
//!   power (down when idle, up when work starts). Counted and listed as what it is, never
//!   joined. A speed drop below the maximum is a degradation only while the GPU works
//!   ([`super::gpu`]): the caller says what the GPU did after the change.

use gpufeed_shared::event::{
    AerSeverity, DeviceAction, HostEvent, LinkChangeClass, PcieLinkChange, ThunderboltDevice,
    ThunderboltInfo, VmRunState, VmStateChange,
};
use gpufeed_shared::event::{PciErrorRecovery, Stamped};
use serde::Serialize;

use super::gpu::Activity;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum EventKind {
    /// Speed or width fell below what the link had (and below its maximum).
    LinkDegraded,
    /// Speed or width changed otherwise (width restored, a tunnel hop, a speed change on a
    /// link already short of lanes).
    LinkChanged,
    /// Speed changed at full width as GPUs manage power: down while the GPU is idle (or
    /// nothing can tell), up. Listed, never joined.
    LinkPowerManaged,
    LinkDown,
    LinkUp,
    AerCorrectable,
    AerNonfatal,
    AerFatal,
    ThunderboltDisconnect,
    ThunderboltReconnect,
    VmStop,
    VmResume,
    /// Counted under the host's own kind name, not joined.
    Context(&'static str),
    /// A wire kind this guest does not know.
    Unknown,
}

impl EventKind {
    /// The `event` label value.
    pub fn as_str(&self) -> &'static str {
        match self {
            EventKind::LinkDegraded => "link_degraded",
            EventKind::LinkChanged => "link_changed",
            EventKind::LinkPowerManaged => "link_power_managed",
            EventKind::LinkDown => "link_down",
            EventKind::LinkUp => "link_up",
            EventKind::AerCorrectable => "aer_correctable",
            EventKind::AerNonfatal => "aer_nonfatal",
            EventKind::AerFatal => "aer_fatal",
            EventKind::ThunderboltDisconnect => "thunderbolt_disconnect",
            EventKind::ThunderboltReconnect => "thunderbolt_reconnect",
            EventKind::VmStop => "vm_stop",
            EventKind::VmResume => "vm_resume",
            EventKind::Context(name) => name,
            EventKind::Unknown => "unknown",
        }
    }

    /// Whether spikes are joined to events of this kind.
    pub fn joins(&self) -> bool {
        !matches!(
            self,
            EventKind::Context(_) | EventKind::Unknown | EventKind::LinkPowerManaged
        )
    }

    /// Whether events of this kind go into the recent list (/events).
    pub fn listed(&self) -> bool {
        !matches!(self, EventKind::Context(_))
    }
}

/// What arrived from the host.
#[derive(Debug, Clone, Copy)]
pub enum Payload<'a> {
    Known(&'a HostEvent),
    /// A payload this guest could not decode: what its frame says (a newer host agent's kind).
    UnknownKind {
        /// The frame's kind number.
        kind: u16,
        /// The host's sequence number of the event.
        seq: u64,
        /// Size of the undecoded payload.
        payload_len: usize,
    },
}

/// One host event handed to the correlator.
#[derive(Debug, Clone, Copy)]
pub struct HostInput<'a> {
    /// Host identity (from its certificate).
    pub host: &'a str,
    /// Host `CLOCK_REALTIME` when the event was emitted, ns.
    pub host_realtime_ns: i64,
    /// Host minus guest realtime, ns, as the hub measured it.
    pub clock_offset_ns: i64,
    pub payload: Payload<'a>,
}

impl<'a> HostInput<'a> {
    pub fn from_stamped(host: &'a str, s: &'a Stamped, clock_offset_ns: i64) -> Self {
        HostInput {
            host,
            host_realtime_ns: s.realtime_ns,
            clock_offset_ns,
            payload: Payload::Known(&s.event),
        }
    }

    /// When the event happened in guest realtime.
    pub fn guest_ns(&self) -> i64 {
        self.host_realtime_ns.saturating_sub(self.clock_offset_ns)
    }
}

/// A classified event: its kind and a one-line description for people.
#[derive(Debug, Clone, PartialEq)]
pub struct Classified {
    pub kind: EventKind,
    /// The host's own kind name (`pcie_link_change`, ...), `unknown` for an unknown kind.
    pub host_kind: &'static str,
    pub summary: String,
}

/// Whether `p` is a link change whose reading depends on what the GPU did after it: a speed
/// drop below the maximum at full width (a degradation while the GPU works, power management
/// while it idles).
pub fn needs_gpu_activity(p: Payload<'_>) -> bool {
    match p {
        Payload::Known(HostEvent::PcieLinkChange(c)) => {
            c.class == LinkChangeClass::SpeedOnly && full_width(c) && speed_fell_below_max(c)
        }
        _ => false,
    }
}

/// Classifies `p`; `gpu` is what the GPU did over the time after the event (read only for a
/// speed change at full width, see [`needs_gpu_activity`]).
pub fn classify(p: Payload<'_>, gpu: Activity) -> Classified {
    let ev = match p {
        Payload::Known(ev) => ev,
        Payload::UnknownKind {
            kind,
            seq,
            payload_len,
        } => {
            return Classified {
                kind: EventKind::Unknown,
                host_kind: "unknown",
                summary: format!(
                    "host event of kind {kind}, unknown to this guest (seq {seq}, \
                     {payload_len} bytes not decoded; is the host agent newer?)"
                ),
            }
        }
    };
    let (kind, summary) = match ev {
        HostEvent::PcieLinkChange(c) => {
            let kind = link_kind(c, gpu);
            (kind, link_summary(c, kind, gpu))
        }
        HostEvent::AerCounter(a) => (
            aer_kind(a.severity),
            format!(
                "{} AER {} +{} on {}",
                a.severity.as_str(),
                a.error,
                a.delta,
                a.bdf
            ),
        ),
        HostEvent::AerRootPortTotal(a) => (
            aer_kind(a.severity),
            format!(
                "{} AER +{} at root port {}",
                a.severity.as_str(),
                a.delta,
                a.bdf
            ),
        ),
        HostEvent::AerTrace(a) => (
            aer_kind(a.severity),
            format!("{} AER on {}", a.severity.as_str(), a.dev_name),
        ),
        HostEvent::PciErrorRecovery(r) => (
            recovery_kind(r),
            format!("PCI error recovery {} on {}", r.event, r.bdf),
        ),
        HostEvent::PciHotplug(h) => (
            match h.event.as_str() {
                "LINK_DOWN" | "CARD_NOT_PRESENT" => EventKind::LinkDown,
                "LINK_UP" | "CARD_PRESENT" => EventKind::LinkUp,
                _ => EventKind::Context(ev.kind_name()),
            },
            format!("PCI hotplug {} on {} slot {}", h.event, h.port, h.slot),
        ),
        HostEvent::ThunderboltDevice(d) => (
            thunderbolt_kind(d),
            format!("Thunderbolt router {} {}", d.device, d.action.as_str()),
        ),
        HostEvent::ThunderboltTunnel(t) => (
            match t.event.as_str() {
                "activated" => EventKind::ThunderboltReconnect,
                "deactivated" => EventKind::ThunderboltDisconnect,
                "low bandwidth" | "insufficient bandwidth" => EventKind::LinkDegraded,
                "changed" => EventKind::LinkChanged,
                _ => EventKind::Context(ev.kind_name()),
            },
            format!("Thunderbolt tunnel {} {}", t.device, t.event),
        ),
        HostEvent::VmState(v) => (
            vm_kind(v),
            format!("VM {} {} → {}", v.vmid, v.old.as_str(), v.new.as_str()),
        ),
        HostEvent::Kmsg(_)
        | HostEvent::KmsgLost { .. }
        | HostEvent::BridgePort(_)
        | HostEvent::DeviceMapped(_)
        | HostEvent::WatcherDisabled { .. } => (
            EventKind::Context(ev.kind_name()),
            ev.kind_name().to_string(),
        ),
    };
    Classified {
        kind,
        host_kind: ev.kind_name(),
        summary,
    }
}

fn aer_kind(s: AerSeverity) -> EventKind {
    match s {
        AerSeverity::Correctable => EventKind::AerCorrectable,
        AerSeverity::NonFatal => EventKind::AerNonfatal,
        AerSeverity::Fatal => EventKind::AerFatal,
    }
}

/// Recovery uevents come only for uncorrectable errors: a failed recovery is fatal for the
/// device, a recovery in progress or done was a non-fatal error.
fn recovery_kind(r: &PciErrorRecovery) -> EventKind {
    if r.event == "FAILED_RECOVERY" {
        EventKind::AerFatal
    } else {
        EventKind::AerNonfatal
    }
}

/// All the lanes the link can train (the host's `degraded` flag is not read: hosts before
/// power-managed links were told apart set it for any speed below the maximum).
fn full_width(c: &PcieLinkChange) -> bool {
    c.max_width > 0 && c.new_width >= c.max_width
}

/// The speed fell, to below the link's maximum.
fn speed_fell_below_max(c: &PcieLinkChange) -> bool {
    let (Some(old), Some(new)) = (c.old_speed_mts, c.new_speed_mts) else {
        return false;
    };
    new < old && c.max_speed_mts.is_some_and(|max| new < max)
}

fn link_kind(c: &PcieLinkChange, gpu: Activity) -> EventKind {
    match c.class {
        LinkChangeClass::LinkDown => EventKind::LinkDown,
        LinkChangeClass::LinkUp => EventKind::LinkUp,
        LinkChangeClass::WidthReduction => EventKind::LinkDegraded,
        LinkChangeClass::SpeedOnly if !full_width(c) => {
            // lanes are missing already: a slower speed on top is a degradation
            if speed_fell_below_max(c) {
                EventKind::LinkDegraded
            } else {
                EventKind::LinkChanged
            }
        }
        LinkChangeClass::SpeedOnly if speed_fell_below_max(c) && gpu == Activity::Busy => {
            EventKind::LinkDegraded
        }
        // at full width: down while the GPU idles (or nothing tells), or up as work starts
        LinkChangeClass::SpeedOnly => EventKind::LinkPowerManaged,
        LinkChangeClass::WidthIncrease | LinkChangeClass::VirtualTunnelLink => {
            EventKind::LinkChanged
        }
    }
}

fn link_summary(c: &PcieLinkChange, kind: EventKind, gpu: Activity) -> String {
    let speed = |s: Option<u32>| match s {
        Some(mts) => format!("{:.1} GT/s", mts as f64 / 1000.0),
        None => "down".to_string(),
    };
    let reading = match (c.class, kind) {
        (LinkChangeClass::SpeedOnly, EventKind::LinkDegraded) if full_width(c) => {
            "; below its maximum while the GPU works".to_string()
        }
        (_, EventKind::LinkPowerManaged) if speed_fell_below_max(c) => format!(
            "; at full width, GPU {}: power management, not a cause",
            gpu.as_str()
        ),
        (_, EventKind::LinkPowerManaged) => "; at full width: power management".to_string(),
        _ => String::new(),
    };
    format!(
        "PCIe link {}: {} x{} → {} x{} ({}){reading}",
        c.bdf,
        speed(c.old_speed_mts),
        c.old_width,
        speed(c.new_speed_mts),
        c.new_width,
        c.class.as_str()
    )
}

/// Usable bandwidth of a router link in Gb/s × 10 (the slower direction).
fn tb_bandwidth(i: &ThunderboltInfo) -> Option<u64> {
    let rx = i.rx_speed_gbps_x10? as u64 * i.rx_lanes? as u64;
    let tx = i.tx_speed_gbps_x10? as u64 * i.tx_lanes? as u64;
    Some(rx.min(tx))
}

fn thunderbolt_kind(d: &ThunderboltDevice) -> EventKind {
    match d.action {
        DeviceAction::Removed => EventKind::ThunderboltDisconnect,
        DeviceAction::Added => EventKind::ThunderboltReconnect,
        DeviceAction::Changed => {
            let before = d.old.as_ref().and_then(tb_bandwidth);
            let after = d.new.as_ref().and_then(tb_bandwidth);
            match (before, after) {
                (Some(b), Some(a)) if a < b => EventKind::LinkDegraded,
                _ => EventKind::LinkChanged,
            }
        }
    }
}

fn vm_kind(v: &VmStateChange) -> EventKind {
    use VmRunState::*;
    match (v.old, v.new) {
        (Paused | Error | Stopped, Running) => EventKind::VmResume,
        (old, new @ (Paused | Error | Stopped)) if old != new => EventKind::VmStop,
        _ => EventKind::Context("vm_state"),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use gpufeed_shared::event::samples;
    use gpufeed_shared::event::{
        AerCounter, AerRootPortTotal, KmsgClass, KmsgRecord, PciHotplug, Source, ThunderboltTunnel,
    };

    /// A link change of the GPU at 0000:09:00.0 (test fixture shared with the join tests).
    pub(crate) fn link(
        class: LinkChangeClass,
        old: (Option<u32>, u8),
        new: (Option<u32>, u8),
    ) -> HostEvent {
        HostEvent::PcieLinkChange(samples::gpu_link_change(
            "0000:09:00.0",
            "0000:08:01.0",
            old,
            new,
            class,
        ))
    }

    pub(crate) fn aer(severity: AerSeverity) -> HostEvent {
        HostEvent::AerCounter(AerCounter {
            bdf: "0000:09:00.0".into(),
            vmid: Some(100),
            severity,
            error: "RxErr".into(),
            delta: 3,
            total: 10,
            detail: None,
            kmsg_context: vec![],
            source: Source::Poll,
        })
    }

    /// A kernel log line about a link going down (context, not an incident).
    pub(crate) fn kmsg_link_down() -> HostEvent {
        HostEvent::Kmsg(KmsgRecord {
            seq: 7,
            usec: 1,
            level: 3,
            facility: 0,
            class: KmsgClass::LinkDown,
            bdf: None,
            vmid: None,
            text: "pcieport 0000:08:01.0: link down".into(),
        })
    }

    fn kind(ev: &HostEvent) -> &'static str {
        classify(Payload::Known(ev), Activity::Unknown)
            .kind
            .as_str()
    }

    fn kind_with(ev: &HostEvent, gpu: Activity) -> &'static str {
        classify(Payload::Known(ev), gpu).kind.as_str()
    }

    fn tb(action: DeviceAction, old: Option<(u32, u8)>, new: Option<(u32, u8)>) -> HostEvent {
        let info = |(s, l): (u32, u8)| ThunderboltInfo {
            rx_speed_gbps_x10: Some(s),
            tx_speed_gbps_x10: Some(s),
            rx_lanes: Some(l),
            tx_lanes: Some(l),
            ..Default::default()
        };
        HostEvent::ThunderboltDevice(ThunderboltDevice {
            device: "0-1".into(),
            action,
            old: old.map(info),
            new: new.map(info),
            vmids: vec![100],
            source: Source::Uevent,
        })
    }

    fn vm(old: VmRunState, new: VmRunState) -> HostEvent {
        HostEvent::VmState(VmStateChange {
            vmid: 100,
            old,
            new,
            detail: None,
            cause: vec![],
        })
    }

    #[test]
    fn link_changes_map_by_class_and_direction() {
        use LinkChangeClass::*;
        let g16 = Some(16000);
        assert_eq!(
            kind(&link(WidthReduction, (g16, 4), (Some(2500), 1))),
            "link_degraded"
        );
        // short of lanes already: a slower speed is a degradation whatever the GPU does
        assert_eq!(
            kind(&link(SpeedOnly, (g16, 2), (Some(2500), 2))),
            "link_degraded"
        );
        assert_eq!(
            kind(&link(SpeedOnly, (Some(2500), 2), (g16, 2))),
            "link_changed"
        );
        assert_eq!(
            kind(&link(WidthIncrease, (g16, 1), (g16, 4))),
            "link_changed"
        );
        assert_eq!(kind(&link(LinkDown, (g16, 4), (None, 0))), "link_down");
        assert_eq!(kind(&link(LinkUp, (None, 0), (g16, 4))), "link_up");
        assert_eq!(
            kind(&link(VirtualTunnelLink, (g16, 4), (Some(2500), 4))),
            "link_changed"
        );
        let c = classify(
            Payload::Known(&link(WidthReduction, (g16, 4), (Some(2500), 1))),
            Activity::Unknown,
        );
        assert_eq!(c.host_kind, "pcie_link_change");
        assert_eq!(
            c.summary,
            "PCIe link 0000:09:00.0: 16.0 GT/s x4 → 2.5 GT/s x1 (width_reduction)"
        );
    }

    /// Speed changes at full width are power management unless the speed fell below the
    /// maximum while the GPU kept working; width, link down and AER do not depend on it.
    #[test]
    fn speed_at_full_width_is_read_against_the_gpu() {
        use LinkChangeClass::*;
        let (g16, g2) = (Some(16000), Some(2500));
        let drop = link(SpeedOnly, (g16, 4), (g2, 4));
        assert!(needs_gpu_activity(Payload::Known(&drop)));
        assert_eq!(kind_with(&drop, Activity::Busy), "link_degraded");
        for gpu in [Activity::Idle, Activity::Unknown, Activity::NotYet] {
            assert_eq!(kind_with(&drop, gpu), "link_power_managed", "{gpu:?}");
        }
        // up when work starts: power management whatever the GPU does
        let rise = link(SpeedOnly, (g2, 4), (g16, 4));
        assert!(!needs_gpu_activity(Payload::Known(&rise)));
        for gpu in [Activity::Busy, Activity::Idle, Activity::Unknown] {
            assert_eq!(kind_with(&rise, gpu), "link_power_managed", "{gpu:?}");
        }
        // a step between two speeds below the maximum, up or down
        let step = link(SpeedOnly, (Some(8000), 4), (Some(5000), 4));
        assert_eq!(kind_with(&step, Activity::Busy), "link_degraded");
        assert_eq!(kind_with(&step, Activity::Idle), "link_power_managed");
        // the rest does not ask the GPU
        for ev in [
            link(WidthReduction, (g16, 4), (g16, 2)),
            link(LinkDown, (g16, 4), (None, 0)),
            aer(AerSeverity::Correctable),
        ] {
            assert!(!needs_gpu_activity(Payload::Known(&ev)));
            assert_eq!(
                kind_with(&ev, Activity::Idle),
                kind_with(&ev, Activity::Busy)
            );
        }
        assert!(!EventKind::LinkPowerManaged.joins() && EventKind::LinkPowerManaged.listed());
        let idle = classify(Payload::Known(&drop), Activity::Idle);
        assert_eq!(
            idle.summary,
            "PCIe link 0000:09:00.0: 16.0 GT/s x4 → 2.5 GT/s x4 (speed_only); at full width, \
             GPU idle: power management, not a cause"
        );
        let busy = classify(Payload::Known(&drop), Activity::Busy);
        assert_eq!(
            busy.summary,
            "PCIe link 0000:09:00.0: 16.0 GT/s x4 → 2.5 GT/s x4 (speed_only); below its maximum \
             while the GPU works"
        );
        assert!(classify(Payload::Known(&rise), Activity::Busy)
            .summary
            .ends_with("; at full width: power management"));
    }

    #[test]
    fn aer_maps_by_severity_from_every_source() {
        assert_eq!(kind(&aer(AerSeverity::Correctable)), "aer_correctable");
        assert_eq!(kind(&aer(AerSeverity::NonFatal)), "aer_nonfatal");
        assert_eq!(kind(&aer(AerSeverity::Fatal)), "aer_fatal");
        let rp = HostEvent::AerRootPortTotal(AerRootPortTotal {
            bdf: "0000:00:01.0".into(),
            severity: AerSeverity::Fatal,
            delta: 1,
            total: 1,
        });
        assert_eq!(kind(&rp), "aer_fatal");
        let rec = |e: &str| {
            HostEvent::PciErrorRecovery(PciErrorRecovery {
                bdf: "0000:09:00.0".into(),
                vmid: None,
                event: e.into(),
                device_online: None,
            })
        };
        assert_eq!(kind(&rec("BEGIN_RECOVERY")), "aer_nonfatal");
        assert_eq!(kind(&rec("FAILED_RECOVERY")), "aer_fatal");
    }

    #[test]
    fn thunderbolt_hotplug_and_vm_state() {
        use DeviceAction::*;
        assert_eq!(
            kind(&tb(Removed, Some((200, 2)), None)),
            "thunderbolt_disconnect"
        );
        assert_eq!(
            kind(&tb(Added, None, Some((200, 2)))),
            "thunderbolt_reconnect"
        );
        assert_eq!(
            kind(&tb(Changed, Some((200, 2)), Some((200, 1)))),
            "link_degraded"
        );
        assert_eq!(
            kind(&tb(Changed, Some((200, 1)), Some((200, 2)))),
            "link_changed"
        );
        let tunnel = |e: &str| {
            HostEvent::ThunderboltTunnel(ThunderboltTunnel {
                device: "0-1".into(),
                event: e.into(),
                details: None,
            })
        };
        assert_eq!(kind(&tunnel("deactivated")), "thunderbolt_disconnect");
        assert_eq!(kind(&tunnel("activated")), "thunderbolt_reconnect");
        assert_eq!(kind(&tunnel("low bandwidth")), "link_degraded");
        assert_eq!(kind(&tunnel("whatever")), "thunderbolt_tunnel");
        let hp = |e: &str| {
            HostEvent::PciHotplug(PciHotplug {
                port: "0000:08:01.0".into(),
                slot: "1".into(),
                event: e.into(),
            })
        };
        assert_eq!(kind(&hp("LINK_DOWN")), "link_down");
        assert_eq!(kind(&hp("CARD_PRESENT")), "link_up");
        assert_eq!(kind(&hp("7")), "pci_hotplug");
        use VmRunState::*;
        assert_eq!(kind(&vm(Running, Paused)), "vm_stop");
        assert_eq!(kind(&vm(Running, Error)), "vm_stop");
        assert_eq!(kind(&vm(Paused, Running)), "vm_resume");
        assert_eq!(kind(&vm(Unknown, Running)), "vm_state");
    }

    #[test]
    fn context_and_unknown_are_counted_but_never_joined() {
        let c = classify(Payload::Known(&kmsg_link_down()), Activity::Unknown);
        assert_eq!(c.kind.as_str(), "kmsg");
        assert!(!c.kind.joins() && !c.kind.listed());
        let u = classify(
            Payload::UnknownKind {
                kind: 99,
                seq: 7,
                payload_len: 12,
            },
            Activity::Unknown,
        );
        assert_eq!(u.kind, EventKind::Unknown);
        assert_eq!(
            u.summary,
            "host event of kind 99, unknown to this guest (seq 7, 12 bytes not decoded; \
             is the host agent newer?)"
        );
        assert_eq!(u.host_kind, "unknown");
        assert!(!u.kind.joins() && u.kind.listed());
        assert!(EventKind::LinkDown.joins() && EventKind::LinkDown.listed());
    }

    #[test]
    fn guest_time_is_host_time_minus_offset() {
        let s = Stamped {
            realtime_ns: 10_000,
            monotonic_ns: 5,
            event: HostEvent::KmsgLost { count: 1 },
        };
        assert_eq!(HostInput::from_stamped("h", &s, 4_000).guest_ns(), 6_000);
        assert_eq!(HostInput::from_stamped("h", &s, -4_000).guest_ns(), 14_000);
        let extreme = HostInput {
            host_realtime_ns: i64::MIN,
            clock_offset_ns: 1,
            ..HostInput::from_stamped("h", &s, 0)
        };
        assert_eq!(extreme.guest_ns(), i64::MIN, "saturates, never panics");
    }
}
