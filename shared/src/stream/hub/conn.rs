//! The driver of one authenticated connection: reads the control and event streams, hands
//! their messages to the core ([`GuestConnection`]) and a batch's acceptance to
//! [`batch::accept`], writes what the core has to send, and sleeps until the core's
//! [`poll_timeout`](GuestConnection::poll_timeout) when nothing arrives, so that an idle
//! connection wakes only for its clock probes. It decides nothing itself: it applies the
//! outcome as metrics and log lines, and hands the accepted events to the join, waiting while
//! the join's queue is full (so that a burst waits in the host's spool, not in a lossy buffer).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::batch;
use super::intake::Delivery;
use super::shared::Inner;
use crate::clock;
use crate::proto::{
    encode, DecodeError, FrameDecoder, GuestConnection, Message, ServerAction, Staged,
    CLOSE_VM_UNBOUND,
};

/// How long the driver would sleep should the core name no deadline (it always names one: the
/// handshake's end, then the next clock probe); any message wakes it before.
const IDLE_NS: u64 = 3_600_000_000_000;

/// Why a connection ended abnormally.
pub(super) enum End {
    /// The peer misbehaved: counted, logged, closed.
    Rejected(&'static str, String),
    /// Transport ended (peer gone, timeout).
    Lost(String),
    /// The host will not stream to this guest: it cannot bind the guest's VM identity to one
    /// of its VMs (the host's reason). Counted and logged; the host tries again later.
    Unbound(String),
    /// This guest could not take the events (its journal write failed; logged there): they
    /// were neither delivered nor acknowledged, and closing makes the host send them again.
    Unavailable,
}

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
impl From<DecodeError> for End {
    fn from(e: DecodeError) -> Self {
        End::Rejected(e.reason(), e.to_string())
    }
}
impl From<crate::proto::ProtocolError> for End {
    fn from(e: crate::proto::ProtocolError) -> Self {
        End::Rejected(e.reason(), e.to_string())
    }
}

/// One authenticated connection (see the module docs).
pub(super) struct Conn<'a> {
    inner: &'a Inner,
    host: &'a str,
    remote: SocketAddr,
    core: GuestConnection,
    /// From then on `gpufeed_stream_connected` counts it, and the caller takes it off again.
    pub(super) handshake_done: bool,
}

async fn read_opt(
    s: &mut Option<quinn::RecvStream>,
) -> Result<Option<quinn::Chunk>, quinn::ReadError> {
    match s {
        Some(s) => s.read_chunk(256 * 1024, true).await,
        None => std::future::pending().await,
    }
}

impl<'a> Conn<'a> {
    pub(super) fn new(inner: &'a Inner, host: &'a str, remote: SocketAddr) -> Self {
        Conn {
            inner,
            host,
            remote,
            core: GuestConnection::new(host, inner.cfg.timing(), clock::monotonic_ns())
                .with_vm_uuid(inner.vm_uuid.clone()),
            handshake_done: false,
        }
    }

    async fn write(send: &mut quinn::SendStream, m: &Message) -> Result<(), End> {
        let mut buf = Vec::with_capacity(64);
        encode(m, &mut buf).map_err(|e| End::Lost(e.to_string()))?;
        send.write_all(&buf).await?;
        Ok(())
    }

    /// What the core says is due next (monotonic ns).
    fn due_ns(&self) -> Option<u64> {
        let st = self.inner.state.lock().expect("hub state");
        self.core.poll_timeout(&st.dedup)
    }

    /// [`due_ns`](Self::due_ns) as a tokio instant: the driver sleeps until then.
    fn deadline(&self) -> tokio::time::Instant {
        let left = match self.due_ns() {
            Some(d) => d.saturating_sub(clock::monotonic_ns()),
            // Nothing is due until a message comes.
            None => IDLE_NS,
        };
        tokio::time::Instant::now() + Duration::from_nanos(left)
    }

    /// The `Hello` deadline passed: the core words the error.
    fn timed_out(&mut self) -> End {
        let due = self.due_ns().unwrap_or(0);
        match self.core.handle_timeout(clock::monotonic_ns().max(due)) {
            Err(e) => e.into(),
            Ok(()) => End::Rejected("timeout", "handshake timed out".into()),
        }
    }

    pub(super) async fn run(
        &mut self,
        conn: &quinn::Connection,
        connected: &prometheus::IntGauge,
    ) -> Result<(), End> {
        let inner = self.inner;
        let hello_by = self.deadline();
        let (mut ctl_send, mut ctl_recv) =
            match tokio::time::timeout_at(hello_by, conn.accept_bi()).await {
                Ok(r) => r?,
                Err(_) => return Err(self.timed_out()),
            };
        let mut ctl_dec = FrameDecoder::default();
        let hello = loop {
            if let Some(m) = ctl_dec.next_frame()? {
                break m;
            }
            let chunk =
                match tokio::time::timeout_at(hello_by, ctl_recv.read_chunk(64 * 1024, true)).await
                {
                    Ok(r) => r?,
                    Err(_) => return Err(self.timed_out()),
                };
            match chunk {
                Some(c) => ctl_dec.push(&c.bytes),
                None => {
                    ctl_dec.finish()?;
                    return Err(End::Rejected(
                        "truncated",
                        "control stream ended before Hello".into(),
                    ));
                }
            }
        };
        let action = {
            let st = inner.state.lock().expect("hub state");
            self.core.handle_control(
                hello,
                &st.dedup,
                clock::monotonic_ns(),
                clock::realtime_ns(),
            )?
        };
        let (boot, resume_from) = match (action, self.core.boot_id()) {
            (ServerAction::Welcome(w), Some(boot)) => {
                Self::write(&mut ctl_send, &w).await?;
                let resume = match &w {
                    Message::Welcome(w) => w.resume_from,
                    Message::WelcomeVm(w) => w.welcome.resume_from,
                    _ => None,
                };
                (boot, resume)
            }
            (ServerAction::Reject(m, reason), _) => {
                let _ = Self::write(&mut ctl_send, &m).await;
                let _ = ctl_send.finish();
                // Let the Reject reach the host before the close.
                let _ = tokio::time::timeout(Duration::from_millis(200), ctl_send.stopped()).await;
                return Err(End::Rejected("hello_refused", reason));
            }
            _ => return Err(End::Rejected("unexpected_message", "no Hello".into())),
        };
        self.handshake_done = true;
        connected.inc();
        tracing::info!(host = self.host, remote = %self.remote, boot, ?resume_from, "hub: host connected");
        let m = &inner.metrics;
        let host_l = [self.host];
        let (received, duplicate, lost, lag, offset_g, rtt_g) = (
            m.received.with_label_values(&host_l),
            m.duplicate.with_label_values(&host_l),
            m.lost.with_label_values(&host_l),
            m.lag.with_label_values(&host_l),
            m.offset.with_label_values(&host_l),
            m.rtt.with_label_values(&host_l),
        );
        let mut ev_recv: Option<quinn::RecvStream> = None;
        let mut ev_dec = FrameDecoder::default();
        let mut out = Vec::new();
        loop {
            let due = self.deadline();
            tokio::select! {
                s = conn.accept_uni(), if ev_recv.is_none() => {
                    ev_recv = Some(s?);
                }
                r = read_opt(&mut ev_recv) => {
                    let chunk = match r {
                        Ok(c) => c,
                        Err(e) => {
                            if ev_dec.buffered() > 0 {
                                return Err(End::Rejected("truncated", format!(
                                    "event stream broke inside a frame ({} bytes buffered): {e}",
                                    ev_dec.buffered()
                                )));
                            }
                            return Err(e.into());
                        }
                    };
                    let Some(chunk) = chunk else {
                        ev_dec.finish()?;
                        return Ok(());
                    };
                    ev_dec.push(&chunk.bytes);
                    let (accepted, end) = self.process(&mut ev_dec, boot, &received, &duplicate, &lost, &lag);
                    inner.intake.deliver(accepted).await;
                    end?;
                }
                r = ctl_recv.read_chunk(64 * 1024, true) => {
                    let Some(chunk) = r? else {
                        ctl_dec.finish()?;
                        return Ok(());
                    };
                    ctl_dec.push(&chunk.bytes);
                    while let Some(msg) = ctl_dec.next_frame()? {
                        let action = {
                            let st = inner.state.lock().expect("hub state");
                            self.core.handle_control(msg, &st.dedup, clock::monotonic_ns(), clock::realtime_ns())?
                        };
                        match action {
                            ServerAction::Clock(sample) => self.clock_sample(sample, &offset_g, &rtt_g),
                            ServerAction::HostState(state) => {
                                inner.host_states.update(self.host, state, Instant::now());
                            }
                            _ => {}
                        }
                    }
                }
                _ = tokio::time::sleep_until(due) => {
                    out.clear();
                    {
                        let st = inner.state.lock().expect("hub state");
                        while let Some(m) = self.core.poll_transmit(&st.dedup, clock::monotonic_ns(), clock::realtime_ns()) {
                            encode(&m, &mut out).map_err(|e| End::Lost(e.to_string()))?;
                        }
                    }
                    if !out.is_empty() {
                        ctl_send.write_all(&out).await?;
                    }
                }
            }
        }
    }

    /// Decodes every complete frame of the event stream and has the core account them; what
    /// the batch amounts to is [`batch::accept`]'s to decide, and this applies it. Returns the
    /// accepted events in sequence order, for the join (also when the connection must end: what
    /// was accepted before the fault is journaled and acknowledged).
    fn process(
        &mut self,
        dec: &mut FrameDecoder,
        boot: u64,
        received: &prometheus::IntCounter,
        duplicate: &prometheus::IntCounter,
        lost: &prometheus::IntCounter,
        lag: &prometheus::Gauge,
    ) -> (Vec<Delivery>, Result<(), End>) {
        let inner = self.inner;
        let now = clock::realtime_ns();
        let mut garbage = Vec::new();
        let mut fatal = None;
        let mut staged = Staged::default();
        let out = {
            let mut st = inner.state.lock().expect("hub state");
            let st = &mut *st;
            loop {
                let msg = match dec.next_frame() {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) if !e.is_fatal() => {
                        garbage.push(e);
                        continue;
                    }
                    Err(e) => {
                        fatal = Some(End::from(e));
                        break;
                    }
                };
                if let Err(e) = self.core.handle_event(msg, &mut staged, &st.dedup) {
                    fatal = Some(e.into());
                    break;
                }
            }
            let at = batch::Receipt {
                host: self.host,
                boot,
                realtime_ns: now,
                clock_offset_ns: st
                    .clocks
                    .get(self.host)
                    .and_then(|c| c.estimate())
                    .map(|e| e.offset_ns),
            };
            let out = batch::accept(
                &mut self.core,
                staged,
                at,
                &mut st.dedup,
                st.journal.as_mut(),
                &mut st.recent,
            );
            if let Some(r) = &out.unavailable {
                if let Some(j) = &mut st.journal {
                    if let Some(unlogged) = j.note_failure(Instant::now()) {
                        tracing::error!(path = %j.path().display(), error = %r.error, host = self.host, events = r.events, unlogged, "hub: event journal write failed; the host keeps the events and sends them again");
                    }
                }
                return (Vec::new(), Err(End::Unavailable));
            }
            out
        };
        for n in &out.notes {
            self.note(n.kind(), n);
        }
        if let Some(l) = out.lag_ns {
            lag.set(l as f64 / 1e9);
        }
        received.inc_by(out.delivered.len() as u64);
        duplicate.inc_by(out.duplicates);
        lost.inc_by(out.lost);
        let m = &inner.metrics;
        m.possible_duplicate
            .with_label_values(&[self.host])
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
            inner
                .metrics
                .rejected
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
        for g in garbage {
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
        let end = match fatal {
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

    fn clock_sample(
        &self,
        s: clock::ClockSample,
        offset_g: &prometheus::Gauge,
        rtt_g: &prometheus::Gauge,
    ) {
        let est = {
            let mut st = self.inner.state.lock().expect("hub state");
            let f = st.clocks.entry(self.host.to_owned()).or_default();
            f.add(s);
            f.estimate()
        };
        let Some(est) = est else { return };
        offset_g.set(est.offset_ns as f64 / 1e9);
        rtt_g.set(est.rtt_ns as f64 / 1e9);
        let Some(ptp) = &self.inner.ptp else { return };
        let Ok(p) = ptp.lock().expect("ptp").offset_ns() else {
            return;
        };
        self.inner.metrics.ptp.set(p as f64 / 1e9);
        let diff = est.offset_ns - p;
        if diff.abs() > 1_000_000 {
            let mut warned = self.inner.ptp_warned.lock().expect("ptp warned");
            let due = warned
                .get(self.host)
                .is_none_or(|t| t.elapsed() > Duration::from_secs(60));
            if due {
                warned.insert(self.host.to_owned(), Instant::now());
                tracing::warn!(host = self.host, probe_offset_ns = est.offset_ns, kvm_ptp_offset_ns = p, diff_ns = diff, "hub: clock offset from probes disagrees with the KVM PTP clock by more than 1 ms (is this host the VM's hypervisor?)");
            }
        }
    }
}
