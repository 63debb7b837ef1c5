//! Which incoming QUIC connections the hub spends memory on.
//!
//! Any pod on the node can reach the hub's port, and every connection in its handshake holds
//! TLS and QUIC state. So, before a connection gets any state:
//!
//! * a peer whose address is not validated is sent a stateless QUIC Retry once
//!   `retry_above` handshakes are in flight (by default always): a flood of Initials from
//!   spoofed or never-answering sources then costs one packet each and no memory;
//! * at most `max_handshakes` connections are in their handshake at once, and at most
//!   `max_per_address` connections (in a handshake or established) come from one IP address;
//!   beyond that the connection is refused (a stateless close).
//!
//! Refusals are counted per reason and logged rate-limited ([`RateLimitedLog`]), not one line
//! per attempt.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The limits (from the hub's configuration).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_handshakes: usize,
    pub max_per_address: usize,
    pub retry_above: usize,
}

/// What to do with an incoming connection.
#[derive(Debug)]
pub enum Decision {
    /// Send a Retry: the peer must prove it receives at its address first.
    Retry,
    /// Refuse, for this reason (a `gpufeed_stream_frames_rejected_total` reason).
    Refuse(&'static str),
    /// Go on with the handshake; the ticket holds the connection's places until dropped.
    Accept(Ticket),
}

#[derive(Debug, Default)]
struct Counts {
    handshakes: usize,
    per_address: HashMap<IpAddr, usize>,
}

/// Counts of connections in their handshake and per address. Cheap to clone.
#[derive(Clone)]
pub struct Admission {
    limits: Limits,
    counts: Arc<Mutex<Counts>>,
}

impl Admission {
    pub fn new(limits: Limits) -> Self {
        Admission {
            limits,
            counts: Arc::default(),
        }
    }

    /// Decides for a connection from `ip`; `validated`: its address is proven (it echoed a
    /// Retry token).
    pub fn decide(&self, ip: IpAddr, validated: bool) -> Decision {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if !validated && c.handshakes >= self.limits.retry_above {
            return Decision::Retry;
        }
        if c.handshakes >= self.limits.max_handshakes {
            return Decision::Refuse("busy");
        }
        let n = c.per_address.entry(ip).or_insert(0);
        if *n >= self.limits.max_per_address {
            return Decision::Refuse("per_address");
        }
        *n += 1;
        c.handshakes += 1;
        Decision::Accept(Ticket {
            counts: self.counts.clone(),
            ip,
            handshaking: true,
        })
    }

    /// Connections in their handshake now.
    pub fn handshakes(&self) -> usize {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .handshakes
    }
}

/// An admitted connection's places: its address's slot for its lifetime, a handshake slot
/// until [`Ticket::established`].
#[derive(Debug)]
pub struct Ticket {
    counts: Arc<Mutex<Counts>>,
    ip: IpAddr,
    handshaking: bool,
}

impl Ticket {
    /// The handshake is over: frees the handshake slot, keeps the address's.
    pub fn established(&mut self) {
        if std::mem::take(&mut self.handshaking) {
            let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            c.handshakes -= 1;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if self.handshaking {
            c.handshakes -= 1;
        }
        if let Some(n) = c.per_address.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.per_address.remove(&self.ip);
            }
        }
    }
}

/// Warnings about things a hostile peer can repeat at will: the first of each kind is logged at
/// once, then at most one line per `interval` per kind, saying how many were not logged.
pub struct RateLimitedLog {
    interval: Duration,
    kinds: Mutex<HashMap<&'static str, Tally>>,
}

struct Tally {
    last: Instant,
    unlogged: u64,
}

impl RateLimitedLog {
    pub fn new(interval: Duration) -> Self {
        RateLimitedLog {
            interval,
            kinds: Mutex::default(),
        }
    }

    /// Notes one occurrence of `kind`. Returns `Some(n)` when a line is due now: `n` occurrences
    /// (besides this one) went unlogged since the last line.
    pub fn note(&self, kind: &'static str, now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|p| p.into_inner());
        match kinds.get_mut(kind) {
            None => {
                kinds.insert(
                    kind,
                    Tally {
                        last: now,
                        unlogged: 0,
                    },
                );
                Some(0)
            }
            Some(t) if now.duration_since(t.last) >= self.interval => {
                t.last = now;
                Some(std::mem::take(&mut t.unlogged))
            }
            Some(t) => {
                t.unlogged += 1;
                None
            }
        }
    }

    /// Kinds with unlogged occurrences whose interval has passed, with their counts (taken).
    pub fn due(&self, now: Instant) -> Vec<(&'static str, u64)> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for (k, t) in kinds.iter_mut() {
            if t.unlogged > 0 && now.duration_since(t.last) >= self.interval {
                t.last = now;
                out.push((*k, std::mem::take(&mut t.unlogged)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_handshakes: 3,
        max_per_address: 2,
        retry_above: 1,
    };

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, n])
    }

    #[test]
    fn unvalidated_peers_are_retried_above_the_threshold() {
        let a = Admission::new(LIMITS);
        let Decision::Accept(_t) = a.decide(ip(1), false) else {
            panic!("first is accepted below the threshold")
        };
        assert!(matches!(a.decide(ip(2), false), Decision::Retry));
        assert!(matches!(a.decide(ip(2), true), Decision::Accept(_)));
    }

    #[test]
    fn caps_per_address_and_in_total_and_frees_places() {
        let a = Admission::new(LIMITS);
        let Decision::Accept(mut t1) = a.decide(ip(1), true) else {
            panic!()
        };
        let Decision::Accept(t2) = a.decide(ip(1), true) else {
            panic!()
        };
        assert!(matches!(
            a.decide(ip(1), true),
            Decision::Refuse("per_address")
        ));
        let Decision::Accept(t3) = a.decide(ip(2), true) else {
            panic!()
        };
        assert!(matches!(a.decide(ip(3), true), Decision::Refuse("busy")));
        // Established: the handshake place is free, the address's is not.
        t1.established();
        assert_eq!(a.handshakes(), 2);
        assert!(matches!(a.decide(ip(3), true), Decision::Accept(_)));
        assert!(matches!(
            a.decide(ip(1), true),
            Decision::Refuse("per_address")
        ));
        drop((t1, t2, t3));
        assert_eq!(a.handshakes(), 0);
        assert!(a.counts.lock().unwrap().per_address.is_empty());
    }

    #[test]
    fn log_lines_are_limited_per_kind_and_count_the_rest() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.note("busy", t0), Some(0));
        assert_eq!(log.note("other", t0), Some(0));
        for i in 1..=999 {
            assert_eq!(log.note("busy", t0 + Duration::from_millis(i)), None);
        }
        assert!(log.due(t0 + Duration::from_secs(5)).is_empty());
        assert_eq!(log.due(t0 + Duration::from_secs(10)), vec![("busy", 999)]);
        assert!(log.due(t0 + Duration::from_secs(30)).is_empty());
        assert_eq!(log.note("busy", t0 + Duration::from_secs(31)), Some(0));
    }
}
