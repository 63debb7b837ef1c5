#!/usr/bin/env bash
# The whole test suite. Kernel tests load real BPF programs, create cgroups,
# namespaces and qdiscs: run as root (they skip on an unprivileged machine
# unless CI=true, where they fail instead).
set -euo pipefail
. "$(dirname "$0")/lib/as-root.sh"
as_root "$@"
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:/root/.cargo/bin:$PATH"
cargo build --workspace --all-targets
# lints and formatting first: cheap, and a red one says exactly what to fix
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo fmt --all --check
cargo test --workspace --no-fail-fast
