//! Discovery: which host PCI devices belong to which VM, the PCIe links on each device's path
//! to its root port, and the Thunderbolt router that carries it.
//!
//! Sources: `hostpciN:` lines of `/etc/pve/qemu-server/<vmid>.conf` in every documented form
//! (`01:00.0`, `0000:01:00.0`, `01:00` = all functions, `host=A;B`, `mapping=<id>` through
//! `/etc/pve/mapping/pci.cfg`), plus `devices` from the agent's config.

use crate::config::check::{range, Invalid};
use crate::roots::Roots;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `[discovery]`: how often the Proxmox configs and the sysfs topology are read again (a
/// uevent of a PCI or Thunderbolt device also triggers a rescan).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    pub rescan_interval_ms: u64,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            rescan_interval_ms: 30_000,
        }
    }
}

impl DiscoveryConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        range(
            "discovery.rescan_interval_ms",
            self.rescan_interval_ms,
            100,
            86_400_000,
        )
    }
}

/// Normalize a PCI address to `dddd:bb:dd.f` (lower case). Accepts `bb:dd.f` (domain 0000).
/// Returns `None` for anything else. A function-less `bb:dd` is handled by [`parse_hostpci_id`].
pub fn normalize_bdf(s: &str) -> Option<String> {
    let s = s.trim();
    let (dom, rest) = match s.matches(':').count() {
        2 => {
            let (d, r) = s.split_once(':')?;
            (d, r)
        }
        1 => ("0000", s),
        _ => return None,
    };
    let (bus, df) = rest.split_once(':')?;
    let (dev, func) = df.split_once('.')?;
    let hex = |x: &str, max_len: usize| {
        !x.is_empty() && x.len() <= max_len && x.bytes().all(|b| b.is_ascii_hexdigit())
    };
    if !(hex(dom, 4) && hex(bus, 2) && hex(dev, 2) && func.len() == 1 && hex(func, 1)) {
        return None;
    }
    let d = u32::from_str_radix(dom, 16).ok()?;
    let b = u32::from_str_radix(bus, 16).ok()?;
    let v = u32::from_str_radix(dev, 16).ok()?;
    let f = u32::from_str_radix(func, 16).ok()?;
    if v > 0x1f || f > 7 {
        return None;
    }
    Some(format!("{d:04x}:{b:02x}:{v:02x}.{f:x}"))
}

/// One host PCI id of a `hostpci` entry: either one function or all functions of a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PciId {
    Function(String),
    /// `dddd:bb:dd` — every function of the device.
    AllFunctions(String),
}

/// Parse `01:00.0`, `0000:01:00.0`, `01:00`, `0000:01:00`.
pub fn parse_hostpci_id(s: &str) -> Option<PciId> {
    let s = s.trim();
    if s.contains('.') {
        return normalize_bdf(s).map(PciId::Function);
    }
    normalize_bdf(&format!("{s}.0")).map(|b| PciId::AllFunctions(b[..b.len() - 2].to_string()))
}

/// A device the agent watches and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub bdf: String,
    pub vmid: Option<u32>,
    /// `hostpci0`, or `config` for the agent's `devices`.
    pub origin: String,
}

/// Result of reading the Proxmox configuration.
#[derive(Debug, Default, Clone)]
pub struct PveScan {
    pub assignments: Vec<Assignment>,
    /// VMIDs with a config file.
    pub vmids: BTreeSet<u32>,
    /// `file:line: problem` for every line that could not be used.
    pub warnings: Vec<String>,
    /// False when `/etc/pve` does not exist (not a Proxmox host).
    pub pve_present: bool,
}

/// One `map` entry of `/etc/pve/mapping/pci.cfg`.
#[derive(Debug, Clone, Default)]
struct MapEntry {
    node: Option<String>,
    paths: Vec<String>,
    id: Option<String>,
}

/// Parse `/etc/pve/mapping/pci.cfg`: `<id>` lines followed by indented `map k=v,...` lines.
fn parse_mapping_cfg(
    text: &str,
    file: &Path,
    warnings: &mut Vec<String>,
) -> BTreeMap<String, Vec<MapEntry>> {
    let mut out: BTreeMap<String, Vec<MapEntry>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for (i, raw) in text.lines().enumerate() {
        let lineno = i + 1;
        if raw.trim().is_empty() || raw.trim_start().starts_with('#') {
            continue;
        }
        let indented = raw.starts_with(' ') || raw.starts_with('\t');
        let line = raw.trim();
        if !indented {
            if line.split_whitespace().count() != 1 {
                warnings.push(format!(
                    "{}:{lineno}: expected a mapping id, got `{line}`",
                    file.display()
                ));
                current = None;
                continue;
            }
            current = Some(line.to_string());
            out.entry(line.to_string()).or_default();
            continue;
        }
        let Some(id) = current.clone() else {
            warnings.push(format!(
                "{}:{lineno}: property outside of a mapping",
                file.display()
            ));
            continue;
        };
        let (key, value) = match line.split_once(char::is_whitespace) {
            Some((k, v)) => (k, v.trim()),
            None => (line, ""),
        };
        if key != "map" {
            continue; // description, mdev, live-migration-capable, ...
        }
        let mut e = MapEntry::default();
        for kv in value.split(',') {
            let Some((k, v)) = kv.split_once('=') else {
                continue;
            };
            match k.trim() {
                "node" => e.node = Some(v.trim().to_string()),
                "id" => e.id = Some(v.trim().to_string()),
                "path" => {
                    for p in v.split(';') {
                        match parse_hostpci_id(p) {
                            Some(PciId::Function(b)) => e.paths.push(b),
                            Some(PciId::AllFunctions(b)) => e.paths.push(format!("{b}.*")),
                            None => warnings.push(format!(
                                "{}:{lineno}: mapping `{id}`: bad path `{p}`",
                                file.display()
                            )),
                        }
                    }
                }
                _ => {}
            }
        }
        if e.paths.is_empty() {
            warnings.push(format!(
                "{}:{lineno}: mapping `{id}`: map without a path",
                file.display()
            ));
            continue;
        }
        out.entry(id).or_default().push(e);
    }
    out
}

/// Expand `dddd:bb:dd` to its functions present in sysfs (or `.0` if none is present).
fn expand_all_functions(roots: &Roots, slot: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(roots.pci_devices())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    n.len() == slot.len() + 2
                        && n.starts_with(slot)
                        && n.as_bytes()[slot.len()] == b'.'
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    if v.is_empty() {
        v.push(format!("{slot}.0"));
    }
    v
}

/// The SMBIOS system UUID of a VM's running configuration: the `uuid=` of its `smbios1:`
/// line (the sections after the first `[` are snapshots and pending changes). `None` where
/// there is none or it is not a UUID.
pub fn smbios_uuid_of_conf(text: &str) -> Option<String> {
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            break;
        }
        let Some(value) = line.strip_prefix("smbios1:") else {
            continue;
        };
        return value
            .split(',')
            .filter_map(|part| part.trim().strip_prefix("uuid="))
            .find_map(gpufeed_shared::smbios::parse_uuid);
    }
    None
}

/// Every VM of this host with an SMBIOS UUID (`smbios1: uuid=` of
/// `/etc/pve/qemu-server/<vmid>.conf`): what a guest's `product_uuid` is matched against.
/// Read whenever a guest names its VM, so that a VM created since the last scan is found.
pub fn vm_smbios_uuids(roots: &Roots) -> BTreeMap<u32, String> {
    let dir = roots.pve().join("qemu-server");
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return BTreeMap::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let vmid = name.strip_suffix(".conf")?.parse::<u32>().ok()?;
            let text = std::fs::read_to_string(e.path()).ok()?;
            Some((vmid, smbios_uuid_of_conf(&text)?))
        })
        .collect()
}

/// Read every `/etc/pve/qemu-server/<vmid>.conf` and resolve `hostpciN` entries.
/// `node` is this Proxmox node's name (for `mapping=`).
pub fn scan_pve(roots: &Roots, node: &str) -> PveScan {
    let mut scan = PveScan::default();
    let pve = roots.pve();
    if !pve.is_dir() {
        return scan;
    }
    scan.pve_present = true;
    let map_file = pve.join("mapping/pci.cfg");
    let mappings = match std::fs::read_to_string(&map_file) {
        Ok(t) => parse_mapping_cfg(&t, &map_file, &mut scan.warnings),
        Err(_) => BTreeMap::new(),
    };
    let dir = pve.join("qemu-server");
    let mut files: Vec<(u32, PathBuf)> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let vmid = name.strip_suffix(".conf")?.parse::<u32>().ok()?;
                    Some((vmid, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    for (vmid, path) in files {
        scan.vmids.insert(vmid);
        let Ok(text) = std::fs::read_to_string(&path) else {
            scan.warnings
                .push(format!("{}: cannot read", path.display()));
            continue;
        };
        parse_vm_conf(roots, vmid, &text, &path, &mappings, node, &mut scan);
    }
    scan
}

fn parse_vm_conf(
    roots: &Roots,
    vmid: u32,
    text: &str,
    path: &Path,
    mappings: &BTreeMap<String, Vec<MapEntry>>,
    node: &str,
    scan: &mut PveScan,
) {
    for (i, raw) in text.lines().enumerate() {
        let lineno = i + 1;
        let line = raw.trim();
        if line.starts_with('[') {
            break; // snapshots, [PENDING], [special:cloudinit]: not the running config
        }
        let Some(rest) = line.strip_prefix("hostpci") else {
            continue;
        };
        let Some((idx, value)) = rest.split_once(':') else {
            scan.warnings.push(format!(
                "{}:{lineno}: hostpci line without `:`",
                path.display()
            ));
            continue;
        };
        let Ok(n) = idx.trim().parse::<u8>() else {
            scan.warnings.push(format!(
                "{}:{lineno}: bad hostpci index `hostpci{idx}`",
                path.display()
            ));
            continue;
        };
        let origin = format!("hostpci{n}");
        let mut ids: Vec<String> = Vec::new();
        let mut mapping: Option<String> = None;
        let mut bad = None;
        for (j, part) in value.split(',').enumerate() {
            let part = part.trim();
            let (k, v) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None if j == 0 => ("host", part),
                None => {
                    bad = Some(format!("unexpected `{part}`"));
                    break;
                }
            };
            match k {
                "host" => {
                    for id in v.split(';') {
                        match parse_hostpci_id(id) {
                            Some(PciId::Function(b)) => ids.push(b),
                            Some(PciId::AllFunctions(s)) => {
                                ids.extend(expand_all_functions(roots, &s))
                            }
                            None => {
                                bad = Some(format!("bad PCI address `{id}`"));
                                break;
                            }
                        }
                    }
                }
                "mapping" => mapping = Some(v.to_string()),
                _ => {} // pcie, x-vga, rombar, romfile, mdev, vendor-id, ...
            }
            if bad.is_some() {
                break;
            }
        }
        if let Some(problem) = bad {
            scan.warnings
                .push(format!("{}:{lineno}: {origin}: {problem}", path.display()));
            continue;
        }
        if let Some(m) = mapping {
            match mappings.get(&m) {
                None => {
                    scan.warnings.push(format!(
                        "{}:{lineno}: {origin}: mapping `{m}` not found in /etc/pve/mapping/pci.cfg",
                        path.display()
                    ));
                    continue;
                }
                Some(entries) => {
                    let chosen = entries
                        .iter()
                        .find(|e| e.node.as_deref() == Some(node))
                        .or_else(|| {
                            if entries.len() == 1 && entries[0].node.is_none() {
                                entries.first()
                            } else {
                                None
                            }
                        });
                    let Some(e) = chosen else {
                        scan.warnings.push(format!(
                            "{}:{lineno}: {origin}: mapping `{m}` has no entry for node `{node}`",
                            path.display()
                        ));
                        continue;
                    };
                    for p in &e.paths {
                        if let Some(slot) = p.strip_suffix(".*") {
                            ids.extend(expand_all_functions(roots, slot));
                        } else {
                            ids.push(p.clone());
                        }
                    }
                    if let (Some(want), Some(first)) = (&e.id, ids.first()) {
                        let dev = roots.pci_devices().join(first);
                        let got = format!(
                            "{}:{}",
                            crate::sysfs::read_attr(&dev.join("vendor"))
                                .unwrap_or_default()
                                .trim_start_matches("0x"),
                            crate::sysfs::read_attr(&dev.join("device"))
                                .unwrap_or_default()
                                .trim_start_matches("0x")
                        );
                        if dev.exists() && !got.eq_ignore_ascii_case(want) {
                            scan.warnings.push(format!(
                                "{}:{lineno}: {origin}: mapping `{m}` expects id {want} at {first}, sysfs has {got}",
                                path.display()
                            ));
                        }
                    }
                }
            }
        }
        if ids.is_empty() {
            scan.warnings.push(format!(
                "{}:{lineno}: {origin}: no PCI device given",
                path.display()
            ));
            continue;
        }
        for bdf in ids {
            scan.assignments.push(Assignment {
                bdf,
                vmid: Some(vmid),
                origin: origin.clone(),
            });
        }
    }
}

/// One PCIe link on a device's path, identified by its downstream-end device (the endpoint or
/// switch upstream port whose `current_link_*` describe it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub child: String,
    pub parent: Option<String>,
    /// A Thunderbolt/USB4 tunnel hop (synthetic speed).
    pub virtual_tunnel: bool,
    pub target: String,
    pub vmid: Option<u32>,
}

/// Topology of one watched device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTopology {
    pub assignment: Assignment,
    /// From the device up to the root port.
    pub path: Vec<String>,
    pub links: Vec<Link>,
    pub thunderbolt_router: Option<String>,
    pub present: bool,
}

fn is_bdf(s: &str) -> bool {
    normalize_bdf(s).as_deref() == Some(s)
}

/// BDFs from the device up to the root port (from the canonical sysfs path).
pub fn pci_path(roots: &Roots, bdf: &str) -> Option<Vec<String>> {
    let link = roots.pci_devices().join(bdf);
    let canon = std::fs::canonicalize(&link).ok()?;
    let mut v: Vec<String> = canon
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .filter(|c| is_bdf(c))
        .map(|s| s.to_string())
        .collect();
    v.reverse();
    if v.first().map(String::as_str) != Some(bdf) {
        return None;
    }
    Some(v)
}

fn removable(roots: &Roots, bdf: &str) -> bool {
    crate::sysfs::read_attr(&roots.pci_devices().join(bdf).join("removable")).as_deref()
        == Some("removable")
}

fn is_bridge(roots: &Roots, bdf: &str) -> bool {
    crate::sysfs::read_attr(&roots.pci_devices().join(bdf).join("class"))
        .map(|c| c.to_ascii_lowercase().starts_with("0x0604"))
        .unwrap_or(false)
}

/// Links on a path `[device, p1, p2, ..., root port]`: the device's own link, then every
/// second hop (a switch's downstream port and upstream port share an internal bus, not a link).
pub fn links_of_path(roots: &Roots, path: &[String], target: &str, vmid: Option<u32>) -> Vec<Link> {
    let mut out = Vec::new();
    let mut i = 0;
    while i + 1 < path.len() {
        let child = &path[i];
        let parent = &path[i + 1];
        // A function other than 0 shares function 0's link.
        let child = match child.rsplit_once('.') {
            Some((slot, f))
                if f != "0" && roots.pci_devices().join(format!("{slot}.0")).exists() =>
            {
                format!("{slot}.0")
            }
            _ => child.clone(),
        };
        let max = crate::sysfs::read_attr(&roots.pci_devices().join(&child).join("max_link_speed"))
            .and_then(|s| crate::sysfs::parse_link_speed(&s));
        let virtual_tunnel = removable(roots, &child)
            && is_bridge(roots, &child)
            && (!removable(roots, parent) || max == Some(2500));
        out.push(Link {
            child,
            parent: Some(parent.clone()),
            virtual_tunnel,
            target: target.to_string(),
            vmid,
        });
        i += 2;
    }
    out
}

/// Thunderbolt router (`0-1`) whose domain tunnels PCIe into this path, if unambiguous.
pub fn thunderbolt_router_for(roots: &Roots, path: &[String]) -> Option<String> {
    let tb = roots.thunderbolt_devices();
    let rd = std::fs::read_dir(&tb).ok()?;
    let mut names: Vec<String> = rd
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    for dom in names.iter().filter(|n| n.starts_with("domain")) {
        let Some(num) = dom.strip_prefix("domain") else {
            continue;
        };
        let Ok(canon) = std::fs::canonicalize(tb.join(dom)) else {
            continue;
        };
        let Some(nhi_dir) = canon.parent() else {
            continue;
        };
        let nhi_chain: Vec<String> = nhi_dir
            .components()
            .filter_map(|c| c.as_os_str().to_str())
            .filter(|c| is_bdf(c))
            .map(String::from)
            .collect();
        // USB4: the NHI links its tunnel root ports as device-link consumers.
        let mut ports: Vec<String> = std::fs::read_dir(nhi_dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter_map(|n| n.strip_prefix("consumer:pci:").map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        // TB3: the NHI sits below the controller's upstream port, beside the tunnel ports.
        if nhi_chain.len() >= 3 {
            ports.push(nhi_chain[nhi_chain.len() - 3].clone());
        }
        if !ports.iter().any(|p| path.contains(p)) {
            continue;
        }
        let routers: Vec<&String> = names
            .iter()
            .filter(|n| is_router_name(n) && n.split('-').next() == Some(num) && !n.ends_with("-0"))
            .collect();
        if routers.len() == 1 {
            return Some(routers[0].clone());
        }
        // Several routers: prefer the one whose removable flag... ambiguous, report none.
        return None;
    }
    None
}

/// `0-1`, `1-301`: a device router (not `domain0`, `0-1.1` xdomain, `0-0:1.1` retimer).
pub fn is_router_name(n: &str) -> bool {
    match n.split_once('-') {
        Some((d, r)) => {
            !d.is_empty()
                && d.bytes().all(|b| b.is_ascii_digit())
                && !r.is_empty()
                && r.bytes().all(|b| b.is_ascii_hexdigit())
        }
        None => false,
    }
}

/// Full discovery: Proxmox assignments plus configured devices, with topology.
pub fn discover(roots: &Roots, node: &str, extra: &[String]) -> (PveScan, Vec<DeviceTopology>) {
    let mut scan = scan_pve(roots, node);
    for d in extra {
        if let Some(b) = normalize_bdf(d) {
            if !scan.assignments.iter().any(|a| a.bdf == b) {
                scan.assignments.push(Assignment {
                    bdf: b,
                    vmid: None,
                    origin: "config".into(),
                });
            }
        }
    }
    let mut topo = Vec::new();
    let mut seen = BTreeSet::new();
    for a in &scan.assignments {
        if !seen.insert(a.bdf.clone()) {
            continue;
        }
        match pci_path(roots, &a.bdf) {
            Some(path) => {
                let links = links_of_path(roots, &path, &a.bdf, a.vmid);
                let tb = thunderbolt_router_for(roots, &path);
                topo.push(DeviceTopology {
                    assignment: a.clone(),
                    path,
                    links,
                    thunderbolt_router: tb,
                    present: true,
                });
            }
            None => topo.push(DeviceTopology {
                assignment: a.clone(),
                path: vec![a.bdf.clone()],
                links: vec![],
                thunderbolt_router: None,
                present: false,
            }),
        }
    }
    (scan, topo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smbios_uuid_of_the_running_config() {
        let conf = "boot: order=scsi0\nsmbios1: uuid=9A8B7C6D-0101-4000-8000-000000000101,manufacturer=cHZl\nhostpci0: 0000:03:00,pcie=1\n[snap1]\nsmbios1: uuid=11111111-2222-3333-4444-555555555555\n";
        assert_eq!(
            smbios_uuid_of_conf(conf).as_deref(),
            Some("9a8b7c6d-0101-4000-8000-000000000101")
        );
        assert_eq!(
            smbios_uuid_of_conf("smbios1: base64=1,uuid=11111111-2222-3333-4444-555555555555")
                .as_deref(),
            Some("11111111-2222-3333-4444-555555555555")
        );
        // only a snapshot has one; a malformed one; none
        assert_eq!(
            smbios_uuid_of_conf("[s]\nsmbios1: uuid=11111111-2222-3333-4444-555555555555"),
            None
        );
        assert_eq!(smbios_uuid_of_conf("smbios1: uuid=xyz"), None);
        assert_eq!(smbios_uuid_of_conf("memory: 4096"), None);
    }

    #[test]
    fn bdf_forms() {
        assert_eq!(normalize_bdf("01:00.0").as_deref(), Some("0000:01:00.0"));
        assert_eq!(
            normalize_bdf("0000:0A:1f.7").as_deref(),
            Some("0000:0a:1f.7")
        );
        assert_eq!(normalize_bdf("10000:01:00.0"), None);
        assert_eq!(normalize_bdf("01:20.0"), None);
        assert_eq!(normalize_bdf("01:00.8"), None);
        assert_eq!(normalize_bdf("gpu"), None);
        assert_eq!(
            parse_hostpci_id("01:00"),
            Some(PciId::AllFunctions("0000:01:00".into()))
        );
        assert_eq!(
            parse_hostpci_id("0000:2e:00"),
            Some(PciId::AllFunctions("0000:2e:00".into()))
        );
        assert!(is_router_name("0-1"));
        assert!(is_router_name("1-301"));
        assert!(!is_router_name("0-1.1"));
        assert!(!is_router_name("domain0"));
        assert!(!is_router_name("0-0:1.1"));
    }
}
