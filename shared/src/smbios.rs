//! SMBIOS system UUIDs: what a VM's firmware reports as its identity (a guest reads it from
//! `/sys/class/dmi/id/product_uuid`; on Proxmox the host sets it with `smbios1: uuid=`), by
//! which a host binds a guest to one of its VMs.

/// The UUID in a `product_uuid` (or `smbios1: uuid=`) value, lowercase; `None` for anything
/// that is not a UUID, and for the nil and all-ones placeholders firmware writes when it has
/// none (every such VM would claim the same one).
pub fn parse_uuid(s: &str) -> Option<String> {
    let s = s.trim();
    let b = s.as_bytes();
    if b.len() != 36 {
        return None;
    }
    for (i, c) in b.iter().enumerate() {
        let dash = matches!(i, 8 | 13 | 18 | 23);
        if dash != (*c == b'-') || (!dash && !c.is_ascii_hexdigit()) {
            return None;
        }
    }
    let u = s.to_ascii_lowercase();
    let digits = || u.bytes().filter(|c| *c != b'-');
    if digits().all(|c| c == b'0') || digits().all(|c| c == b'f') {
        return None;
    }
    Some(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_uuids_and_refuses_placeholders() {
        assert_eq!(
            parse_uuid("4C4C4544-0042-3610-8057-B4C04F4E3332\n").as_deref(),
            Some("4c4c4544-0042-3610-8057-b4c04f4e3332")
        );
        for bad in [
            "",
            "Not Settable",
            "00000000-0000-0000-0000-000000000000",
            "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF",
            "4c4c4544-0042-3610-8057-b4c04f4e333",
            "4c4c4544x0042-3610-8057-b4c04f4e3332",
            "4c4c4544-0042-3610-8057-b4c04f4e333g",
            "4c4c4544-0042-3610-8057-b4c04f4e3332-",
        ] {
            assert_eq!(parse_uuid(bad), None, "{bad:?}");
        }
    }
}
