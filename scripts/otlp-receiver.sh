#!/usr/bin/env bash
# Fetches a real OTLP metrics receiver for the OTLP push tests: VictoriaMetrics from Debian 13
# (trixie's `victoria-metrics`, 1.112), whose `/opentelemetry/v1/metrics` takes OTLP over HTTP
# (protobuf) and whose `/api/v1/query` answers PromQL as Prometheus does (bookworm's 1.79 has no
# OTLP). Debian's Prometheus cannot be the receiver: its packages (2.42 in bookworm, 2.53 in
# trixie, 3.5 in unstable) are all built with the OTLP endpoint disabled.
#
# A scratch apt of our own (its sources, lists, status and archives under DIR; the machine's
# apt configuration untouched, as the VM lab does) downloads the .deb, and the one binary is
# unpacked from it: DIR/bin/victoria-metrics (glibc >= 2.34 and libzstd, both in Debian 12).
#
#   scripts/otlp-receiver.sh [DIR]   (default: target/tmp/otlp-receiver, where the tests look)
#
# Idempotent: nothing is fetched when DIR holds the binary. Needs apt-get, dpkg-deb and
# deb.debian.org. Prints the binary's path.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
dir=${1:-$repo/target/tmp/otlp-receiver}
suite=trixie
package=victoria-metrics
bin="$dir/bin/victoria-metrics"

if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
command -v apt-get >/dev/null || { echo "otlp-receiver: apt-get is needed (Debian or Ubuntu)" >&2; exit 1; }
mkdir -p "$dir/apt/lists/partial" "$dir/apt/archives/partial" "$dir/apt/etc" "$dir/bin"
# test binaries running side by side may call this at once: one fetches, the others wait for it
exec 9>"$dir/.lock"
flock 9
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
echo "deb http://deb.debian.org/debian $suite main" >"$dir/apt/etc/sources.list"
[ -e "$dir/apt/etc/status" ] || : >"$dir/apt/etc/status"
opts=(
  -o "Dir::Etc::sourcelist=$dir/apt/etc/sources.list" -o "Dir::Etc::sourceparts=-"
  -o "Dir::State::Lists=$dir/apt/lists" -o "Dir::State::status=$dir/apt/etc/status"
  -o "Dir::Cache=$dir/apt" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root"
  -o "Acquire::Languages=none"
)
echo "otlp-receiver: fetching $suite's $package into $dir" >&2
apt-get "${opts[@]}" update -q >&2 || { echo "otlp-receiver: apt-get update of $suite failed (deb.debian.org reachable? debian-archive-keyring installed?)" >&2; exit 1; }
(cd "$dir/apt/archives" && apt-get "${opts[@]}" download -q "$package" >&2) \
  || { echo "otlp-receiver: $suite has no $package package" >&2; exit 1; }
deb=$(ls "$dir"/apt/archives/${package}_*.deb | head -1)
# only the one binary (the package's 226 MB hold eight); a rename: a test beside us never sees half of it
dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/bin/victoria-metrics >"$dir/bin/.victoria-metrics.new"
chmod 755 "$dir/bin/.victoria-metrics.new"
mv -f "$dir/bin/.victoria-metrics.new" "$bin"
echo "otlp-receiver: $(basename "$deb")" >&2
rm -f "$dir"/apt/archives/*.deb
echo "$bin"
