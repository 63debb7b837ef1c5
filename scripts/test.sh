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

# Room: a whole run took 6.4 GB of disk at its peak (target/ 2.9 GB built without incremental
# caches as the CI builds, the VM lab's cache 2.1 GB, the lab's disks and images while they
# run). A disk that fills midway shows up as a linker's bus error or an I/O error in some test,
# so a disk that cannot hold it is said here. What a previous run left counts as room.
need_mb=6500
lab_cache=${GPUFEED_LAB_CACHE:-/var/cache/gpufeed-lab}
free_mb=$(df -Pm . | awk 'NR == 2 { print $4 }')
kept_mb=$(du -smc target "$lab_cache" 2>/dev/null | awk 'END { print $1 }')
if [ $((free_mb + ${kept_mb:-0})) -lt "$need_mb" ]; then
  echo "test.sh: $free_mb MB free on $(df -P . | awk 'NR == 2 { print $6 }') (and ${kept_mb:-0} MB from an earlier run in target/ and $lab_cache); a run needs about $need_mb MB: free some space first" >&2
  exit 1
fi
cargo build --workspace --all-targets
# lints and formatting first: cheap, and a red one says exactly what to fix
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo fmt --all --check
cargo test --workspace --no-fail-fast
