"""deploy/kuberay/rayservice.yaml, checked offline: the RayService against KubeRay's published
ray.io/v1 CRD schema (strict), its pod templates against the Kubernetes schemas, its
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

from tests.deploy import crd_schema

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAYSERVICE = DEPLOY / "kuberay" / "rayservice.yaml"
KUBERNETES_VERSION = "1.33.0"

# KubeRay's own CRD schema (tests/deploy/schemas, see crd_schema.py), strict: a misspelt field
# is an error, as with kubectl apply --validate=strict, not an unknown field the API server drops.
RAYSERVICE_SCHEMA = crd_schema.load("rayservice.ray.io-v1.json")
# What the API server checks of metadata (ObjectMeta) for a custom resource, in the fields we use.
METADATA_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                   "namespace": {"type": "string"},
                   "labels": {"type": "object", "additionalProperties": {"type": "string"}}},
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


def test_rayservice_matches_kuberays_crd(service: dict[str, Any]) -> None:
    jsonschema.validate(service, RAYSERVICE_SCHEMA)
    jsonschema.validate(service["metadata"], METADATA_SCHEMA)
    # The schema is strict and typed: a misspelt or mistyped field fails.
    misspelt = yaml.safe_load(yaml.safe_dump(service))
    misspelt["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(misspelt, RAYSERVICE_SCHEMA)
    mistyped = yaml.safe_load(yaml.safe_dump(service))
    mistyped["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(mistyped, RAYSERVICE_SCHEMA)


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


def test_pods_use_the_serve_settings_of_pagoda_serve(service: dict[str, Any]) -> None:
    from pagoda.entrypoints.ray.server import SERVE_ENV

    for template in templates(service):
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert SERVE_ENV.items() <= env.items()


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
