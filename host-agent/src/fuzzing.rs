//! Entry points shared by the cargo-fuzz targets (`host-agent/fuzz`) and the stable
//! random-input test: each feeds arbitrary bytes to the agent's parsers. None may panic.

use std::path::Path;

/// /dev/kmsg record parser, stream splitter and classifier.
pub fn kmsg(data: &[u8]) {
    if let Ok(r) = crate::kmsg::parse_record(data) {
        let _ = crate::kmsg::classify(&r);
    }
    let text = String::from_utf8_lossy(data);
    for rec in crate::kmsg::split_records(&text) {
        if let Ok(r) = crate::kmsg::parse_record(rec.as_bytes()) {
            let _ = crate::kmsg::classify(&r);
        }
    }
}

/// sysfs attribute parsers (link speed/width, AER counters, Thunderbolt speeds, PSI).
pub fn sysfs(data: &[u8]) {
    let s = String::from_utf8_lossy(data);
    let _ = crate::sysfs::parse_link_speed(&s);
    let _ = crate::sysfs::parse_link_width(&s);
    let _ = crate::sysfs::parse_aer_counters(&s);
    let _ = crate::sysfs::parse_tb_speed(&s);
    let _ = crate::sysfs::parse_u64(&s);
    let _ = crate::watch::hoststats::parse_psi(&s);
    let _ = crate::discovery::normalize_bdf(&s);
    let _ = crate::discovery::parse_hostpci_id(&s);
    let _ = crate::portname::parse_port_name(&s);
}

/// uevent messages, tracefs lines and rtnetlink dumps.
pub fn wire(data: &[u8]) {
    let _ = crate::uevent::parse_uevent(data);
    let s = String::from_utf8_lossy(data);
    let formats = kernel_formats();
    for line in s.lines() {
        for f in &formats {
            let _ = crate::tracefs::decode(f, line);
        }
    }
    let _ = crate::tracefs::Format::parse(&s);
    let mut rows = Vec::new();
    let _ = crate::rtnetlink::parse_dump_chunk(data, 7, &mut rows);
    let _ = crate::rtnetlink::parse_newlink(data);
    let mut stats = Vec::new();
    let _ = crate::rtnetlink::parse_stats_chunk(data, 7, &mut stats);
    if let Some(u) = crate::uevent::parse_uevent(data) {
        let _ = crate::uevent::react(&u);
    }
}

/// The recorded `format` files of the three tracepoints the agent decodes.
fn kernel_formats() -> Vec<crate::tracefs::Format> {
    [
        include_str!("../tests/fixtures/tracefs/ras-aer_event.format"),
        include_str!("../tests/fixtures/tracefs/pci-pcie_link_event.format"),
        include_str!("../tests/fixtures/tracefs/pci-pci_hp_event.format"),
    ]
    .iter()
    .filter_map(|t| crate::tracefs::Format::parse(t).ok())
    .collect()
}

/// Agent configuration (TOML).
pub fn config(data: &[u8]) {
    let s = String::from_utf8_lossy(data);
    let _ = crate::config::Config::parse(&s, Path::new("fuzz.toml"));
}

/// All of the above.
pub fn all(data: &[u8]) {
    kmsg(data);
    sysfs(data);
    wire(data);
    config(data);
}
