//! The join's one owner: the correlator, the incident page's timeline, the merge of the pods'
//! windows and what was logged. It takes one [`Input`] at a time and answers from its own
//! state; it has no lock, reads no clock of its own (each input comes with `now`) and does no
//! IO but its log lines, so a test or a benchmark drives it directly, and the driver
//! ([`super::driver`]) only moves inputs in and publishes its answers.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use crate::collect::{LiveUids, TickReport};
use crate::correlate::events::{self, Payload};
use crate::correlate::views::EventView;
use crate::correlate::{link_condition, Config, Correlator, GpuWindow, HostInput};
use crate::families::Rows;
use crate::hub::{Delivery, Hub, ReceivedEvent, UnknownEvent};
use crate::incident::profile::{ProfileTemplate, Target};
use crate::incident::{self, HostView, PageState, Timeline, TimelineConfig, Unexplained};
use crate::pods::PodStore;

use super::feed_stall::{self, FeedStallBook, FeedStallShare};
use super::merge::Merge;

/// What the join is fed, one at a time, in the order they happened.
pub enum Input {
    /// A collector tick's report.
    Tick(Box<TickReport>),
    /// A host event the hub accepted (or one of a kind this guest cannot decode).
    Host(Box<Delivery>),
    /// The hub whose host state the pictures read (when the stream starts).
    Hub(Hub),
    /// `/api/picture`: one listed event's picture, answered on `reply`.
    Picture {
        host: String,
        event: String,
        time_ms: i64,
        reply: tokio::sync::oneshot::Sender<Option<incident::Picture>>,
    },
    /// Holds the owner until the sender is dropped (a busy join, for the tests).
    #[cfg(test)]
    Hold(std::sync::mpsc::Receiver<()>),
}

/// What the operator set for the join.
#[derive(Clone, Default)]
pub struct Settings {
    pub correlate: Config,
    /// This node's name (profile links).
    pub node: String,
    /// Hosts the operator declared simulated (`--simulated-host`): labelled so on the page.
    pub simulated: Vec<String>,
    /// `--profile-url`: links from affected pods and spikes to their profiles.
    pub profile: Option<ProfileTemplate>,
    /// Where the join publishes the pods' feed stall by cause for the scrape.
    pub feed_stall: FeedStallShare,
}

impl Settings {
    /// The profile link for `namespace/pod`'s spike at `spike_ms`, when a template is set.
    pub fn profile_url(&self, namespace: &str, pod: &str, spike_ms: i64) -> Option<String> {
        let t = self.profile.as_ref()?;
        t.render(&Target::spike(namespace, pod, &self.node, spike_ms))
    }
}

/// What [`JoinOwner::series_stamp`] compares.
pub type SeriesStamp = ([Option<u64>; 4], u64);

pub struct JoinOwner {
    settings: Settings,
    corr: Correlator,
    timeline: Timeline,
    merge: Merge,
    pods: PodStore,
    hub: Option<Hub>,
    /// UIDs of the pods the collector had at the last tick.
    live: LiveUids,
    /// (host, kind) of unknown kinds already logged: one line each, not one per event.
    unknown_logged: HashSet<(String, u16)>,
    /// Pods forgotten so far (their series went with them).
    forgotten: u64,
    /// The pods' feed stall by cause.
    feed: FeedStallBook,
}

impl JoinOwner {
    pub fn new(settings: Settings, pods: PodStore) -> JoinOwner {
        let cfg = settings.correlate.clone();
        JoinOwner {
            timeline: Timeline::new(TimelineConfig::new(cfg.before, cfg.after)),
            corr: Correlator::new(cfg),
            merge: Merge::default(),
            pods,
            hub: None,
            live: LiveUids::default(),
            unknown_logged: HashSet::new(),
            forgotten: 0,
            feed: FeedStallBook::new(settings.feed_stall.clone()),
            settings,
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// One input, at guest realtime `now_ns` (`now`: the same instant on the monotonic clock).
    pub fn handle(&mut self, input: Input, now: Instant, now_ns: i64) {
        match input {
            Input::Tick(report) => self.tick(&report, now, now_ns),
            Input::Host(d) => match *d {
                Delivery::Event(ev) => self.host_event(&ev, now_ns),
                Delivery::Unknown(ev) => self.unknown_event(&ev, now_ns),
            },
            Input::Hub(hub) => self.hub = Some(hub),
            Input::Picture {
                host,
                event,
                time_ms,
                reply,
            } => {
                let _ = reply.send(self.picture(&host, &event, time_ms, now_ns));
            }
            #[cfg(test)]
            Input::Hold(until) => {
                let _ = until.recv();
            }
        }
    }

    /// After a tick: the collector's windows into the correlator and the timeline, the GPU's
    /// activity, pictures frozen when due, gone pods forgotten.
    pub fn tick(&mut self, report: &TickReport, now: Instant, now_ns: i64) {
        self.merge.add(&report.windows, &self.pods, now, now_ns);
        tracing::trace!(
            windows = report.windows.len(),
            pods = self.merge.pods(),
            "signal windows into the correlator"
        );
        for w in self.merge.windows() {
            let seen = self.corr.observe_window(w);
            self.timeline.window(&w, seen);
        }
        // the first tick has no window (nothing to divide by), and no GPU window either
        let prev = self.merge.last_tick_ns.replace(now_ns);
        if let Some(prev) = prev {
            self.corr.gpu_window(GpuWindow {
                at: now_ns,
                len: now_ns - prev,
                busy: report.gpu_busy,
            });
        }
        let degraded = self.hub.as_ref().and_then(|h| {
            let gpu = self.corr.gpu_now();
            h.hosts()
                .into_iter()
                .filter_map(|(host, _)| {
                    feed_stall::degraded_full_bps(&links_now(Some(h), &host), gpu)
                })
                .min_by(f64::total_cmp)
        });
        self.feed
            .tick(&report.feed, &report.live, prev, now_ns, degraded);
        self.corr.end_tick(now_ns);
        self.timeline.end_tick(now_ns, self.corr.spike_records());
        if self.timeline.freeze_due(now_ns, self.corr.event_records()) {
            let hub = self.hub.as_ref();
            let links = |host: &str| links_now(hub, host);
            let listed: Vec<_> = self.corr.event_records().collect();
            self.timeline.freeze(now_ns, &listed, &links);
        }
        // the collector hands on the same set while its pods stay the same
        if !Arc::ptr_eq(&self.live, &report.live) {
            let live = &report.live;
            for uid in self.live.iter().filter(|uid| !live.contains(*uid)) {
                self.corr.forget_uid(uid);
                self.forgotten += 1;
            }
            self.merge.keep_pods(live);
            self.live = report.live.clone();
        }
    }

    /// One received host event.
    pub fn host_event(&mut self, ev: &ReceivedEvent, now_ns: i64) {
        if self.settings.simulated.contains(&ev.host) {
            tracing::info!(host = %ev.host, kind = ev.kind, "simulated host event received");
        }
        let input = HostInput {
            host: &ev.host,
            host_realtime_ns: ev.host_realtime_ns,
            clock_offset_ns: ev.clock_offset_ns.unwrap_or(0),
            payload: Payload::Known(&ev.event),
        };
        self.corr.host_event(input, now_ns);
        let kind = self.timeline_event(&input);
        if feed_stall::stalls_the_feed(&kind) {
            let cfg = &self.settings.correlate;
            let at = input.guest_ns();
            self.feed.host_event(
                at - cfg.before.as_nanos() as i64,
                at + cfg.after.as_nanos() as i64,
            );
        }
    }

    /// One received event of a kind this guest cannot decode.
    pub fn unknown_event(&mut self, ev: &UnknownEvent, now_ns: i64) {
        if self.unknown_logged.insert((ev.host.clone(), ev.kind)) {
            tracing::info!(
                host = %ev.host,
                kind = ev.kind,
                seq = ev.seq,
                bytes = ev.payload_len,
                "host sends events of a kind this guest does not know (a newer host agent?); counted and listed as unknown"
            );
        }
        let input = HostInput {
            host: &ev.host,
            host_realtime_ns: ev.host_realtime_ns,
            clock_offset_ns: ev.clock_offset_ns.unwrap_or(0),
            payload: Payload::UnknownKind {
                kind: ev.kind,
                seq: ev.seq,
                payload_len: ev.payload_len,
            },
        };
        self.corr.host_event(input, now_ns);
        self.timeline_event(&input);
    }

    /// One host event into the page's timeline (after the correlator has it); its kind.
    fn timeline_event(&mut self, input: &HostInput<'_>) -> events::EventKind {
        let known = match input.payload {
            Payload::Known(ev) => Some(ev),
            Payload::UnknownKind { .. } => None,
        };
        // the picture's title: with the GPU's activity now (the correlator's own verdict on a
        // speed change waits for the GPU's window after it; the event list carries that)
        let c = events::classify(input.payload, self.corr.gpu_now());
        self.timeline
            .host_event(input.host, input.guest_ns(), known, &c);
        c.kind
    }

    /// `/events`: recent host events with the pods they hit, newest first.
    pub fn events(&self) -> Vec<EventView> {
        let mut v = self.corr.recent_events();
        for e in &mut v {
            if self.settings.simulated.contains(&e.host) {
                e.tags.push("simulated".into());
            }
        }
        v
    }

    /// Changes whenever the correlation series do but for their ratios' slow drift with time:
    /// a spike or an event recorded or expired, a pod forgotten (host events are inputs the
    /// driver sees itself).
    pub fn series_stamp(&self) -> SeriesStamp {
        (self.corr.records_stamp(), self.forgotten)
    }

    /// The correlation series (`gpufeed_*`) and the host events' annotation timestamps.
    pub fn series(&self, now_ns: i64) -> Vec<Rows> {
        let mut families = self.corr.series_rows(now_ns);
        families.push(incident::annotations::rows(self.corr.event_records()));
        families
    }

    /// `/api/state`: the hosts and their links, the unexplained spikes, the newest events'
    /// pictures (the others are drawn when asked for: [`JoinOwner::picture`]) and the strip.
    pub fn page_state(&self, now_ns: i64) -> PageState {
        let gpu = self.corr.gpu_now();
        let hub = self.hub.as_ref();
        let hosts = hub
            .map(|h| {
                h.hosts()
                    .into_iter()
                    .map(|(host, connected)| {
                        let mut links = h
                            .host_state(&host)
                            .map(|s| incident::links_of(&s))
                            .unwrap_or_default();
                        for l in &mut links {
                            l.condition = link_condition(
                                l.speed_gts,
                                l.width,
                                l.max_speed_gts,
                                l.max_width,
                                gpu,
                            );
                        }
                        HostView {
                            links,
                            simulated: self.settings.simulated.contains(&host),
                            connected,
                            host,
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let unexplained = self
            .corr
            .unexplained_spikes(now_ns)
            .into_iter()
            .map(|spike| Unexplained {
                profile_url: self
                    .settings
                    .profile_url(&spike.namespace, &spike.pod, spike.time),
                spike,
            })
            .collect();
        let links = |host: &str| links_now(hub, host);
        let mut listed: Vec<_> = self.corr.event_records().collect();
        listed.sort_by_key(|e| std::cmp::Reverse((e.at, e.id)));
        let pictures_not_shown = listed.len().saturating_sub(incident::PICTURES_IN_STATE) as u64;
        listed.truncate(incident::PICTURES_IN_STATE);
        let mut timelines = self.timeline.pictures(now_ns, listed.into_iter(), &links);
        for p in &mut timelines {
            self.link_profiles(p);
        }
        PageState {
            node: self.settings.node.clone(),
            feed_stall: self.feed_stall_view(),
            hosts,
            unexplained,
            timelines,
            pictures_not_shown,
            strip: self.timeline.strip(now_ns),
            profiles: self.settings.profile.is_some(),
        }
    }

    /// The picture of the listed event of `host` of kind `event` at guest time `time_ms` (as
    /// `/events` names it).
    pub fn picture(
        &self,
        host: &str,
        event: &str,
        time_ms: i64,
        now_ns: i64,
    ) -> Option<incident::Picture> {
        let record = self.corr.event_records().find(|e| {
            e.host == host && e.kind.as_str() == event && e.at.div_euclid(1_000_000) == time_ms
        })?;
        let hub = self.hub.as_ref();
        let links = |host: &str| links_now(hub, host);
        let mut p = self
            .timeline
            .pictures(now_ns, std::iter::once(record), &links)
            .pop()?;
        self.link_profiles(&mut p);
        Some(p)
    }

    /// Each pod's feed stall by cause, named as the pod store names it, the most stalled first.
    fn feed_stall_view(&self) -> Vec<incident::PodFeedStall> {
        let mut out: Vec<incident::PodFeedStall> = self
            .feed
            .pods()
            .map(|(uid, c)| {
                let (namespace, pod) = self
                    .pods
                    .with(uid, |m| (m.namespace.clone(), m.name.clone()))
                    .unwrap_or_else(|| (String::new(), uid.to_string()));
                let mut causes: Vec<(String, f64)> = c
                    .by_cause()
                    .iter()
                    .map(|(cause, ns)| (cause.to_string(), *ns as f64 * 1e-9))
                    .collect();
                causes.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                incident::PodFeedStall {
                    namespace,
                    pod,
                    seconds: c.total() as f64 * 1e-9,
                    causes,
                }
            })
            .collect();
        out.sort_by(|a, b| {
            b.seconds
                .total_cmp(&a.seconds)
                .then_with(|| (&a.namespace, &a.pod).cmp(&(&b.namespace, &b.pod)))
        });
        out
    }

    /// The profile links of a picture's pods.
    fn link_profiles(&self, p: &mut incident::Picture) {
        for t in &mut p.pods {
            t.profile_url = self
                .settings
                .profile_url(&t.namespace, &t.pod, p.time + t.lag_ms);
        }
    }

    /// Pods the merge holds (for the benchmark and tests).
    pub fn pods_merged(&self) -> usize {
        self.merge.pods()
    }
}

/// The host's PCIe links as its last state has them.
fn links_now(hub: Option<&Hub>, host: &str) -> Vec<incident::LinkView> {
    hub.and_then(|h| h.host_state(host))
        .map(|s| incident::links_of(&s))
        .unwrap_or_default()
}
