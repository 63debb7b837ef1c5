//! AER counters: every named counter of `aer_dev_{correctable,nonfatal,fatal}` of every device
//! on each watched path, and `aer_rootport_total_err_*` of root ports.

use super::recent::RecentKmsg;
use super::topology::Topology;
use super::unit::vm_suffix;
use super::unit::{Cx, Outcome, Poke, Starting, Unit, Watcher};
use crate::attrs::AttrFiles;
use crate::config::check::{range, Invalid};
use crate::metrics::{self, vmid_label};
use crate::roots::Roots;
use crate::sysfs::{parse_aer_counters, parse_u64, AER_DEV_FILES, AER_ROOTPORT_FILES};
use gpufeed_shared::event::{
    AerCounter, AerDetail, AerRootPortTotal, AerSeverity, HostEvent, Source,
};
use prometheus::{IntCounterVec, Registry};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

#[derive(Debug, Default)]
pub struct AerPoller {
    counters: HashMap<(String, AerSeverity, String), u64>,
    totals: HashMap<(String, AerSeverity), u64>,
    /// Last text of each `aer_dev_*` file: an unchanged file (the usual case) is not parsed.
    texts: HashMap<(String, AerSeverity), String>,
    /// The devices' directories and counter files, kept open: a poll is one `pread` per file
    /// (it was a path walk, an open, reads and a close, and a `stat` of the directory).
    files: AttrFiles,
}

/// True if any device of the topology has AER counter files.
pub fn any_aer_files(roots: &Roots, topo: &Topology) -> bool {
    topo.aer_devices.keys().any(|b| {
        roots
            .pci_devices()
            .join(b)
            .join("aer_dev_correctable")
            .exists()
    })
}

/// The kernel log's recent records about `bdf` (its AER dump lines), within `window`.
fn kmsg_context(recent: &RecentKmsg, window: Duration, bdf: &str) -> Vec<String> {
    recent
        .matching(window, |r| {
            r.bdf.as_deref() == Some(bdf) || r.text.contains(bdf)
        })
        .into_iter()
        .map(|r| r.text)
        .collect()
}

impl AerPoller {
    pub fn new() -> Self {
        Self::default()
    }

    /// Poll all devices (or only `only`); `detail` is attached to increments of the device it names.
    #[allow(clippy::too_many_arguments)]
    pub fn poll(
        &mut self,
        roots: &Roots,
        topo: &Topology,
        metrics: &AerMetrics,
        recent: &RecentKmsg,
        context_window: Duration,
        only: Option<&str>,
        detail: Option<&AerDetail>,
    ) -> Vec<HostEvent> {
        let mut out = Vec::new();
        if only.is_none() {
            // A device that left the topology and comes back is a new device.
            self.forget(|b| !topo.aer_devices.contains_key(b));
            let watched: HashSet<&str> = topo.aer_devices.keys().map(String::as_str).collect();
            self.files.retain(&watched);
        }
        for (bdf, (vmid, is_root)) in &topo.aer_devices {
            if only.is_some_and(|o| o != bdf) {
                continue;
            }
            let dir = || roots.pci_devices().join(bdf);
            let vm = vmid_label(*vmid);
            let mut removed = false;
            for (file, sev) in AER_DEV_FILES {
                let text = match self.files.read(bdf, dir, file) {
                    Ok(t) => t,
                    // Removed (hot unplug, surprise removal, `remove`): when it is back its
                    // counters start again at zero in a new `pci_dev`, so its first read then is
                    // a baseline. Only a failed read asks whether the directory is still there.
                    Err(_) if !dir().exists() => {
                        removed = true;
                        break;
                    }
                    Err(_) => continue,
                };
                match self.texts.get_mut(&(bdf.clone(), sev)) {
                    Some(t) if *t == text => continue, // no counter moved
                    Some(t) => t.clone_from(&text),
                    None => {
                        self.texts.insert((bdf.clone(), sev), text.clone());
                    }
                }
                for (name, value) in parse_aer_counters(&text) {
                    if name.starts_with("TOTAL_ERR_") {
                        continue; // sum of the named lines (can undercount); not a named error
                    }
                    let key = (bdf.clone(), sev, name.clone());
                    let prev = self.counters.insert(key, value);
                    let c = metrics.errors.with_label_values(&[
                        bdf.as_str(),
                        vm.as_str(),
                        sev.as_str(),
                        name.as_str(),
                    ]);
                    match prev {
                        // First read of this device (at start or after it came back): the
                        // kernel's count so far goes into the series, but when those errors
                        // happened is unknown, so no event. A count below the last one is a
                        // new device under the same address (replugged between two polls):
                        // its whole count is new.
                        None => c.inc_by(value),
                        Some(p) if value < p => c.inc_by(value),
                        Some(p) if value > p => {
                            c.inc_by(value - p);
                            let ctx = kmsg_context(recent, context_window, bdf);
                            let det = detail
                                .filter(|d| d.dev_name == *bdf && d.severity == sev)
                                .cloned();
                            out.push(HostEvent::AerCounter(AerCounter {
                                bdf: bdf.clone(),
                                vmid: *vmid,
                                severity: sev,
                                error: name,
                                delta: value - p,
                                total: value,
                                source: if det.is_some() {
                                    Source::Tracepoint
                                } else {
                                    Source::Poll
                                },
                                detail: det,
                                kmsg_context: ctx,
                            }));
                        }
                        Some(_) => {}
                    }
                }
            }
            if removed {
                self.forget(|b| b == bdf);
                self.files.forget(bdf);
                continue;
            }
            if *is_root {
                for (file, sev) in AER_ROOTPORT_FILES {
                    let Some(value) = self
                        .files
                        .read(bdf, dir, file)
                        .ok()
                        .and_then(|t| parse_u64(&t))
                    else {
                        continue;
                    };
                    let prev = self.totals.insert((bdf.clone(), sev), value);
                    let c = metrics
                        .rootport
                        .with_label_values(&[bdf.as_str(), sev.as_str()]);
                    match prev {
                        None => c.inc_by(value),
                        Some(p) if value < p => c.inc_by(value), // a new port: see above
                        Some(p) if value > p => {
                            c.inc_by(value - p);
                            out.push(HostEvent::AerRootPortTotal(AerRootPortTotal {
                                bdf: bdf.clone(),
                                severity: sev,
                                delta: value - p,
                                total: value,
                            }));
                        }
                        Some(_) => {}
                    }
                }
            }
        }
        out
    }

    /// Drop everything known about the devices `gone` selects: their next read is a first read.
    fn forget(&mut self, gone: impl Fn(&str) -> bool) {
        self.counters.retain(|(b, _, _), _| !gone(b));
        self.totals.retain(|(b, _), _| !gone(b));
        self.texts.retain(|(b, _), _| !gone(b));
    }
}

// ---- The unit: configuration, series, loop. ----

/// `[aer]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AerConfig {
    pub enabled: bool,
    pub poll_interval_ms: u64,
    /// Use the `ras:aer_event` tracepoint when present (exact time and status detail; read by
    /// [`super::tracepoints`], which pokes this watcher).
    pub tracepoint: bool,
    /// Attach kmsg records for the device seen within this window to counter events.
    pub kmsg_context_ms: u64,
}

impl Default for AerConfig {
    fn default() -> Self {
        AerConfig {
            enabled: true,
            poll_interval_ms: 1000,
            tracepoint: true,
            kmsg_context_ms: 5000,
        }
    }
}

impl AerConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        range("aer.poll_interval_ms", self.poll_interval_ms, 10, 600_000)?;
        range("aer.kmsg_context_ms", self.kmsg_context_ms, 0, 600_000)
    }
}

pub struct AerMetrics {
    pub errors: IntCounterVec,
    pub rootport: IntCounterVec,
}

impl AerMetrics {
    pub fn new(r: &Registry) -> AerMetrics {
        AerMetrics {
            errors: metrics::int_counter_vec(
                r,
                "gpufeed_host_aer_errors_total",
                "AER errors counted by the device (named counters of aer_dev_*)",
                &["bdf", "vmid", "severity", "error"],
            ),
            rootport: metrics::int_counter_vec(
                r,
                "gpufeed_host_aer_rootport_errors_total",
                "AER errors counted by a root port for its hierarchy",
                &["bdf", "severity"],
            ),
        }
    }
}

pub const UNIT: Unit = Unit {
    name: "aer",
    describe,
};

/// Builds the unit from its section `[aer]`, registering its series in `r`.
pub fn watcher(r: &Registry, cfg: AerConfig) -> Box<dyn Watcher> {
    Box::new(AerWatcher {
        metrics: AerMetrics::new(r),
        cfg,
    })
}

struct AerWatcher {
    metrics: AerMetrics,
    cfg: AerConfig,
}

impl Watcher for AerWatcher {
    fn start(self: Box<Self>, cx: Cx) -> Starting {
        Box::pin(async move {
            let a = cx.ctx;
            let cfg = self.cfg;
            let m = self.metrics;
            let t = a.topo.get();
            if !t.aer_devices.is_empty() && !any_aer_files(&a.roots, &t) {
                return Outcome::Off("no aer_dev_* files on the watched devices (kernel without AER support or no OS AER ownership)".into());
            }
            let mut p = AerPoller::new();
            p.poll(&a.roots, &t, &m, &a.recent, Duration::ZERO, None, None);
            Outcome::On(vec![tokio::spawn(async move {
                let mut pokes = a.pokes(cfg.poll_interval_ms, cx.inbox).await;
                let window = Duration::from_millis(cfg.kmsg_context_ms);
                // With the records being read, what the poll finds first waits for its record
                // ([`super::aer_hold`]) up to two polls or a second, whichever is longer.
                let hold_for = || {
                    if a.aer_records.load(std::sync::atomic::Ordering::Relaxed) {
                        Duration::from_millis((2 * cfg.poll_interval_ms).max(1000))
                    } else {
                        Duration::ZERO
                    }
                };
                let mut hold = super::aer_hold::Hold::default();
                loop {
                    let poke = pokes.next().await;
                    let t = a.topo.get();
                    let now = std::time::Instant::now();
                    match poke {
                        // The tracepoint names the device: a held increment of it takes the
                        // detail; else read its counters now and attach it; a report that
                        // moved no counter is still worth an event.
                        Poke::Aer(d) => {
                            let joined = hold.join(&d);
                            let evs = p.poll(
                                &a.roots,
                                &t,
                                &m,
                                &a.recent,
                                window,
                                Some(&d.dev_name),
                                Some(&d),
                            );
                            if evs.is_empty() && !joined {
                                a.bus.emit(HostEvent::AerTrace(d));
                            }
                            // with its detail, an increment may still wait for the log's lines
                            let passed = hold.admit(evs, now, hold_for());
                            a.emit_all(passed);
                        }
                        Poke::Tick | Poke::Port(..) => {
                            let evs = p.poll(&a.roots, &t, &m, &a.recent, window, None, None);
                            let passed = hold.admit(evs, now, hold_for());
                            a.emit_all(passed);
                        }
                    }
                    // the kernel log's lines may have come in while an increment was held
                    for c in hold.each_mut().filter(|c| c.kmsg_context.is_empty()) {
                        c.kmsg_context = kmsg_context(&a.recent, window, &c.bdf);
                    }
                    a.emit_all(hold.complete());
                    a.emit_all(hold.expired(now));
                }
            })])
        })
    }
}

fn describe(e: &HostEvent) -> Option<String> {
    Some(match e {
        HostEvent::AerCounter(a) => format!(
            "{}{}: {} {} +{} (total {}){}",
            a.bdf,
            vm_suffix(a.vmid),
            a.severity.as_str(),
            a.error,
            a.delta,
            a.total,
            if a.kmsg_context.is_empty() {
                String::new()
            } else {
                format!(" [{}]", a.kmsg_context.join(" | "))
            }
        ),
        HostEvent::AerRootPortTotal(a) => format!(
            "{}: root port {} +{} (total {})",
            a.bdf,
            a.severity.as_str(),
            a.delta,
            a.total
        ),
        HostEvent::AerTrace(d) => format!(
            "{}: {} status {:#010x}",
            d.dev_name,
            d.severity.as_str(),
            d.status
        ),
        _ => return None,
    })
}
