//! What a FinOps setting can be refused for: each refusal names the flag to fix.

use std::time::Duration;

/// Series label names a pod label can become. Few and fixed: they are label names on every GPU
/// series, and dashboards, the KEDA trigger and the rules select on them.
pub const LABEL_NAMES: [&str; 3] = ["tenant", "model", "app"];

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("--pod-label {0:?}: expected NAME=POD_LABEL_KEY, e.g. tenant=team.example.com/tenant")]
    PodLabelSyntax(String),
    #[error("--pod-label {given:?}: unknown label name {name:?} (allowed: tenant, model, app)")]
    UnknownLabelName { given: String, name: String },
    #[error("--pod-label {0:?}: the label name is given twice")]
    DuplicateLabelName(String),
    #[error("--pod-label {given:?}: {key:?} is not a Kubernetes label key")]
    BadLabelKey { given: String, key: String },
    #[error(
        "--gpu-cost-weights {0:?}: expected three numbers COMPUTE,VRAM,PCIE, e.g. 0.55,0.35,0.10"
    )]
    WeightsSyntax(String),
    #[error("--gpu-cost-weights {0:?}: a weight is negative")]
    NegativeWeight(String),
    #[error("--gpu-cost-weights {given:?}: the weights sum to {sum}, not 1")]
    WeightsSum { given: String, sum: f64 },
    #[error("--gpu-hourly-rate {0}: the node's hourly price must be a number ≥ 0")]
    BadRate(f64),
    #[error("--gpu-cost-currency {0:?}: expected a currency code such as USD or EUR")]
    BadCurrency(String),
    #[error("{0}: a GPU's capacity cannot be 0")]
    ZeroCapacity(&'static str),
    #[error("--mps-sustain {0:?}: must be at least 1s")]
    BadSustain(Duration),
}
