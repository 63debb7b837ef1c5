//! The feed stall by cause (`gpufeed_gpu_feed_stall_seconds_total`, docs/metrics.md "Feed
//! stall"). The CUDA probes keep a raw account per pod: the stall of any cause, its run-queue
//! part, and the time and bytes of its synchronous host-to-device copies. What else held the
//! work back only the join knows, from the host: a link running below its maximum while the
//! copies ran, a host event (AER, link down, a VM stopped) around the stall. So the split is
//! made here, once per tick and pod, from the growth of the pod's account over the tick, and
//! what it moves to `pcie_link` or `host_event` comes out of `unexplained`: the causes always
//! add up to the stall of all causes.
//!
//! Nothing here reads a clock or does IO: the owner hands in the tick's totals, the links'
//! state and the host events' times ([`FeedStallBook`]), and publishes the running totals for
//! the scrape ([`FeedStallShare`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use rustc_hash::{FxHashMap, FxHashSet};

use crate::collect::FeedRaw;
use crate::correlate::{link_condition, Activity, EventKind, LinkCondition};
use crate::incident::LinkView;

/// A pod's feed stall by cause, ns (running totals, or one tick's part).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Causes {
    /// The feeding thread waited on a run queue.
    pub cpu: u64,
    /// Host-to-device copies took longer than the host link's full speed would have, while
    /// the link ran degraded.
    pub pcie_link: u64,
    /// The rest, where it fell within a host event's window.
    pub host_event: u64,
    /// The rest.
    pub unexplained: u64,
}

impl Causes {
    /// (`cause` label, ns), in the order /metrics lists them.
    pub fn by_cause(&self) -> [(&'static str, u64); 4] {
        [
            ("cpu", self.cpu),
            ("host_event", self.host_event),
            ("pcie_link", self.pcie_link),
            ("unexplained", self.unexplained),
        ]
    }

    pub fn total(&self) -> u64 {
        self.cpu + self.pcie_link + self.host_event + self.unexplained
    }

    fn add(&mut self, o: &Causes) {
        self.cpu += o.cpu;
        self.pcie_link += o.pcie_link;
        self.host_event += o.host_event;
        self.unexplained += o.unexplained;
    }
}

/// What the host said about one tick's interval.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TickHost {
    /// The full-speed bandwidth (bytes a second, one direction) of a host link that ran
    /// degraded during the tick; `None`: every link at its maximum, or no host state.
    pub degraded_full_bps: Option<f64>,
    /// The part of the tick (0 to 1) that host events' windows cover.
    pub host_event_share: f64,
}

/// One tick of a pod: the growth `d` of its raw account split by cause.
///
/// `cpu` is the run-queue part as the probes counted it; the rest of the stall is
/// `unexplained` but for what the host explains: first the copies' time beyond what the
/// link's full speed would take (`copy time − bytes / full bandwidth`, at least 0, at most the
/// rest) while a link ran degraded, then, of what is left, the part of the tick that host
/// events' windows cover (the probes do not say when within the tick a gap fell).
pub fn split(d: &FeedRaw, host: &TickHost) -> Causes {
    // a tick may read the run-queue part of a gap before its total: the rest then comes
    // with the next tick's (as the probes' own account always had it)
    let mut rest = d.all_ns.saturating_sub(d.cpu_ns);
    let pcie_link = match host.degraded_full_bps {
        Some(bps) if bps > 0.0 => {
            let full_ns = d.copy_bytes as f64 / bps * 1e9;
            ((d.copy_ns as f64 - full_ns).max(0.0) as u64).min(rest)
        }
        _ => 0,
    };
    rest -= pcie_link;
    let host_event = ((rest as f64 * host.host_event_share.clamp(0.0, 1.0)) as u64).min(rest);
    rest -= host_event;
    Causes {
        cpu: d.cpu_ns,
        pcie_link,
        host_event,
        unexplained: rest,
    }
}

/// Bytes a second, one direction, of one lane at `gts` GT/s after line encoding (8b/10b up to
/// 5 GT/s, 128b/130b above).
fn lane_bps(gts: f64) -> f64 {
    let encoding = if gts <= 5.0 {
        8.0 / 10.0
    } else {
        128.0 / 130.0
    };
    gts * 1e9 * encoding / 8.0
}

/// The full-speed bandwidth of the links that run degraded as the page reads them (lanes
/// missing, or below their maximum speed while the GPU works; see [`link_condition`]), the
/// least of them; `None` when none is.
pub fn degraded_full_bps(links: &[LinkView], gpu: Activity) -> Option<f64> {
    links
        .iter()
        .filter(|l| {
            link_condition(l.speed_gts, l.width, l.max_speed_gts, l.max_width, gpu)
                == LinkCondition::Degraded
        })
        .map(|l| lane_bps(l.max_speed_gts) * l.max_width)
        .filter(|b| *b > 0.0)
        .min_by(f64::total_cmp)
}

/// Host events whose window is stall time of `host_event`: errors on the link, the link gone,
/// the VM stopped. A speed or width change is `pcie_link`'s, measured on the copies.
pub fn stalls_the_feed(kind: &EventKind) -> bool {
    matches!(
        kind,
        EventKind::AerCorrectable
            | EventKind::AerNonfatal
            | EventKind::AerFatal
            | EventKind::LinkDown
            | EventKind::ThunderboltDisconnect
            | EventKind::VmStop
    )
}

/// The share of `[from, to)` that the windows cover (overlaps counted once).
fn covered(windows: &VecDeque<(i64, i64)>, from: i64, to: i64) -> f64 {
    if to <= from {
        return 0.0;
    }
    let mut parts: Vec<(i64, i64)> = windows
        .iter()
        .map(|&(a, b)| (a.max(from), b.min(to)))
        .filter(|(a, b)| a < b)
        .collect();
    parts.sort_unstable();
    let (mut sum, mut end) = (0i64, from);
    for (a, b) in parts {
        let a = a.max(end);
        if b > a {
            sum += b - a;
            end = b;
        }
    }
    sum as f64 / (to - from) as f64
}

/// The pods' feed stall by cause as the join last split it, shared with the scrape (which
/// writes it with the pods' labels). Cheap to clone.
#[derive(Clone, Default)]
pub struct FeedStallShare(Arc<Mutex<FxHashMap<String, Causes>>>);

impl FeedStallShare {
    /// Each pod's running totals, by UID.
    pub fn snapshot(&self) -> FxHashMap<String, Causes> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn publish(&self, pods: &FxHashMap<String, (FeedRaw, Causes)>) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|uid, _| pods.contains_key(uid));
        for (uid, (_, c)) in pods {
            match m.get_mut(uid) {
                Some(v) => *v = *c,
                None => {
                    m.insert(uid.clone(), *c);
                }
            }
        }
    }
}

/// The join's account: per pod the raw totals last seen and the causes so far; the host
/// events' windows; the links' state at the last tick.
#[derive(Default)]
pub struct FeedStallBook {
    pods: FxHashMap<String, (FeedRaw, Causes)>,
    /// Guest realtime windows `[from, to)` of host events that stall the feed.
    windows: VecDeque<(i64, i64)>,
    /// The degraded links' full bandwidth at the last tick.
    degraded_before: Option<f64>,
    share: FeedStallShare,
}

/// Growth of a running total (one that went back started again: all of it is new).
fn grown(now: u64, before: u64) -> u64 {
    if now >= before {
        now - before
    } else {
        now
    }
}

impl FeedStallBook {
    pub fn new(share: FeedStallShare) -> FeedStallBook {
        FeedStallBook {
            share,
            ..FeedStallBook::default()
        }
    }

    /// A host event that stalls the feed, its window `[from, to)` in guest realtime.
    pub fn host_event(&mut self, from: i64, to: i64) {
        if to > from {
            self.windows.push_back((from, to));
        }
    }

    /// One tick `[from, to)` (guest realtime; `from` `None` for the first): each pod's totals
    /// after it, the links' degraded bandwidth at its end. Pods not in `live` are forgotten.
    pub fn tick(
        &mut self,
        pods: &HashMap<String, FeedRaw>,
        live: &FxHashSet<std::sync::Arc<str>>,
        from: Option<i64>,
        to: i64,
        degraded_full_bps: Option<f64>,
    ) {
        // the copies of a tick in which the link changed ran partly degraded
        let host = TickHost {
            degraded_full_bps: degraded_full_bps.or(self.degraded_before),
            host_event_share: from.map_or(0.0, |f| covered(&self.windows, f, to)),
        };
        self.degraded_before = degraded_full_bps;
        // windows that ended are of no later tick
        self.windows.retain(|&(_, end)| end > to);
        for (uid, &raw) in pods {
            let (seen, causes) = self.pods.entry(uid.clone()).or_default();
            let d = FeedRaw {
                cpu_ns: grown(raw.cpu_ns, seen.cpu_ns),
                all_ns: grown(raw.all_ns, seen.all_ns),
                copy_ns: grown(raw.copy_ns, seen.copy_ns),
                copy_bytes: grown(raw.copy_bytes, seen.copy_bytes),
            };
            *seen = raw;
            causes.add(&split(&d, &host));
        }
        self.pods.retain(|uid, _| live.contains(uid.as_str()));
        self.share.publish(&self.pods);
    }

    /// A pod's running totals.
    pub fn causes(&self, uid: &str) -> Option<Causes> {
        self.pods.get(uid).map(|(_, c)| *c)
    }

    /// Every pod's running totals, by UID.
    pub fn pods(&self) -> impl Iterator<Item = (&str, Causes)> {
        self.pods.iter().map(|(uid, (_, c))| (uid.as_str(), *c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn raw(cpu: u64, all: u64, copy_ns: u64, copy_bytes: u64) -> FeedRaw {
        FeedRaw {
            cpu_ns: cpu,
            all_ns: all,
            copy_ns,
            copy_bytes,
        }
    }

    /// 1 GB/s full speed: a byte is a nanosecond.
    const GBPS: Option<f64> = Some(1e9);

    #[test]
    fn a_healthy_link_and_no_event_leave_the_rest_unexplained() {
        let c = split(
            &raw(10 * MS, 100 * MS, 80 * MS, 10_000_000),
            &TickHost::default(),
        );
        assert_eq!(
            c,
            Causes {
                cpu: 10 * MS,
                unexplained: 90 * MS,
                ..Causes::default()
            }
        );
    }

    #[test]
    fn slow_copies_on_a_degraded_link_are_pcie_link_beyond_full_speed() {
        // 80 ms of copies of 10 MB: 10 ms at full speed, 70 ms the link's
        let host = TickHost {
            degraded_full_bps: GBPS,
            ..TickHost::default()
        };
        let c = split(&raw(10 * MS, 100 * MS, 80 * MS, 10_000_000), &host);
        assert_eq!(
            (c.cpu, c.pcie_link, c.unexplained),
            (10 * MS, 70 * MS, 20 * MS)
        );
        assert_eq!(c.total(), 100 * MS);
        // at most the rest: copies the thread blocked in are not stall
        let c = split(&raw(10 * MS, 40 * MS, 80 * MS, 10_000_000), &host);
        assert_eq!((c.pcie_link, c.unexplained), (30 * MS, 0));
        // copies at full speed: none
        let c = split(&raw(0, 40 * MS, 10 * MS, 20_000_000), &host);
        assert_eq!((c.pcie_link, c.unexplained), (0, 40 * MS));
    }

    #[test]
    fn host_events_take_their_share_of_what_is_left() {
        let host = TickHost {
            degraded_full_bps: GBPS,
            host_event_share: 0.5,
        };
        let c = split(&raw(0, 100 * MS, 30 * MS, 10_000_000), &host);
        assert_eq!(
            (c.pcie_link, c.host_event, c.unexplained),
            (20 * MS, 40 * MS, 40 * MS)
        );
        assert_eq!(c.total(), 100 * MS);
        let whole = TickHost {
            host_event_share: 3.0,
            ..TickHost::default()
        };
        assert_eq!(split(&raw(0, 100 * MS, 0, 0), &whole).host_event, 100 * MS);
    }

    #[test]
    fn windows_cover_their_share_of_a_tick_once() {
        let w = VecDeque::from([(0, 400), (300, 500), (900, 2000)]);
        assert_eq!(covered(&w, 0, 1000), 0.6);
        assert_eq!(covered(&w, 500, 900), 0.0);
        assert_eq!(covered(&w, 1000, 1000), 0.0);
    }

    fn link(speed: f64, width: f64) -> LinkView {
        LinkView {
            bdf: "0000:0a:00.0".into(),
            vmid: "100".into(),
            speed_gts: speed,
            width,
            max_speed_gts: 16.0,
            max_width: 4.0,
            condition: LinkCondition::Full,
        }
    }

    #[test]
    fn a_link_is_degraded_as_the_page_reads_it_and_full_speed_is_its_maximum() {
        let full = 4.0 * 16e9 * 128.0 / 130.0 / 8.0;
        let near = |got: Option<f64>| got.is_some_and(|g| (g - full).abs() < 1.0);
        assert!(near(degraded_full_bps(&[link(16.0, 1.0)], Activity::Idle)));
        assert!(near(degraded_full_bps(&[link(2.5, 4.0)], Activity::Busy)));
        // power saving, at full speed, down: not a degraded link's copies
        assert_eq!(degraded_full_bps(&[link(2.5, 4.0)], Activity::Idle), None);
        assert_eq!(degraded_full_bps(&[link(16.0, 4.0)], Activity::Busy), None);
        assert_eq!(degraded_full_bps(&[link(0.0, 0.0)], Activity::Busy), None);
        assert!((lane_bps(2.5) - 250e6).abs() < 1.0);
    }

    fn pods(uid: &str, feed: FeedRaw) -> HashMap<String, FeedRaw> {
        HashMap::from([(uid.to_string(), feed)])
    }

    /// The book splits each tick's growth: the tick after a link recovers still counts its
    /// copies against the full speed, a host event's window covers the ticks it overlaps, and
    /// a gone pod is forgotten (by the share too).
    #[test]
    fn the_book_splits_each_ticks_growth_and_publishes_the_totals() {
        let share = FeedStallShare::default();
        let mut book = FeedStallBook::new(share.clone());
        let live = FxHashSet::from_iter([std::sync::Arc::<str>::from("u1")]);
        let s = 1_000 * MS as i64;
        book.tick(&pods("u1", raw(0, 10 * MS, 0, 0)), &live, None, s, None);
        assert_eq!(book.causes("u1").unwrap().unexplained, 10 * MS);
        // degraded at the end of the second tick: 30 ms of copies of 10 MB
        book.tick(
            &pods("u1", raw(0, 60 * MS, 30 * MS, 10_000_000)),
            &live,
            Some(s),
            2 * s,
            GBPS,
        );
        assert_eq!(book.causes("u1").unwrap().pcie_link, 20 * MS);
        // recovered at the end of the third: its copies were still slow in part
        book.tick(
            &pods("u1", raw(0, 110 * MS, 60 * MS, 20_000_000)),
            &live,
            Some(2 * s),
            3 * s,
            None,
        );
        assert_eq!(book.causes("u1").unwrap().pcie_link, 40 * MS);
        // the fourth: healthy, and half of it in an AER's window
        book.host_event(3 * s + s / 2, 5 * s);
        book.tick(
            &pods("u1", raw(0, 210 * MS, 90 * MS, 30_000_000)),
            &live,
            Some(3 * s),
            4 * s,
            None,
        );
        let c = book.causes("u1").unwrap();
        assert_eq!((c.pcie_link, c.host_event), (40 * MS, 50 * MS));
        assert_eq!(c.total(), 210 * MS);
        assert_eq!(share.snapshot()["u1"], c);
        book.tick(
            &HashMap::new(),
            &FxHashSet::default(),
            Some(4 * s),
            5 * s,
            None,
        );
        assert!(book.causes("u1").is_none() && share.snapshot().is_empty());
    }
}
