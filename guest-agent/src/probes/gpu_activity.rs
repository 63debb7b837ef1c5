//! Whether the GPU worked in a tick: the one place that says what counts as GPU work, read by
//! the collector into its tick report (the join reads the verdict, not the probes).
//!
//! From what the agent has: NVML's per-process SM utilisation (its gauge family is set every
//! tick while NVML is loaded), time in the GPU driver and CUDA synchronisation (windows of
//! their signals, when a unit that has them is loaded: its silence then means idle). A better
//! source plugs in here.

use super::signal::{SignalSpec, SignalWindow, WindowValue};
use super::unit::GaugeValue;

/// The signals whose windows are GPU work: time in the GPU driver (`gpu_driver`), CUDA
/// synchronisation (`cuda`). NVML tells by its own gauge.
pub const GPU_WORK_SIGNALS: &[&str] = &["gpu_ioctl", "gpu_sync_wait"];

/// Whether one of the loaded units' signals is GPU work (its silence then says the GPU idled).
pub fn sees_gpu_work(signals: &[SignalSpec]) -> bool {
    signals.iter().any(|s| GPU_WORK_SIGNALS.contains(&s.name))
}

/// Whether the GPU worked in the tick of `windows` and `gauges`; `gpu_signals`: a unit with
/// [`GPU_WORK_SIGNALS`] is loaded. `None` when nothing loaded can tell.
pub fn gpu_busy(
    windows: &[SignalWindow],
    gauges: &[(&'static str, Vec<GaugeValue>)],
    gpu_signals: bool,
) -> Option<bool> {
    let nvml_busy = gauges
        .iter()
        .find(|(family, _)| *family == super::nvml::SM)
        .map(|(_, values)| values.iter().any(|v| v.value > 0.0));
    let probe_busy = gpu_signals
        && windows.iter().any(|w| {
            GPU_WORK_SIGNALS.contains(&w.signal)
                && matches!(w.value, WindowValue::Latency { count, .. } if count > 0)
        });
    (nvml_busy.is_some() || gpu_signals).then_some(nvml_busy.unwrap_or(false) || probe_busy)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::collect::Owner;
    use crate::probes::unit::no_labels;

    /// The GPU units' own signals are the ones counted as GPU work.
    #[test]
    fn the_gpu_work_signals_are_the_gpu_units_own() {
        use crate::probes::cuda::CudaProbe;
        use crate::probes::gpu_driver::GpuDriverProbe;
        use crate::probes::gpu_process::GpuProcessUnit;
        let ours = [GpuDriverProbe::SIGNAL, CudaProbe::SIGNAL];
        assert_eq!(ours.each_ref().map(|s| s.name), GPU_WORK_SIGNALS);
        assert!(sees_gpu_work(&ours[..1]));
    }

    /// NVML's gauge decides where it is set (a process on the SMs), else the GPU signals'
    /// windows; with neither, nothing can tell.
    #[test]
    fn gpu_busy_reads_nvml_then_the_gpu_signals() {
        let sm = |value: f64| {
            (
                crate::probes::nvml::SM,
                vec![GaugeValue {
                    owner: Owner::Unattributed,
                    labels: no_labels(),
                    value,
                }],
            )
        };
        let ioctl = SignalWindow {
            owner: Owner::Pod {
                uid: "u1".into(),
                container_id: Some("c1".into()),
            },
            signal: "gpu_ioctl",
            at: Instant::now(),
            window: Duration::from_secs(1),
            value: WindowValue::Latency {
                count: 1,
                sum_us: 5.0,
                p50_us: 5.0,
                p99_us: 5.0,
                max_us: 5.0,
            },
        };
        assert_eq!(gpu_busy(&[], &[], false), None);
        assert_eq!(gpu_busy(&[], &[], true), Some(false));
        assert_eq!(
            gpu_busy(std::slice::from_ref(&ioctl), &[], true),
            Some(true)
        );
        assert_eq!(gpu_busy(&[], &[sm(0.0)], false), Some(false));
        assert_eq!(gpu_busy(&[], &[sm(90.0)], false), Some(true));
        assert_eq!(gpu_busy(&[ioctl], &[sm(0.0)], true), Some(true));
    }
}
