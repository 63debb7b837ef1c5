"""Helm v4's own library (PyPI's helm-python-sdk: Helm's Go SDK over a C ABI) on a chart, for
the tests; no cluster is contacted:

    python helm_chart.py lint CHART [VALUES.yaml...]
    python helm_chart.py template CHART NAME NAMESPACE [--is-upgrade] [VALUES.yaml...] [--set K=V...] [--set-file K=PATH...]
    python helm_chart.py cli 'helm install|upgrade|template NAME CHART [flags]'
    python helm_chart.py package CHART DESTINATION

CHART is a chart directory or a packaged chart (.tgz). `package` answers {"archive": path}.

Values files and --set/--set-file expressions merge in order, as `helm template -f ... --set ...`
does. `lint` answers a JSON object (Helm's lint report); `template` checks the merged values
against the chart's values.schema.json as `helm install` does, renders, and answers a JSON
object: {"manifests": {template path: text}} or {"error": Helm's message}. `cli` takes a helm
command line as a document shows it (shell quoting, paths relative to the working directory)
and does what it asks of the chart: its values files, --set and --set-file, release name and
namespace, as `template` does; a flag it does not know is an error, so a document cannot use
one untested.
"""

import json
import shlex
import sys

import helm_python as helm


def deep_merge(base, over):
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_merge(base[k], v)
        else:
            base[k] = v
    return base


def user_values(args):
    values = {}
    rest = []
    it = iter(args)
    for a in it:
        if a == "--set":
            deep_merge(values, helm.parse_set_string(next(it)))
        elif a == "--set-file":
            deep_merge(values, helm.parse_set_file(next(it)))
        elif a == "--is-upgrade":
            rest.append(a)
        else:
            with open(a, encoding="utf-8") as f:
                deep_merge(values, helm.values_from_yaml(f.read()) or {})
    return values, rest


def load(chart):
    if chart.endswith(".tgz"):
        with open(chart, "rb") as f:
            return helm.Chart.load_archive(f.read())
    return helm.Chart.load(chart)


def render(chart, name, namespace, values, upgrade):
    try:
        with load(chart) as c:
            c.validate_schema(c.merge_values(values))
            out = c.render(
                values,
                name=name,
                namespace=namespace,
                revision=2 if upgrade else 1,
                is_install=not upgrade,
                is_upgrade=upgrade,
            )
    except helm.HelmError as e:
        return {"error": str(e)}
    return {"manifests": out}


# flags of `helm install/upgrade/template` that change nothing in what is rendered
NO_RENDER_EFFECT = {"--wait", "--atomic", "--install", "--debug"}


def cli(line):
    words = shlex.split(line)
    if words[:1] != ["helm"] or len(words) < 2 or words[1] not in ("install", "upgrade", "template"):
        return {"error": f"not a helm install/upgrade/template command: {line}"}
    upgrade = words[1] == "upgrade"
    positional, values, namespace = [], {}, "default"
    it = iter(words[2:])
    for w in it:
        if w in ("-n", "--namespace"):
            namespace = next(it)
        elif w in ("-f", "--values"):
            with open(next(it), encoding="utf-8") as f:
                deep_merge(values, helm.values_from_yaml(f.read()) or {})
        elif w == "--set":
            deep_merge(values, helm.parse_set_string(next(it)))
        elif w == "--set-file":
            deep_merge(values, helm.parse_set_file(next(it)))
        elif w in NO_RENDER_EFFECT:
            pass
        elif w.startswith("-"):
            return {"error": f"a flag this check does not know: {w}"}
        else:
            positional.append(w)
    if len(positional) != 2:
        return {"error": f"expected NAME CHART, got {positional}"}
    name, chart = positional
    return render(chart, name, namespace, values, upgrade)


def main():
    if sys.argv[1] == "cli":
        print(json.dumps(cli(sys.argv[2])))
        return
    if sys.argv[1] == "package":
        print(json.dumps({"archive": helm.package(sys.argv[2], destination=sys.argv[3])}))
        return
    cmd, chart = sys.argv[1], sys.argv[2]
    if cmd == "lint":
        values, _ = user_values(sys.argv[3:])
        print(json.dumps(helm.lint(chart, values, strict=True)))
        return
    name, namespace = sys.argv[3], sys.argv[4]
    values, flags = user_values(sys.argv[5:])
    upgrade = "--is-upgrade" in flags
    print(json.dumps(render(chart, name, namespace, values, upgrade)))


if __name__ == "__main__":
    main()
