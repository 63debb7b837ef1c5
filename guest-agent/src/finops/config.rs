//! FinOps settings as given (command line) and as validated. Every refusal names the setting,
//! so that an agent that will not start says which flag to fix.

use std::time::Duration;

use super::cost::CostModel;
pub use super::cost::{GpuCapacity, Weights};
pub use super::error::{ConfigError, LABEL_NAMES};
use super::labels::PodLabels;
use super::mps::MpsConfig;

/// Capacities as far as a source knows them: configuration, or the GPU itself (NVML fills one
/// of these when it is present). [`CapacityInput::or`] layers sources; [`CapacityInput::resolve`]
/// checks the result.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CapacityInput {
    pub memory_bytes: Option<u64>,
    pub link_bytes_per_second: Option<u64>,
    /// Only NVML says (no setting).
    pub gpus: Option<u32>,
}

impl CapacityInput {
    /// The node's GPU capacity as NVML reports it (the library the `nvml` probe's
    /// `--nvml-library` names, or where driver stacks put it): the GPUs' memory and maximum
    /// link bandwidth summed (the hourly rate is the node's, so its shares are of all its
    /// GPUs). Each number from the GPUs that gave it: a GPU that is lost, or whose NVML
    /// lacks a call, is left out of that sum and said (logged), and the others still price;
    /// nothing when the library is absent (the configuration must then give them).
    pub fn discovered(options: &crate::probes::UnitOptions) -> CapacityInput {
        let library = &options.get::<crate::probes::nvml::Config>().library;
        let nvml = match crate::nvml::Nvml::open(library) {
            Ok(crate::nvml::Opened::Loaded(nvml)) => nvml,
            Ok(crate::nvml::Opened::Absent(why)) => {
                tracing::warn!("GPU capacity for the cost model: {why}");
                return CapacityInput::default();
            }
            Err(e) => {
                tracing::warn!("GPU capacity for the cost model: {library}: {e}");
                return CapacityInput::default();
            }
        };
        let survey = nvml.capacity();
        for f in &survey.failures {
            tracing::warn!("GPU capacity for the cost model: {f}; that GPU's number is left out");
        }
        CapacityInput::from_gpus(&survey.gpus)
    }

    /// The sums over the GPUs that gave each number (see [`CapacityInput::discovered`]).
    pub fn from_gpus(gpus: &[crate::nvml::GpuCapacity]) -> CapacityInput {
        let sum = |pick: fn(&crate::nvml::GpuCapacity) -> Option<u64>, what: &str| {
            let given: Vec<u64> = gpus.iter().filter_map(pick).collect();
            for g in gpus.iter().filter(|g| pick(g).is_none()) {
                tracing::warn!(
                    gpu = g.index,
                    "NVML gave no {what} for this GPU: the cost model leaves it out of the {what}"
                );
            }
            (!given.is_empty()).then(|| given.iter().sum())
        };
        let memory_bytes = sum(|g| g.memory_total_bytes, "total memory");
        let link_bytes_per_second = sum(|g| g.link_bytes_per_second, "link bandwidth");
        let priced = gpus
            .iter()
            .filter(|g| g.memory_total_bytes.is_some())
            .count();
        CapacityInput {
            memory_bytes,
            link_bytes_per_second,
            gpus: (priced > 0).then(|| u32::try_from(priced).unwrap_or(u32::MAX)),
        }
    }

    /// Each capacity from `self`, else from `fallback` (configuration over discovery: an
    /// operator who sets one means it).
    pub fn or(self, fallback: CapacityInput) -> CapacityInput {
        CapacityInput {
            memory_bytes: self.memory_bytes.or(fallback.memory_bytes),
            link_bytes_per_second: self
                .link_bytes_per_second
                .or(fallback.link_bytes_per_second),
            gpus: self.gpus.or(fallback.gpus),
        }
    }

    /// Both capacities, non-zero.
    pub fn resolve(self) -> Result<GpuCapacity, ConfigError> {
        self.check_nonzero()?;
        Ok(GpuCapacity {
            memory_bytes: self
                .memory_bytes
                .ok_or(ConfigError::MissingCapacity(MEMORY_FLAG))?,
            link_bytes_per_second: self
                .link_bytes_per_second
                .ok_or(ConfigError::MissingCapacity(LINK_FLAG))?,
            gpus: self.gpus.unwrap_or(1).max(1),
        })
    }

    fn check_nonzero(&self) -> Result<(), ConfigError> {
        if self.memory_bytes == Some(0) {
            return Err(ConfigError::ZeroCapacity(MEMORY_FLAG));
        }
        if self.link_bytes_per_second == Some(0) {
            return Err(ConfigError::ZeroCapacity(LINK_FLAG));
        }
        Ok(())
    }
}

const MEMORY_FLAG: &str = "--gpu-memory-bytes";
const LINK_FLAG: &str = "--gpu-link-bytes-per-second";

/// FinOps settings as the command line gives them.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `NAME=POD_LABEL_KEY`, NAME one of [`LABEL_NAMES`].
    pub pod_labels: Vec<String>,
    /// Node price per hour; no cost series without one.
    pub hourly_rate: Option<f64>,
    pub currency: String,
    /// `COMPUTE,VRAM,PCIE`.
    pub weights: String,
    /// Configured capacities; NVML's, when a probe provides them, fill what is not set.
    pub capacity: CapacityInput,
    pub mps_sustain: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            pod_labels: Vec::new(),
            hourly_rate: None,
            currency: "USD".into(),
            weights: "0.55,0.35,0.10".into(),
            capacity: CapacityInput::default(),
            mps_sustain: MpsConfig::default().sustain,
        }
    }
}

/// The cost half of a valid configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct CostSettings {
    pub model: CostModel,
    pub currency: String,
}

/// A valid FinOps configuration.
#[derive(Debug, Clone)]
pub struct FinopsConfig {
    pub labels: PodLabels,
    /// `None`: no hourly rate, no cost series.
    pub cost: Option<CostSettings>,
    pub mps: MpsConfig,
}

impl Settings {
    /// Checks everything; `discovered` are capacities the GPU reported (NVML), used where the
    /// configuration sets none.
    pub fn validate(&self, discovered: CapacityInput) -> Result<FinopsConfig, ConfigError> {
        let labels = PodLabels::parse(&self.pod_labels)?;
        let weights = Weights::parse(&self.weights)?;
        let currency = self.currency.trim();
        if currency.is_empty()
            || currency.len() > 8
            || !currency.chars().all(|c| c.is_ascii_alphanumeric())
        {
            return Err(ConfigError::BadCurrency(self.currency.clone()));
        }
        if let Some(r) = self.hourly_rate {
            if !r.is_finite() || r < 0.0 {
                return Err(ConfigError::BadRate(r));
            }
        }
        // a zero is wrong whether or not a rate is set
        self.capacity.check_nonzero()?;
        let cost = match self.hourly_rate {
            None => None,
            Some(hourly_rate) => Some(CostSettings {
                model: CostModel {
                    hourly_rate,
                    weights,
                    capacity: self.capacity.or(discovered).resolve()?,
                },
                currency: currency.to_string(),
            }),
        };
        if self.mps_sustain < Duration::from_secs(1) {
            return Err(ConfigError::BadSustain(self.mps_sustain));
        }
        Ok(FinopsConfig {
            labels,
            cost,
            mps: MpsConfig {
                sustain: self.mps_sustain,
                ..MpsConfig::default()
            },
        })
    }
}

/// The FinOps flags of `gpufeed-guest run`.
#[derive(Debug, Clone, clap::Args)]
pub struct FinopsArgs {
    /// A pod label that becomes a series label on the GPU series, the cost series and
    /// gpufeed_pod_info: NAME=POD_LABEL_KEY with NAME one of tenant, model, app, e.g.
    /// tenant=team.example.com/tenant. Repeatable.
    #[arg(long = "pod-label", value_name = "NAME=KEY")]
    pub pod_labels: Vec<String>,
    /// The node's price per hour (its GPU included); turns on gpufeed_gpu_cost_total.
    #[arg(
        long,
        value_name = "PRICE",
        allow_negative_numbers = true,
        env = "GPUFEED_GPU_HOURLY_RATE"
    )]
    pub gpu_hourly_rate: Option<f64>,
    /// Currency of --gpu-hourly-rate (the cost series' currency label).
    #[arg(long, default_value = "USD", env = "GPUFEED_GPU_COST_CURRENCY")]
    pub gpu_cost_currency: String,
    /// Weights of the compute, VRAM and PCIe shares in a pod's cost; they sum to 1.
    #[arg(
        long,
        value_name = "COMPUTE,VRAM,PCIE",
        default_value = "0.55,0.35,0.10",
        env = "GPUFEED_GPU_COST_WEIGHTS"
    )]
    pub gpu_cost_weights: String,
    /// The GPU's total memory, e.g. 80GiB (what VRAM shares divide by).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, env = "GPUFEED_GPU_MEMORY_BYTES")]
    pub gpu_memory_bytes: Option<u64>,
    /// The GPU's host link bandwidth per direction, e.g. 32GB for PCIe 4.0 x16 (what PCIe
    /// shares divide by).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, env = "GPUFEED_GPU_LINK_BYTES_PER_SECOND")]
    pub gpu_link_bytes_per_second: Option<u64>,
    /// How long a pod's duty cycle must stay low (or high and queueing) before the MPS advice
    /// changes.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub mps_sustain: Duration,
}

impl FinopsArgs {
    pub fn settings(&self) -> Settings {
        Settings {
            pod_labels: self.pod_labels.clone(),
            hourly_rate: self.gpu_hourly_rate,
            currency: self.gpu_cost_currency.clone(),
            weights: self.gpu_cost_weights.clone(),
            capacity: CapacityInput {
                memory_bytes: self.gpu_memory_bytes,
                link_bytes_per_second: self.gpu_link_bytes_per_second,
                gpus: None,
            },
            mps_sustain: self.mps_sustain,
        }
    }
}

/// A byte count: an integer with an optional unit (`80GiB`, `16GB`, `64MiB`, `1000`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a byte count such as 80GiB or 32GB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?}: too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut Settings)) -> Result<FinopsConfig, ConfigError> {
        let mut s = Settings {
            hourly_rate: Some(2.5),
            capacity: CapacityInput {
                memory_bytes: Some(80 << 30),
                link_bytes_per_second: Some(32_000_000_000),
                gpus: None,
            },
            ..Settings::default()
        };
        f(&mut s);
        s.validate(CapacityInput::default())
    }

    #[test]
    fn defaults_and_a_full_configuration_are_valid() {
        let c = Settings::default()
            .validate(CapacityInput::default())
            .unwrap();
        assert!(c.cost.is_none(), "no rate: no cost");
        let c = with(|s| s.pod_labels = vec!["tenant=team.example.com/tenant".into()]).unwrap();
        let cost = c.cost.unwrap();
        assert_eq!(cost.model.weights, Weights::default());
        assert_eq!(cost.model.hourly_rate, 2.5);
        assert_eq!(cost.currency, "USD");
        assert_eq!(c.labels.names().collect::<Vec<_>>(), ["tenant"]);
    }

    #[test]
    fn each_invalid_setting_is_named() {
        let e = |f: fn(&mut Settings)| with(f).unwrap_err().to_string();
        assert!(e(|s| s.weights = "0.5,0.3,0.1".into()).contains("--gpu-cost-weights"));
        assert!(e(|s| s.weights = "0.5,0.3,0.1".into()).contains("sum to 0.9"));
        assert!(e(|s| s.weights = "0.5,0.5".into()).contains("three numbers"));
        assert!(e(|s| s.weights = "1.2,-0.2,0".into()).contains("negative"));
        assert!(e(|s| s.hourly_rate = Some(-1.0)).contains("--gpu-hourly-rate -1"));
        assert!(e(|s| s.hourly_rate = Some(f64::NAN)).contains("--gpu-hourly-rate"));
        assert!(
            e(|s| s.pod_labels = vec!["team=x/y".into()]).contains("unknown label name \"team\"")
        );
        assert!(e(|s| s.pod_labels = vec!["tenant".into()]).contains("NAME=POD_LABEL_KEY"));
        assert!(e(|s| s.pod_labels = vec!["app=a".into(), "app=b".into()]).contains("twice"));
        assert!(
            e(|s| s.pod_labels = vec!["app=bad key".into()]).contains("not a Kubernetes label key")
        );
        assert!(e(|s| s.capacity.memory_bytes = Some(0)).contains("--gpu-memory-bytes"));
        assert!(e(|s| s.capacity.link_bytes_per_second = Some(0))
            .contains("--gpu-link-bytes-per-second: a GPU's capacity cannot be 0"));
        assert!(e(|s| s.capacity.memory_bytes = None).contains("--gpu-memory-bytes: not set"));
        assert!(e(|s| s.currency = "".into()).contains("--gpu-cost-currency"));
        assert!(e(|s| s.mps_sustain = Duration::from_millis(10)).contains("--mps-sustain"));
        // a zero capacity is refused even without a rate
        let mut s = Settings::default();
        s.capacity.memory_bytes = Some(0);
        assert_eq!(
            s.validate(CapacityInput::default()).unwrap_err(),
            ConfigError::ZeroCapacity("--gpu-memory-bytes")
        );
    }

    #[test]
    fn weights_near_one_are_one() {
        assert!(Weights::parse("0.33,0.33,0.34").is_ok());
        assert!(Weights::parse("1,0,0").is_ok());
        assert!(Weights::parse("0.55, 0.35, 0.10").is_ok());
        assert!(Weights::parse("0.55,0.35,0.1001").is_err());
    }

    #[test]
    fn discovered_capacities_fill_what_configuration_leaves_open() {
        let nvml = CapacityInput {
            memory_bytes: Some(24 << 30),
            link_bytes_per_second: Some(16_000_000_000),
            gpus: Some(2),
        };
        let mut s = Settings {
            hourly_rate: Some(1.0),
            ..Settings::default()
        };
        s.capacity.memory_bytes = Some(20 << 30);
        let cap = s.validate(nvml).unwrap().cost.unwrap().model.capacity;
        assert_eq!(
            cap,
            GpuCapacity {
                memory_bytes: 20 << 30,
                link_bytes_per_second: 16_000_000_000,
                gpus: 2,
            }
        );
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("32GB"), Ok(32_000_000_000));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert!(parse_bytes("12XB").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
    }
}
