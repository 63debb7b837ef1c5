//! Compiles every probe in ../bpf with clang (CO-RE against the committed
//! vmlinux.h) and generates a libbpf-rs skeleton per probe into OUT_DIR.

use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

/// BPF objects to build; each has a `bpf/<name>.bpf.c`. The agent's probes have a
/// `src/probes/<name>.rs` that includes the skeleton; `bench_empty` is only used
/// by the overhead benchmark and `tc_foreign` only by the tc tests.
const PROBES: &[&str] = &[
    "sched",
    "tcp",
    "tc",
    "gpu_driver",
    "cuda",
    "bench_empty",
    "tc_foreign",
];

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let bpf_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bpf");
    for header in ["vmlinux.h", "hist.h", "cgroup.h"] {
        println!("cargo:rerun-if-changed={}", bpf_dir.join(header).display());
    }
    for probe in PROBES {
        let src = bpf_dir.join(format!("{probe}.bpf.c"));
        println!("cargo:rerun-if-changed={}", src.display());
        SkeletonBuilder::new()
            .source(&src)
            .clang_args([
                format!("-I{}", bpf_dir.display()),
                // Pin the instruction set: LLVM 20 changed the default; v3 needs kernel >= 5.1.
                "-mcpu=v3".to_string(),
                "-Wall".to_string(),
                "-Werror".to_string(),
                // vmlinux.h defines these; the helper headers' fallbacks would clash.
                "-Wno-unused-function".to_string(),
            ])
            .build_and_generate(out.join(format!("{probe}.skel.rs")))
            .unwrap_or_else(|e| panic!("building bpf/{probe}.bpf.c failed: {e:#}"));
    }
}
