//! The tick loop: the collector ticks on a thread of its own every interval (a tick is all
//! blocking syscalls), and hands each tick's report by value: its GPU totals to FinOps, the
//! rest to the join. Neither holds a lock of the collector's: a scrape, which locks the
//! collector's store to render the owners' series, never waits for them.
//!
//! At shutdown the loop is stopped and its thread joined, so that the units are dropped: clsact
//! filters (kernels before tcx) outlive the process unless detached.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::collect::Collector;
use crate::finops::FinOps;
use crate::join::Join;

/// The running loop.
pub struct TickLoop {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

/// When the last tick ended, for the health check: milliseconds since `started`.
#[derive(Clone)]
pub struct LastTick {
    started: Instant,
    ms: Arc<AtomicU64>,
}

impl LastTick {
    pub fn new() -> LastTick {
        LastTick {
            started: Instant::now(),
            ms: Arc::default(),
        }
    }

    fn mark(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.ms.store(ms, Ordering::Relaxed);
    }

    /// How long ago the last tick ended (or the loop was set up).
    pub fn age(&self) -> Duration {
        let now = self.started.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.ms.load(Ordering::Relaxed)))
    }
}

impl Default for LastTick {
    fn default() -> Self {
        Self::new()
    }
}

impl TickLoop {
    /// Ticks `collector` every `interval` from now on.
    pub fn start(
        mut collector: Collector,
        interval: Duration,
        join: Join,
        finops: FinOps,
        last: LastTick,
    ) -> std::io::Result<TickLoop> {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("tick".into())
            .spawn(move || {
                let mut next = Instant::now() + interval;
                loop {
                    let wait = next.saturating_duration_since(Instant::now());
                    if stopped.recv_timeout(wait) != Err(RecvTimeoutError::Timeout) {
                        break; // asked to stop (or the agent is gone)
                    }
                    next += interval;
                    let mut report = match collector.tick() {
                        Ok(report) => report,
                        Err(e) => {
                            tracing::warn!("reading the cgroup hierarchy failed: {e}");
                            continue;
                        }
                    };
                    // FinOps takes its part of the report; the join the rest
                    let totals = std::mem::take(&mut report.gpu);
                    join.tick(report);
                    finops.book(totals, Instant::now());
                    last.mark();
                }
                drop(collector);
            })?;
        Ok(TickLoop { stop, thread })
    }

    /// Ends the tick in progress, then drops the units.
    pub fn stop(self) {
        let _ = self.stop.send(());
        if self.thread.join().is_err() {
            tracing::warn!("the tick thread panicked; its probes were not detached");
        }
    }
}
