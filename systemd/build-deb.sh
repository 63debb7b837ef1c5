#!/bin/sh
# Build the gpufeed-host Debian package with dpkg-deb (the one packaging definition).
#   systemd/build-deb.sh [--binary PATH] [--out DIR] [--version VERSION]
# Without --binary it runs `cargo build --release -p gpufeed-host`. --version overrides the
# workspace version (the upgrade test builds a newer package with it).
# Contents: /usr/bin/gpufeed-host, /usr/lib/systemd/system/gpufeed-host.service,
# /etc/gpufeed/host.toml (conffile, every default commented out),
# /usr/share/doc/gpufeed-host/{copyright,changelog.Debian.gz,host-agent.md,install.md}.
# Needs dpkg-dev (dpkg-shlibdeps computes the library dependencies).
set -eu
umask 022
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
bin=""
out="$repo/target/debian"
version=""
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) bin=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    *) echo "usage: $0 [--binary PATH] [--out DIR] [--version VERSION]" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  (cd "$repo" && cargo build --release -p gpufeed-host)
  bin="${CARGO_TARGET_DIR:-$repo/target}/release/gpufeed-host"
fi
[ -n "$version" ] || version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1)
arch=$(dpkg --print-architecture)
maintainer="gpufeed maintainers <gpufeed@localhost>"
# Reproducible dates: the last commit's, else now.
epoch=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)}
stage=$(mktemp -d)
chmod 0755 "$stage"
trap 'rm -rf "$stage"' EXIT
doc="$stage/usr/share/doc/gpufeed-host"
install -D -m 0755 "$bin" "$stage/usr/bin/gpufeed-host"
# /usr/lib/systemd/system: where Debian 13 (Proxmox VE 9) installs units; on merged-/usr
# Debian 12 (Proxmox VE 8) it is the same directory as /lib/systemd/system.
install -D -m 0644 "$here/gpufeed-host.service" "$stage/usr/lib/systemd/system/gpufeed-host.service"
install -D -m 0644 "$here/host.toml" "$stage/etc/gpufeed/host.toml"
install -D -m 0644 "$here/copyright" "$doc/copyright"
for d in host-agent.md install.md; do
  if [ -f "$repo/docs/$d" ]; then
    install -D -m 0644 "$repo/docs/$d" "$doc/$d"
  fi
done
# A Debian changelog entry for this version (Debian policy: changelog.Debian.gz).
cat > "$doc/changelog.Debian" <<CL
gpufeed-host ($version) unstable; urgency=medium

  * gpufeed-host $version, built from the gpufeed repository (see its history).

 -- $maintainer  $(date -u -R -d "@$epoch")
CL
gzip -9n "$doc/changelog.Debian"

# Library dependencies as dpkg-shlibdeps computes them from the binary (it wants a
# debian/control to exist; nothing else from a source package is needed).
shl=$(mktemp -d)
mkdir "$shl/debian"
printf 'Source: gpufeed\n\nPackage: gpufeed-host\nArchitecture: any\n' > "$shl/debian/control"
libdeps=$(cd "$shl" && dpkg-shlibdeps -O "$stage/usr/bin/gpufeed-host" 2>/dev/null \
  | sed -n 's/^shlibs:Depends=//p')
rm -rf "$shl"
[ -n "$libdeps" ] || { echo "build-deb: dpkg-shlibdeps found no dependencies" >&2; exit 1; }

mkdir -p "$stage/DEBIAN"
printf '/etc/gpufeed/host.toml\n' > "$stage/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat > "$stage/DEBIAN/control" <<CTL
Package: gpufeed-host
Version: $version
Section: admin
Priority: optional
Architecture: $arch
Maintainer: $maintainer
Installed-Size: $size
Depends: $libdeps, systemd
Description: gpufeed host agent for Proxmox VE GPU nodes
 Watches PCIe/Thunderbolt links, AER counters, vmbr bridge traffic and VM
 state of a Proxmox VE host, serves them on a host-local /metrics and
 streams them to the guest agents.
CTL
# Maintainer scripts. systemctl enable/disable only edit symlinks and work without a running
# systemd (a chroot, an image build); start/stop/restart need one (/run/systemd/system).
cat > "$stage/DEBIAN/postinst" <<'PI'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
  # $2 is the version configured before; empty on a first install.
  if [ -z "$2" ]; then
    systemctl enable gpufeed-host.service
  fi
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    if [ -z "$2" ]; then
      systemctl start gpufeed-host.service || echo "gpufeed-host: start failed, see journalctl -u gpufeed-host" >&2
    else
      # The new binary replaces the running one (a service the admin stopped stays stopped).
      systemctl try-restart gpufeed-host.service || echo "gpufeed-host: restart failed, see journalctl -u gpufeed-host" >&2
    fi
  fi
fi
PI
cat > "$stage/DEBIAN/prerm" <<'PR'
#!/bin/sh
set -e
# Only on removal: an upgrade restarts the service in postinst instead.
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
  systemctl stop gpufeed-host.service || true
fi
PR
cat > "$stage/DEBIAN/postrm" <<'PO'
#!/bin/sh
set -e
if [ "$1" = purge ]; then
  systemctl disable gpufeed-host.service || true
  # The stream's spool holds events not yet acknowledged by a guest; purge drops it unless
  # asked to keep it:  GPUFEED_KEEP_SPOOL=1 apt purge gpufeed-host
  if [ "${GPUFEED_KEEP_SPOOL:-0}" != 1 ]; then
    rm -rf /var/lib/gpufeed
  fi
fi
# On upgrade the new package's postinst reloads.
if { [ "$1" = remove ] || [ "$1" = purge ]; } && [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
PO
chmod 0755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/prerm" "$stage/DEBIAN/postrm"
mkdir -p "$out"
deb="$out/gpufeed-host_${version}_${arch}.deb"
SOURCE_DATE_EPOCH=$epoch dpkg-deb --root-owner-group -Z"${DEB_COMPRESSOR:-xz}" --build "$stage" "$deb" >/dev/null
echo "$deb"
