//! The host's view of one guest's hardware as state: the host agent's own series (names,
//! labels, values) that concern that guest, sent over the control stream so that one scrape
//! of the guest holds the host's side too.
//!
//! State, not events: a [`HostState`] replaces the previous one whole, so nothing needs to be
//! spooled, acknowledged or replayed, and a lost one is repaired by the next.

use serde::{Deserialize, Serialize};

/// Names of the host's families that the guest reads from a state, not only forwards: the host
/// agent registers its series under them and the guest's incident view finds a link's speed
/// and width by them, so the two cannot drift apart.
pub mod names {
    /// Current PCIe link speed in GT/s (0 = down), by `bdf`, `vmid`.
    pub const PCIE_LINK_SPEED: &str = "gpufeed_host_pcie_link_speed_gts";
    /// Current PCIe link width in lanes (0 = down).
    pub const PCIE_LINK_WIDTH: &str = "gpufeed_host_pcie_link_width";
    /// The link's maximum speed in GT/s.
    pub const PCIE_LINK_MAX_SPEED: &str = "gpufeed_host_pcie_link_max_speed_gts";
    /// The link's maximum width in lanes.
    pub const PCIE_LINK_MAX_WIDTH: &str = "gpufeed_host_pcie_link_max_width";
}

/// The series of one scrape of the host agent that concern a guest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostState {
    /// The host agent's realtime clock when it took the snapshot, ns.
    pub taken_realtime_ns: i64,
    pub families: Vec<StateFamily>,
    /// Series left out because the snapshot would not fit one frame.
    pub truncated_series: u32,
}

/// One metric family, as Prometheus's text format would carry it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateFamily {
    pub name: String,
    pub help: String,
    pub kind: StateKind,
    pub series: Vec<StateSeries>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateKind {
    Counter,
    Gauge,
}

/// One series: its labels (sorted by name, as the host renders them) and value.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StateSeries {
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

// Values compare by their bits: a snapshot equals the previous one exactly when nothing
// changed (NaN included), which is what "send only when changed" needs.
impl PartialEq for StateSeries {
    fn eq(&self, other: &Self) -> bool {
        self.labels == other.labels && self.value.to_bits() == other.value.to_bits()
    }
}
impl Eq for StateSeries {}

impl StateSeries {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

impl HostState {
    /// Whether the series are those of `other` (the time of the snapshot aside).
    pub fn same_series(&self, other: &HostState) -> bool {
        self.families == other.families && self.truncated_series == other.truncated_series
    }

    /// Number of series.
    pub fn len(&self) -> usize {
        self.families.iter().map(|f| f.series.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(v: f64) -> HostState {
        HostState {
            taken_realtime_ns: 1,
            families: vec![StateFamily {
                name: "gpufeed_host_pcie_link_width".into(),
                help: "h".into(),
                kind: StateKind::Gauge,
                series: vec![StateSeries {
                    labels: vec![("bdf".into(), "0000:0a:00.0".into())],
                    value: v,
                }],
            }],
            truncated_series: 0,
        }
    }

    #[test]
    fn round_trip_and_change_detection() {
        let s = state(4.0);
        let bytes = postcard::to_stdvec(&s).unwrap();
        let back: HostState = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, s);
        let mut later = state(4.0);
        later.taken_realtime_ns = 2;
        assert!(later.same_series(&s));
        assert!(!state(1.0).same_series(&s));
        assert!(state(f64::NAN).same_series(&state(f64::NAN)));
        assert_eq!(s.len(), 1);
        assert_eq!(s.families[0].series[0].label("bdf"), Some("0000:0a:00.0"));
    }
}
