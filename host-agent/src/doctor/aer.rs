//! `aer_owner`: the operating system, not the firmware, handles AER. With the firmware in
//! charge ("firmware first", or _OSC not granting AER to the OS) the kernel's AER driver is not
//! bound, no `ras:aer_event` fires for most errors and the `aer_dev_*` counters stay 0, so the
//! agent's AER watcher sees little or nothing.

use std::io::Read;
use std::path::Path;

use gpufeed_shared::doctor::Finding;

use crate::kmsg::{parse_record, split_records};
use crate::roots::Roots;

const CHECK: &str = "aer_owner";

/// Passes when the kernel's AER port service driver is bound to at least one root port
/// (`/sys/bus/pci_express/drivers/aer/<port>:pcieNNN`): the kernel binds it only where the
/// firmware granted AER control through _OSC. A failure quotes the kernel log's lines about
/// the negotiation (_OSC, APEI/GHES firmware first, pci=noaer).
pub fn owner(roots: &Roots) -> Finding {
    let drv = roots.path("/sys/bus/pci_express/drivers/aer");
    let ports: Vec<String> = std::fs::read_dir(&drv)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(":pcie"))
                .collect()
        })
        .unwrap_or_default();
    if !ports.is_empty() {
        let mut ports = ports;
        ports.sort();
        return Finding::pass(
            CHECK,
            format!("the kernel's AER driver serves {}", ports.join(", ")),
        );
    }
    let log = kernel_log(&roots.dev().join("kmsg"));
    let said: Vec<&str> = log
        .iter()
        .map(String::as_str)
        .filter(|l| about_aer_ownership(l))
        .take(3)
        .collect();
    let why = if said.is_empty() {
        "the kernel log has no _OSC line left".to_string()
    } else {
        format!("the kernel log says: {}", said.join(" | "))
    };
    Finding::fail(
        CHECK,
        format!(
            "no root port has the kernel's AER driver ({} is empty or absent); {why}",
            drv.display()
        ),
        "let the OS own AER: in the firmware setup turn off \"firmware first\" / WHEA error \
         handling or turn on \"OS native AER\" (names vary by vendor); check that the kernel \
         command line has no pci=noaer; pcie_ports=native forces it against the firmware's \
         _OSC answer (know why the firmware keeps it first)",
    )
}

/// Kernel log lines that tell who owns AER.
fn about_aer_ownership(line: &str) -> bool {
    let l = line.to_ascii_lowercase();
    (l.contains("_osc") && (l.contains("aer") || l.contains("not requesting")))
        || l.contains("firmware first")
        || l.contains("pci=noaer")
}

/// The kernel log's history: every record still in the ring buffer (`/dev/kmsg`, read without
/// blocking until it has none), or the records of a recorded file.
pub fn kernel_log(path: &Path) -> Vec<String> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let Ok(meta) = std::fs::metadata(path) else {
        return Vec::new();
    };
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if meta.file_type().is_char_device() {
        let mut buf = vec![0u8; 16384];
        loop {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if let Ok(r) = parse_record(&buf[..n]) {
                        out.push(r.text);
                    }
                }
                // overwritten while reading: the next read goes on from the oldest left
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break, // EAGAIN: the end of the history
            }
        }
    } else {
        let mut text = String::new();
        if f.read_to_string(&mut text).is_ok() {
            for rec in split_records(&text) {
                if let Ok(r) = parse_record(rec.as_bytes()) {
                    out.push(r.text);
                }
            }
        }
    }
    out
}
