//! What a person looks at during an incident: the state behind the page at `/`
//! (`/api/state`: every host's link state now, a picture per recent host event, the last
//! hour's events and spikes, the spikes no host event explains), the same as text for a
//! terminal (`gpufeed-guest explain`), the host events as a series Grafana annotates with, and
//! the hand-off to a profiler.

pub mod annotations;
pub mod explain;
pub mod link;
pub mod profile;
pub mod timeline;

use gpufeed_shared::hoststate::{names, HostState};
use serde::{Deserialize, Serialize};

use crate::correlate::views::SpikeView;
use crate::correlate::LinkCondition;

pub use explain::explain;
pub use link::LinkView;
pub use profile::ProfileTemplate;
pub use timeline::{Picture, Strip, Timeline, TimelineConfig};

/// Pictures `/api/state` carries: the newest events'. Each picture is bounded (links, steps,
/// pods, points), so this bounds the answer whatever the history; older events' pictures are
/// asked for one at a time (`/api/picture`).
pub const PICTURES_IN_STATE: usize = 12;

/// `/api/state`.
#[derive(Debug, Clone, Serialize)]
pub struct PageState {
    /// This node.
    pub node: String,
    /// Each pod's GPU feed stall by cause since the agent started, the most stalled first (the
    /// page leads with it: is the GPU getting fed, and if not, what holds it back).
    pub feed_stall: Vec<PodFeedStall>,
    pub hosts: Vec<HostView>,
    /// Spikes no host event explains, newest first.
    pub unexplained: Vec<Unexplained>,
    /// One picture per listed host event, newest first (the same events as `/events`), for the
    /// newest [`PICTURES_IN_STATE`] of them.
    pub timelines: Vec<Picture>,
    /// Listed events whose pictures are left out (`/api/picture` draws each).
    pub pictures_not_shown: u64,
    /// The last hour: every listed host event and every spike.
    pub strip: Strip,
    /// Whether a profile link template is configured (`--profile-url`).
    pub profiles: bool,
}

/// A pod's GPU feed stall (`gpufeed_gpu_feed_stall_seconds_total`) by cause.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PodFeedStall {
    pub namespace: String,
    /// Its name, or its UID while the API has not named it (as in /metrics).
    pub pod: String,
    /// All causes, seconds.
    pub seconds: f64,
    /// (cause, seconds), the largest first.
    pub causes: Vec<(String, f64)>,
}

/// A spike no host event explains, with the link to its profiles when configured.
#[derive(Debug, Clone, Serialize)]
pub struct Unexplained {
    #[serde(flatten)]
    pub spike: SpikeView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile_url: Option<String>,
}

/// One host agent as this guest knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostView {
    pub host: String,
    /// Its stream is connected now.
    pub connected: bool,
    /// The operator said this host is a simulation (the quickstart demo).
    pub simulated: bool,
    /// The PCIe links the host reports for this guest, from its last state.
    pub links: Vec<LinkView>,
}

/// The links in a host's state, by BDF.
pub fn links_of(state: &HostState) -> Vec<LinkView> {
    let mut links: std::collections::BTreeMap<String, LinkView> = Default::default();
    for fam in &state.families {
        let field: fn(&mut LinkView) -> &mut f64 = match fam.name.as_str() {
            names::PCIE_LINK_SPEED => |l| &mut l.speed_gts,
            names::PCIE_LINK_WIDTH => |l| &mut l.width,
            names::PCIE_LINK_MAX_SPEED => |l| &mut l.max_speed_gts,
            names::PCIE_LINK_MAX_WIDTH => |l| &mut l.max_width,
            _ => continue,
        };
        for s in &fam.series {
            let Some(bdf) = s.label("bdf") else { continue };
            let l = links.entry(bdf.to_string()).or_insert_with(|| LinkView {
                bdf: bdf.to_string(),
                vmid: s.label("vmid").unwrap_or_default().to_string(),
                speed_gts: 0.0,
                width: 0.0,
                max_speed_gts: 0.0,
                max_width: 0.0,
                condition: LinkCondition::default(),
            });
            *field(l) = s.value;
        }
    }
    links.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufeed_shared::hoststate::{StateFamily, StateKind, StateSeries};

    #[test]
    fn links_come_from_the_hosts_gauges() {
        let series = |bdf: &str, vmid: &str, v: f64| StateSeries {
            labels: vec![
                ("bdf".into(), bdf.into()),
                ("host".into(), "pve1".into()),
                ("vmid".into(), vmid.into()),
            ],
            value: v,
        };
        let fam = |name: &str, s: Vec<StateSeries>| StateFamily {
            name: name.into(),
            help: String::new(),
            kind: StateKind::Gauge,
            series: s,
        };
        let st = HostState {
            taken_realtime_ns: 0,
            families: vec![
                fam(
                    "gpufeed_host_pcie_link_speed_gts",
                    vec![
                        series("0000:0a:00.0", "100", 2.5),
                        series("0000:09:01.0", "", 16.0),
                    ],
                ),
                fam(
                    "gpufeed_host_pcie_link_width",
                    vec![
                        series("0000:0a:00.0", "100", 1.0),
                        series("0000:09:01.0", "", 4.0),
                    ],
                ),
                fam(
                    "gpufeed_host_pcie_link_max_speed_gts",
                    vec![series("0000:0a:00.0", "100", 16.0)],
                ),
                fam(
                    "gpufeed_host_pcie_link_max_width",
                    vec![series("0000:0a:00.0", "100", 4.0)],
                ),
                fam("gpufeed_host_cpu_busy_ratio", vec![]),
            ],
            truncated_series: 0,
        };
        let links = links_of(&st);
        assert_eq!(links.len(), 2);
        assert_eq!(
            links[1],
            LinkView {
                bdf: "0000:0a:00.0".into(),
                vmid: "100".into(),
                speed_gts: 2.5,
                width: 1.0,
                max_speed_gts: 16.0,
                max_width: 4.0,
                condition: LinkCondition::Full,
            }
        );
        assert_eq!(links[0].vmid, "");
    }
}
