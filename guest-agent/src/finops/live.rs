//! The GPUs' capacity read live: what the cost shares divide by, taken at each tick from what
//! the nvml probe reports now, configured flags first. An agent started without NVML (a CPU
//! node, a driver loaded late) still starts and reports everything else; NVML that appears
//! later, or a GPU that comes back (an eGPU replugged), counts in the cost from then on.
//!
//! [`Reported`] is what the tick's report says of the GPUs ([`NvmlCapacity`]); [`Live::update`]
//! is the decision, with no IO but its log lines (each said once, when what it says changes).

use crate::collect::NvmlCapacity;

use super::config::{CapacityInput, GpuCapacity, LINK_FLAG, MEMORY_FLAG};

/// What the nvml probe reports of the node's GPUs at one tick.
#[derive(Debug, Clone, PartialEq)]
pub enum Reported {
    /// Sums over the GPUs that gave each number; `gpus`: those that gave their memory.
    Gpus(CapacityInput),
    /// NVML is loaded and reports no GPU's capacity (none enumerated, or all lost).
    NoGpu,
    /// The probe runs without NVML: why (where it looked).
    NotLoaded(String),
    /// The nvml probe is not loaded (`--probes` leaves it out).
    ProbeOff,
}

impl From<&NvmlCapacity> for Reported {
    /// What the tick's report says of the GPUs: NVML with no GPU's capacity is `NoGpu`, else
    /// the sums over the GPUs that gave each number.
    fn from(nvml: &NvmlCapacity) -> Reported {
        match nvml {
            NvmlCapacity::ProbeOff => Reported::ProbeOff,
            NvmlCapacity::NotLoaded(why) => Reported::NotLoaded(why.clone()),
            NvmlCapacity::Gpus { memory, link } if memory.is_empty() && link.is_empty() => {
                Reported::NoGpu
            }
            NvmlCapacity::Gpus { memory, link } => {
                let sum = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() as u64);
                Reported::Gpus(CapacityInput {
                    memory_bytes: sum(memory),
                    link_bytes_per_second: sum(link),
                    gpus: (!memory.is_empty())
                        .then(|| u32::try_from(memory.len()).unwrap_or(u32::MAX)),
                })
            }
        }
    }
}

impl Reported {
    fn input(&self) -> CapacityInput {
        match self {
            Reported::Gpus(c) => *c,
            _ => CapacityInput::default(),
        }
    }

    /// The `reason` label of a capacity NVML does not give now.
    fn reason(&self) -> &'static str {
        match self {
            Reported::Gpus(_) => "nvml_incomplete",
            Reported::NoGpu => "nvml_no_gpu",
            Reported::NotLoaded(_) => "nvml_not_loaded",
            Reported::ProbeOff => "nvml_probe_off",
        }
    }

    fn why(&self) -> String {
        match self {
            Reported::Gpus(_) => "NVML gives no such number for any GPU".into(),
            Reported::NoGpu => "NVML reports no GPU".into(),
            Reported::NotLoaded(why) => format!("NVML not loaded ({why})"),
            Reported::ProbeOff => "the nvml probe is not loaded (--probes)".into(),
        }
    }
}

/// The capacity the cost divides by, kept across ticks.
#[derive(Debug, Clone)]
pub struct Live {
    configured: CapacityInput,
    /// The capacity the cost divides by: the last one known (none before the first).
    pub current: Option<GpuCapacity>,
    /// The resources neither configured nor reported now (`memory_bytes`,
    /// `link_bytes_per_second`), with the `reason` label; empty while all are known.
    pub missing: Vec<&'static str>,
    pub reason: &'static str,
    /// The last line logged, so that each state is said once.
    said: Option<String>,
}

impl Live {
    /// Before the first tick, what the configuration lacks is `not_read_yet`.
    pub fn new(configured: CapacityInput) -> Live {
        let missing: Vec<&'static str> = [
            ("memory_bytes", configured.memory_bytes),
            ("link_bytes_per_second", configured.link_bytes_per_second),
        ]
        .into_iter()
        .filter(|(_, v)| v.is_none())
        .map(|(r, _)| r)
        .collect();
        // fully configured: priced from the start, as before NVML was read live
        let current = match (configured.memory_bytes, configured.link_bytes_per_second) {
            (Some(memory_bytes), Some(link_bytes_per_second)) => Some(GpuCapacity {
                memory_bytes,
                link_bytes_per_second,
                gpus: configured.gpus.unwrap_or(1).max(1),
            }),
            _ => None,
        };
        Live {
            configured,
            current,
            reason: if missing.is_empty() {
                ""
            } else {
                "not_read_yet"
            },
            missing,
            said: None,
        }
    }

    /// Takes this tick's report. Configured values win over reported ones; a capacity no
    /// longer reported (NVML gone, every GPU lost) leaves the last one known in force, since
    /// the node still costs its rate.
    pub fn update(&mut self, reported: &Reported) {
        let input = self.configured.or(reported.input());
        self.missing = [
            ("memory_bytes", MEMORY_FLAG, input.memory_bytes),
            (
                "link_bytes_per_second",
                LINK_FLAG,
                input.link_bytes_per_second,
            ),
        ]
        .into_iter()
        .filter(|(_, _, v)| v.is_none())
        .map(|(r, _, _)| r)
        .collect();
        self.reason = if self.missing.is_empty() {
            ""
        } else {
            reported.reason()
        };
        let line = match (input.memory_bytes, input.link_bytes_per_second) {
            (Some(memory_bytes), Some(link_bytes_per_second)) => {
                let now = GpuCapacity {
                    memory_bytes,
                    link_bytes_per_second,
                    gpus: input.gpus.unwrap_or(1).max(1),
                };
                let first = self.said.is_none();
                let line = match self.current.replace(now) {
                    Some(was) if was == now && !first => return,
                    Some(was) if !first => format!(
                        "GPU capacity for the cost changed: {} (was {})",
                        show(&now),
                        show(&was)
                    ),
                    _ => format!("GPU capacity for the cost: {}", show(&now)),
                };
                self.said = Some(line.clone());
                tracing::info!("{line}");
                return;
            }
            (memory, link) => {
                let unset: Vec<&str> = [(MEMORY_FLAG, memory), (LINK_FLAG, link)]
                    .into_iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(f, _)| f)
                    .collect();
                let unset = unset.join(" and ");
                match &self.current {
                    None => format!(
                        "no GPU capacity, the cost is not computed until there is one: {} and {unset} not set",
                        reported.why()
                    ),
                    Some(was) => format!(
                        "GPU capacity no longer reported: {} and {unset} not set; the cost keeps dividing by the last known, {}",
                        reported.why(),
                        show(was)
                    ),
                }
            }
        };
        if self.said.as_deref() != Some(line.as_str()) {
            tracing::warn!("{line}");
            self.said = Some(line);
        }
    }
}

fn show(c: &GpuCapacity) -> String {
    format!(
        "memory_bytes={} link_bytes_per_second={} gpus={}",
        c.memory_bytes, c.link_bytes_per_second, c.gpus
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nvml(memory: u64, link: u64, gpus: u32) -> Reported {
        Reported::Gpus(CapacityInput {
            memory_bytes: Some(memory),
            link_bytes_per_second: Some(link),
            gpus: Some(gpus),
        })
    }

    #[test]
    fn without_capacity_none_then_nvml_then_a_gpu_back() {
        let mut l = Live::new(CapacityInput::default());
        assert_eq!(l.reason, "not_read_yet");
        l.update(&Reported::NotLoaded("where it looked".into()));
        assert_eq!(l.current, None);
        assert_eq!(l.missing, ["memory_bytes", "link_bytes_per_second"]);
        assert_eq!(l.reason, "nvml_not_loaded");
        assert!(l.said.as_deref().unwrap().contains(
            "NVML not loaded (where it looked) and --gpu-memory-bytes and --gpu-link-bytes-per-second not set"
        ));
        l.update(&nvml(80, 16, 1));
        assert_eq!(
            l.current,
            Some(GpuCapacity {
                memory_bytes: 80,
                link_bytes_per_second: 16,
                gpus: 1
            })
        );
        assert!(l.missing.is_empty() && l.reason.is_empty());
        l.update(&nvml(104, 24, 2));
        assert_eq!(l.current.map(|c| (c.memory_bytes, c.gpus)), Some((104, 2)));
        assert!(l.said.as_deref().unwrap().contains("changed"));
        // every GPU gone: the last capacity stays, said with why
        l.update(&Reported::NoGpu);
        assert_eq!(l.current.map(|c| c.memory_bytes), Some(104));
        assert_eq!(l.reason, "nvml_no_gpu");
    }

    #[test]
    fn configured_capacity_wins_over_nvml() {
        let mut l = Live::new(CapacityInput {
            memory_bytes: Some(20),
            ..CapacityInput::default()
        });
        l.update(&Reported::ProbeOff);
        assert_eq!(l.current, None);
        assert_eq!(l.missing, ["link_bytes_per_second"]);
        // both configured: priced before any tick
        let both = CapacityInput {
            memory_bytes: Some(20),
            link_bytes_per_second: Some(5),
            gpus: None,
        };
        assert_eq!(Live::new(both).current.map(|c| c.gpus), Some(1));
        assert_eq!(l.reason, "nvml_probe_off");
        l.update(&nvml(80, 16, 2));
        assert_eq!(
            l.current,
            Some(GpuCapacity {
                memory_bytes: 20,
                link_bytes_per_second: 16,
                gpus: 2
            })
        );
    }

    #[test]
    fn the_report_says_what_the_gpus_gave() {
        assert_eq!(Reported::from(&NvmlCapacity::ProbeOff), Reported::ProbeOff);
        assert!(matches!(
            Reported::from(&NvmlCapacity::NotLoaded("x".into())),
            Reported::NotLoaded(_)
        ));
        let gpus = |memory: Vec<f64>, link: Vec<f64>| NvmlCapacity::Gpus { memory, link };
        assert_eq!(
            Reported::from(&gpus(vec![80.0, 24.0], vec![16.0])),
            nvml(104, 16, 2)
        );
        assert_eq!(Reported::from(&gpus(vec![], vec![])), Reported::NoGpu);
    }
}
