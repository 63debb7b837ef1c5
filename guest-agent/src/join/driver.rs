//! The join's driver: one thread that owns the [`JoinOwner`], fed by one bounded channel of
//! [`Input`]s (the tick thread's reports, the hub's events through a thread of their own, the
//! page's picture questions), and that publishes the owner's answers for the readers.
//!
//! Readers never wait on the join's work: `/events` and the scrape read the answers published
//! after the last batch of inputs that changed them (at most [`BATCH`] late in a burst;
//! [`SERIES_EVERY`] for the ratios' drift with time), the page the state
//! rendered at most once per [`STATE_EVERY`]. Rendering the page's state is the one answer with
//! a cost worth sparing: it is rendered while someone reads it (within [`STATE_READ_WITHIN`]);
//! a read that finds none, or one older than twice [`STATE_EVERY`], asks for a fresh one and
//! waits for it at most [`STATE_WAIT`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prometheus::core::{Collector as PromCollector, Desc};
use prometheus::proto::MetricFamily;

use crate::collect::TickReport;
use crate::correlate::views::EventView;
use crate::families::Rows;
use crate::hub::Hub;
use crate::incident::{self, annotations, PageState};
use crate::pods::PodStore;

use super::owner::{Input, JoinOwner, SeriesStamp, Settings};

/// Inputs waiting for the owner; a full queue holds the sender (the tick thread, the hub's
/// intake and with it the connection: a burst waits, nothing is lost).
pub const QUEUE: usize = 1024;
/// In a burst the owner answers at least this often; otherwise as soon as its queue is empty.
pub const BATCH: Duration = Duration::from_millis(100);
/// The page's state is rendered at most this often.
pub const STATE_EVERY: Duration = Duration::from_secs(1);
/// The page's state is rendered while it was read within this.
pub const STATE_READ_WITHIN: Duration = Duration::from_secs(60);
/// How long a read of a stale state waits for a fresh one before taking what there is.
pub const STATE_WAIT: Duration = Duration::from_millis(1500);
/// The correlation series are rendered again after a host event, a spike recorded or expired
/// or a pod forgotten, and at least this often (their explained ratios move with time): a
/// quiet node's ticks render none (at 1,000 pods a rendering is milliseconds).
pub const SERIES_EVERY: Duration = Duration::from_secs(10);

/// Guest realtime now, ns.
fn realtime_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// What the owner published after its last batch of inputs.
#[derive(Default)]
pub struct Answers {
    /// `/events`: recent host events with the pods they hit, newest first.
    pub events: Vec<EventView>,
    /// The correlation series and the annotation timestamps, for the scrape (as rows: a
    /// scrape builds the families it writes).
    pub series: Vec<Rows>,
}

/// The page's state and when it was rendered (`None`: before anyone asked).
struct StateAnswer {
    at: Option<Instant>,
    state: Arc<PageState>,
}

/// The join as the rest of the agent holds it: a sender to its owner and its published
/// answers. Cheap to clone.
#[derive(Clone)]
pub struct Join {
    tx: SyncSender<Input>,
    answers: tokio::sync::watch::Receiver<Arc<Answers>>,
    state: tokio::sync::watch::Receiver<Arc<StateAnswer>>,
    /// Milliseconds since `started` of the last read of the page's state (0: never).
    state_read_ms: Arc<AtomicU64>,
    started: Instant,
    settings: Arc<Settings>,
}

/// The error of a question the owner did not answer in time (a burst ahead of it).
#[derive(Debug, thiserror::Error)]
#[error("the join is busy; ask again")]
pub struct Busy;

impl Join {
    /// Starts the owner's thread.
    pub fn start(settings: Settings, pods: PodStore) -> std::io::Result<Join> {
        let (tx, rx) = sync_channel(QUEUE);
        let (answers_tx, answers) = tokio::sync::watch::channel(Arc::new(Answers::default()));
        let started = Instant::now();
        let owner = JoinOwner::new(settings.clone(), pods);
        let first = Arc::new(StateAnswer {
            at: None,
            state: Arc::new(owner.page_state(realtime_ns())),
        });
        let (state_tx, state) = tokio::sync::watch::channel(first);
        let state_read_ms = Arc::new(AtomicU64::new(0));
        let read = state_read_ms.clone();
        std::thread::Builder::new()
            .name("join".into())
            .spawn(move || run(owner, rx, answers_tx, state_tx, read, started))?;
        Ok(Join {
            tx,
            answers,
            state,
            state_read_ms,
            started,
            settings: Arc::new(settings),
        })
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// A tick's report to the join (from the tick thread; waits while the join's queue is full).
    pub fn tick(&self, report: TickReport) {
        let _ = self.tx.send(Input::Tick(Box::new(report)));
    }

    /// The hub whose host events and state this join reads. Its events come from the hub's
    /// intake queue, in order, on a thread of their own into the join's queue: while that is
    /// full the hub's queue fills and the hub waits (a burst is joined in full, late rather
    /// than lost). An event is joined, counted and listed as it arrives, not at the next tick.
    pub fn attach_hub(&self, hub: Hub) {
        let rx = hub.intake();
        let _ = self.tx.send(Input::Hub(hub));
        let Some(mut rx) = rx else {
            tracing::error!(
                "the hub's events are taken by another reader; host events are not joined"
            );
            return;
        };
        let tx = self.tx.clone();
        let spawned = std::thread::Builder::new()
            .name("hub-events".into())
            .spawn(move || {
                while let Some(d) = rx.blocking_recv() {
                    if tx.send(Input::Host(Box::new(d))).is_err() {
                        return; // the join is gone: the agent is stopping
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the thread that joins host events: {e}");
        }
    }

    /// The answers published after the join's last batch of inputs.
    pub fn answers(&self) -> Arc<Answers> {
        self.answers.borrow().clone()
    }

    /// `/api/state`: the page's state, rendered at most [`STATE_EVERY`] ago; when the last one
    /// is older (nobody read it for a while), a fresh one within [`STATE_WAIT`] if the join
    /// gets to it, else the last one.
    pub async fn page_state(&self) -> Arc<PageState> {
        let now_ms = self.started.elapsed().as_millis() as u64;
        self.state_read_ms.store(now_ms.max(1), Ordering::Relaxed);
        let mut rx = self.state.clone();
        let fresh = rx
            .borrow_and_update()
            .at
            .is_some_and(|at| at.elapsed() <= 2 * STATE_EVERY);
        if !fresh {
            let _ = tokio::time::timeout(STATE_WAIT, rx.changed()).await;
        }
        let state = rx.borrow().state.clone();
        state
    }

    /// `/api/picture`: the listed event's picture, drawn by the join between its inputs.
    pub async fn picture(
        &self,
        host: String,
        event: String,
        time_ms: i64,
    ) -> Result<Option<incident::Picture>, Busy> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.tx
            .try_send(Input::Picture {
                host,
                event,
                time_ms,
                reply,
            })
            .map_err(|_| Busy)?;
        match tokio::time::timeout(STATE_WAIT, answer).await {
            Ok(Ok(p)) => Ok(p),
            _ => Err(Busy),
        }
    }

    #[cfg(test)]
    pub(crate) fn tx_for_tests(&self) -> &SyncSender<Input> {
        &self.tx
    }

    /// The join's series for a registry.
    pub fn series(&self) -> JoinSeries {
        JoinSeries::new(self.answers.clone())
    }
}

/// The owner's thread: inputs in, answers out.
fn run(
    mut owner: JoinOwner,
    rx: Receiver<Input>,
    answers: tokio::sync::watch::Sender<Arc<Answers>>,
    state: tokio::sync::watch::Sender<Arc<StateAnswer>>,
    state_read_ms: Arc<AtomicU64>,
    started: Instant,
) {
    let mut last_state = started;
    let mut last_series: Option<(Instant, SeriesStamp)> = None;
    let mut gone = false;
    while !gone {
        match rx.recv_timeout(STATE_EVERY) {
            Ok(input) => {
                let mut host_events = matches!(input, Input::Host(_));
                owner.handle(input, Instant::now(), realtime_ns());
                // what queued meanwhile, for at most one batch, then the answers
                let until = Instant::now() + BATCH;
                while Instant::now() < until {
                    match rx.try_recv() {
                        Ok(input) => {
                            host_events |= matches!(input, Input::Host(_));
                            owner.handle(input, Instant::now(), realtime_ns());
                        }
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            gone = true;
                            break;
                        }
                    }
                }
                let stamp = owner.series_stamp();
                let due = match &last_series {
                    None => true,
                    Some((at, was)) => host_events || *was != stamp || at.elapsed() >= SERIES_EVERY,
                };
                if due {
                    let now_ns = realtime_ns();
                    last_series = Some((Instant::now(), stamp));
                    answers.send_replace(Arc::new(Answers {
                        events: owner.events(),
                        series: owner.series(now_ns),
                    }));
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => gone = true,
        }
        let read = state_read_ms.load(Ordering::Relaxed);
        let read_lately = read > 0
            && (started.elapsed().as_millis() as u64).saturating_sub(read)
                <= STATE_READ_WITHIN.as_millis() as u64;
        if read_lately && last_state.elapsed() >= STATE_EVERY {
            let began = Instant::now();
            let rendered = Arc::new(owner.page_state(realtime_ns()));
            last_state = Instant::now();
            tracing::debug!(
                ms = (last_state - began).as_millis() as u64,
                "the page's state rendered"
            );
            state.send_replace(Arc::new(StateAnswer {
                at: Some(last_state),
                state: rendered,
            }));
        }
    }
}

/// The correlation series for a registry, as the join last published them.
pub struct JoinSeries {
    answers: tokio::sync::watch::Receiver<Arc<Answers>>,
    descs: Vec<Desc>,
}

impl JoinSeries {
    fn new(answers: tokio::sync::watch::Receiver<Arc<Answers>>) -> JoinSeries {
        let descs = [
            (
                crate::correlate::views::LATENCY_SPIKES,
                "Latency spikes detected per pod and signal",
            ),
            (annotations::HOST_EVENT_TIMESTAMP, annotations::HELP),
        ]
        .into_iter()
        .filter_map(|(n, h)| Desc::new(n.into(), h.into(), vec![], Default::default()).ok())
        .collect();
        JoinSeries { answers, descs }
    }
}

impl PromCollector for JoinSeries {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let answers = self.answers.borrow().clone();
        answers.series.iter().map(Rows::family).collect()
    }
}
