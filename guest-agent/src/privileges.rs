//! Preflight: say exactly which privilege or kernel feature is missing, before
//! libbpf gets a chance to fail with a wall of verifier output.

use std::path::Path;

use gpufeed_shared::doctor::{CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN};

pub use gpufeed_shared::doctor::effective_caps;

/// Everything that stops the agent from loading its probes, one line each.
pub fn missing(status: &str, btf: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let caps = effective_caps(status).unwrap_or(0);
    let has = |c: u32| caps & (1u64 << c) != 0;
    // Kernels >= 5.8 split CAP_BPF and CAP_PERFMON out of CAP_SYS_ADMIN; either works.
    if !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        out.push(
            "missing capability CAP_BPF (grant CAP_BPF and CAP_PERFMON, or run as root)"
                .to_string(),
        );
    }
    if !has(CAP_PERFMON) && !has(CAP_SYS_ADMIN) {
        out.push("missing capability CAP_PERFMON (needed to attach tracing programs)".to_string());
    }
    if !btf.exists() {
        out.push(format!(
            "kernel BTF not found at {} (kernel built without CONFIG_DEBUG_INFO_BTF)",
            btf.display()
        ));
    }
    out
}

/// The kernel lockdown mode, e.g. "confidentiality", if the LSM is there.
pub fn lockdown() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/security/lockdown").ok()?;
    // "none [integrity] confidentiality": the bracketed word is the active mode
    gpufeed_shared::doctor::lockdown_mode(&text).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_decide_what_is_missing() {
        let btf = Path::new("/"); // exists
        let root = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert!(missing(root, btf).is_empty());
        let none = "CapEff:\t0000000000000000\n";
        let m = missing(none, btf);
        assert_eq!(m.len(), 2);
        assert!(
            m[0].contains("CAP_BPF") && m[1].contains("CAP_PERFMON"),
            "{m:?}"
        );
        let bpf_perfmon = format!(
            "CapEff:\t{:016x}\n",
            (1u64 << CAP_BPF) | (1u64 << CAP_PERFMON)
        );
        assert!(missing(&bpf_perfmon, btf).is_empty());
        let no_btf = missing(root, Path::new("/nonexistent/vmlinux"));
        assert_eq!(no_btf.len(), 1);
        assert!(no_btf[0].contains("CONFIG_DEBUG_INFO_BTF"));
        assert_eq!(effective_caps("garbage"), None);
    }
}
