"""JSON schemas of the custom resources under ``deploy/`` (KubeRay's RayService, the Prometheus
operator's ServiceMonitor), taken from their projects' published CRDs, for offline validation.

No PyPI package ships these CRDs, so ``tests/deploy/schemas/`` keeps the ``openAPIV3Schema``
of each CRD's served version, extracted from the CRD file of a release with

    python -m tests.deploy.crd_schema CRD.yaml VERSION OUT.json "SOURCE" [PATH ...]

which keeps only the structure (field names, types, enums, required fields, formats): it drops
every ``description`` (the upstream prose), ``status`` (never written by a manifest), and replaces the properties at the dotted
PATHs (``[]`` for array items) by a plain object: there the CRD embeds a Kubernetes type that the
tests check against the Kubernetes schema itself (kubernetes-validate). ``$comment`` records the
source. ``strict`` turns a schema into what ``kubectl apply --validate=strict`` enforces: a field
the schema does not know is an error, not silently pruned.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"


def extract(crd: dict[str, Any], version: str, cut: list[str]) -> dict[str, Any]:
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = copy.deepcopy(served["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status", None)
    for path in cut:
        node = schema
        *parents, last = path.split(".")
        for part in parents:
            node = node["properties"][part.removesuffix("[]")]
            if part.endswith("[]"):
                node = node["items"]
        if last not in node["properties"]:
            raise KeyError(f"{path}: not in the CRD's schema")
        node["properties"][last] = {"type": "object"}  # checked against the Kubernetes schema
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{version}"}
    schema["properties"]["kind"] = {"const": crd["spec"]["names"]["kind"]}
    return structure_only(schema)


def structure_only(schema: Any) -> Any:
    """``schema`` without its prose: every string ``description`` removed (a property that is
    itself named ``description`` is a dict under ``properties`` and stays)."""
    if isinstance(schema, list):
        return [structure_only(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: structure_only(v) for k, v in schema.items() if not (k == "description" and isinstance(v, str))}


def strict(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to other fields (unless
    the CRD keeps unknown fields there or gives a schema for them)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("properties", "items", "additionalProperties", "allOf", "anyOf", "oneOf")
           else v for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def load(name: str) -> dict[str, Any]:
    """A stored schema, strict."""
    return strict(json.loads((SCHEMAS / name).read_text()))


def main(argv: list[str]) -> int:
    crd_path, version, out, source, *cut = argv
    crd = yaml.safe_load(Path(crd_path).read_text())
    schema = {"$comment": source, **extract(crd, version, cut)}
    Path(out).write_text(json.dumps(schema, indent=1, sort_keys=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
