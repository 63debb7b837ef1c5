//! The hub's ring of recent events ([`super::Hub::recent`]): at most `capacity` events and about
//! `max_bytes` of them (each event's estimate: twice its encoded payload, plus its fixed size),
//! the oldest going first; the newest is always kept.

use std::collections::VecDeque;

use super::event::ReceivedEvent;

pub struct Recent {
    capacity: usize,
    max_bytes: usize,
    /// With each event's estimated size.
    events: VecDeque<(usize, ReceivedEvent)>,
    bytes: usize,
}

/// Estimated memory of a received event with this payload size.
pub fn estimate(e: &ReceivedEvent, payload_len: usize) -> usize {
    std::mem::size_of::<ReceivedEvent>() + e.host.len() + 2 * payload_len
}

impl Recent {
    pub fn new(capacity: usize, max_bytes: usize) -> Self {
        Recent {
            capacity,
            max_bytes,
            events: VecDeque::with_capacity(capacity.min(65536)),
            bytes: 0,
        }
    }

    pub fn push(&mut self, e: ReceivedEvent, size: usize) {
        if self.capacity == 0 {
            return;
        }
        self.bytes += size;
        self.events.push_back((size, e));
        while self.events.len() > self.capacity
            || (self.events.len() > 1 && self.bytes > self.max_bytes)
        {
            if let Some((n, _)) = self.events.pop_front() {
                self.bytes -= n;
            }
        }
    }

    /// Oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &ReceivedEvent> {
        self.events.iter().map(|(_, e)| e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::event::sample as ev;

    #[test]
    fn bounded_in_count_and_bytes_newest_kept() {
        let mut r = Recent::new(3, 1000);
        for s in 0..5 {
            r.push(ev(s), 100);
        }
        assert_eq!(r.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2, 3, 4]);
        r.push(ev(5), 950);
        assert_eq!(r.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![5]);
        r.push(ev(6), 5000);
        assert_eq!(r.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![6]);
        let mut none = Recent::new(0, 1000);
        none.push(ev(0), 1);
        assert_eq!(none.iter().count(), 0);
    }
}
