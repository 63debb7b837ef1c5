//! FinOps settings as given (command line) and as validated. Every refusal names the setting,
//! so that an agent that will not start says which flag to fix.

use std::time::Duration;

pub use super::cost::{GpuCapacity, Weights};
pub use super::error::{ConfigError, LABEL_NAMES};
use super::labels::PodLabels;
use super::mps::MpsConfig;

/// Capacities as far as a source knows them: configuration, or the GPU itself (what the nvml
/// probe reports at each tick, [`super::live::Reported`]). [`CapacityInput::or`] layers
/// sources; [`super::live::Live`] decides what the cost divides by.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CapacityInput {
    pub memory_bytes: Option<u64>,
    pub link_bytes_per_second: Option<u64>,
    /// Only NVML says (no setting).
    pub gpus: Option<u32>,
}

impl CapacityInput {
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

pub(super) const MEMORY_FLAG: &str = "--gpu-memory-bytes";
pub(super) const LINK_FLAG: &str = "--gpu-link-bytes-per-second";

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

/// The cost half of a valid configuration. The capacity is not in it: it is read live
/// ([`super::live`]), the configured one first.
#[derive(Debug, Clone, PartialEq)]
pub struct CostSettings {
    pub hourly_rate: f64,
    pub weights: Weights,
    /// Configured capacities; what is not set comes from NVML at each tick.
    pub configured: CapacityInput,
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
    /// Checks everything. A rate without a configured capacity is valid: the capacity is then
    /// NVML's, read at each tick, and until there is one the cost waits (an agent on a node
    /// without NVML must not refuse to start, a DaemonSet would crash-loop on every such node).
    pub fn validate(&self) -> Result<FinopsConfig, ConfigError> {
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
        let cost = self.hourly_rate.map(|hourly_rate| CostSettings {
            hourly_rate,
            weights,
            configured: self.capacity,
            currency: currency.to_string(),
        });
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
    /// The node's price per hour (its GPU included); turns on gpufeed_gpu_cost_total once the
    /// GPUs' capacity is known (configured, or from NVML at run time).
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
        s.validate()
    }

    #[test]
    fn defaults_and_a_full_configuration_are_valid() {
        let c = Settings::default().validate().unwrap();
        assert!(c.cost.is_none(), "no rate: no cost");
        let c = with(|s| s.pod_labels = vec!["tenant=team.example.com/tenant".into()]).unwrap();
        let cost = c.cost.unwrap();
        assert_eq!(cost.weights, Weights::default());
        assert_eq!(cost.hourly_rate, 2.5);
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
        // a rate without a configured capacity starts (the capacity comes from NVML, live)
        assert!(with(|s| s.capacity = CapacityInput::default()).is_ok());
        assert!(e(|s| s.currency = "".into()).contains("--gpu-cost-currency"));
        assert!(e(|s| s.mps_sustain = Duration::from_millis(10)).contains("--mps-sustain"));
        // a zero capacity is refused even without a rate
        let mut s = Settings::default();
        s.capacity.memory_bytes = Some(0);
        assert_eq!(
            s.validate().unwrap_err(),
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
    fn byte_counts() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("32GB"), Ok(32_000_000_000));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert!(parse_bytes("12XB").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
    }
}
