//! AER counters: every named counter of `aer_dev_{correctable,nonfatal,fatal}` of every device
//! on each watched path, and `aer_rootport_total_err_*` of root ports.

use crate::metrics::{vmid_label, Metrics};
use crate::roots::Roots;
use crate::sysfs::{parse_aer_counters, read_attr, read_u64, AER_DEV_FILES, AER_ROOTPORT_FILES};
use crate::watch::{RecentKmsg, Topology};
use gpufeed_shared::event::{
    AerCounter, AerDetail, AerRootPortTotal, AerSeverity, HostEvent, Source,
};
use std::collections::HashMap;
use std::time::Duration;

#[derive(Debug, Default)]
pub struct AerPoller {
    counters: HashMap<(String, AerSeverity, String), u64>,
    totals: HashMap<(String, AerSeverity), u64>,
    /// Last text of each `aer_dev_*` file: an unchanged file (the usual case) is not parsed.
    texts: HashMap<(String, AerSeverity), String>,
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
        metrics: &Metrics,
        recent: &RecentKmsg,
        context_window: Duration,
        only: Option<&str>,
        detail: Option<&AerDetail>,
    ) -> Vec<HostEvent> {
        let mut out = Vec::new();
        for (bdf, (vmid, is_root)) in &topo.aer_devices {
            if only.is_some_and(|o| o != bdf) {
                continue;
            }
            let dir = roots.pci_devices().join(bdf);
            let vm = vmid_label(*vmid);
            for (file, sev) in AER_DEV_FILES {
                let Some(text) = read_attr(&dir.join(file)) else {
                    continue;
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
                    let c = metrics.aer_errors.with_label_values(&[
                        bdf.as_str(),
                        vm.as_str(),
                        sev.as_str(),
                        name.as_str(),
                    ]);
                    match prev {
                        None => c.inc_by(value),
                        Some(p) if value > p => {
                            c.inc_by(value - p);
                            let ctx = recent
                                .matching(context_window, |r| {
                                    r.bdf.as_deref() == Some(bdf.as_str())
                                        || r.text.contains(bdf.as_str())
                                })
                                .into_iter()
                                .map(|r| r.text)
                                .collect();
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
                        Some(_) => {} // equal, or reset by a device reset: re-baseline
                    }
                }
            }
            if *is_root {
                for (file, sev) in AER_ROOTPORT_FILES {
                    let Some(value) = read_u64(&dir.join(file)) else {
                        continue;
                    };
                    let prev = self.totals.insert((bdf.clone(), sev), value);
                    let c = metrics
                        .aer_rootport
                        .with_label_values(&[bdf.as_str(), sev.as_str()]);
                    match prev {
                        None => c.inc_by(value),
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
}
