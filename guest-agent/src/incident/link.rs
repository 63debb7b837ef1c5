//! A PCIe link as the incident page draws it (the host's gauges and how the
//! link reads beside the GPU's activity).

use serde::{Deserialize, Serialize};

use crate::correlate::LinkCondition;

/// A PCIe link as the host agent's gauges have it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkView {
    pub bdf: String,
    /// The VM the device is passed through to ("" for a bridge above it).
    pub vmid: String,
    pub speed_gts: f64,
    pub width: f64,
    pub max_speed_gts: f64,
    pub max_width: f64,
    /// How it reads beside the GPU's activity now (the join sets it; below the maximum speed
    /// at full width is a GPU saving power unless the GPU works).
    #[serde(default)]
    pub condition: LinkCondition,
}
