#!/usr/bin/env bash
# The whole test suite. Kernel tests load real BPF programs, create cgroups,
# namespaces and qdiscs: run as root (they skip on an unprivileged machine
# unless CI=true, where they fail instead).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:/root/.cargo/bin:$PATH"
cargo build --workspace --all-targets
cargo test --workspace --no-fail-fast
