#!/usr/bin/env bash
# Builds the gpufeed-guest container image that the DaemonSet in talos/kubernetes/ runs, with
# buildah and no base image: the binary at /usr/local/bin/gpufeed-guest, the shared libraries it links
# (libelf, zlib, libgcc_s, libc, the loader) and nothing else. No registry is contacted.
#
#   scripts/build-image.sh                       release build, image gpufeed-guest:<version>
#   scripts/build-image.sh --binary PATH         package another build (the tests use debug)
#   scripts/build-image.sh --tag NAME:TAG        another image name
#   scripts/build-image.sh --archive FILE        also write an OCI archive (for `skopeo copy
#                                                oci-archive:FILE docker://REGISTRY/...`)
#   scripts/build-image.sh --talos-extension     build the Talos system extension instead:
#                                                /manifest.yaml, and under /rootfs the service
#                                                definition (talos/extension-service.yaml) and
#                                                its container root with the same files
#
# The image lands in the local containers storage (podman/buildah, /var/lib/containers).
set -euo pipefail
# buildah writes the root's containers storage
. "$(dirname "$0")/lib/as-root.sh"
as_root "$@"
# Modes of what this writes do not depend on the caller's umask (no group/world write).
umask 022
cd "$(dirname "$0")/.."

binary=""
tag=""
archive=""
extension=false
while [ $# -gt 0 ]; do
    case "$1" in
        --binary) binary="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --archive) archive="$2"; shift 2 ;;
        --talos-extension) extension=true; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "build-image: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

command -v buildah >/dev/null || {
    echo "build-image: buildah is not installed (apt-get install buildah)" >&2
    exit 1
}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
if $extension; then
    tag=${tag:-gpufeed-guest-extension:$version}
else
    tag=${tag:-gpufeed-guest:$version}
fi
if [ -z "$binary" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
    cargo build --release -p gpufeed-guest
    binary="${CARGO_TARGET_DIR:-target}/release/gpufeed-guest"
fi
[ -x "$binary" ] || { echo "build-image: no executable at $binary" >&2; exit 1; }

ctr=$(buildah from scratch)
cleanup() {
    buildah umount "$ctr" >/dev/null 2>&1 || true
    buildah rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT
root=$(buildah mount "$ctr")

# The agent's container root at $1: the binary, the loader and every library ldd resolves (at
# the same paths as on the build machine), and the directories the mounts land on, which a
# read-only root cannot have created for it.
container_root() {
    install -D -m 0755 "$binary" "$1/usr/local/bin/gpufeed-guest"
    # Without DWARF (the release profile keeps it for perf): a fifth of the size. Symbols
    # stay, so backtraces still name functions.
    strip --strip-debug "$1/usr/local/bin/gpufeed-guest"
    for lib in $(ldd "$binary" | grep -o '/[^ )]*'); do
        install -D -m 0755 "$(readlink -f "$lib")" "$1$lib"
    done
    # mount points of the service's mounts (a read-only root cannot make them at start):
    # /host/usr/local is the host's, for the NVIDIA extensions' NVML
    mkdir -p "$1/var/lib/gpufeed" "$1/etc/gpufeed/tls" "$1/host/sys/fs/cgroup" \
        "$1/host/usr/local" "$1/sys" "$1/proc" "$1/dev" "$1/tmp"
    # The agent runs as root on a read-only root and writes nothing to /tmp; a world-writable
    # directory would only be a hazard, and Talos refuses extensions that contain one.
    chmod 0755 "$1/tmp"
}

if $extension; then
    # Talos system extension: the service definition is read from
    # /usr/local/etc/containers/<name>.yaml and its root is /usr/local/lib/containers/<name>.
    name=$(sed -n 's/^name: *//p' talos/extension-service.yaml)
    install -D -m 0644 talos/extension-service.yaml "$root/rootfs/usr/local/etc/containers/$name.yaml"
    container_root "$root/rootfs/usr/local/lib/containers/$name"
    cat > "$root/manifest.yaml" <<EOF
version: v1alpha1
metadata:
  name: $name
  version: "$version"
  author: gpufeed
  description: |
    gpufeed guest agent as an extension service: per-pod eBPF probes and the host event hub.
  compatibility:
    talos:
      # ExtensionServiceConfig (the TLS files) and the configuration dependency
      version: ">= v1.7.0"
EOF
else
    container_root "$root"
fi

if $extension; then
    buildah config \
        --label org.opencontainers.image.title=gpufeed-guest-extension \
        --label org.opencontainers.image.version="$version" \
        "$ctr"
else
    buildah config \
        --entrypoint '["/usr/local/bin/gpufeed-guest"]' \
        --cmd run \
        --port 9745/tcp --port 7845/udp \
        --label org.opencontainers.image.title=gpufeed-guest \
        --label org.opencontainers.image.version="$version" \
        --label org.opencontainers.image.description="gpufeed guest agent: per-pod eBPF probes and the host event hub" \
        "$ctr"
fi
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
trap - EXIT
echo "build-image: $tag ($(podman image inspect --format '{{.Size}}' "$tag" 2>/dev/null | numfmt --to=iec 2>/dev/null || echo '?'))"
if [ -n "$archive" ]; then
    mkdir -p "$(dirname "$archive")"
    rm -f "$archive"
    buildah push --quiet "$tag" "oci-archive:$archive:$tag"
    echo "build-image: wrote $archive"
fi
