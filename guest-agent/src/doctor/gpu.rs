//! `gpu_compute_source`: a GPU node whose pods' compute time does not come from NVML.
//!
//! Without NVML the compute source falls back to the CUDA launch estimate or to time inside
//! the GPU driver, and a server that launches asynchronously and polls reads a duty cycle and
//! a cost near 0 however busy its SMs are. Nothing in the series says so on its own, so the
//! running agent checks it from its store: the election (which source, why not a better
//! one), what NVML sees, and whether any pod used a GPU.

use gpufeed_shared::doctor::Finding;

use crate::collect::Store;
use crate::owner::Owner;
use crate::probes::gpu_compute::ComputeSource;
use crate::probes::nvml::{GPUS, LIBRARY_INFO};

const CHECK: &str = "gpu_compute_source";

/// What the fix says, whatever the reason NVML is missing.
const FIX: &str = "give the agent NVML: add the gpu component to the overlay (runtimeClassName: \
                   nvidia, NVIDIA_VISIBLE_DEVICES=all, NVIDIA_DRIVER_CAPABILITIES=utility), or on \
                   a node without the NVIDIA container toolkit mount the driver's library \
                   directory and set --nvml-library (docs/install.md, \"NVML\")";

/// The finding for the agent's store after a tick.
pub fn compute_source(store: &Store) -> Finding {
    let compute = &store.stats.compute;
    let nvml_gpus = store
        .stats
        .units
        .iter()
        .flat_map(|u| u.series.iter())
        .find(|s| s.name == GPUS)
        .map(|s| s.value as u64);
    let nvml_library = store
        .stats
        .units
        .iter()
        .flat_map(|u| u.node.iter())
        .find(|f| f.name == LIBRARY_INFO)
        .and_then(|f| f.samples.first())
        .and_then(|(l, _)| l.get("library").cloned());
    let users = gpu_pods(store);
    let why_not = compute
        .unavailable
        .iter()
        .filter(|(s, _)| *s == ComputeSource::Nvml)
        .map(|(_, why)| why.as_str())
        .next();
    match (compute.source, nvml_library, nvml_gpus) {
        (Some(ComputeSource::Nvml), Some(lib), Some(n)) => {
            Finding::pass(CHECK, format!("compute time from NVML ({lib}), {n} GPUs"))
        }
        (_, Some(lib), Some(0)) => Finding::fail(
            CHECK,
            format!("NVML ({lib}) sees 0 GPUs: the agent's container sees no GPU device"),
            "set NVIDIA_VISIBLE_DEVICES=all on the agent (the gpu component does) so that the \
             toolkit gives its container the GPUs",
        ),
        (None, None, None) => {
            Finding::skip(CHECK, "no GPU probe selected (nvml, gpu_driver, cuda)")
        }
        (source, _, _) => {
            let source = source.map_or("none", ComputeSource::label);
            let why = why_not.unwrap_or("the nvml probe is not selected (--probes)");
            if users.is_empty() {
                Finding::pass(
                    CHECK,
                    format!("no pod uses a GPU here; compute source {source} (NVML: {why})"),
                )
            } else {
                Finding::fail(
                    CHECK,
                    format!(
                        "{} pods use a GPU ({}) but their compute time comes from {source}, \
                         which reads near 0 for asynchronous launches: {why}",
                        users.len(),
                        users.join(", ")
                    ),
                    FIX,
                )
            }
        }
    }
}

/// Pods with any GPU series: driver calls, CUDA calls, compute time, NVML memory.
fn gpu_pods(store: &Store) -> Vec<String> {
    let gpu_family = |f: &str| f.starts_with("ebpf_gpu_") || f.starts_with("ebpf_cuda_");
    let mut out: Vec<String> = store
        .owners
        .iter()
        .filter(|(_, o)| o.gone_since.is_none())
        .filter(|(_, o)| {
            o.series.iter().any(|((f, _), v)| {
                gpu_family(f)
                    && match v {
                        crate::probes::unit::Value::Count(n) => *n > 0,
                        crate::probes::unit::Value::Hist(h) => !h.is_empty(),
                    }
            })
        })
        .filter_map(|(owner, _)| pod_name(owner))
        .collect();
    for (f, values) in &store.gauges {
        if f.starts_with("gpufeed_nvml_process_") {
            out.extend(
                values
                    .iter()
                    .filter(|g| g.value > 0.0)
                    .filter_map(|g| pod_name(&g.owner)),
            );
        }
    }
    out.sort();
    out.dedup();
    out
}

/// A pod's UID (the store keys pods by UID; names come from the API).
fn pod_name(owner: &Owner) -> Option<String> {
    match owner {
        Owner::Pod { uid, .. } => Some(format!("pod {uid}")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::unit::{Labels, NodeFamily, SelfSeries, UnitStats, Value};
    use crate::probes::ComputeStatus;

    fn store(
        source: Option<ComputeSource>,
        why: Option<&str>,
        nvml: Option<(&str, u64)>,
        pod_driver_ns: u64,
    ) -> Store {
        let mut s = Store::default();
        s.stats.compute = ComputeStatus {
            source,
            unavailable: why
                .map(|w| (ComputeSource::Nvml, w.to_string()))
                .into_iter()
                .collect(),
        };
        if let Some((lib, n)) = nvml {
            s.stats.units.push(UnitStats {
                series: vec![SelfSeries::gauge(GPUS, "", n as f64)],
                node: vec![NodeFamily {
                    name: LIBRARY_INFO,
                    help: "",
                    kind: crate::probes::unit::Kind::Gauge,
                    samples: vec![(Labels::from([("library", lib.to_string())]), 1.0)],
                }],
                ..UnitStats::default()
            });
        } else {
            s.stats.units.push(UnitStats {
                series: vec![SelfSeries::gauge(GPUS, "", 0.0)],
                ..UnitStats::default()
            });
        }
        let owner = Owner::Pod {
            uid: "u1".into(),
            container_id: None,
        };
        let o = s.owners.entry(owner).or_default();
        o.series.insert(
            ("ebpf_gpu_driver_time_seconds_total", Labels::new()),
            Value::Count(pod_driver_ns),
        );
        s
    }

    #[test]
    fn a_gpu_node_without_nvml_fails_with_the_fix() {
        let why = "libnvidia-ml.so.1 not found in the loader's path nor in /usr/lib64";
        let f = compute_source(&store(Some(ComputeSource::DriverTime), Some(why), None, 5));
        assert_eq!(f.status, gpufeed_shared::doctor::Status::Fail, "{f:?}");
        assert!(
            f.detail.contains("driver_time") && f.detail.contains(why),
            "{}",
            f.detail
        );
        assert!(f.detail.contains("pod u1"), "{}", f.detail);
        assert!(f.fix.as_deref().unwrap().contains("runtimeClassName"));

        // no pod used the GPU: nothing is wrong yet
        let f = compute_source(&store(Some(ComputeSource::DriverTime), Some(why), None, 0));
        assert!(f.passed(), "{f:?}");
        assert!(f.detail.contains(why));

        // NVML there, sees GPUs: pass naming the library
        let f = compute_source(&store(
            Some(ComputeSource::Nvml),
            None,
            Some(("/x/lib.so", 2)),
            5,
        ));
        assert!(f.passed() && f.detail.contains("/x/lib.so") && f.detail.contains("2 GPUs"));

        // NVML there, 0 GPUs: fail whatever the pods
        let f = compute_source(&store(
            Some(ComputeSource::DriverTime),
            Some("NVML sees 0 GPUs"),
            Some(("/x/lib.so", 0)),
            0,
        ));
        assert_eq!(f.status, gpufeed_shared::doctor::Status::Fail);
        assert!(f.detail.contains("0 GPUs"), "{}", f.detail);
        assert!(f
            .fix
            .as_deref()
            .unwrap()
            .contains("NVIDIA_VISIBLE_DEVICES=all"));
    }
}
