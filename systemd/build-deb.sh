#!/bin/sh
# Build the gpufeed-host Debian package with dpkg-deb.
#   systemd/build-deb.sh [--binary PATH] [--out DIR]
# Without --binary it runs `cargo build --release -p gpufeed-host`.
# Contents: /usr/bin/gpufeed-host, /lib/systemd/system/gpufeed-host.service,
# /etc/gpufeed/host.toml (conffile), /usr/share/doc/gpufeed-host/host-agent.md.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
bin=""
out="$repo/target/debian"
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) bin=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: $0 [--binary PATH] [--out DIR]" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  (cd "$repo" && cargo build --release -p gpufeed-host)
  bin="${CARGO_TARGET_DIR:-$repo/target}/release/gpufeed-host"
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1)
arch=$(dpkg --print-architecture)
stage=$(mktemp -d)
chmod 0755 "$stage"
trap 'rm -rf "$stage"' EXIT
install -D -m 0755 "$bin" "$stage/usr/bin/gpufeed-host"
install -D -m 0644 "$here/gpufeed-host.service" "$stage/lib/systemd/system/gpufeed-host.service"
install -D -m 0644 "$here/host.toml" "$stage/etc/gpufeed/host.toml"
if [ -f "$repo/docs/host-agent.md" ]; then
  install -D -m 0644 "$repo/docs/host-agent.md" "$stage/usr/share/doc/gpufeed-host/host-agent.md"
fi
mkdir -p "$stage/DEBIAN"
printf '/etc/gpufeed/host.toml\n' > "$stage/DEBIAN/conffiles"
cat > "$stage/DEBIAN/control" <<CTL
Package: gpufeed-host
Version: $version
Section: admin
Priority: optional
Architecture: $arch
Maintainer: gpufeed maintainers <gpufeed@localhost>
Depends: libc6, systemd
Description: gpufeed host agent for Proxmox VE GPU nodes
 Watches PCIe/Thunderbolt links, AER counters, vmbr bridge traffic and VM
 state of a Proxmox VE host and serves them on a host-local /metrics.
CTL
cat > "$stage/DEBIAN/postinst" <<'PI'
#!/bin/sh
set -e
if [ "$1" = configure ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
PI
cat > "$stage/DEBIAN/prerm" <<'PR'
#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
  systemctl stop gpufeed-host.service || true
fi
PR
cat > "$stage/DEBIAN/postrm" <<'PO'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
PO
chmod 0755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/prerm" "$stage/DEBIAN/postrm"
mkdir -p "$out"
deb="$out/gpufeed-host_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Z"${DEB_COMPRESSOR:-xz}" --build "$stage" "$deb" >/dev/null
echo "$deb"
