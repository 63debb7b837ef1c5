#!/usr/bin/env bash
# GPU check: runs a small CUDA program (scripts/gpu-check.c) in a pod-shaped
# cgroup under gpufeed-guest on a machine with an NVIDIA GPU, and writes a
# markdown report of what each GPU probe saw beside the program's own counts
# and NVML's: compute time, duty cycle and VRAM by each source the agent has.
# Takes under a minute; needs root, a C compiler (or --client) and the NVIDIA
# driver (libcuda.so.1, libnvidia-ml.so.1).
#
#   scripts/gpu-check.sh [--agent PATH] [--client PATH] [--out FILE] [-- AGENT FLAGS...]
#
#   --agent   gpufeed-guest binary (default: target/release/gpufeed-guest,
#             else target/debug/gpufeed-guest, else the one on PATH)
#   --client  the program, built already (default: built from gpu-check.c)
#   --out     report file (default: gpu-check.md)
#   after --   further flags for `gpufeed-guest run` (e.g. --nvml-library)
#
# The program finds libcuda.so.1 the usual way (LD_LIBRARY_PATH included), so
# the tests run this script against the stand-in driver library.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
agent="" client="" out="gpu-check.md"
while [ $# -gt 0 ]; do
  case "$1" in
    --agent) agent=$2; shift 2 ;;
    --client) client=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
extra=("$@")

say() { echo "gpu-check: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (the agent loads BPF programs)"
if [ -z "$agent" ]; then
  for a in "$repo/target/release/gpufeed-guest" "$repo/target/debug/gpufeed-guest"; do
    [ -x "$a" ] && { agent=$a; break; }
  done
  [ -n "$agent" ] || agent=$(command -v gpufeed-guest) || die "no gpufeed-guest binary (build it or pass --agent)"
fi
[ -x "$agent" ] || die "$agent is not an executable"

work=$(mktemp -d /tmp/gpufeed-gpu-check.XXXXXX)
cg_root=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
[ -n "$cg_root" ] || die "no cgroup2 mount"
uid=$(cat /proc/sys/kernel/random/uuid)
cid=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
node="$cg_root/gpufeed-gpu-check-$$"
pod="$node/kubepods/burstable/pod$uid"
ctr="$pod/$cid"
agent_pid="" client_pid=""

cleanup() {
  [ -n "$client_pid" ] && kill -9 "$client_pid" 2>/dev/null || true
  [ -n "$agent_pid" ] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null || true
  for d in "$ctr" "$pod" "$node/kubepods/burstable" "$node/kubepods" "$node"; do
    [ -d "$d" ] && rmdir "$d" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

if [ -z "$client" ]; then
  command -v cc >/dev/null || die "no C compiler to build gpu-check.c (install one or pass --client)"
  client="$work/gpu-check"
  cc -O2 -I "$here/../guest-agent/tests/fixtures/cuda" -o "$client" "$here/gpu-check.c" -ldl
fi
mkdir -p "$ctr" "$work/ctl"

# the agent, on a port it picks (logged)
duty_window=10
"$agent" run --no-kube --interval 500ms --metrics-listen 127.0.0.1:0 \
  --probes gpu_driver,cuda,nvml --cuda-launches --gpu-duty-window "${duty_window}s" \
  "${extra[@]}" >"$work/agent.log" 2>&1 &
agent_pid=$!
addr=""
for _ in $(seq 300); do
  addr=$(sed -n 's/.*serving \/metrics.*addr=\([0-9.:]*\).*/\1/p' "$work/agent.log" | head -1)
  [ -n "$addr" ] && break
  kill -0 "$agent_pid" 2>/dev/null || { cat "$work/agent.log" >&2; die "the agent exited"; }
  sleep 0.1
done
[ -n "$addr" ] || { cat "$work/agent.log" >&2; die "the agent did not start serving"; }
say "agent serving on $addr"

scrape() {
  local host=${addr%:*} port=${addr##*:}
  exec 3<>"/dev/tcp/$host/$port"
  printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n' "$addr" >&3
  sed '1,/^\r\{0,1\}$/d' <&3
  exec 3<&-
}

# value NAME [LABEL_MATCH...]: the sum of the series of family NAME (a plain
# name, or NAME_count / NAME_sum) whose labels contain every LABEL_MATCH
value() {
  local file=$1 name=$2; shift 2
  awk -v name="$name" -v want="$*" '
    BEGIN { n = split(want, w, " ") }
    $1 ~ /^#/ { next }
    {
      series = $1; base = series; sub(/\{.*/, "", base)
      if (base != name) next
      for (i = 1; i <= n; i++) if (index(series, w[i]) == 0) next
      sum += $2; found = 1
    }
    END {
      if (!found) print "absent"
      else if (sum == int(sum)) printf "%.0f\n", sum
      else printf "%.9f\n", sum
    }' "$file"
}

# await FILE SECONDS: waits for a file the program writes
await() {
  for _ in $(seq $(( $2 * 10 ))); do
    [ -e "$work/ctl/$1" ] && return 0
    kill -0 "$client_pid" 2>/dev/null || die "the program exited before '$1'"
    sleep 0.1
  done
  die "the program did not reach '$1' within $2 s"
}

# until_metric NAME MATCH WANT SECONDS: scrapes until the value is WANT
until_metric() {
  local name=$1 match=$2 want=$3
  for _ in $(seq $(( $4 * 5 ))); do
    scrape >"$work/m"
    [ "$(value "$work/m" "$name" $match)" = "$want" ] && return 0
    sleep 0.2
  done
  return 1
}

sh -c "echo \$\$ > '$ctr/cgroup.procs' && exec '$client' '$work/ctl'" &
client_pid=$!
await ready 120
say "program initialised (context and module loaded); waiting for the agent to probe it"
sel="pod=\"$uid\""
until_metric gpufeed_cuda_libraries "" 1 15 || die "the agent did not attach to the program's libcuda"
if until_metric gpufeed_gpu_ioctl_processes_probed "" 1 10; then
  driver_probed=yes
else
  driver_probed="no (the program holds no GPU device file the agent recognised)"
fi

touch "$work/ctl/go"
await peak 120
while read -r k v; do declare "own_$k=$v"; done <"$work/ctl/result"
until_metric ebpf_gpu_vram_reserved_bytes "$sel" "$own_vram_bytes" 10 || true
sleep 1.5 # NVML's samples and one more interval
scrape >"$work/peak"
touch "$work/ctl/release"
await freed 60
until_metric ebpf_gpu_vram_reserved_bytes "$sel" 0 10 || true
scrape >"$work/freed"
touch "$work/ctl/exit"
wait "$client_pid" || die "the program failed"
client_pid=""
sleep 1.5
scrape >"$work/after"

v() { value "$work/$1" "$2" "$sel" "${@:3}"; }
s_to_ns() { awk -v s="$1" 'BEGIN { if (s == "absent") print s; else printf "%.0f\n", s * 1e9 }'; }
same() { [ "$1" = "$2" ] && echo "equal" || echo "differs"; }
within() { # within GOT WANT: how far GOT is from WANT, in percent
  awk -v g="$1" -v w="$2" 'BEGIN {
    if (g == "absent" || w == 0) { print "n/a"; exit }
    d = (g - w) / w * 100; printf "%+.1f%%\n", d }'
}

gpu_name="stand-in (no nvidia-smi)"
if command -v nvidia-smi >/dev/null; then
  gpu_name=$(nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader 2>/dev/null | head -1 || echo unknown)
fi
vram_peak=$(v peak ebpf_gpu_vram_reserved_bytes)
h2d=$(value "$work/after" ebpf_gpu_pcie_bytes_total "$sel" 'direction="h2d"')
d2h=$(value "$work/after" ebpf_gpu_pcie_bytes_total "$sel" 'direction="d2h"')
launches=$(v after ebpf_gpu_kernel_launches_total)
sync_count=$(v after ebpf_gpu_sync_wait_microseconds_count)
sync_sum=$(value "$work/after" ebpf_gpu_sync_wait_microseconds_sum "$sel")
busy=$(s_to_ns "$(value "$work/after" ebpf_gpu_busy_estimate_seconds_total "$sel")")
driver=$(s_to_ns "$(value "$work/after" ebpf_gpu_driver_time_seconds_total "$sel")")
compute=$(s_to_ns "$(value "$work/after" ebpf_gpu_compute_time_seconds_total "$sel")")
source=$(sed -n 's/^gpufeed_gpu_compute_source{source="\([a-z_]*\)"} 1$/\1/p' "$work/after" | head -1)
[ -n "$source" ] || source=none
# the busiest duty cycle at the peak scrape, beside what the program's kernels fill of the window
duty=$(awk -v name=ebpf_gpu_active_compute_duty_cycle -v sel="$sel" '
  $1 ~ /^#/ { next }
  { base = $1; sub(/\{.*/, "", base) }
  base == name && index($1, sel) { if (!found || $2 > max) max = $2; found = 1 }
  END { if (found) printf "%.4f\n", max; else print "absent" }' "$work/peak")
ioctls=$(v after ebpf_gpu_ioctl_latency_microseconds_count)
nvml_mem=$(v peak gpufeed_nvml_process_memory_bytes)
nvml_sm=$(v peak gpufeed_nvml_process_sm_utilization_ratio)
own_duty=$(awk -v k="$own_kernel_ns" -v w="$duty_window" 'BEGIN { printf "%.4f\n", k / (w * 1e9) }')
sync_sum_ns=$(awk -v u="$sync_sum" 'BEGIN { if (u == "absent") print u; else printf "%.0f\n", u * 1e3 }')

{
  echo "# GPU check"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), GPU: $gpu_name; agent: $("$agent" --version 2>/dev/null || echo "$agent")."
  echo "The program (scripts/gpu-check.c) ran in pod \`$uid\`; driver-time uprobes on it: $driver_probed."
  echo
  echo "| what | the program's own count | gpufeed | | NVML |"
  echo "|---|---|---|---|---|"
  echo "| VRAM held at peak (bytes) | $own_vram_bytes | $vram_peak (\`ebpf_gpu_vram_reserved_bytes\`) | $(same "$vram_peak" "$own_vram_bytes") | $nvml_mem (\`gpufeed_nvml_process_memory_bytes\`; includes the context) |"
  echo "| VRAM after the frees (bytes) | 0 | $(v freed ebpf_gpu_vram_reserved_bytes) | $(same "$(v freed ebpf_gpu_vram_reserved_bytes)" 0) | $(v freed gpufeed_nvml_process_memory_bytes) |"
  echo "| host-to-device bytes | $own_h2d_bytes | $h2d (\`ebpf_gpu_pcie_bytes_total{direction=\"h2d\"}\`) | $(same "$h2d" "$own_h2d_bytes") | |"
  echo "| device-to-host bytes | $own_d2h_bytes | $d2h | $(same "$d2h" "$own_d2h_bytes") | |"
  echo "| kernel launches | $own_launches | $launches (\`ebpf_gpu_kernel_launches_total\`) | $(same "$launches" "$own_launches") | |"
  echo "| synchronisation calls | $own_sync_calls | $sync_count (\`ebpf_gpu_sync_wait_microseconds_count\`) | $(same "$sync_count" "$own_sync_calls") | |"
  echo "| time blocked in them (ns) | $own_sync_wait_ns | $sync_sum_ns (\`_sum\`) | $(within "$sync_sum_ns" "$own_sync_wait_ns") | |"
  echo "| first launch → last synchronisation (ns) | $own_launch_to_done_ns | $busy (\`ebpf_gpu_busy_estimate_seconds_total\`) | $(within "$busy" "$own_launch_to_done_ns") | SM $nvml_sm (\`gpufeed_nvml_process_sm_utilization_ratio\` at peak) |"
  echo "| GPU compute time (ns) | $own_kernel_ns (kernel time asked for) | $compute (\`ebpf_gpu_compute_time_seconds_total\`, source $source) | $(within "$compute" "$own_kernel_ns") | |"
  echo "| duty cycle at peak (${duty_window} s window) | $own_duty (kernel time ÷ window) | $duty (\`ebpf_gpu_active_compute_duty_cycle\`) | $(within "$duty" "$own_duty") | SM $nvml_sm |"
  echo "| time in driver ioctls (ns) | | $driver (\`ebpf_gpu_driver_time_seconds_total\`), $ioctls calls | | |"
  echo
  echo "GPU capacity by NVML: memory $(value "$work/peak" gpufeed_gpu_memory_total_bytes 'gpu="0"') bytes, link $(value "$work/peak" gpufeed_gpu_link_max_bytes_per_second 'gpu="0"') bytes/s per direction (GPU 0)."
} >"$out"
say "report written to $out"
