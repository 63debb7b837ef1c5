//! Where NVML may be: the configured name or path first, then where the NVIDIA driver
//! stacks put `libnvidia-ml.so.1`, since a pod's loader path rarely names them all.
//!
//! * `/usr/lib/x86_64-linux-gnu`, `/usr/lib/aarch64-linux-gnu`: Debian/Ubuntu driver
//!   packages, and where the NVIDIA container toolkit mounts it into a Debian-based image;
//! * `/usr/lib64`: RPM-based hosts and images;
//! * `/usr/local/nvidia/lib64`: the GPU Operator's and managed clouds' driver containers;
//! * `/usr/local/glibc/usr/lib`: Talos's NVIDIA system extensions (Talos keeps the driver's
//!   glibc libraries apart from its own root);
//! * `/run/nvidia/driver/usr/lib/x86_64-linux-gnu`, `/run/nvidia/driver/usr/lib64`: the GPU
//!   Operator's driver root on the host, seen through a hostPath mount.

/// The library's name as the driver installs it.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

/// Directories searched after the configured library, in order.
pub const STANDARD_DIRS: [&str; 7] = [
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/local/nvidia/lib64",
    "/usr/local/glibc/usr/lib",
    "/run/nvidia/driver/usr/lib/x86_64-linux-gnu",
    "/run/nvidia/driver/usr/lib64",
];

/// What to try, in order: `configured` (a name the loader searches for, or a path), and
/// when it is the default name, the library in each standard directory that has it. A path
/// given on purpose is the only one tried: an operator who names one means it.
pub fn candidates(configured: &str) -> Vec<String> {
    let mut out = vec![configured.to_string()];
    if configured == LIBRARY {
        out.extend(
            STANDARD_DIRS
                .iter()
                .map(|d| format!("{d}/{}", LIBRARY))
                .filter(|p| std::path::Path::new(p).exists()),
        );
    }
    out
}

/// Why no NVML was found, with the fix, for logs, doctor and `/readyz`.
pub fn not_found(configured: &str, why: &str) -> String {
    let what = if configured == LIBRARY {
        format!(
            "{} not found in the loader's path nor in {}",
            LIBRARY,
            STANDARD_DIRS.join(", ")
        )
    } else {
        format!("--nvml-library {configured} cannot be opened")
    };
    format!(
        "{what} ({why}): add the gpu component (runtimeClassName: nvidia, \
         NVIDIA_DRIVER_CAPABILITIES=utility) or mount the driver's library directory and set \
         --nvml-library"
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_configured_path_is_the_only_candidate() {
        assert_eq!(
            super::candidates("/opt/x/libnvidia-ml.so.1"),
            ["/opt/x/libnvidia-ml.so.1"]
        );
        let c = super::candidates(super::LIBRARY);
        assert_eq!(c[0], "libnvidia-ml.so.1");
        assert!(c[1..].iter().all(|p| p.starts_with('/')));
        let why = super::not_found("libnvidia-ml.so.1", "cannot open");
        assert!(why.contains("/usr/local/glibc/usr/lib"), "{why}");
        assert!(why.contains("runtimeClassName"), "{why}");
    }
}
