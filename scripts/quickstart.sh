#!/usr/bin/env bash
# Sets everything up on this machine and runs the local stack: the guest agent
# (probes for every cgroup here) and a Prometheus on loopback that scrapes it.
# Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:/root/.cargo/bin:$PATH"
cargo build --release -p gpufeed-guest

metrics=127.0.0.1:9745
prom=127.0.0.1:9090
state=$(mktemp -d /tmp/gpufeed-local.XXXXXX)
cat > "$state/prometheus.yml" <<YAML
global: { scrape_interval: 5s }
scrape_configs:
  - job_name: gpufeed-guest
    static_configs: [ { targets: ['$metrics'] } ]
YAML
prometheus --config.file="$state/prometheus.yml" --storage.tsdb.path="$state/data" \
  --web.listen-address="$prom" >"$state/prometheus.log" 2>&1 &
prom_pid=$!
trap 'kill $prom_pid 2>/dev/null; rm -rf "$state"' EXIT

cat <<MSG
gpufeed local stack
  guest agent metrics  http://$metrics/metrics
  Prometheus           http://$prom/  (try: histogram_quantile(0.99, rate(ebpf_sched_latency_microseconds_bucket[5m])))
MSG
./target/release/gpufeed-guest run --metrics-listen "$metrics" "$@"
