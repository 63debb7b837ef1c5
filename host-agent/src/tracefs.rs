//! Tracepoints through a private tracefs instance (`instances/gpufeed`, as rasdaemon does),
//! with the `fields` option so each record prints `name=value` for every field of its
//! `format` (decode by name). Used when present: `ras:aer_event`, `pci:pcie_link_event`,
//! `pci:pci_hp_event`.

use crate::roots::Roots;
use gpufeed_shared::event::{AerDetail, AerSeverity};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub const INSTANCE: &str = "gpufeed";

/// One trace record: event name and fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRecord {
    pub event: String,
    pub ts_ns: Option<u64>,
    pub fields: BTreeMap<String, String>,
}

impl TraceRecord {
    pub fn num(&self, k: &str) -> Option<u64> {
        let v = self.fields.get(k)?;
        let first = v.split_whitespace().next()?;
        crate::sysfs::parse_u64(first)
    }
}

/// Parse one `trace_pipe` line written with `options/fields` on, e.g.
/// `  kworker/0:1-12 [000] .....  480.512863: aer_event: dev_name=0000:00:1c.0 status=0x1 (1) severity=0x2 (2) ...`.
pub fn parse_line(line: &str) -> Option<TraceRecord> {
    // The event name follows the timestamp `NNN.NNNNNN: `.
    let mut search = 0;
    let (ts, rest) = loop {
        let i = line.get(search..)?.find(": ")? + search;
        let before = line.get(..i)?;
        let tok = before.rsplit(' ').next().unwrap_or("");
        if let Some((s, us)) = tok.split_once('.') {
            if !s.is_empty()
                && s.bytes().all(|b| b.is_ascii_digit())
                && !us.is_empty()
                && us.bytes().all(|b| b.is_ascii_digit())
            {
                let sec: u64 = s.parse().ok()?;
                let mut frac: u64 = us.get(..us.len().min(9))?.parse().ok()?;
                for _ in us.len().min(9)..9 {
                    frac *= 10;
                }
                break (
                    sec.checked_mul(1_000_000_000)
                        .and_then(|x| x.checked_add(frac)),
                    line.get(i + 2..)?,
                );
            }
        }
        search = i + 2;
    };
    let (event, body) = rest.split_once(": ").unwrap_or((rest, ""));
    let event = event.trim();
    if event.is_empty() || event.contains(' ') {
        return None;
    }
    let mut fields: BTreeMap<String, String> = BTreeMap::new();
    let mut last: Option<String> = None;
    for tok in body.split(' ').filter(|t| !t.is_empty()) {
        match tok.split_once('=') {
            Some((k, v))
                if !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') =>
            {
                fields.insert(k.to_string(), v.to_string());
                last = Some(k.to_string());
            }
            _ => {
                if let Some(k) = &last {
                    if let Some(v) = fields.get_mut(k) {
                        v.push(' ');
                        v.push_str(tok);
                    }
                }
            }
        }
    }
    Some(TraceRecord {
        event: event.to_string(),
        ts_ns: ts,
        fields,
    })
}

/// `ras:aer_event` record → detail. severity: 0 non-fatal, 1 fatal, 2 corrected.
pub fn aer_detail(r: &TraceRecord) -> Option<AerDetail> {
    if r.event != "aer_event" {
        return None;
    }
    let dev = r
        .fields
        .get("dev_name")?
        .split_whitespace()
        .next()?
        .to_string();
    let severity = match r.num("severity")? {
        0 => AerSeverity::NonFatal,
        1 => AerSeverity::Fatal,
        2 => AerSeverity::Correctable,
        _ => return None,
    };
    let status = r.num("status").unwrap_or(0) as u32;
    let tlp_header = if r.num("tlp_header_valid").unwrap_or(0) != 0 {
        r.fields.get("tlp_header").and_then(|v| parse_u32_array(v))
    } else {
        None
    };
    Some(AerDetail {
        dev_name: dev,
        severity,
        status,
        tlp_header,
        trace_ns: r.ts_ns,
    })
}

/// `ARRAY[01, 00, 00, 00, ...]` (bytes, little endian) → four u32.
fn parse_u32_array(v: &str) -> Option<[u32; 4]> {
    let inner = v.split_once('[')?.1.split_once(']')?.0;
    let bytes: Vec<u8> = inner
        .split([',', ' '])
        .filter(|s| !s.is_empty())
        .filter_map(|s| u8::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .collect();
    if bytes.len() != 16 {
        return None;
    }
    let mut out = [0u32; 4];
    for (i, c) in bytes.chunks(4).enumerate() {
        out[i] = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Some(out)
}

/// Set up the private instance and enable the events that exist. Returns the instance
/// directory and the enabled events, or `None` when tracefs or none of the events is there.
pub fn setup(roots: &Roots, want: &[(&str, &str)]) -> Option<(PathBuf, Vec<String>)> {
    let tracefs = roots.tracefs();
    let available: Vec<(&str, &str)> = want
        .iter()
        .copied()
        .filter(|(sys, ev)| {
            tracefs
                .join("events")
                .join(sys)
                .join(ev)
                .join("format")
                .exists()
        })
        .collect();
    if available.is_empty() {
        return None;
    }
    let inst = tracefs.join("instances").join(INSTANCE);
    if !inst.exists() {
        if let Err(e) = std::fs::create_dir(&inst) {
            tracing::warn!("tracefs: cannot create instance {}: {e}", inst.display());
            return None;
        }
    }
    let _ = std::fs::write(inst.join("options/fields"), "1");
    let _ = std::fs::write(inst.join("trace_clock"), "mono");
    let mut enabled = Vec::new();
    for (sys, ev) in available {
        if std::fs::write(inst.join("events").join(sys).join(ev).join("enable"), "1").is_ok() {
            enabled.push(format!("{sys}:{ev}"));
        }
    }
    if enabled.is_empty() {
        return None;
    }
    Some((inst, enabled))
}

/// Read `trace_pipe` of the instance on a blocking thread and forward parsed records.
pub fn spawn_reader(
    inst: PathBuf,
    tx: tokio::sync::mpsc::Sender<TraceRecord>,
) -> std::io::Result<()> {
    use std::io::BufRead;
    let f = std::fs::File::open(inst.join("trace_pipe"))?;
    std::thread::Builder::new()
        .name("tracefs".into())
        .spawn(move || {
            let r = std::io::BufReader::new(f);
            for line in r.lines() {
                let Ok(line) = line else { return };
                if let Some(rec) = parse_line(&line) {
                    if tx.blocking_send(rec).is_err() {
                        return;
                    }
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fields_lines() {
        let l = "     irq/122-aerdrv-98      [002] .....  5123.456789: aer_event: dev_name=0000:09:00.0 status=0x1000 (4096) severity=0x2 (2) tlp_header_valid=0x0 (0) tlp_header=ARRAY[00, 00, 00, 00, 00, 00, 00, 00, 00, 00, 00, 00, 00, 00, 00, 00]";
        let r = parse_line(l).unwrap();
        assert_eq!(r.event, "aer_event");
        assert_eq!(r.ts_ns, Some(5_123_456_789_000));
        let d = aer_detail(&r).unwrap();
        assert_eq!(d.dev_name, "0000:09:00.0");
        assert_eq!(d.severity, AerSeverity::Correctable);
        assert_eq!(d.status, 0x1000);
        assert_eq!(d.tlp_header, None);
        let l2 = "kworker-1 [000] ..... 10.000001: aer_event: dev_name=0000:09:00.0 status=0x4000 (16384) severity=0x1 (1) tlp_header_valid=0x1 (1) tlp_header=ARRAY[4a, 00, 00, 01, 0f, 00, 00, 01, 00, 00, 20, 00, 00, 00, 00, 00]";
        let d2 = aer_detail(&parse_line(l2).unwrap()).unwrap();
        assert_eq!(d2.severity, AerSeverity::Fatal);
        assert_eq!(d2.tlp_header, Some([0x0100004a, 0x0100000f, 0x00200000, 0]));
        let l3 = "sleep-13671   [000] .....   480.512863: sched_process_exec: filename=/usr/bin/sleep pid=0x3567 (13671) old_pid=0x3567 (13671)";
        let r3 = parse_line(l3).unwrap();
        assert_eq!(r3.num("pid"), Some(13671));
        assert_eq!(r3.fields["filename"], "/usr/bin/sleep");
        assert!(parse_line("garbage").is_none());
        assert!(parse_line("").is_none());
    }
}
