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

# Three streams, as the suite alone kept one of the two cores idle on average (93% of a core
# over a whole run): the VM lab's tests (lab/tests, QEMU's emulated CPUs, about 16 minutes)
# beside the rest. Each selects the whole workspace (the lab's by --test names), so cargo
# resolves the same features for all and builds nothing twice; the lab's VMs run one at a time
# (a lock of their own) and its lines carry a `lab| ` prefix.
# * host_package first, beside the lints: systemd in its VMs times out a start and misses
#   watchdog pings when the emulator is starved for a minute, so it holds the kernel tests'
#   lock too (they wait for it) and runs at the normal priority.
# * the rest of the lab at SCHED_IDLE (children inherit it), beside the suite: whenever a
#   kernel test's task wants a CPU it takes it from the emulator at once, so latency and rate
#   measurements see the machine as they did alone, and the VMs get the idle time. stream_vm
#   among them holds the kernel tests' lock too: its VM's tap and bridge are on this machine,
#   where kernel tests count every device's drops.
lab_stream() { # LOG [idle] --test NAME...: one cargo test of the lab, its lines prefixed
  local log=$1 prio=()
  shift
  [ "$1" = idle ] && prio=(chrt --idle 0) && shift
  ("${prio[@]}" cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log" | sed -u 's/^/lab| /')
}
lab_tests=()
for t in lab/tests/*.rs; do
  name=$(basename "$t" .rs)
  [ "$name" = host_package ] || lab_tests+=(--test "$name")
done
trap '[ $? = 0 ] || kill $(jobs -p) 2>/dev/null || true' EXIT
lab_stream target/lab-tests-alone.log --test host_package &
alone_pid=$!
# clippy holds cargo's lock on target/ while it runs: let the lab's cargo be past it first
for _ in $(seq 1 600); do
  grep -q 'Running' target/lab-tests-alone.log 2>/dev/null && break
  kill -0 "$alone_pid" 2>/dev/null || break
  sleep 0.1
done
# lints and formatting first: cheap, and a red one says exactly what to fix
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo fmt --all --check
lab_stream target/lab-tests.log idle "${lab_tests[@]}" &
lab_pid=$!
rest=0
cargo test --workspace --exclude gpufeed-lab --no-fail-fast || rest=$?
lab=0
wait "$alone_pid" || lab=$?
wait "$lab_pid" || lab=$?
if [ "$lab" != 0 ]; then
  # the lab's failures again, whole, where the end of the log shows them
  echo "test.sh: the VM lab's failures (target/lab-tests-alone.log, target/lab-tests.log):"
  sed -n '/^failures:$/,/^test result: FAILED/p' target/lab-tests-alone.log target/lab-tests.log
fi
echo "test.sh: the suite $([ "$rest" = 0 ] && echo passed || echo FAILED); the VM lab $([ "$lab" = 0 ] && echo passed || echo FAILED)"
[ "$rest" = 0 ] && [ "$lab" = 0 ]
