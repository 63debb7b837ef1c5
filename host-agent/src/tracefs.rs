//! Tracepoints through a private tracefs instance (`instances/gpufeed`, as rasdaemon does),
//! with the `fields` option so each record prints `name=value` for every field of its
//! `format` (decode by name). Used when present: `ras:aer_event`, `pci:pcie_link_event`,
//! `pci:pci_hp_event`. [`decode`] turns a line into a [`TraceEvent`] given the event's
//! [`Format`]; the tracepoints watcher ([`crate::watch::tracepoints`]) acts on it.

use crate::roots::Roots;
use gpufeed_shared::event::{AerDetail, AerSeverity, PciHotplug};
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
    /// A number as `options/fields` prints it: `0x40 (64)` for most integers, but
    /// `(2)` for a one-byte field (`'A'(65)` when the byte is printable), as the kernel's
    /// `print_fields` writes them.
    pub fn num(&self, k: &str) -> Option<u64> {
        let v = self.fields.get(k)?;
        let first = v.split_whitespace().next()?;
        crate::sysfs::parse_u64(first).or_else(|| {
            let inner = v.rsplit_once('(')?.1.split_once(')')?.0;
            inner.trim().parse().ok()
        })
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

/// An event's `format` file, reduced to what decoding needs: the event name, the names of its
/// own fields (the `common_*` ones are not printed with `options/fields`) and the value → name
/// tables of its `__print_symbolic(REC->field, ...)` calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Format {
    pub name: String,
    pub fields: Vec<String>,
    pub symbols: BTreeMap<String, BTreeMap<i64, String>>,
}

impl Format {
    /// Parse the text of `events/<system>/<event>/format`.
    pub fn parse(text: &str) -> Result<Format, DecodeError> {
        let mut f = Format::default();
        for line in text.lines() {
            let line = line.trim();
            if let Some(n) = line.strip_prefix("name:") {
                f.name = n.trim().to_string();
            } else if let Some(decl) = line.strip_prefix("field:") {
                // `field:u32 tlp_header[4];\toffset:...`: the name is the declaration's last word.
                let decl = decl.split(';').next().unwrap_or("");
                let name = decl.rsplit(' ').next().unwrap_or("");
                let name = name.split('[').next().unwrap_or("");
                if !name.is_empty() && !name.starts_with("common_") {
                    f.fields.push(name.to_string());
                }
            } else if line.starts_with("print fmt:") {
                break;
            }
        }
        // `print fmt:` runs to the end of the file: the kernel copies the TP_printk format as
        // written, so a `\n` in it is a line break there (7.3's pci_hp_event: its
        // `__print_symbolic` table is on the line after `print fmt:`)
        if let Some((_, fmt)) = text.split_once("print fmt:") {
            f.symbols = print_symbolic_tables(fmt);
        }
        if f.name.is_empty() {
            return Err(DecodeError::BadFormat);
        }
        Ok(f)
    }
}

/// `__print_symbolic(REC->event, { 0, "LINK_UP" }, { 1, "LINK_DOWN" })` → event → {0: LINK_UP,
/// 1: LINK_DOWN}. Entries whose value is not a number (an enum the kernel did not resolve) are
/// left out.
fn print_symbolic_tables(fmt: &str) -> BTreeMap<String, BTreeMap<i64, String>> {
    let mut out = BTreeMap::new();
    for call in fmt.split("__print_symbolic(REC->").skip(1) {
        let Some((field, rest)) = call.split_once(',') else {
            continue;
        };
        let mut table = BTreeMap::new();
        // Entries run until the call's closing parenthesis; `{`/`}` delimit each.
        let body = rest.split(')').next().unwrap_or("");
        for entry in body.split('{').skip(1) {
            let entry = entry.split('}').next().unwrap_or("");
            let Some((v, name)) = entry.split_once(',') else {
                continue;
            };
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(h) => i64::from_str_radix(h, 16).ok(),
                None => v.parse().ok(),
            };
            if let Some(v) = parsed {
                table.insert(v, name.trim().trim_matches('"').to_string());
            }
        }
        out.insert(field.trim().to_string(), table);
    }
    out
}

/// What a tracepoint record means to the agent.
#[derive(Debug, Clone, PartialEq)]
pub enum TraceEvent {
    /// `ras:aer_event`: a device reported an AER error.
    Aer(AerDetail),
    /// `pci:pcie_link_event`: the link below this port changed (re-read its links).
    Link { port: String },
    /// `pci:pci_hp_event`: a hotplug slot event.
    Hotplug(PciHotplug),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not a trace_pipe record")]
    NotARecord,
    #[error("format file without a `name:` line")]
    BadFormat,
    #[error("record of `{got}` decoded with the format of `{want}`")]
    WrongEvent { want: String, got: String },
    #[error("`{0}` is not an event the agent decodes")]
    Unsupported(String),
    #[error("{event}: field `{field}` is missing")]
    MissingField { event: String, field: String },
    #[error("{event}: field `{field}` has the unexpected value {value:?}")]
    BadValue {
        event: String,
        field: String,
        value: String,
    },
}

/// Decode one `trace_pipe` line (written with `options/fields`) of the event `format`
/// describes. Pure: the tracepoints watcher feeds it the kernel's lines, tests feed it
/// recorded ones.
pub fn decode(format: &Format, line: &str) -> Result<TraceEvent, DecodeError> {
    decode_record(format, parse_line(line).ok_or(DecodeError::NotARecord)?)
}

/// [`decode`] of a line already split into fields.
pub fn decode_record(format: &Format, r: TraceRecord) -> Result<TraceEvent, DecodeError> {
    if r.event != format.name {
        return Err(DecodeError::WrongEvent {
            want: format.name.clone(),
            got: r.event,
        });
    }
    // Every field of the format is printed; one missing means the line is not what we think.
    if let Some(f) = format.fields.iter().find(|f| !r.fields.contains_key(*f)) {
        return Err(r.missing(f));
    }
    match r.event.as_str() {
        "aer_event" => aer_detail(&r).map(TraceEvent::Aer),
        "pcie_link_event" => Ok(TraceEvent::Link {
            port: r.string("port_name")?,
        }),
        "pci_hp_event" => {
            let n = r.number("event")?;
            let event = format
                .symbols
                .get("event")
                .and_then(|t| t.get(&(n as i64)))
                .cloned()
                .unwrap_or_else(|| n.to_string());
            Ok(TraceEvent::Hotplug(PciHotplug {
                port: r.string("port_name")?,
                slot: r.string("slot")?,
                event,
            }))
        }
        other => Err(DecodeError::Unsupported(other.to_string())),
    }
}

impl TraceRecord {
    fn missing(&self, field: &str) -> DecodeError {
        DecodeError::MissingField {
            event: self.event.clone(),
            field: field.to_string(),
        }
    }

    fn string(&self, field: &str) -> Result<String, DecodeError> {
        self.fields
            .get(field)
            .cloned()
            .ok_or_else(|| self.missing(field))
    }

    fn number(&self, field: &str) -> Result<u64, DecodeError> {
        let v = self.fields.get(field).ok_or_else(|| self.missing(field))?;
        self.num(field).ok_or_else(|| DecodeError::BadValue {
            event: self.event.clone(),
            field: field.to_string(),
            value: v.clone(),
        })
    }
}

/// `ras:aer_event` record → detail. severity: 0 non-fatal, 1 fatal, 2 corrected.
fn aer_detail(r: &TraceRecord) -> Result<AerDetail, DecodeError> {
    let dev = r.string("dev_name")?;
    let dev = dev.split_whitespace().next().unwrap_or("").to_string();
    let severity = match r.number("severity")? {
        0 => AerSeverity::NonFatal,
        1 => AerSeverity::Fatal,
        2 => AerSeverity::Correctable,
        n => {
            return Err(DecodeError::BadValue {
                event: r.event.clone(),
                field: "severity".into(),
                value: n.to_string(),
            })
        }
    };
    let status = r.number("status")? as u32;
    let tlp_header = if r.num("tlp_header_valid").unwrap_or(0) != 0 {
        r.fields.get("tlp_header").and_then(|v| parse_u32_array(v))
    } else {
        None
    };
    Ok(AerDetail {
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

/// The private instance with the events that were enabled in it.
#[derive(Debug)]
pub struct Instance {
    pub dir: PathBuf,
    /// `system:event` of each enabled event.
    pub enabled: Vec<String>,
    /// Their formats, by event name.
    pub formats: BTreeMap<String, Format>,
}

/// Why there is no instance.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// tracefs, or every wanted event, is absent: polling covers it.
    #[error("none of {wanted} present under {tracefs}")]
    Absent { wanted: String, tracefs: PathBuf },
    /// The events are there but this process cannot write tracefs.
    #[error("{} is read-only for this process ({source}): {hint}", dir.display())]
    ReadOnly {
        dir: PathBuf,
        source: std::io::Error,
        hint: &'static str,
    },
    /// The events are there, none could be enabled.
    #[error("cannot enable {wanted} in {}: {why}", dir.display())]
    NotEnabled {
        wanted: String,
        dir: PathBuf,
        why: String,
    },
}

/// Set up the private instance and enable the events that exist.
pub fn setup(roots: &Roots, want: &[(&str, &str)]) -> Result<Instance, SetupError> {
    let wanted = want
        .iter()
        .map(|(s, e)| format!("{s}:{e}"))
        .collect::<Vec<_>>()
        .join(", ");
    let tracefs = roots.tracefs();
    let formats: Vec<(&str, &str, Format)> = want
        .iter()
        .filter_map(|&(sys, ev)| {
            let path = tracefs.join("events").join(sys).join(ev).join("format");
            let text = std::fs::read_to_string(&path).ok()?;
            match Format::parse(&text) {
                Ok(f) => Some((sys, ev, f)),
                Err(e) => {
                    tracing::warn!("tracefs: {}: {e}", path.display());
                    None
                }
            }
        })
        .collect();
    if formats.is_empty() {
        return Err(SetupError::Absent { wanted, tracefs });
    }
    let dir = tracefs.join("instances").join(INSTANCE);
    if !dir.exists() {
        if let Err(source) = std::fs::create_dir(&dir) {
            if source.raw_os_error() == Some(libc::EROFS) {
                return Err(SetupError::ReadOnly {
                    dir,
                    source,
                    hint: "a systemd unit with ProtectKernelTunables=yes must bind tracefs \
                           elsewhere (BindPaths=-/sys/kernel/tracing:/run/gpufeed-host/tracing, \
                           as systemd/gpufeed-host.service does)",
                });
            }
            return Err(SetupError::NotEnabled {
                wanted,
                dir,
                why: format!("cannot create the instance: {source}"),
            });
        }
    }
    let _ = std::fs::write(dir.join("options/fields"), "1");
    let _ = std::fs::write(dir.join("trace_clock"), "mono");
    let mut inst = Instance {
        dir,
        enabled: Vec::new(),
        formats: BTreeMap::new(),
    };
    let mut why = String::new();
    for (sys, ev, f) in formats {
        let enable = inst.dir.join("events").join(sys).join(ev).join("enable");
        match std::fs::write(&enable, "1") {
            Ok(()) => {
                inst.enabled.push(format!("{sys}:{ev}"));
                inst.formats.insert(f.name.clone(), f);
            }
            Err(e) => why = format!("{}: {e}", enable.display()),
        }
    }
    if inst.enabled.is_empty() {
        return Err(SetupError::NotEnabled {
            wanted,
            dir: inst.dir,
            why,
        });
    }
    Ok(inst)
}

/// Read `trace_pipe` of the instance on a blocking thread and forward decoded events; lines
/// that do not decode are logged (debug) and skipped.
pub fn spawn_reader(
    inst: Instance,
    tx: tokio::sync::mpsc::Sender<TraceEvent>,
) -> std::io::Result<()> {
    use std::io::BufRead;
    let f = std::fs::File::open(inst.dir.join("trace_pipe"))?;
    std::thread::Builder::new()
        .name("tracefs".into())
        .spawn(move || {
            let r = std::io::BufReader::new(f);
            for line in r.lines() {
                let Ok(line) = line else { return };
                let Some(rec) = parse_line(&line) else {
                    continue;
                };
                let Some(format) = inst.formats.get(&rec.event) else {
                    continue;
                };
                match decode_record(format, rec) {
                    Ok(ev) => {
                        if tx.blocking_send(ev).is_err() {
                            return;
                        }
                    }
                    Err(e) => tracing::debug!("tracefs: {e}: {line}"),
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn print_fmt_over_two_lines_as_7_3_writes_it() {
        // events/pci/pci_hp_event/format on Debian's 7.3: the `\n` of TP_printk is a line
        // break in the file, the symbol table on the next line (the agent emitted "2" for
        // CARD_PRESENT until this was read)
        let text = "name: pci_hp_event\nID: 1234\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\n\tfield:__data_loc char[] port_name;\toffset:8;\tsize:4;\tsigned:0;\n\tfield:__data_loc char[] slot;\toffset:12;\tsize:4;\tsigned:0;\n\tfield:int event;\toffset:16;\tsize:4;\tsigned:1;\n\nprint fmt: \"%s slot:%s, event:%s\n\", __get_str(port_name), __get_str(slot), __print_symbolic(REC->event, {0, \"LINK_UP\"}, {1, \"LINK_DOWN\"}, {2, \"CARD_PRESENT\"}, {3, \"CARD_NOT_PRESENT\"})\n";
        let f = Format::parse(text).unwrap();
        assert_eq!(f.fields, ["port_name", "slot", "event"]);
        let t = &f.symbols["event"];
        assert_eq!(t.get(&0).map(String::as_str), Some("LINK_UP"));
        assert_eq!(t.get(&2).map(String::as_str), Some("CARD_PRESENT"));
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn one_byte_fields_as_the_kernel_prints_them() {
        // ras:aer_event on Debian's 6.12, a correctable BadTLP injected by QEMU
        let l = "irq/24-aerdrv-54      [000] .....    18.483140: aer_event: dev_name=0000:01:00.0 status=0x40 (64) severity=(2) tlp_header_valid=(0) tlp_header=<INVALID-SIZE>";
        let r = parse_line(l).unwrap();
        assert_eq!(r.num("severity"), Some(2));
        assert_eq!(r.num("tlp_header_valid"), Some(0));
        assert_eq!(r.num("status"), Some(0x40));
        let d = aer_detail(&r).unwrap();
        assert_eq!(d.dev_name, "0000:01:00.0");
        assert_eq!(d.severity, AerSeverity::Correctable);
        assert_eq!(d.status, 0x40);
        assert_eq!(d.tlp_header, None);
        let mut r = r;
        r.fields.insert("severity".into(), "'A'(65)".into());
        assert_eq!(r.num("severity"), Some(65));
    }

    #[test]
    fn parses_fields_lines() {
        let l3 = "sleep-13671   [000] .....   480.512863: sched_process_exec: filename=/usr/bin/sleep pid=0x3567 (13671) old_pid=0x3567 (13671)";
        let r3 = parse_line(l3).unwrap();
        assert_eq!(r3.event, "sched_process_exec");
        assert_eq!(r3.ts_ns, Some(480_512_863_000));
        assert_eq!(r3.num("pid"), Some(13671));
        assert_eq!(r3.fields["filename"], "/usr/bin/sleep");
        assert!(parse_line("garbage").is_none());
        assert!(parse_line("").is_none());
    }
}
