//! A unit's state as the agent reports it: up or down with why, and how it
//! runs on this kernel.

/// What the agent exports as `gpufeed_probe_up{probe}` and `gpufeed_probe_info`.
#[derive(Debug, Clone)]
pub struct ProbeStatus {
    pub name: &'static str,
    pub up: bool,
    /// Why a probe is down (logged once).
    pub reason: Option<String>,
    /// How it runs on this kernel: `hook`, `storage`, `reads` (labels of `gpufeed_probe_info`)
    pub how: Vec<(&'static str, String)>,
}

impl ProbeStatus {
    pub fn up(name: &'static str) -> ProbeStatus {
        ProbeStatus {
            name,
            up: true,
            reason: None,
            how: Vec::new(),
        }
    }

    pub fn down(name: &'static str, reason: impl Into<String>) -> ProbeStatus {
        ProbeStatus {
            name,
            up: false,
            reason: Some(reason.into()),
            how: Vec::new(),
        }
    }

    /// Adds how the probe runs (`hook`, `storage`, `reads`).
    pub fn with(mut self, key: &'static str, value: impl Into<String>) -> ProbeStatus {
        self.how.push((key, value.into()));
        self
    }
}
