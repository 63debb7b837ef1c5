//! Compiles every BPF object with clang (CO-RE against the committed
//! vmlinux.h) and generates a libbpf-rs skeleton per object into OUT_DIR as
//! `<name>.skel.rs`.
//!
//! The objects are found, not listed: every `../bpf/<name>.bpf.c` is a probe
//! (its unit in `src/probes/` includes the skeleton), every
//! `tests/bpf/<name>.bpf.c` a test-only object (a benchmark's empty programs,
//! a foreign tc program for the tc tests). Both folders share the headers in
//! `../bpf`.

use std::path::{Path, PathBuf};

use libbpf_cargo::SkeletonBuilder;

/// `(name, path)` of every `<name>.bpf.c` in `dir`, sorted by name.
fn objects(dir: &Path) -> Vec<(String, PathBuf)> {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    let mut out: Vec<(String, PathBuf)> = entries
        .filter_map(|e| {
            let path = e.ok()?.path();
            let name = path
                .file_name()?
                .to_str()?
                .strip_suffix(".bpf.c")?
                .to_string();
            Some((name, path))
        })
        .collect();
    out.sort();
    out
}

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let bpf_dir = manifest.join("../bpf");
    let test_dir = manifest.join("tests/bpf");
    // a directory: cargo reruns when any file in it changes, is added or removed
    for dir in [&bpf_dir, &test_dir] {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    let all = objects(&bpf_dir).into_iter().chain(objects(&test_dir));
    for (name, src) in all {
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
            .build_and_generate(out.join(format!("{name}.skel.rs")))
            .unwrap_or_else(|e| panic!("building {} failed: {e:#}", src.display()));
    }
}
