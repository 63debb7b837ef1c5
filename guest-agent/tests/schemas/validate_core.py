"""Validates Kubernetes objects against Kubernetes' own OpenAPI schema of one release, strict
(an unknown field is an error), with the PyPI package kubernetes-validate:

    python validate_core.py VERSION OBJECTS.json

OBJECTS.json holds an array of objects; the answer (stdout) is a JSON array of the same
length, each the list of what is wrong with that object (empty: valid).
"""

import json
import sys

import kubernetes_validate


def problems(obj, version):
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(str(p) for p in e.path)
        return [f"/{where}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [str(e)]
    return []


def main():
    version, path = sys.argv[1], sys.argv[2]
    with open(path, encoding="utf-8") as f:
        objects = json.load(f)
    print(json.dumps([problems(o, version) for o in objects]))


if __name__ == "__main__":
    main()
