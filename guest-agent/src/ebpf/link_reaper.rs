//! Releasing uprobe links off the tick.
//!
//! Closing a uprobe link waits for the kernel to unregister the uprobe, and that waits for an
//! RCU grace period: closed one after another, the 32 uprobes of 8 GPU processes that had
//! exited took 3.5 s here, all that time in the tick that forgot them. Concurrent closes share
//! their grace periods (the same 32 closed together took 0.1 s), so the reaper closes what it
//! is handed on many threads at once, on its own thread: the tick only hands the links over.
//! Dropping the reaper waits for every close. (Uprobes of processes still running cost more:
//! the kernel takes each out of every mapping of the library, and closing them together
//! gains little; the agent's exit beside running GPU processes waits for that.)

use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;

use libbpf_rs::Link;

/// Links closed at once, at most: each close mostly waits for a grace period the others
/// share. The 32 uprobes of 8 exited processes took 3.5 s one at a time, 2.1 s 8 at a time,
/// 0.1 s all together; those of 8 running processes, right after, 6.3-6.5 s one at a time,
/// 5.8-5.9 s 4 at a time, 5.6-5.7 s all together.
const AT_ONCE: usize = 64;

/// A thread that closes the links handed to it, many at once. The thread starts with the
/// first links handed over: an agent that never forgets a uprobe (the syscall modes) has none.
pub struct LinkReaper {
    name: &'static str,
    worker: Option<Worker>,
}

struct Worker {
    tx: Sender<Vec<Link>>,
    thread: JoinHandle<()>,
}

impl LinkReaper {
    /// A reaper whose thread, once started, is named `name`.
    pub fn new(name: &'static str) -> LinkReaper {
        LinkReaper { name, worker: None }
    }

    /// Hands `links` over to be closed; returns at once. Where no thread can be started
    /// they are closed here.
    pub fn release(&mut self, links: Vec<Link>) {
        if links.is_empty() {
            return;
        }
        if self.worker.is_none() {
            self.worker = Worker::start(self.name);
        }
        match &self.worker {
            Some(w) => {
                if let Err(e) = w.tx.send(links) {
                    close(e.0);
                }
            }
            None => close(links),
        }
    }
}

impl Worker {
    fn start(name: &str) -> Option<Worker> {
        let (tx, rx) = channel::<Vec<Link>>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while let Ok(mut links) = rx.recv() {
                    // what else is waiting joins this round
                    while let Ok(more) = rx.try_recv() {
                        links.extend(more);
                    }
                    close(links);
                }
            });
        match thread {
            Ok(thread) => Some(Worker { tx, thread }),
            Err(e) => {
                tracing::debug!(error = %e, "no thread to close links on; closing them in place");
                None
            }
        }
    }
}

impl Drop for LinkReaper {
    /// Waits until every link handed over is closed.
    fn drop(&mut self) {
        if let Some(Worker { tx, thread }) = self.worker.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

/// Closes `links`, up to `AT_ONCE` at a time, each on a thread of its own.
fn close(mut links: Vec<Link>) {
    while !links.is_empty() {
        let round: Vec<Link> = links.drain(..links.len().min(AT_ONCE)).collect();
        std::thread::scope(|s| {
            for link in round {
                if let Err(e) = std::thread::Builder::new().spawn_scoped(s, move || drop(link)) {
                    // no thread: the link came back with the error's closure and is
                    // closed here
                    tracing::debug!(error = %e, "closing a link on this thread");
                }
            }
        });
    }
}
