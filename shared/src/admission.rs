//! Which incoming connections a listener on the node's address spends memory on: the hub's
//! QUIC port and both agents' HTTP ports, which every pod on the node (and every process on
//! the host) can reach.
//!
//! Before a connection gets any state:
//!
//! * a peer whose address is not validated is sent a stateless QUIC Retry once
//!   `retry_above` connections are pending (the hub: always): a flood of Initials from spoofed
//!   or never-answering sources then costs one packet each and no memory;
//! * at most `max_per_address` connections (pending or established) come from one IP address;
//! * at most `max_pending` connections are pending (a QUIC handshake; an HTTP connection is
//!   pending for its whole life). When they are all taken, a newcomer from an address that
//!   holds fewer of them than the address holding the most is let in by **evicting** the
//!   oldest pending connection of that address: the places are shared fairly among the
//!   addresses that want them, so a few addresses (or many, each holding a fair share) cannot
//!   lock out one more, a kubelet or a Prometheus;
//! * addresses that authenticated before ([`Admission::remember`]: a host that completed
//!   mutual TLS) have `known_reserve` pending places of their own, which strangers can neither
//!   take nor evict: a host that restarts during a flood reconnects at once.
//!
//! Refusals are counted per reason and logged rate-limited ([`crate::ratelog::RateLimitedLog`]),
//! not one line per attempt.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// The limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_pending: usize,
    pub max_per_address: usize,
    pub retry_above: usize,
    /// Pending places kept for remembered addresses (0: none).
    pub known_reserve: usize,
}

/// What to do with an incoming connection.
#[derive(Debug)]
pub enum Decision {
    /// Send a Retry: the peer must prove it receives at its address first.
    Retry,
    /// Refuse, for this reason (a `gpufeed_stream_frames_rejected_total` reason).
    Refuse(&'static str),
    /// Go on; the ticket holds the connection's places until dropped, and says when the
    /// connection was evicted for a newcomer ([`Ticket::evicted`]).
    Accept(Ticket),
}

struct Pending {
    ip: IpAddr,
    known: bool,
    evict: Arc<Notify>,
}

#[derive(Default)]
struct Counts {
    /// Pending connections by arrival.
    pending: BTreeMap<u64, Pending>,
    pending_strangers: usize,
    pending_known: usize,
    /// Pending connections of strangers per address.
    pending_per_address: HashMap<IpAddr, usize>,
    /// All connections per address.
    per_address: HashMap<IpAddr, usize>,
    /// Addresses that authenticated, most recent last.
    known: VecDeque<IpAddr>,
    next_id: u64,
    evictions: u64,
}

/// Remembered addresses at most (the hosts of one guest are a handful).
const KNOWN_MAX: usize = 256;

/// Counts of connections; cheap to clone.
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Remembers `ip` as an address that authenticated (it gets the reserved places).
    pub fn remember(&self, ip: IpAddr) {
        let mut c = self.lock();
        c.known.retain(|k| *k != ip);
        c.known.push_back(ip);
        while c.known.len() > KNOWN_MAX {
            c.known.pop_front();
        }
    }

    /// Decides for a connection from `ip`; `validated`: its address is proven (it echoed a
    /// Retry token).
    pub fn decide(&self, ip: IpAddr, validated: bool) -> Decision {
        let mut guard = self.lock();
        let c = &mut *guard;
        let known = self.limits.known_reserve > 0 && c.known.contains(&ip);
        let total_pending = c.pending_strangers + c.pending_known;
        if !validated && !known && total_pending >= self.limits.retry_above {
            return Decision::Retry;
        }
        if c.per_address.get(&ip).copied().unwrap_or(0) >= self.limits.max_per_address {
            return Decision::Refuse("per_address");
        }
        let has_room = if known {
            c.pending_known < self.limits.known_reserve
                || c.pending_strangers + c.pending_known
                    < self.limits.max_pending + self.limits.known_reserve
        } else {
            c.pending_strangers < self.limits.max_pending
        };
        if !has_room && (known || !c.evict_for(ip)) {
            return Decision::Refuse("busy");
        }
        *c.per_address.entry(ip).or_insert(0) += 1;
        if known {
            c.pending_known += 1;
        } else {
            c.pending_strangers += 1;
            *c.pending_per_address.entry(ip).or_insert(0) += 1;
        }
        let id = c.next_id;
        c.next_id += 1;
        let evict = Arc::new(Notify::new());
        c.pending.insert(
            id,
            Pending {
                ip,
                known,
                evict: evict.clone(),
            },
        );
        Decision::Accept(Ticket {
            counts: self.counts.clone(),
            id,
            ip,
            evict,
            pending: true,
        })
    }

    /// Connections pending now.
    pub fn pending(&self) -> usize {
        let c = self.lock();
        c.pending_strangers + c.pending_known
    }

    /// Connections evicted for newcomers so far.
    pub fn evictions(&self) -> u64 {
        self.lock().evictions
    }
}

impl Counts {
    /// Makes room for a stranger from `ip` by evicting the oldest pending connection of the
    /// stranger address that holds the most, if that is more than `ip` holds.
    fn evict_for(&mut self, ip: IpAddr) -> bool {
        let mine = self.pending_per_address.get(&ip).copied().unwrap_or(0);
        let Some(most) = self.pending_per_address.values().copied().max() else {
            return false;
        };
        if most <= mine {
            return false;
        }
        let victim = self
            .pending
            .iter()
            .find(|(_, p)| !p.known && self.pending_per_address.get(&p.ip) == Some(&most))
            .map(|(id, _)| *id);
        let Some(p) = victim.and_then(|id| self.pending.remove(&id)) else {
            return false;
        };
        // Its place goes now; its ticket, when dropped, gives back only the address's.
        self.pending_strangers -= 1;
        dec(&mut self.pending_per_address, p.ip);
        self.evictions += 1;
        p.evict.notify_one();
        true
    }
}

fn dec(m: &mut HashMap<IpAddr, usize>, ip: IpAddr) {
    if let Some(n) = m.get_mut(&ip) {
        *n -= 1;
        if *n == 0 {
            m.remove(&ip);
        }
    }
}

/// An admitted connection's places: its address's for its lifetime, a pending one until
/// [`Ticket::established`] or an eviction.
pub struct Ticket {
    counts: Arc<Mutex<Counts>>,
    id: u64,
    ip: IpAddr,
    evict: Arc<Notify>,
    pending: bool,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("ip", &self.ip)
            .field("pending", &self.pending)
            .finish()
    }
}

impl Ticket {
    fn release_pending(&mut self, c: &mut Counts) {
        if std::mem::take(&mut self.pending) {
            if let Some(p) = c.pending.remove(&self.id) {
                if p.known {
                    c.pending_known -= 1;
                } else {
                    c.pending_strangers -= 1;
                    dec(&mut c.pending_per_address, p.ip);
                }
            }
        }
    }

    /// The handshake is over: frees the pending place, keeps the address's; the connection
    /// can no longer be evicted.
    pub fn established(&mut self) {
        let counts = self.counts.clone();
        let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
        self.release_pending(&mut c);
    }

    /// Resolves when the connection was evicted for a newcomer (its place is already gone):
    /// the holder closes it.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let counts = self.counts.clone();
        let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
        self.release_pending(&mut c);
        dec(&mut c.per_address, self.ip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_pending: 3,
        max_per_address: 2,
        retry_above: 1,
        known_reserve: 0,
    };

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, n])
    }

    fn accept(a: &Admission, n: u8) -> Ticket {
        match a.decide(ip(n), true) {
            Decision::Accept(t) => t,
            d => panic!("{n}: {d:?}"),
        }
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
        let t1 = accept(&a, 1);
        let t2 = accept(&a, 1);
        assert!(matches!(
            a.decide(ip(1), true),
            Decision::Refuse("per_address")
        ));
        let t3 = accept(&a, 2);
        // Full, and 127.0.0.3 holds nothing: the oldest of 127.0.0.1 (which holds the most)
        // makes room.
        let t4 = accept(&a, 3);
        assert_eq!(a.evictions(), 1);
        let evicted = now(t1.evicted());
        assert!(evicted, "the oldest of the address holding most is told");
        // Now 1, 2 and 3 hold one each: nobody holds more than a newcomer from 2 would.
        assert!(matches!(a.decide(ip(2), true), Decision::Refuse("busy")));
        // Established: the pending place is free, the address's is not.
        let mut t3 = t3;
        t3.established();
        assert_eq!(a.pending(), 2);
        assert!(matches!(a.decide(ip(4), true), Decision::Accept(_)));
        drop((t1, t2, t3, t4));
        assert_eq!(a.pending(), 0);
        assert!(a.lock().per_address.is_empty());
        assert!(a.lock().pending_per_address.is_empty());
    }

    /// Whether a future is ready at once.
    fn now(f: impl std::future::Future<Output = ()>) -> bool {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::ZERO, f)
                .await
                .is_ok()
        })
    }

    #[test]
    fn many_addresses_share_the_places_fairly() {
        let a = Admission::new(Limits {
            max_pending: 64,
            max_per_address: 64,
            retry_above: usize::MAX,
            known_reserve: 0,
        });
        // Eight addresses fill every place ...
        let mut held: Vec<Ticket> = (0..64).map(|i| accept(&a, 10 + (i % 8) as u8)).collect();
        // ... a ninth still gets in, again and again, each time at the cost of the address
        // holding most.
        for _ in 0..8 {
            held.push(accept(&a, 99));
        }
        assert_eq!(a.pending(), 64);
        assert_eq!(a.lock().pending_per_address[&ip(99)], 8);
        // Sixty-four addresses with one place each: a newcomer still gets in, at the cost of
        // the oldest connection; an address that already holds one does not.
        let a = Admission::new(Limits {
            max_pending: 64,
            max_per_address: 64,
            retry_above: usize::MAX,
            known_reserve: 0,
        });
        let one: Vec<Ticket> = (0..64).map(|i| accept(&a, 100 + i as u8)).collect();
        assert!(matches!(a.decide(ip(163), true), Decision::Refuse("busy")));
        let _newcomer = accept(&a, 99);
        assert_eq!(a.evictions(), 1);
        assert!(now(one[0].evicted()), "the oldest went");
        assert!(!now(one[1].evicted()));
    }

    #[test]
    fn known_addresses_have_places_strangers_cannot_take() {
        let a = Admission::new(Limits {
            max_pending: 4,
            max_per_address: 8,
            retry_above: 0,
            known_reserve: 2,
        });
        a.remember(ip(1));
        let _strangers: Vec<Ticket> = (0..4).map(|i| accept(&a, 20 + i)).collect();
        // Full of strangers; the host is let in without a Retry, and evicts nobody.
        let Decision::Accept(_h1) = a.decide(ip(1), false) else {
            panic!("known address refused")
        };
        let Decision::Accept(_h2) = a.decide(ip(1), false) else {
            panic!("known address refused")
        };
        assert_eq!(a.evictions(), 0);
        // Its reserve is used up and the rest is full: refused, still nobody evicted.
        assert!(matches!(a.decide(ip(1), true), Decision::Refuse("busy")));
        // A stranger evicts a stranger, never the host's pending connections.
        assert!(matches!(a.decide(ip(30), true), Decision::Accept(_)));
        assert_eq!(a.evictions(), 1);
        assert_eq!(a.lock().pending_known, 2);
    }
}
