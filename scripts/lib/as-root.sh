# Sourced by the scripts that need root (they load BPF programs, make cgroups and namespaces,
# install packages). `as_root "$@"` at the top of such a script:
#   * as root (a root shell on a fresh server, a container, CI): does nothing;
#   * otherwise, with sudo: runs the script again through sudo (with the same arguments, and
#     CI and the GPUFEED_* settings kept), so `./scripts/x.sh` works either way;
#   * otherwise: says how to run it as root and exits 1.
# Source this before the script changes directory: the script's absolute path is taken here.

AS_ROOT_SELF=$(readlink -f "$0")

as_root() {
  [ "$(id -u)" -eq 0 ] && return 0
  local self=$AS_ROOT_SELF name keep
  name=$(basename "$0")
  if command -v sudo >/dev/null 2>&1; then
    keep=$(env | sed -n 's/^\(CI\|GPUFEED_[A-Za-z0-9_]*\)=.*/\1/p' | paste -sd, -)
    echo "$name: needs root; running it through sudo" >&2
    if [ -n "$keep" ]; then
      exec sudo --preserve-env="$keep" -- "$self" "$@"
    fi
    exec sudo -- "$self" "$@"
  fi
  echo "$name: needs root, and this machine has no sudo: run it from a root shell (su -, or su -c '$self')" >&2
  exit 1
}
