#!/usr/bin/env bash
# Builds the gpufeed-guest container image that talos/gpufeed-guest.yaml runs, with buildah and
# no base image: the binary at /usr/local/bin/gpufeed-guest, the shared libraries it links
# (libelf, zlib, libgcc_s, libc, the loader) and nothing else. No registry is contacted.
#
#   scripts/build-image.sh                       release build, image gpufeed-guest:<version>
#   scripts/build-image.sh --binary PATH         package another build (the tests use debug)
#   scripts/build-image.sh --tag NAME:TAG        another image name
#   scripts/build-image.sh --archive FILE        also write an OCI archive (for `skopeo copy
#                                                oci-archive:FILE docker://REGISTRY/...`)
#
# The image lands in the local containers storage (podman/buildah, /var/lib/containers).
set -euo pipefail
cd "$(dirname "$0")/.."

binary=""
tag=""
archive=""
while [ $# -gt 0 ]; do
    case "$1" in
        --binary) binary="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --archive) archive="$2"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "build-image: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

command -v buildah >/dev/null || {
    echo "build-image: buildah is not installed (apt-get install buildah)" >&2
    exit 1
}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
tag=${tag:-gpufeed-guest:$version}
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

install -D -m 0755 "$binary" "$root/usr/local/bin/gpufeed-guest"
# The loader and every library ldd resolves, at the same paths as on the build machine.
for lib in $(ldd "$binary" | grep -o '/[^ )]*'); do
    install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
done
# The agent writes its event journal under /var/lib/gpufeed (a volume in the DaemonSet) and
# nothing else: the root filesystem can be read-only.
mkdir -p "$root/var/lib/gpufeed" "$root/etc/gpufeed/tls" "$root/tmp"
chmod 1777 "$root/tmp"

buildah config \
    --entrypoint '["/usr/local/bin/gpufeed-guest"]' \
    --cmd run \
    --port 9745/tcp --port 7845/udp \
    --label org.opencontainers.image.title=gpufeed-guest \
    --label org.opencontainers.image.version="$version" \
    --label org.opencontainers.image.description="gpufeed guest agent: per-pod eBPF probes and the host event hub" \
    "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
trap - EXIT
echo "build-image: $tag ($(du -sh "$binary" | cut -f1) binary)"
if [ -n "$archive" ]; then
    mkdir -p "$(dirname "$archive")"
    rm -f "$archive"
    buildah push --quiet "$tag" "oci-archive:$archive:$tag"
    echo "build-image: wrote $archive"
fi
