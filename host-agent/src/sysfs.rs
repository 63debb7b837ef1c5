//! Parsers for sysfs attribute text: `current_link_speed`/`_width`, `aer_dev_*`, Thunderbolt
//! `rx_speed`/`tx_speed` (the formats are quoted in the tests of each parser).
//! Every parser takes arbitrary text and returns `None`/skips what it does not understand;
//! none of them panics.

use gpufeed_shared::event::AerSeverity;
use std::path::Path;

/// Read a sysfs attribute, trimmed. `None` when missing or unreadable (EINVAL on a down link).
pub fn read_attr(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    let s = String::from_utf8_lossy(&bytes);
    Some(s.trim().to_string())
}

/// Parse a PCIe link speed into MT/s: `16.0 GT/s PCIe` → 16000, old `8 GT/s` → 8000,
/// `2.5 GT/s` → 2500. `Unknown`, `Unknown speed` or garbage → `None`.
pub fn parse_link_speed(s: &str) -> Option<u32> {
    let s = s.trim();
    let num = s.split_whitespace().next()?;
    let rest = s[num.len()..].trim_start();
    if !rest.starts_with("GT/s") {
        return None;
    }
    let mts = parse_decimal_x1000(num)?;
    if mts == 0 {
        None
    } else {
        Some(mts)
    }
}

/// `16.0` → 16000, `2.5` → 2500, `8` → 8000 (three decimals at most).
fn parse_decimal_x1000(num: &str) -> Option<u32> {
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if int.is_empty() || int.len() > 6 || frac.len() > 3 {
        return None;
    }
    if !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let i: u32 = int.parse().ok()?;
    let mut f: u32 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    for _ in frac.len()..3 {
        f *= 10;
    }
    i.checked_mul(1000)?.checked_add(f)
}

/// Link width: a bare integer; `0` for a down link. Garbage → `None`.
pub fn parse_link_width(s: &str) -> Option<u8> {
    let s = s.trim().trim_start_matches('x');
    s.parse::<u8>().ok()
}

/// Format MT/s for people: 16000 → `16.0 GT/s`.
pub fn fmt_speed(mts: Option<u32>) -> String {
    match mts {
        Some(m) => format!("{}.{} GT/s", m / 1000, (m % 1000) / 100),
        None => "Unknown".into(),
    }
}

/// One counter line of `aer_dev_*`: name (possibly with spaces, old ABI) and value.
/// The line is split on its last space.
pub fn parse_aer_counters(text: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Some((name, val)) = line.rsplit_once([' ', '\t']) else {
            continue;
        };
        let name = name.trim();
        if name.is_empty() {
            continue;
        }
        if let Ok(v) = val.trim().parse::<u64>() {
            out.push((name.to_string(), v));
        }
    }
    out
}

/// The three per-device AER files and their severities.
pub const AER_DEV_FILES: [(&str, AerSeverity); 3] = [
    ("aer_dev_correctable", AerSeverity::Correctable),
    ("aer_dev_nonfatal", AerSeverity::NonFatal),
    ("aer_dev_fatal", AerSeverity::Fatal),
];

/// Root-port totals (root ports and RCECs only).
pub const AER_ROOTPORT_FILES: [(&str, AerSeverity); 3] = [
    ("aer_rootport_total_err_cor", AerSeverity::Correctable),
    ("aer_rootport_total_err_nonfatal", AerSeverity::NonFatal),
    ("aer_rootport_total_err_fatal", AerSeverity::Fatal),
];

/// Thunderbolt per-lane speed: `20.0 Gb/s` → 200 (Gb/s × 10).
pub fn parse_tb_speed(s: &str) -> Option<u32> {
    let s = s.trim();
    let num = s.split_whitespace().next()?;
    if !s[num.len()..].trim_start().starts_with("Gb/s") {
        return None;
    }
    let x1000 = parse_decimal_x1000(num)?;
    Some(x1000 / 100)
}

/// Read the integer at `path` (decimal or 0x-hex).
pub fn read_u64(path: &Path) -> Option<u64> {
    parse_u64(&read_attr(path)?)
}

pub fn parse_u64(s: &str) -> Option<u64> {
    let s = s.trim();
    if let Some(h) = s.strip_prefix("0x") {
        u64::from_str_radix(h, 16).ok()
    } else {
        s.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_speeds() {
        assert_eq!(parse_link_speed("16.0 GT/s PCIe"), Some(16000));
        assert_eq!(parse_link_speed("2.5 GT/s PCIe\n"), Some(2500));
        assert_eq!(parse_link_speed("64.0 GT/s PCIe"), Some(64000));
        assert_eq!(parse_link_speed("8 GT/s"), Some(8000));
        assert_eq!(parse_link_speed("5 GT/s"), Some(5000));
        assert_eq!(parse_link_speed("Unknown"), None);
        assert_eq!(parse_link_speed("Unknown speed"), None);
        assert_eq!(parse_link_speed("0"), None);
        assert_eq!(parse_link_speed(""), None);
        assert_eq!(parse_link_speed("99999999999.0 GT/s"), None);
        assert_eq!(fmt_speed(Some(2500)), "2.5 GT/s");
        assert_eq!(fmt_speed(Some(16000)), "16.0 GT/s");
    }

    #[test]
    fn widths() {
        assert_eq!(parse_link_width("4\n"), Some(4));
        assert_eq!(parse_link_width("0"), Some(0));
        assert_eq!(parse_link_width("x16"), Some(16));
        assert_eq!(parse_link_width("Unknown"), None);
    }

    #[test]
    fn aer_lines() {
        let t = "RxErr 0\nBadTLP 3\nBadDLLP 0\nRollover 0\nTimeout 1\nNonFatalErr 0\nCorrIntErr 0\nHeaderOF 0\ndev_cor_errs_bit[9] 3\nTOTAL_ERR_COR 7\n";
        let v = parse_aer_counters(t);
        assert_eq!(v.len(), 10);
        assert_eq!(v[1], ("BadTLP".into(), 3));
        assert_eq!(v[8], ("dev_cor_errs_bit[9]".into(), 3));
        assert_eq!(v[9], ("TOTAL_ERR_COR".into(), 7));
        let old = parse_aer_counters("Receiver Error 2\nBad TLP 0\nTOTAL_ERR_COR 2\n");
        assert_eq!(old[0], ("Receiver Error".into(), 2));
        assert!(parse_aer_counters("garbage\n 5\nX y\n").is_empty());
    }

    #[test]
    fn tb_speed() {
        assert_eq!(parse_tb_speed("20.0 Gb/s\n"), Some(200));
        assert_eq!(parse_tb_speed("10.0 Gb/s"), Some(100));
        assert_eq!(parse_tb_speed("40 Gb/s"), Some(400));
        assert_eq!(parse_tb_speed("fast"), None);
    }
}
