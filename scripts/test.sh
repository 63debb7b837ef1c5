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

# Room: a whole run took 6.4 GB of disk at its peak: target/ 2.9 GB built without incremental
# caches as the CI builds, the VM lab's cache 2.1 GB, and the lab's disks and payloads in the
# temporary directory while they run (the rest). A disk that fills midway shows up as a linker's
# bus error or an I/O error in some test, so a disk that cannot hold it is said here. Each share
# is asked of the filesystem it lands on, and what a previous run left there counts as room.
lab_cache=${GPUFEED_LAB_CACHE:-/var/cache/gpufeed-lab}
mkdir -p "$lab_cache"
declare -A need_mb kept_mb
# share PATH MB [kept]: PATH's filesystem must hold MB more; with `kept`, less what PATH holds
# now (an earlier run's build or cache, reused)
share() {
  local m held=0
  m=$(df -P "$1" | awk 'NR == 2 { print $6 }')
  [ "${3:-}" = kept ] && held=$(du -sm "$1" 2>/dev/null | awk '{ print $1 }')
  need_mb[$m]=$((${need_mb[$m]:-0} + $2))
  kept_mb[$m]=$((${kept_mb[$m]:-0} + ${held:-0}))
}
mkdir -p target
share target 3000 kept
share "$lab_cache" 2100 kept
share "${TMPDIR:-/tmp}" 1400
for m in "${!need_mb[@]}"; do
  free=$(df -Pm "$m" | awk 'NR == 2 { print $4 }')
  if [ $((free + ${kept_mb[$m]})) -lt "${need_mb[$m]}" ]; then
    echo "test.sh: $free MB free on $m (and ${kept_mb[$m]} MB an earlier run left there); a run needs about ${need_mb[$m]} MB there: free some space first" >&2
    exit 1
  fi
done
cargo build --workspace --all-targets
# lints and formatting first: cheap, and a red one says exactly what to fix
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo fmt --all --check
cargo test --workspace --no-fail-fast
