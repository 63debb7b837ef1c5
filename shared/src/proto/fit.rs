//! Events made to fit a frame: the only part of a host event without a natural bound is the
//! kernel log context of an AER event (every matching `/dev/kmsg` line of a window, up to
//! hundreds in an error storm). It is cut to [`KMSG_CONTEXT_MAX_BYTES`] (the first lines, which
//! name the error, are kept, and a last line says how many were cut), and cut further if the
//! event still does not fit in a frame: the event itself is never dropped for its size.

use super::codec::{EncodeError, EncodedEvent};
use crate::event::HostEvent;

/// Bytes of kernel log context an AER event carries at most.
pub const KMSG_CONTEXT_MAX_BYTES: usize = 8 * 1024;

/// Cuts `lines` to at most `max_bytes` of text (the marker line included when lines are cut);
/// returns whether anything was cut.
fn cut_lines(lines: &mut Vec<String>, max_bytes: usize) -> bool {
    let total: usize = lines.iter().map(String::len).sum();
    if total <= max_bytes {
        return false;
    }
    let n = lines.len();
    // Room for the marker line; keep whole lines (the first ones) while they fit.
    let budget = max_bytes.saturating_sub(64);
    let mut used = 0;
    let keep = lines
        .iter()
        .take_while(|l| {
            used += l.len();
            used <= budget
        })
        .count();
    lines.truncate(keep);
    lines.push(format!("[gpufeed: {} more lines cut]", n - keep));
    true
}

/// The event's kmsg context, if it has one.
fn context_of(ev: &mut HostEvent) -> Option<&mut Vec<String>> {
    match ev {
        HostEvent::AerCounter(a) => Some(&mut a.kmsg_context),
        _ => None,
    }
}

/// `ev` encoded for the stream, its kmsg context cut to [`KMSG_CONTEXT_MAX_BYTES`] and, while
/// the frame would still be too large, to half as much again (down to the marker line).
/// Returns whether the context was cut.
pub fn encode_event(
    host_realtime_ns: i64,
    host_monotonic_ns: u64,
    ev: &HostEvent,
) -> Result<(EncodedEvent, bool), EncodeError> {
    const MIN_BUDGET: usize = 64;
    let mut ev = std::borrow::Cow::Borrowed(ev);
    let mut cut = false;
    let mut max = KMSG_CONTEXT_MAX_BYTES;
    loop {
        let over = match &*ev {
            HostEvent::AerCounter(a) => a.kmsg_context.iter().map(String::len).sum::<usize>() > max,
            _ => false,
        };
        if over {
            if let Some(ctx) = context_of(ev.to_mut()) {
                cut |= cut_lines(ctx, max);
            }
        }
        let payload = postcard::to_allocvec(&*ev)?;
        match EncodedEvent::new(host_realtime_ns, host_monotonic_ns, ev.kind(), &payload) {
            Err(EncodeError::Oversize { .. })
                if max > MIN_BUDGET && matches!(&*ev, HostEvent::AerCounter(_)) =>
            {
                max = (max / 2).max(MIN_BUDGET);
            }
            r => return r.map(|e| (e, cut)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{AerCounter, AerSeverity, Source};

    fn aer(lines: usize, len: usize) -> HostEvent {
        HostEvent::AerCounter(AerCounter {
            bdf: "0000:01:00.0".into(),
            vmid: Some(100),
            severity: AerSeverity::Correctable,
            error: "RxErr".into(),
            delta: 1,
            total: 7,
            detail: None,
            kmsg_context: (0..lines)
                .map(|i| format!("{i:04} {}", "x".repeat(len)))
                .collect(),
            source: Source::Poll,
        })
    }

    fn decoded(e: &EncodedEvent) -> HostEvent {
        let mut frame = Vec::new();
        e.write_frame(0, &mut frame).unwrap();
        let mut d = crate::proto::FrameDecoder::default();
        d.push(&frame);
        match d.next_frame().unwrap().unwrap() {
            crate::proto::Message::Event(f) => postcard::from_bytes(&f.payload).unwrap(),
            m => panic!("{m:?}"),
        }
    }

    #[test]
    fn an_aer_storm_context_is_cut_not_the_event_dropped() {
        // 512 lines of 200 bytes: 100 KiB, above the 64 KiB frame limit.
        let ev = aer(512, 200);
        let (e, cut) = encode_event(1, 2, &ev).unwrap();
        assert!(cut);
        let HostEvent::AerCounter(got) = decoded(&e) else {
            panic!()
        };
        let bytes: usize = got.kmsg_context.iter().map(String::len).sum();
        assert!(bytes <= KMSG_CONTEXT_MAX_BYTES, "{bytes}");
        assert!(got.kmsg_context[0].starts_with("0000 "));
        let last = got.kmsg_context.last().unwrap();
        let kept = got.kmsg_context.len() - 1;
        assert_eq!(last, &format!("[gpufeed: {} more lines cut]", 512 - kept));
        assert_eq!((got.error.as_str(), got.total), ("RxErr", 7));
    }

    #[test]
    fn small_context_is_untouched_and_one_huge_line_goes() {
        let ev = aer(3, 50);
        let (e, cut) = encode_event(1, 2, &ev).unwrap();
        assert!(!cut);
        assert_eq!(decoded(&e), ev);
        // One line above every cap: cut to the marker only.
        let (e, cut) = encode_event(1, 2, &aer(1, 100_000)).unwrap();
        assert!(cut);
        let HostEvent::AerCounter(got) = decoded(&e) else {
            panic!()
        };
        assert_eq!(got.kmsg_context, vec!["[gpufeed: 1 more lines cut]"]);
    }
}
