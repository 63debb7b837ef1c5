#!/usr/bin/env bash
# Runs every cargo-fuzz target (libFuzzer) for a while each: the stream frame decoder
# (shared/fuzz) and the host agent's parsers (host-agent/fuzz: kmsg, sysfs files, uevents /
# tracefs lines / rtnetlink dumps, the config).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      default 60
#
# Works on the stable toolchain: RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its -Z flags, and
# `--sanitizer none` needs no sanitizer runtime (the code under test is safe Rust: what the
# fuzzer looks for is a panic, an overflow or a hang). Installs cargo-fuzz if it is missing.
# Corpora and any crash reproducer stay in <crate>/fuzz/{corpus,artifacts}/ (not committed).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
export PATH="$HOME/.cargo/bin:/root/.cargo/bin:$PATH"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-fuzz}"

run() { # crate dir, target
    echo "== $1: $2 (${secs}s)"
    (cd "$1" && cargo fuzz run "$2" --sanitizer none --release -- \
        -max_total_time="$secs" -print_final_stats=1 2>&1) |
        grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+[[:space:]]+DONE|==[0-9]+==|.*(panicked|crash))' || true
    # cargo fuzz exits non-zero on a crash; grep above only filters what is printed
    (cd "$1" && ls fuzz/artifacts/"$2" 2>/dev/null | grep -q . ) &&
        { echo "fuzz.sh: $1 $2 found a crash: $1/fuzz/artifacts/$2/" >&2; exit 1; }
    return 0
}

run shared frame_decoder
for t in kmsg sysfs wire config; do
    run host-agent "$t"
done
echo "fuzz.sh: no crashes"
