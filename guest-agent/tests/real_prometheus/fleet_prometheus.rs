//! The fleet as one Prometheus reads it, and as a long-term store receives it: two host agents
//! (`pve-a`, `pve-b`), each on its own recorded eGPU tree and streaming to its own guest agent;
//! a real Prometheus scrapes both guests with the shipped fleet rules (the `gpufeed.fleet`
//! group, evaluated every second here instead of every minute, so that a "degraded minute"
//! is a degraded second) and remote-writes everything to a second Prometheus started with its
//! receiver on (`--web.enable-remote-write-receiver`), as docs/install.md configures a fleet
//! past one Prometheus.
//!
//! pve-a's link drops to x1 for a few seconds; pve-b's stays at x4: the second Prometheus
//! holds both guests' copies of both hosts' series, and the fleet rule counts degraded samples
//! for pve-a only, the same count the first Prometheus has.

use crate::common;
use crate::manifests;

use std::time::Duration;

use common::host_agent::*;
use common::*;
use manifests::{kustomize_dir, yaml_documents};

/// The shipped `gpufeed.fleet` group as a rule file, evaluated every second.
fn fleet_rules() -> String {
    let path = kustomize_dir("components/prometheus-operator/prometheus-rules.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let pr = &yaml_documents(&text, "prometheus-rules.yaml")[0];
    let mut group = pr["spec"]["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|g| g["name"].as_str() == Some("gpufeed.fleet"))
        .expect("the gpufeed.fleet group")
        .clone();
    group["interval"] = "1s".into();
    let mut file = serde_yaml::Mapping::new();
    file.insert("groups".into(), vec![group].into());
    serde_yaml::to_string(&file).unwrap()
}

#[test]
fn two_hosts_two_guests_one_prometheus_and_a_remote_write_store() {
    let Some(_lock) = require_root() else { return };
    let hosts = ["pve-a", "pve-b"];
    let dirs: Vec<tempfile::TempDir> = hosts.iter().map(|_| tempfile::tempdir().unwrap()).collect();
    let mut pairs = Vec::new();
    for (host, dir) in hosts.iter().zip(&dirs) {
        let root = dir.path().join("root");
        demo(&["tree", root.to_str().unwrap()]);
        let quic = free_port();
        let h = start_host_named(
            dir.path(),
            host,
            quic,
            HostIntervals::FAST,
            "enabled = false\n",
        );
        let g = guest_of_host_named(dir.path(), host, quic, "1s", "none", &[]);
        pairs.push((h, g, root));
    }
    let store = Prometheus::receiver();
    let targets: Vec<String> = pairs
        .iter()
        .map(|(_, g, _)| format!("'{}'", g.addr))
        .collect();
    let write = store.addr();
    let prom = Prometheus::start_with(|dir| {
        std::fs::write(dir.join("fleet.yaml"), fleet_rules()).unwrap();
        format!(
            "rule_files:\n  - {}\nremote_write:\n  - url: http://{write}/api/v1/write\n    \
             queue_config:\n      batch_send_deadline: 1s\nscrape_configs:\n  - job_name: gpufeed-guest\n    \
             static_configs:\n      - targets: [{}]\n",
            dir.join("fleet.yaml").display(),
            targets.join(", ")
        )
    });

    // pve-a's GPU link drops to x1 for a few seconds, pve-b's stays at its maximum
    demo(&["link", pairs[0].2.to_str().unwrap(), "2.5 GT/s PCIe", "1"]);
    let width = |p: &Prometheus, host: &str| {
        p.scalar(&format!(
            "max(gpufeed_host_pcie_link_width{{host=\"{host}\",bdf=\"{GPU}\"}})"
        ))
    };
    wait_for(Duration::from_secs(30), || {
        (width(&prom, "pve-a") == Some(1.0)).then_some(())
    })
    .expect("pve-a's drop in its guest's scrape");
    std::thread::sleep(Duration::from_secs(5));
    demo(&["link", pairs[0].2.to_str().unwrap(), "16.0 GT/s PCIe", "4"]);
    wait_for(Duration::from_secs(30), || {
        (width(&prom, "pve-a") == Some(4.0)).then_some(())
    })
    .expect("pve-a's link restored");

    // the fleet rule: degraded samples for pve-a, none for pve-b
    let degraded = |p: &Prometheus, host: &str| {
        p.scalar(&format!(
            "host:gpufeed_host_pcie_link_degraded_minutes:sum1h{{host=\"{host}\"}}"
        ))
    };
    let a = degraded(&prom, "pve-a").expect("pve-a's degraded count");
    assert!(
        a >= 4.0,
        "pve-a degraded for ~5 s, counted {a} one-second samples"
    );
    assert_eq!(degraded(&prom, "pve-b"), Some(0.0));

    // the store received what the first Prometheus scraped and recorded: both guests' copies
    // of both hosts' series and the fleet rule's result, equal to the first's
    let at = |p: &Prometheus, q: &str| {
        p.scalar(&format!(
            "{q} @ {}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                - 10
        ))
    };
    let sent = wait_for(Duration::from_secs(30), || {
        let both = hosts.iter().all(|h| width(&store, h) == Some(4.0));
        let recorded = degraded(&store, "pve-a").is_some_and(|v| v >= 4.0)
            && degraded(&store, "pve-b") == Some(0.0);
        (both && recorded).then_some(())
    });
    assert!(
        sent.is_some(),
        "in the store: widths {:?} {:?}, degraded {:?} {:?}",
        width(&store, "pve-a"),
        width(&store, "pve-b"),
        degraded(&store, "pve-a"),
        degraded(&store, "pve-b")
    );
    let q = "host:gpufeed_host_pcie_link_degraded_minutes:sum1h{host=\"pve-a\"}";
    assert_eq!(
        at(&store, q),
        at(&prom, q),
        "the same value ten seconds ago in both"
    );
    let up = store.query("up{job=\"gpufeed-guest\"}").unwrap().len();
    assert_eq!(up, 2, "both guests' scrapes in the store");
}
