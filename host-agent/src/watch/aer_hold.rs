//! Counter increments the AER poll found before the `ras:aer_event` record of the same error
//! arrived: held a moment so the record can still join them.
//!
//! The kernel's AER handler bumps the device's `aer_dev_*` counter, writes the kernel log
//! and emits the tracepoint in one go, but the three reach the agent on their own paths (a
//! poll, /dev/kmsg, trace_pipe). When the poll reads the counter first (seen in a VM with an
//! injected BadTLP: the counter 0.2 s before the record), emitting at once would give an
//! event without the record's detail and a second, separate `AerTrace` for the same error.
//! Held events go out when the record joins them, or when their hold is over without one.

use gpufeed_shared::event::{AerCounter, AerDetail, HostEvent, Source};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub struct Hold {
    held: Vec<(Instant, AerCounter)>,
}

impl Hold {
    /// Holds the poll's counter events for `hold` (other events pass); returns what is
    /// emitted now.
    pub fn admit(
        &mut self,
        events: Vec<HostEvent>,
        now: Instant,
        hold: Duration,
    ) -> Vec<HostEvent> {
        let mut out = Vec::new();
        for ev in events {
            match ev {
                HostEvent::AerCounter(c)
                    if !hold.is_zero() && (c.detail.is_none() || c.kmsg_context.is_empty()) =>
                {
                    self.held.push((now + hold, c))
                }
                other => out.push(other),
            }
        }
        out
    }

    /// Attaches the record `d` to the held increments of the device and severity it names;
    /// whether it found one (the record arrived in time).
    pub fn join(&mut self, d: &AerDetail) -> bool {
        let mut found = false;
        for (_, c) in &mut self.held {
            if c.bdf == d.dev_name && c.severity == d.severity && c.detail.is_none() {
                c.detail = Some(d.clone());
                c.source = Source::Tracepoint;
                found = true;
            }
        }
        found
    }

    /// The held events that have both the record and the kernel log's lines: nothing more
    /// to wait for.
    pub fn complete(&mut self) -> Vec<HostEvent> {
        let mut out = Vec::new();
        self.held.retain(|(_, c)| {
            if c.detail.is_some() && !c.kmsg_context.is_empty() {
                out.push(HostEvent::AerCounter(c.clone()));
                false
            } else {
                true
            }
        });
        out
    }

    /// The held events whose hold is over, as they are.
    pub fn expired(&mut self, now: Instant) -> Vec<HostEvent> {
        let mut out = Vec::new();
        self.held.retain(|(until, c)| {
            if *until <= now {
                out.push(HostEvent::AerCounter(c.clone()));
                false
            } else {
                true
            }
        });
        out
    }

    /// Every held increment, to fill in what arrived since the poll (the kernel log's lines).
    pub fn each_mut(&mut self) -> impl Iterator<Item = &mut AerCounter> {
        self.held.iter_mut().map(|(_, c)| c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufeed_shared::event::AerSeverity;

    fn counter(bdf: &str, sev: AerSeverity) -> HostEvent {
        HostEvent::AerCounter(AerCounter {
            bdf: bdf.into(),
            vmid: None,
            severity: sev,
            error: "BadTLP".into(),
            delta: 1,
            total: 1,
            detail: None,
            kmsg_context: vec![],
            source: Source::Poll,
        })
    }

    fn detail(bdf: &str, sev: AerSeverity) -> AerDetail {
        AerDetail {
            dev_name: bdf.into(),
            severity: sev,
            status: 0x40,
            tlp_header: None,
            trace_ns: Some(1),
        }
    }

    #[test]
    fn a_record_and_the_log_in_time_join_the_counter_once() {
        let mut h = Hold::default();
        let t0 = Instant::now();
        let hold = Duration::from_secs(1);
        let passed = h.admit(
            vec![counter("0000:01:00.0", AerSeverity::Correctable)],
            t0,
            hold,
        );
        assert!(passed.is_empty());
        // another device's record, another severity's: nothing joins
        assert!(!h.join(&detail("0000:02:00.0", AerSeverity::Correctable)));
        assert!(!h.join(&detail("0000:01:00.0", AerSeverity::Fatal)));
        assert!(h.join(&detail("0000:01:00.0", AerSeverity::Correctable)));
        // the record is there, the kernel log's lines not yet
        assert!(h.complete().is_empty());
        for c in h.each_mut() {
            c.kmsg_context = vec!["AER: Correctable error message received".into()];
        }
        let out = h.complete();
        let [HostEvent::AerCounter(c)] = out.as_slice() else {
            panic!("{out:?}")
        };
        assert_eq!(c.detail.as_ref().map(|d| d.status), Some(0x40));
        assert_eq!(c.source, Source::Tracepoint);
        assert!(h.expired(t0 + hold).is_empty(), "emitted once");
    }

    #[test]
    fn without_a_record_the_counter_goes_out_when_its_hold_is_over() {
        let mut h = Hold::default();
        let t0 = Instant::now();
        let hold = Duration::from_secs(1);
        h.admit(
            vec![counter("0000:01:00.0", AerSeverity::Correctable)],
            t0,
            hold,
        );
        assert!(h.expired(t0 + hold / 2).is_empty());
        let out = h.expired(t0 + hold);
        assert!(matches!(out.as_slice(), [HostEvent::AerCounter(c)] if c.detail.is_none()));
        // no hold (no tracepoint in use): straight through
        let out = h.admit(
            vec![counter("0000:01:00.0", AerSeverity::Fatal)],
            t0,
            Duration::ZERO,
        );
        assert_eq!(out.len(), 1);
    }
}
