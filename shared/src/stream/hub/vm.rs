//! This guest's VM identity: the SMBIOS system UUID the hypervisor gave the VM (on Proxmox the
//! `smbios1: uuid=` of its configuration), as `class/dmi/id/product_uuid` under the sysfs root
//! shows it. The hub names it to hosts that take it, which route this guest its VM's events.

use std::path::Path;

/// The file under the sysfs root.
pub const PRODUCT_UUID: &str = "class/dmi/id/product_uuid";

/// Reads the UUID under `sysfs_root`; `None` (logged) when the file is missing or unreadable
/// (`product_uuid` is root-only on most kernels) or holds no usable UUID: then hosts route
/// this guest by their configuration.
pub fn read(sysfs_root: &Path) -> Option<String> {
    let path = sysfs_root.join(PRODUCT_UUID);
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let uuid = crate::smbios::parse_uuid(&s);
            match &uuid {
                Some(u) => {
                    tracing::info!(vm_uuid = %u, file = %path.display(), "this guest's VM identity (SMBIOS system UUID); hosts that take it route it its VM's events")
                }
                None => {
                    tracing::warn!(file = %path.display(), "no usable SMBIOS system UUID; hosts route this guest by their configuration")
                }
            }
            uuid
        }
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "cannot read the SMBIOS system UUID; hosts route this guest by their configuration");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_under_the_sysfs_root() {
        let d = std::env::temp_dir().join(format!("gpufeed-vm-uuid-{}", std::process::id()));
        std::fs::create_dir_all(d.join("class/dmi/id")).unwrap();
        assert_eq!(read(&d), None, "missing file");
        std::fs::write(
            d.join(PRODUCT_UUID),
            "9A8B7C6D-1111-2222-3333-444455556666\n",
        )
        .unwrap();
        assert_eq!(
            read(&d).as_deref(),
            Some("9a8b7c6d-1111-2222-3333-444455556666")
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
