#!/usr/bin/env bash
# Installs the system packages gpufeed needs to build and test on Debian/Ubuntu.
# Idempotent: does nothing (and asks no mirror) when everything is there.
set -euo pipefail

packages=(
  # building the BPF programs (libbpf-cargo: clang; libbpf-sys: libelf, zlib)
  clang llvm libelf-dev zlib1g-dev pkg-config build-essential
  # tests: namespaces, veth, bridges, qdiscs, traffic, counters, a real Prometheus
  iproute2 iperf3 prometheus util-linux procps curl
  # host agent packaging checks
  dpkg-dev systemd
  # the incident page, rendered in a real browser by the tests
  chromium
  # the container image (scripts/build-image.sh) and the DaemonSet run by a real runtime
  # (runc: Debian's crun refuses hybrid cgroup hosts)
  buildah podman runc
)

if [ "$(id -u)" -ne 0 ]; then
  echo "setup.sh: run as root (installs packages with apt-get)" >&2
  exit 1
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  for c in "$HOME/.cargo/bin/cargo" /root/.cargo/bin/cargo; do
    [ -x "$c" ] && export PATH="$(dirname "$c"):$PATH" && break
  done
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup.sh: no Rust toolchain found; install one with rustup (Rust >= 1.85)" >&2
  exit 1
fi

# The kernel interfaces the agents use.
[ -e /sys/kernel/btf/vmlinux ] || echo "setup.sh: warning: no /sys/kernel/btf/vmlinux; the guest probes need a BTF kernel" >&2
mountpoint -q /sys/kernel/tracing 2>/dev/null || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
