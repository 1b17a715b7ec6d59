"""The Kubernetes manifests under ``deploy/kubernetes``, checked offline: core kinds against the
Kubernetes JSON schemas that ``kubernetes-validate`` bundles (strict: unknown fields are errors),
the ServiceMonitor against the Prometheus operator's published CRD schema (strict), and the manifests against
each other and against ``pagoda serve``'s own flags."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pagoda.entrypoints.openai.server import add_serve_args
from tests.deploy import crd_schema

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = DEPLOY / "kubernetes"
# A fixed version, so a new kubernetes-validate release cannot change what passes.
KUBERNETES_VERSION = "1.33.0"

# The Prometheus operator's own CRD schema (tests/deploy/schemas, see crd_schema.py), strict.
SERVICE_MONITOR_SCHEMA = crd_schema.load("servicemonitor.monitoring.coreos.com-v1.json")


def load_all() -> dict[str, dict[str, Any]]:
    """Every manifest, by kind (one object of each kind here)."""
    by_kind: dict[str, dict[str, Any]] = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert doc["kind"] not in by_kind, f"two {doc['kind']} manifests"
            by_kind[doc["kind"]] = doc
    return by_kind


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    return load_all()


def container(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def serve_args(manifests: dict[str, dict[str, Any]]) -> Any:
    """The container's args as ``pagoda serve`` itself parses them: a misspelt flag fails here."""
    import argparse

    args = container(manifests)["args"]
    assert args[0] == "serve"
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(parser)
    return parser.parse_args(args[1:])


def test_every_kind_is_present(manifests: dict[str, dict[str, Any]]) -> None:
    assert set(manifests) == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                              "ServiceMonitor", "ConfigMap"}


@pytest.mark.parametrize("kind", ["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                                  "ConfigMap"])
def test_core_kinds_match_kubernetes_schema(manifests: dict[str, dict[str, Any]], kind: str) -> None:
    kubernetes_validate.validate(manifests[kind], KUBERNETES_VERSION, strict=True)


def test_service_monitor_matches_the_operators_crd(manifests: dict[str, dict[str, Any]]) -> None:
    monitor = manifests["ServiceMonitor"]
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    assert monitor["metadata"]["name"]
    bad = yaml.safe_load(yaml.safe_dump(monitor))
    bad["spec"]["endpoints"][0]["scrapeInterval"] = "15s"  # the field is "interval"
    with pytest.raises(jsonschema.ValidationError, match="scrapeInterval"):
        jsonschema.validate(bad, SERVICE_MONITOR_SCHEMA)


def test_service_and_monitors_select_the_pods(manifests: dict[str, dict[str, Any]]) -> None:
    deployment, service = manifests["Deployment"], manifests["Service"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = {"Deployment": deployment["spec"]["selector"]["matchLabels"],
                 "Service": service["spec"]["selector"],
                 "PodDisruptionBudget": manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]}
    for kind, selector in selectors.items():
        assert selector.items() <= pod_labels.items(), kind
    # The ServiceMonitor picks Services (not pods) by label, and scrapes a Service port by name.
    monitor = manifests["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["endpoints"]} <= port_names
    assert all(e.get("path", "/metrics") == "/metrics" for e in monitor["endpoints"])


def test_service_and_probes_reach_the_server(manifests: dict[str, dict[str, Any]]) -> None:
    c, args = container(manifests), serve_args(manifests)
    assert args.host == "0.0.0.0"  # the default loopback address is unreachable from the kubelet
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.port}

    def resolve(port: int | str) -> int:
        return ports[port] if isinstance(port, str) else port

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = c[probe]["httpGet"]
        assert check["path"] == "/health", probe
        assert resolve(check["port"]) == args.port, probe
    (service_port,) = manifests["Service"]["spec"]["ports"]
    assert resolve(service_port["targetPort"]) == args.port


def test_grace_period_covers_drain_and_shutdown(manifests: dict[str, dict[str, Any]]) -> None:
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    c, args = container(manifests), serve_args(manifests)
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pre_stop_s > 0
    # The grace period counts from the start of preStop; SIGTERM (and --shutdown-timeout) after it.
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + args.shutdown_timeout
    resources = c["resources"]
    assert resources["requests"] and resources["limits"]


def test_hpa_scales_the_deployment_on_the_adapters_name(manifests: dict[str, dict[str, Any]]) -> None:
    hpa, deployment = manifests["HorizontalPodAutoscaler"], manifests["Deployment"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"], "Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    hpa_name = metric["pods"]["metric"]["name"]

    # The adapter rule must turn the Prometheus series into exactly the name the HPA asks for.
    config = yaml.safe_load(manifests["ConfigMap"]["data"]["config.yaml"])
    (rule,) = config["rules"]
    series = re.match(r"[^{]+", rule["seriesQuery"]).group(0)
    assert series == "pagoda:num_requests_waiting"
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert renamed == hpa_name
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def test_dockerfile_installs_as_the_readme_does() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    runs = [line for line in text.splitlines() if line.startswith("RUN")]
    assert any("pip install -e ." in line for line in runs)
    assert "torch" not in " ".join(runs)  # the version comes from pyproject.toml's pin only
    assert 'EXPOSE 8000' in text
