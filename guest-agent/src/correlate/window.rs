//! What the probe units hand the correlator every tick: one window per (pod, signal).

use std::sync::Arc;

use serde::Serialize;

/// A pod as the correlator knows it. `uid` keeps two pods of the same name apart (a pod
/// deleted and re-created under its old name is a new pod with a fresh baseline).
///
/// Its names are shared strings: the join keeps one key per pod and hands clones of it to the
/// correlator and the timeline every tick, which compare a key they hold with the one handed
/// to them by pointer before by bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PodKey {
    pub namespace: Arc<str>,
    pub pod: Arc<str>,
    pub uid: Arc<str>,
}

impl PodKey {
    pub fn new(namespace: &str, pod: &str, uid: &str) -> Self {
        PodKey {
            namespace: namespace.into(),
            pod: pod.into(),
            uid: uid.into(),
        }
    }
}

/// What a signal's windows are, as the unit that made them declared it: how the detector
/// reads a signal the configuration has no policy for (`Config::signals`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SignalShape {
    /// Observations with a count, a sum and quantiles: the mean is tested for rises.
    #[default]
    Distribution,
    /// Events per second: the rate is tested for rises; a window without events is a zero.
    Rate,
    /// A level read once a tick (a throughput): tested for falls, dips below its baseline.
    Level,
}

/// One tick of one latency signal of one pod, summarised from the probe's delta.
///
/// For a distribution signal (`run_queue_wait`, `tcp_rtt`) `count` is the number of
/// observations and `p50`/`p99`/`max` are their quantiles. For a rate signal
/// (`tcp_retransmit_rate`, `tc_drop_rate`) the unit reports the per-second rate of the window in
/// `p50`, `p99` and `max` and the number of events in `count`. The detector tests the mean
/// (`sum / count`) of a distribution and the rate of a rate signal, and reports `p99`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SignalWindow {
    pub pod: PodKey,
    /// `run_queue_wait`, `tcp_rtt`, `tcp_retransmit_rate`, `tc_drop_rate`, or a later unit's name.
    pub signal: String,
    /// End of the window, guest `CLOCK_REALTIME` in ns.
    pub at: i64,
    pub count: u64,
    pub sum: f64,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub shape: SignalShape,
}

/// A [`SignalWindow`] by reference, with what the detector reads: a caller that keeps its
/// pods' keys hands them over without copying them into every window each tick.
#[derive(Debug, Clone, Copy)]
pub struct WindowRef<'a> {
    pub pod: &'a PodKey,
    pub signal: &'a str,
    pub at: i64,
    pub count: u64,
    /// `sum / count` of a distribution (what its detector tests).
    pub mean: f64,
    pub p99: f64,
    pub shape: SignalShape,
}

impl SignalWindow {
    pub fn view(&self) -> WindowRef<'_> {
        WindowRef {
            pod: &self.pod,
            signal: &self.signal,
            at: self.at,
            count: self.count,
            mean: self.sum / self.count as f64,
            p99: self.p99,
            shape: self.shape,
        }
    }
}
