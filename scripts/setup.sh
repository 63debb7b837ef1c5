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
)

# installs packages with apt-get
. "$(dirname "$0")/lib/as-root.sh"
as_root "$@"

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

# The upstream schemas the manifest tests validate against (npm and PyPI packages, pinned in
# guest-agent/tests/schemas/); the tests install them on first use too.
if command -v npm >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1; then
  "$(dirname "$0")/schema-tools.sh"
else
  echo "setup.sh: warning: npm and python3 are needed for the manifest schema tests" >&2
fi
