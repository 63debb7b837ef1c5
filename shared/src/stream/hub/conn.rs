//! The driver of one authenticated connection: it moves the bytes of the control and event
//! streams into the hub's sans-IO core ([`GuestStream`], one for the hub, behind its lock),
//! writes what the core has to send, and sleeps until the core's
//! [`poll_timeout`](GuestStream::poll_timeout) when nothing arrives, so that an idle
//! connection wakes only for its acks and clock probes. It decides nothing itself: it applies
//! what the core reports as metrics and log lines, reads the KVM PTP clock when the core has
//! a new estimate, and hands the accepted events to the join, waiting while the join's queue is
//! full (so that a burst waits in the host's spool, not in a lossy buffer).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::core::{ConnId, ControlEvent, End};
use super::intake::Delivery;
use super::shared::Inner;
use crate::clock;
use crate::proto::{encode, CLOSE_VM_UNBOUND};

/// How long the driver would sleep should the core name no deadline (it always names one: the
/// handshake's end, then the next clock probe); any message wakes it before.
const IDLE_NS: u64 = 3_600_000_000_000;

impl From<quinn::ReadError> for End {
    fn from(e: quinn::ReadError) -> Self {
        match e {
            quinn::ReadError::ConnectionLost(c) => c.into(),
            e => End::Lost(e.to_string()),
        }
    }
}
impl From<quinn::WriteError> for End {
    fn from(e: quinn::WriteError) -> Self {
        match e {
            quinn::WriteError::ConnectionLost(c) => c.into(),
            e => End::Lost(e.to_string()),
        }
    }
}
impl From<quinn::ConnectionError> for End {
    fn from(e: quinn::ConnectionError) -> Self {
        match e {
            quinn::ConnectionError::ApplicationClosed(c)
                if c.error_code == CLOSE_VM_UNBOUND.into() =>
            {
                // The host is authenticated, but its reason is still only shown, bounded.
                let why = String::from_utf8_lossy(&c.reason);
                End::Unbound(why.chars().take(200).collect())
            }
            e => End::Lost(e.to_string()),
        }
    }
}

/// One authenticated connection (see the module docs).
pub(super) struct Conn<'a> {
    inner: &'a Inner,
    host: &'a str,
    remote: SocketAddr,
    id: ConnId,
    /// From then on `gpufeed_stream_connected` counts it, and the caller takes it off again.
    pub(super) handshake_done: bool,
}

async fn read_opt(
    s: &mut Option<quinn::RecvStream>,
    max: usize,
) -> Result<Option<quinn::Chunk>, quinn::ReadError> {
    match s {
        Some(s) => s.read_chunk(max, true).await,
        None => std::future::pending().await,
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        st.stream.remove(self.id);
    }
}

impl<'a> Conn<'a> {
    pub(super) fn new(inner: &'a Inner, host: &'a str, remote: SocketAddr) -> Self {
        let id = {
            let mut st = inner.state.lock().expect("hub state");
            st.stream.accept(host, clock::monotonic_ns())
        };
        Conn {
            inner,
            host,
            remote,
            id,
            handshake_done: false,
        }
    }

    /// Encodes what the core has to send into `out`; returns when the core wants the driver
    /// back (a tokio instant).
    fn pending(&self, out: &mut Vec<u8>) -> Result<tokio::time::Instant, End> {
        let mut st = self.inner.state.lock().expect("hub state");
        let now = clock::monotonic_ns();
        while let Some(m) = st.stream.poll_transmit(self.id, now, clock::realtime_ns()) {
            encode(&m, out).map_err(|e| End::Lost(e.to_string()))?;
        }
        let left = st
            .stream
            .poll_timeout(self.id)
            .map_or(IDLE_NS, |d| d.saturating_sub(now));
        Ok(tokio::time::Instant::now() + Duration::from_nanos(left))
    }

    pub(super) async fn run(
        &mut self,
        conn: &quinn::Connection,
        connected: &prometheus::IntGauge,
    ) -> Result<(), End> {
        let inner = self.inner;
        let m = &inner.metrics;
        let host_l = [self.host];
        let (offset_g, rtt_g) = (
            m.offset.with_label_values(&host_l),
            m.rtt.with_label_values(&host_l),
        );
        let mut ctl_send: Option<quinn::SendStream> = None;
        let mut ctl_recv: Option<quinn::RecvStream> = None;
        let mut ev_recv: Option<quinn::RecvStream> = None;
        let mut out = Vec::new();
        loop {
            out.clear();
            let due = self.pending(&mut out)?;
            if let (Some(send), false) = (&mut ctl_send, out.is_empty()) {
                send.write_all(&out).await?;
            }
            let streaming = self.handshake_done;
            tokio::select! {
                s = conn.accept_bi(), if ctl_recv.is_none() => {
                    let (send, recv) = s?;
                    ctl_send = Some(send);
                    ctl_recv = Some(recv);
                }
                s = conn.accept_uni(), if streaming && ev_recv.is_none() => {
                    ev_recv = Some(s?);
                }
                r = read_opt(&mut ev_recv, 256 * 1024) => {
                    let chunk = match r {
                        Ok(c) => c,
                        Err(e) => {
                            let st = inner.state.lock().expect("hub state");
                            return Err(st.stream.handle_events_broken(self.id, e.into()));
                        }
                    };
                    let Some(chunk) = chunk else {
                        let st = inner.state.lock().expect("hub state");
                        return st.stream.handle_events_finished(self.id);
                    };
                    let (accepted, end) = self.process(&chunk.bytes);
                    inner.intake.deliver(accepted).await;
                    end?;
                }
                r = read_opt(&mut ctl_recv, 64 * 1024) => {
                    let events = {
                        let mut st = inner.state.lock().expect("hub state");
                        match r? {
                            None => return st.stream.handle_control_finished(self.id),
                            Some(chunk) => st.stream.handle_control(
                                self.id,
                                &chunk.bytes,
                                clock::monotonic_ns(),
                                clock::realtime_ns(),
                            )?,
                        }
                    };
                    for e in events {
                        match e {
                            ControlEvent::Connected { boot, resume_from } => {
                                self.handshake_done = true;
                                connected.inc();
                                tracing::info!(host = self.host, remote = %self.remote, boot, ?resume_from, "hub: host connected");
                            }
                            ControlEvent::HostState(state) => {
                                inner.host_states.update(self.host, state, Instant::now());
                            }
                            ControlEvent::Clock(est) => {
                                offset_g.set(est.offset_ns as f64 / 1e9);
                                rtt_g.set(est.rtt_ns as f64 / 1e9);
                                self.cross_check();
                            }
                            ControlEvent::Finish(end) => {
                                out.clear();
                                let _ = self.pending(&mut out);
                                if let Some(send) = &mut ctl_send {
                                    let _ = send.write_all(&out).await;
                                    let _ = send.finish();
                                    // Let the Reject reach the host before the close.
                                    let _ = tokio::time::timeout(Duration::from_millis(200), send.stopped()).await;
                                }
                                return Err(end);
                            }
                        }
                    }
                }
                _ = tokio::time::sleep_until(due) => {
                    let mut st = inner.state.lock().expect("hub state");
                    st.stream.handle_timeout(self.id, clock::monotonic_ns())?;
                }
            }
        }
    }

    /// Hands the bytes of the event stream to the core and applies what the batch amounted
    /// to. Returns the accepted events in sequence order, for the join (also when the
    /// connection must end: what was accepted before the fault is journaled and acknowledged).
    fn process(&mut self, bytes: &[u8]) -> (Vec<Delivery>, Result<(), End>) {
        let inner = self.inner;
        let read = {
            let mut st = inner.state.lock().expect("hub state");
            let st = &mut *st;
            let read = st.stream.handle_events(
                self.id,
                bytes,
                clock::realtime_ns(),
                st.journal.as_mut(),
                &mut st.recent,
            );
            if let Some(r) = &read.outcome.unavailable {
                if let Some(j) = &mut st.journal {
                    if let Some(unlogged) = j.note_failure(Instant::now()) {
                        tracing::error!(path = %j.path().display(), error = %r.error, host = self.host, events = r.events, unlogged, "hub: event journal write failed; the host keeps the events and sends them again");
                    }
                }
                return (Vec::new(), Err(End::Unavailable));
            }
            read
        };
        let out = read.outcome;
        for n in &out.notes {
            self.note(n.kind(), n);
        }
        let m = &inner.metrics;
        let host_l = [self.host];
        if let Some(l) = out.lag_ns {
            m.lag.with_label_values(&host_l).set(l as f64 / 1e9);
        }
        m.received
            .with_label_values(&host_l)
            .inc_by(out.delivered.len() as u64);
        m.duplicate
            .with_label_values(&host_l)
            .inc_by(out.duplicates);
        m.lost.with_label_values(&host_l).inc_by(out.lost);
        m.possible_duplicate
            .with_label_values(&host_l)
            .inc_by(out.possible_duplicates);
        if out.bad_payload > 0 {
            m.rejected
                .with_label_values(&[self.host, "bad_payload"])
                .inc_by(out.bad_payload);
        }
        if !out.unknown.is_empty() {
            tracing::debug!(
                host = self.host,
                unknown = out.unknown.len(),
                "hub: events of a kind this guest does not know; passed on undecoded"
            );
            m.rejected
                .with_label_values(&[self.host, "unknown_kind"])
                .inc_by(out.unknown.len() as u64);
        }
        for reason in &out.refused {
            inner.reject(
                self.host,
                reason,
                self.remote,
                &format_args!(
                    "refused a message numbered out of range ({reason}); the stream goes on"
                ),
            );
        }
        for g in read.skipped {
            inner.reject(
                self.host,
                g.reason(),
                self.remote,
                &format_args!("skipped a frame: {g}"),
            );
        }
        let mut accepted: Vec<Delivery> = out.delivered.into_iter().map(Delivery::Event).collect();
        if !out.unknown.is_empty() {
            accepted.extend(out.unknown.into_iter().map(Delivery::Unknown));
            accepted.sort_by_key(Delivery::seq);
        }
        let end = match read.end {
            Some(f) => Err(f),
            None => Ok(()),
        };
        (accepted, end)
    }

    /// A warning about this host's stream that repeats (gaps, losses): rate-limited per kind.
    fn note(&self, kind: &'static str, detail: &dyn std::fmt::Display) {
        let key = (self.host.to_owned(), kind);
        if let Some(unlogged) = self.inner.host_log.note(key, Instant::now()) {
            tracing::warn!(host = self.host, kind, unlogged, "hub: {detail}");
        }
    }

    /// A new clock estimate: the KVM PTP clock, where there is one, is read and the core says
    /// whether their disagreement is worth a warning.
    fn cross_check(&self) {
        let Some(ptp) = &self.inner.ptp else { return };
        let Ok(p) = ptp.lock().expect("ptp").offset_ns() else {
            return;
        };
        self.inner.metrics.ptp.set(p as f64 / 1e9);
        let d = {
            let mut st = self.inner.state.lock().expect("hub state");
            st.stream.handle_ptp(self.id, p, clock::monotonic_ns())
        };
        if let Some(d) = d {
            tracing::warn!(host = self.host, probe_offset_ns = d.probe_offset_ns, kvm_ptp_offset_ns = d.kvm_ptp_offset_ns, diff_ns = d.diff_ns, "hub: clock offset from probes disagrees with the KVM PTP clock by more than 1 ms (is this host the VM's hypervisor?)");
        }
    }
}
