#!/usr/bin/env bash
# The whole system on this machine: installs what is needed, builds, and runs
#   * the host agent on this machine's real /sys, kernel log and bridges,
#   * the guest agent with its real eBPF probes for every cgroup here,
#   * the QUIC stream between them on loopback (certificates made into the state directory),
#   * a Prometheus on loopback scraping both.
# Ctrl-C stops everything. Options:
#   --state DIR   keep certificates, spool and journal in DIR (default: a fresh temp dir,
#                 removed at exit)
#   --demo        also run a second, simulated host agent on a recorded Thunderbolt eGPU tree
#                 whose link drops to 2.5 GT/s x1 for 30 s every minute, and a small workload in
#                 a pod-shaped cgroup that is starved of CPU while the link is down: within two
#                 minutes the page at / shows the link drop joined to that pod. Everything the
#                 demo simulates is labelled simulated on the page, in /events and in the log.
#   --dev         a debug build instead of the release build (builds faster, runs slower)
#   --check       start everything, wait until the guest has the host stream connected and
#                 Prometheus has scraped both agents, print the URLs, stop (for tests and CI)
set -euo pipefail
. "$(dirname "$0")/lib/as-root.sh"
args=("$@")

state=""
check=0
demo=0
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --state) state="$2"; shift 2 ;;
    --check) check=1; shift ;;
    --demo) demo=1; shift ;;
    --dev) profile=dev; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "quickstart.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
# the probes need CAP_BPF and CAP_PERFMON: root, or this script again through sudo
as_root "${args[@]}"
cd "$(dirname "$0")/.."

./scripts/setup.sh
export PATH="$HOME/.cargo/bin:/root/.cargo/bin:$PATH"
echo "quickstart: building the $profile binaries (a few minutes the first time)"
cargo build --profile "$profile" -p gpufeed-guest -p gpufeed-host

guest_metrics=${GPUFEED_GUEST_METRICS:-127.0.0.1:9745}
host_metrics=${GPUFEED_HOST_METRICS:-127.0.0.1:9847}
quic=${GPUFEED_QUIC:-127.0.0.1:7845}
prom=${GPUFEED_PROMETHEUS:-127.0.0.1:9090}
keep_state=1
if [ -z "$state" ]; then
  state=$(mktemp -d /tmp/gpufeed-quickstart.XXXXXX)
  keep_state=0
fi
mkdir -p "$state"
pids=()
demo_pod=""
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ -n "$demo_pod" ]; then
    ./scripts/demo-egpu.sh stop "$demo_pod"
    # the pod's parents, up to the demo's own top-level cgroup
    d=$(dirname "$demo_pod")
    for _ in 1 2 3; do rmdir "$d" 2>/dev/null || true; d=$(dirname "$d"); done
  fi
  wait 2>/dev/null || true
  [ "$keep_state" = 1 ] || rm -rf "$state"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bin=./target/$([ "$profile" = dev ] && echo debug || echo release)
host=$(hostname)
demo_host=demo-egpu
if [ ! -f "$state/certs/ca/ca.pem" ]; then
  "$bin/gpufeed-guest" certs init --out "$state/certs" --guest-addr "$quic" --host "$host" \
    --host "$demo_host" >/dev/null
fi
# A generated host bundle's configuration (laid out for /etc/gpufeed) as it would be installed,
# but pointed at the bundle where it lies, its spool at SPOOL ("": memory only).
bundle_config() { # HOST SPOOL
  local bundle="$state/certs/hosts/$1"
  sed -e "s#^spool_dir = .*#spool_dir = \"$2\"#" -e "s#/etc/gpufeed/#$bundle/#" "$bundle/host.toml"
}
{
  echo "metrics_listen = \"$host_metrics\""
  bundle_config "$host" "$state/spool"
} >"$state/host.toml"

"$bin/gpufeed-host" run --config "$state/host.toml" >"$state/host.log" 2>&1 &
pids+=($!)
"$bin/gpufeed-guest" run --metrics-listen "$guest_metrics" --quic-listen "$quic" \
  --tls-dir "$state/certs/guest" --event-journal "$state/journal.jsonl" --no-kube \
  --simulated-host "$demo_host" >"$state/guest.log" 2>&1 &
pids+=($!)

if [ "$demo" = 1 ]; then
  # The simulated host: the recorded eGPU tree as its root, nothing of this machine's own.
  ./scripts/demo-egpu.sh tree "$state/demo-root"
  # Its bundle's configuration, with a link poll fast enough to see the demo's steps and none
  # of the watchers that would read this machine's bridges, load or Thunderbolt events.
  {
    echo "root = \"$state/demo-root\""
    echo 'metrics_listen = "127.0.0.1:9848"'
    echo 'devices = ["0000:0a:00.0"]'
    bundle_config "$demo_host" ""
    printf '%s\n' '[pcie]' 'poll_interval_ms = 200' '[bridge]' 'enabled = false' \
      '[host]' 'enabled = false' '[thunderbolt]' 'uevents = false'
  } >"$state/demo-host.toml"
  "$bin/gpufeed-host" run --config "$state/demo-host.toml" >"$state/demo-host.log" 2>&1 &
  pids+=($!)
  cg=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/self/mounts)
  demo_pod="$cg/gpufeed-demo/kubepods/burstable/pod00000000-0000-4000-8000-00000000de70"
  ./scripts/demo-egpu.sh cycle "$state/demo-root" 60 "$demo_pod" >"$state/demo.log" 2>&1 &
  pids+=($!)
fi

cat >"$state/prometheus.yml" <<YAML
global: { scrape_interval: 5s, evaluation_interval: 5s }
scrape_configs:
  - job_name: gpufeed-guest
    honor_labels: true
    static_configs: [ { targets: ['$guest_metrics'] } ]
  - job_name: gpufeed-host
    static_configs: [ { targets: ['$host_metrics'] } ]
YAML
prometheus --config.file="$state/prometheus.yml" --storage.tsdb.path="$state/prometheus" \
  --web.listen-address="$prom" >"$state/prometheus.log" 2>&1 &
pids+=($!)

# Wait for a value in a /metrics text, for up to $3 seconds.
wait_metric() {
  local url=$1 pattern=$2 secs=$3
  for _ in $(seq "$secs"); do
    if curl -fsS "$url" 2>/dev/null | grep -qE "$pattern"; then return 0; fi
    for p in "${pids[@]}"; do
      if ! kill -0 "$p" 2>/dev/null; then
        echo "quickstart: a process exited early; logs in $state:" >&2
        tail -n 20 "$state"/*.log >&2
        return 1
      fi
    done
    sleep 1
  done
  echo "quickstart: timed out waiting for $pattern at $url" >&2
  tail -n 20 "$state"/*.log >&2
  return 1
}
wait_metric "http://$guest_metrics/metrics" '^gpufeed_probe_up\{probe="sched_latency"\} 1' 60
wait_metric "http://$guest_metrics/metrics" "^gpufeed_stream_connected\\{[^}]*host=\"$host\"[^}]*\\} 1" 60
# `certs init` names the guest in host.toml by its address's host part
wait_metric "http://$host_metrics/metrics" "^gpufeed_host_stream_connected\\{[^}]*guest=\"${quic%:*}\"[^}]*\\} 1" 30

cat <<MSG
gpufeed on this machine (state and logs in $state)
  incident page http://$guest_metrics/   (the same as text: $bin/gpufeed-guest explain)
  host events   http://$guest_metrics/events
  guest agent   http://$guest_metrics/metrics
  host agent    http://$host_metrics/metrics   (events live: $bin/gpufeed-host watch --config $state/host.toml)
  host → guest  QUIC with mutual TLS on $quic
  Prometheus    http://$prom/   (try: histogram_quantile(0.99, rate(ebpf_sched_latency_microseconds_bucket[5m])))
MSG

if [ "$check" = 1 ]; then
  for _ in $(seq 60); do
    if curl -fsS "http://$prom/api/v1/query?query=up" 2>/dev/null | grep -q '"gpufeed-host"' &&
       [ "$(curl -fsS "http://$prom/api/v1/query?query=sum(up)" | grep -o '"[0-9]*"]' | tr -dc 0-9)" = 2 ]; then
      echo "quickstart: check passed (both agents up in Prometheus, host stream connected)"
      exit 0
    fi
    sleep 1
  done
  echo "quickstart: Prometheus did not scrape both agents" >&2
  exit 1
fi
if [ "$demo" = 1 ]; then
  echo "demo: the simulated host $demo_host drops its GPU link every minute (log: $state/demo.log);"
  echo "      the pod 00000000-0000-4000-8000-00000000de70 is starved meanwhile: watch http://$guest_metrics/"
fi
echo "Ctrl-C stops everything."
wait -n "${pids[@]}"
echo "quickstart: a process exited; logs in $state" >&2
exit 1
