#!/bin/bash
# The scheduler overhead benchmark on this VM's kernel, by hand (TCG: ratios only):
#
#   cargo bench -p gpufeed-guest --bench overhead --no-run     # prints the binary's path
#   cargo build --release -p gpufeed-guest
#   cargo run -p gpufeed-lab -- boot --variant bench --kernel trixie --deadline 3600 \
#       --copy target/release/deps/overhead-<hash>:overhead \
#       --copy target/release/gpufeed-guest:gpufeed-guest lab/scenarios/sched-bench.sh
#
# The bench variant has perf, bpftool and libbpf-tools' runqlat (the peer). A round trip takes
# about ten times as long under TCG, so the ping-pong runs 20 000 round trips instead of 200 000.
. /payload/lab.sh

report kernel "$(uname -r)"
report cpus "$(nproc)"
cd /tmp
GPUFEED_BENCH_AGENT=/payload/gpufeed-guest GPUFEED_BENCH_LOOPS=20000 /payload/overhead \
	>/tmp/bench.out 2>/tmp/bench.err && rc=0 || rc=$?
while IFS= read -r l; do report progress "$l"; done </tmp/bench.err
while IFS= read -r l; do report row "$l"; done </tmp/bench.out
report bench_exit "$rc"
lab_done
