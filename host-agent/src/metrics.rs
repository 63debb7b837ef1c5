//! Host-local Prometheus view (`/metrics`). Series names are a contract (see docs/host-agent.md).
//! Every series carries the constant label `host`.

use prometheus::{
    CounterVec, Encoder, Gauge, GaugeVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
    TextEncoder,
};
use std::collections::HashMap;
use std::sync::Arc;

pub struct Metrics {
    pub registry: Registry,
    pub pcie_speed: GaugeVec,
    pub pcie_width: IntGaugeVec,
    pub pcie_max_speed: GaugeVec,
    pub pcie_max_width: IntGaugeVec,
    pub pcie_changes: IntCounterVec,
    pub aer_errors: IntCounterVec,
    pub aer_rootport: IntCounterVec,
    pub tb_speed: GaugeVec,
    pub tb_lanes: IntGaugeVec,
    pub tb_authorized: IntGaugeVec,
    pub bridge_bytes: IntCounterVec,
    pub bridge_packets: IntCounterVec,
    pub bridge_drops: IntCounterVec,
    pub bridge_errors: IntCounterVec,
    pub bridge_microburst: GaugeVec,
    pub vm_up: IntGaugeVec,
    pub vm_state: IntGaugeVec,
    pub vcpu_run_delay: CounterVec,
    pub host_cpu: Gauge,
    pub host_mem_total: Gauge,
    pub host_mem_available: Gauge,
    pub host_pressure: CounterVec,
    pub kmsg_records: IntCounterVec,
    pub kmsg_lost: IntCounter,
    pub events: IntCounterVec,
    pub watcher_enabled: IntGaugeVec,
}

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> T {
    r.register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

impl Metrics {
    pub fn new(host: &str) -> Arc<Metrics> {
        let mut labels = HashMap::new();
        labels.insert("host".to_string(), host.to_string());
        let r = Registry::new_custom(None, Some(labels)).expect("valid registry");
        let gv = |n: &str, h: &str, l: &[&str]| reg(&r, GaugeVec::new(Opts::new(n, h), l).unwrap());
        let igv =
            |n: &str, h: &str, l: &[&str]| reg(&r, IntGaugeVec::new(Opts::new(n, h), l).unwrap());
        let icv =
            |n: &str, h: &str, l: &[&str]| reg(&r, IntCounterVec::new(Opts::new(n, h), l).unwrap());
        let cv =
            |n: &str, h: &str, l: &[&str]| reg(&r, CounterVec::new(Opts::new(n, h), l).unwrap());
        let g = |n: &str, h: &str| reg(&r, Gauge::new(n, h).unwrap());
        Arc::new(Metrics {
            pcie_speed: gv(
                "gpufeed_host_pcie_link_speed_gts",
                "Current PCIe link speed in GT/s (0 = down)",
                &["bdf", "vmid"],
            ),
            pcie_width: igv(
                "gpufeed_host_pcie_link_width",
                "Current PCIe link width in lanes (0 = down)",
                &["bdf", "vmid"],
            ),
            pcie_max_speed: gv(
                "gpufeed_host_pcie_link_max_speed_gts",
                "Maximum PCIe link speed in GT/s",
                &["bdf", "vmid"],
            ),
            pcie_max_width: igv(
                "gpufeed_host_pcie_link_max_width",
                "Maximum PCIe link width in lanes",
                &["bdf", "vmid"],
            ),
            pcie_changes: icv(
                "gpufeed_host_pcie_link_changes_total",
                "PCIe link changes by class",
                &["bdf", "vmid", "change"],
            ),
            aer_errors: icv(
                "gpufeed_host_aer_errors_total",
                "AER errors counted by the device (named counters of aer_dev_*)",
                &["bdf", "vmid", "severity", "error"],
            ),
            aer_rootport: icv(
                "gpufeed_host_aer_rootport_errors_total",
                "AER errors counted by a root port for its hierarchy",
                &["bdf", "severity"],
            ),
            tb_speed: gv(
                "gpufeed_host_thunderbolt_link_speed_gbps",
                "Thunderbolt/USB4 per-lane link speed in Gb/s",
                &["device", "direction"],
            ),
            tb_lanes: igv(
                "gpufeed_host_thunderbolt_lanes",
                "Thunderbolt/USB4 lanes in use",
                &["device", "direction"],
            ),
            tb_authorized: igv(
                "gpufeed_host_thunderbolt_authorized",
                "Thunderbolt router authorized value (0,1,2)",
                &["device"],
            ),
            bridge_bytes: icv(
                "gpufeed_host_bridge_bytes_total",
                "Bytes through a bridge port; direction from the VM's side for VM ports",
                &["bridge", "port", "vmid", "direction"],
            ),
            bridge_packets: icv(
                "gpufeed_host_bridge_packets_total",
                "Packets through a bridge port",
                &["bridge", "port", "vmid", "direction"],
            ),
            bridge_drops: icv(
                "gpufeed_host_bridge_drops_total",
                "Dropped packets on a bridge port",
                &["bridge", "port", "vmid", "direction"],
            ),
            bridge_errors: icv(
                "gpufeed_host_bridge_errors_total",
                "Errors on a bridge port",
                &["bridge", "port", "vmid", "direction"],
            ),
            bridge_microburst: gv(
                "gpufeed_host_bridge_microburst_bytes_per_second",
                "Highest sample-window byte rate in the last period",
                &["bridge", "port", "vmid", "direction"],
            ),
            vm_up: igv(
                "gpufeed_host_vm_up",
                "1 if the VM's QEMU process runs and the guest is running",
                &["vmid"],
            ),
            vm_state: igv(
                "gpufeed_host_vm_state",
                "1 for the VM's current state",
                &["vmid", "state"],
            ),
            vcpu_run_delay: cv(
                "gpufeed_host_vcpu_run_delay_seconds_total",
                "Time the VM's vCPU threads waited for a host CPU (schedstat)",
                &["vmid"],
            ),
            host_cpu: g("gpufeed_host_cpu_usage_ratio", "Host CPU usage 0..1"),
            host_mem_total: g("gpufeed_host_memory_total_bytes", "Host memory"),
            host_mem_available: g(
                "gpufeed_host_memory_available_bytes",
                "Host memory available",
            ),
            host_pressure: cv(
                "gpufeed_host_pressure_stall_seconds_total",
                "PSI stall time",
                &["resource", "kind"],
            ),
            kmsg_records: icv(
                "gpufeed_host_kmsg_records_total",
                "Kernel log records by class",
                &["class"],
            ),
            kmsg_lost: reg(
                &r,
                IntCounter::new(
                    "gpufeed_host_kmsg_lost_records_total",
                    "Kernel log records lost (sequence gaps)",
                )
                .unwrap(),
            ),
            events: icv(
                "gpufeed_host_events_total",
                "Events emitted by kind",
                &["kind"],
            ),
            watcher_enabled: igv(
                "gpufeed_host_watcher_enabled",
                "1 if the watcher runs, 0 if it is off",
                &["watcher"],
            ),
            registry: r,
        })
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

pub fn vmid_label(v: Option<u32>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// Serve `/metrics` until the listener fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    use axum::{http::header, response::IntoResponse, routing::get, Router};
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        m.render(),
                    )
                        .into_response()
                }
            }),
        )
        .route("/", get(|| async { "gpufeed-host: see /metrics\n" }));
    axum::serve(listener, app).await
}
