//! The kernel log records of the last moments ([`RecentKmsg`]): what the kmsg watcher read,
//! for the AER watcher's context and the VM watcher's stop causes.

use gpufeed_shared::event::KmsgRecord;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Recent classified kernel log records, for AER context and VM stop causes.
#[derive(Debug, Default)]
pub struct RecentKmsg {
    inner: Mutex<VecDeque<(Instant, KmsgRecord)>>,
}

impl RecentKmsg {
    const CAP: usize = 512;

    pub fn push(&self, r: KmsgRecord) {
        let mut q = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= Self::CAP {
            q.pop_front();
        }
        q.push_back((Instant::now(), r));
    }

    /// Records within `window` for which `pred` holds.
    pub fn matching(
        &self,
        window: Duration,
        pred: impl Fn(&KmsgRecord) -> bool,
    ) -> Vec<KmsgRecord> {
        let q = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        q.iter()
            .filter(|(t, r)| now.duration_since(*t) <= window && pred(r))
            .map(|(_, r)| r.clone())
            .collect()
    }
}
