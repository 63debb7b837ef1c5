//! `/dev/kmsg` record parser and classifier (the record format is the kernel's
//! `Documentation/ABI/testing/dev-kmsg`). Never panics on any input.
//!
//! Record: `prio,seq,usec,flag[,more..];text` followed by continuation lines starting with a
//! space (` SUBSYSTEM=pci`, ` DEVICE=+pci:0000:00:1c.0`).

use gpufeed_shared::event::KmsgClass;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRecord {
    pub facility: u8,
    pub level: u8,
    pub seq: u64,
    pub usec: u64,
    /// `true` for flag `c` (continuation fragment, legacy).
    pub cont: bool,
    pub text: String,
    pub dict: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("empty record")]
    Empty,
    #[error("no `;` between header and text")]
    NoText,
    #[error("bad header field `{0}`")]
    BadHeader(&'static str),
}

/// Parse one record (header line plus any continuation lines).
pub fn parse_record(buf: &[u8]) -> Result<RawRecord, ParseError> {
    let s = String::from_utf8_lossy(buf);
    let s = s.trim_end_matches(['\n', '\0']);
    if s.trim().is_empty() {
        return Err(ParseError::Empty);
    }
    let (first, rest) = match s.split_once('\n') {
        Some((a, b)) => (a, Some(b)),
        None => (s, None),
    };
    let (header, text) = first.split_once(';').ok_or(ParseError::NoText)?;
    let mut fields = header.split(',');
    let prio: u32 = fields
        .next()
        .and_then(|f| f.trim().parse().ok())
        .ok_or(ParseError::BadHeader("prio"))?;
    let seq: u64 = fields
        .next()
        .and_then(|f| f.trim().parse().ok())
        .ok_or(ParseError::BadHeader("seq"))?;
    let usec: u64 = fields
        .next()
        .and_then(|f| f.trim().parse().ok())
        .ok_or(ParseError::BadHeader("usec"))?;
    // flag is optional in very old kernels; unknown further fields are ignored.
    let cont = matches!(fields.next().map(str::trim), Some("c"));
    let mut dict = Vec::new();
    if let Some(rest) = rest {
        for line in rest.split('\n') {
            let Some(l) = line.strip_prefix(' ') else {
                continue;
            };
            if let Some((k, v)) = l.split_once('=') {
                dict.push((k.to_string(), v.to_string()));
            }
        }
    }
    Ok(RawRecord {
        facility: (prio >> 3).min(255) as u8,
        level: (prio & 7) as u8,
        seq,
        usec,
        cont,
        text: text.to_string(),
        dict,
    })
}

/// Split a text stream (a recorded kmsg file) into records: a line starting with a space
/// continues the previous record.
pub fn split_records(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.split('\n') {
        if line.starts_with(' ') {
            if let Some(last) = out.last_mut() {
                last.push('\n');
                last.push_str(line);
                continue;
            }
        }
        if line.is_empty() {
            continue;
        }
        out.push(line.to_string());
    }
    out
}

/// Tracks the sequence number to count lost records.
#[derive(Debug, Default)]
pub struct SeqTracker {
    last: Option<u64>,
    pub lost_total: u64,
}

impl SeqTracker {
    /// Returns the number of records lost before this one (0 if none).
    pub fn observe(&mut self, seq: u64) -> u64 {
        let lost = match self.last {
            Some(l) if seq > l.saturating_add(1) => seq - l - 1,
            _ => 0,
        };
        if self.last.is_none_or(|l| seq > l) {
            self.last = Some(seq);
        }
        self.lost_total = self.lost_total.saturating_add(lost);
        lost
    }
}

/// A classified record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    pub class: KmsgClass,
    pub bdf: Option<String>,
    /// VMID when the text names a Proxmox tap (`tap100i0`).
    pub vmid: Option<u32>,
}

fn find_bdf_at(s: &str) -> Option<String> {
    // Leading `dddd:bb:dd.f` (12 chars) at the start of s.
    let cand = s.get(..12)?;
    crate::discovery::normalize_bdf(cand).filter(|b| b == &cand.to_ascii_lowercase())
}

/// `<driver> <bdf>: ...` prefix.
fn prefix_bdf(text: &str) -> Option<String> {
    let (_, rest) = text.split_once(' ')?;
    let b = find_bdf_at(rest)?;
    if rest.as_bytes().get(12) == Some(&b':') {
        Some(b)
    } else {
        None
    }
}

/// First BDF after `marker` in text.
fn bdf_after(text: &str, marker: &str) -> Option<String> {
    let i = text.find(marker)?;
    let rest = text.get(i + marker.len()..)?.trim_start();
    find_bdf_at(rest)
}

fn dict_bdf(rec: &RawRecord) -> Option<String> {
    rec.dict
        .iter()
        .find(|(k, _)| k == "DEVICE")
        .and_then(|(_, v)| v.strip_prefix("+pci:"))
        .and_then(crate::discovery::normalize_bdf)
}

/// VMID from `tap<vmid>i<n>` / `fwpr<vmid>p<n>` / `veth<vmid>i<n>` inside the text.
fn tap_vmid(text: &str) -> Option<u32> {
    for pfx in ["tap", "fwpr", "fwln", "veth"] {
        let mut from = 0;
        while let Some(i) = text.get(from..).and_then(|t| t.find(pfx)) {
            let start = from + i + pfx.len();
            if let Some(p) = crate::portname::parse_port_name(
                text.get(from + i..)
                    .unwrap_or("")
                    .split(|c: char| !c.is_ascii_alphanumeric())
                    .next()
                    .unwrap_or(""),
            ) {
                return Some(p.0);
            }
            from = start;
        }
    }
    None
}

/// Classify a record; `None` for records gpufeed does not care about.
pub fn classify(rec: &RawRecord) -> Option<Classified> {
    let t = rec.text.as_str();
    let subsystem = rec
        .dict
        .iter()
        .find(|(k, _)| k == "SUBSYSTEM")
        .map(|(_, v)| v.as_str());
    let dev = dict_bdf(rec).or_else(|| prefix_bdf(t));
    let mk = |class, bdf: Option<String>| {
        Some(Classified {
            class,
            bdf,
            vmid: None,
        })
    };

    if t.contains("AER:") && (t.contains("error received") || t.contains("error message received"))
    {
        // The error source follows "from" (6.8+) or "received:" (≤6.7).
        let src = bdf_after(t, "received from")
            .or_else(|| bdf_after(t, "received:"))
            .or(dev);
        return mk(KmsgClass::AerSource, src);
    }
    if t.contains("PCIe Bus Error:")
        || t.contains("error status/mask=")
        || t.contains("TLP Header:")
        || is_aer_bit_line(t)
    {
        return mk(KmsgClass::AerDetail, dev);
    }
    if t.contains("AER: device recovery")
        || t.contains("can't recover")
        || t.contains("Root Port link has been reset")
        || t.contains("AER: subordinate device reset")
        || t.contains("aer_ratelimit")
    {
        return mk(KmsgClass::AerRecovery, dev);
    }
    if t.contains("DPC: containment event") {
        return mk(KmsgClass::Dpc, dev);
    }
    if t.contains("pciehp") || t.contains("Slot(") {
        if t.contains("Link Down") {
            return mk(KmsgClass::LinkDown, dev);
        }
        if t.contains("Link Up") {
            return mk(KmsgClass::LinkUp, dev);
        }
        if t.contains("Card not present") {
            return mk(KmsgClass::CardNotPresent, dev);
        }
        if t.contains("Card present") {
            return mk(KmsgClass::CardPresent, dev);
        }
    }
    if t.contains("retraining non-functional downstream link") {
        return mk(KmsgClass::Retraining, dev);
    }
    if t.contains("available PCIe bandwidth, limited by") {
        return mk(KmsgClass::BandwidthLimited, dev);
    }
    if t.starts_with("thunderbolt ") || subsystem == Some("thunderbolt") {
        return mk(KmsgClass::Thunderbolt, None);
    }
    if t.starts_with("vfio-pci ") || t.starts_with("vfio ") || t.starts_with("vfio_") {
        return mk(KmsgClass::Vfio, dev);
    }
    if (t.contains("entered disabled state") || t.contains("(unregistering)"))
        && tap_vmid(t).is_some()
    {
        return Some(Classified {
            class: KmsgClass::VmStop,
            bdf: None,
            vmid: tap_vmid(t),
        });
    }
    None
}

/// `   [12] Timeout` style lines of an AER dump (after the `<driver> <bdf>:` prefix).
fn is_aer_bit_line(t: &str) -> bool {
    let body = match prefix_bdf(t) {
        Some(_) => t.split_once(": ").map(|x| x.1).unwrap_or(""),
        None => t,
    };
    let b = body.trim_start();
    if body.len() == b.len() {
        return false; // the dump lines are indented
    }
    let Some(r) = b.strip_prefix('[') else {
        return false;
    };
    let Some((num, name)) = r.split_once(']') else {
        return false;
    };
    !num.trim().is_empty()
        && num.trim().bytes().all(|c| c.is_ascii_digit())
        && !name.trim().is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_header_and_dict() {
        let r = parse_record(b"3,1234,5678901,-,caller=T1;pcieport 0000:00:1c.4: AER: Correctable error message received from 0000:09:00.0\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:1c.4\n").unwrap();
        assert_eq!(
            (r.facility, r.level, r.seq, r.usec, r.cont),
            (0, 3, 1234, 5678901, false)
        );
        assert_eq!(r.dict.len(), 2);
        let c = classify(&r).unwrap();
        assert_eq!(c.class, KmsgClass::AerSource);
        assert_eq!(c.bdf.as_deref(), Some("0000:09:00.0"));
    }

    #[test]
    fn bad_records() {
        assert_eq!(parse_record(b""), Err(ParseError::Empty));
        assert_eq!(parse_record(b"6,1,2,-"), Err(ParseError::NoText));
        assert_eq!(
            parse_record(b"x,1,2,-;t"),
            Err(ParseError::BadHeader("prio"))
        );
        assert_eq!(parse_record(b"6,,2,-;t"), Err(ParseError::BadHeader("seq")));
        assert_eq!(parse_record(b"6,1;t"), Err(ParseError::BadHeader("usec")));
        // facility from prio: 30 = daemon.info
        let r = parse_record(b"30,7,8,c;x").unwrap();
        assert_eq!((r.facility, r.level, r.cont), (3, 6, true));
    }

    #[test]
    fn seq_gaps_are_counted() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(10), 0);
        assert_eq!(t.observe(11), 0);
        assert_eq!(t.observe(15), 3);
        assert_eq!(t.observe(15), 0);
        assert_eq!(t.lost_total, 3);
    }
}
