"""deploy/kuberay/rayservice.yaml, checked offline: the RayService against a strict schema of
the KubeRay (ray.io/v1) fields it uses, its pod templates against the Kubernetes schemas, its
serveConfigV2 against Ray Serve's own config schema, the application's args against pagoda's
application builder, and the pieces against each other (ports, CPUs, Ray version)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAYSERVICE = DEPLOY / "kuberay" / "rayservice.yaml"
KUBERNETES_VERSION = "1.33.0"

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_POD_TEMPLATE = {"type": "object", "required": ["spec"]}  # its inside: the Kubernetes schema, below
_INT = {"type": "integer", "minimum": 0}

# The subset of KubeRay's ray.io/v1 RayService CRD this manifest uses; anything else is refused,
# so a misspelt field cannot pass as an unknown (ignored) one.
RAYSERVICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STR_MAP},
        },
        "spec": {
            "type": "object", "required": ["serveConfigV2", "rayClusterConfig"], "additionalProperties": False,
            "properties": {
                "serveConfigV2": {"type": "string"},
                "rayClusterConfig": {
                    "type": "object", "required": ["headGroupSpec"], "additionalProperties": False,
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "headGroupSpec": {
                            "type": "object", "required": ["template"], "additionalProperties": False,
                            "properties": {"rayStartParams": _STR_MAP, "template": _POD_TEMPLATE,
                                           "serviceType": {"type": "string"}},
                        },
                        "workerGroupSpecs": {
                            "type": "array",
                            "items": {
                                "type": "object", "required": ["groupName", "template"], "additionalProperties": False,
                                "properties": {"groupName": {"type": "string"}, "replicas": _INT,
                                               "minReplicas": _INT, "maxReplicas": _INT,
                                               "rayStartParams": _STR_MAP, "template": _POD_TEMPLATE},
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def service() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(RAYSERVICE.read_text()) if d is not None]
    return doc


def templates(service: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]


def serve_config(service: dict[str, Any]) -> Any:
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))


def test_rayservice_matches_the_crd_subset(service: dict[str, Any]) -> None:
    jsonschema.validate(service, RAYSERVICE_SCHEMA)


def test_pod_templates_match_kubernetes_schema(service: dict[str, Any]) -> None:
    for template in templates(service):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "pagoda"},
                        "template": template}
        kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
        (container,) = template["spec"]["containers"]
        assert container["resources"]["requests"] and container["resources"]["limits"]


def test_serve_config_builds_pagodas_application(service: dict[str, Any]) -> None:
    import pagoda.ray
    from pagoda.entrypoints.ray.args import ScaleConfig

    config = serve_config(service)
    (app,) = config.applications
    module, _, name = app.import_path.partition(":")
    assert (module, name) == ("pagoda.ray", "build_app") and callable(getattr(pagoda.ray, name))
    args = pagoda.ray.parse_config(app.args)  # a misspelt or bad option fails here
    pagoda.ray.build_application(args)
    scale = ScaleConfig.from_args(args)
    assert scale.autoscaling is not None
    # Every replica Serve may start fits on the worker pods KubeRay may start.
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    cpus = sum(g["maxReplicas"] * float(g["rayStartParams"]["num-cpus"]) for g in workers)
    assert scale.autoscaling["max_replicas"] * args.replica_num_cpus <= cpus
    for group in workers:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        assert float(container["resources"]["requests"]["cpu"]) >= float(group["rayStartParams"]["num-cpus"])
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # replicas go to the workers


def test_ports_image_and_ray_version_agree(service: dict[str, Any]) -> None:
    config = serve_config(service)
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["serve"] == config.http_options.port
    assert config.http_options.host == "0.0.0.0"  # reachable from the head's Service
    images = {t["spec"]["containers"][0]["image"] for t in templates(service)}
    assert len(images) == 1  # head and workers run the same pagoda + Ray install
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    minimum = re.search(r'ray = \["ray\[serve\]>=([0-9.]+)"\]', pyproject).group(1)
    version = service["spec"]["rayClusterConfig"]["rayVersion"]
    assert tuple(map(int, version.split("."))) >= tuple(map(int, minimum.split(".")))
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert 'pip install -e ".[$PAGODA_EXTRAS]"' in dockerfile  # the image the comment tells you to build
