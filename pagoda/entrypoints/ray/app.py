"""Building the Ray Serve application: ``Ingress`` in front of ``EngineReplica`` replicas
routed by ``PagodaRequestRouter``.

``build_app`` is the application builder Ray Serve config files name
(``import_path: pagoda.ray:build_app``; ``serve run pagoda.ray:build_app model=DIR
num_replicas=2``): its ``args`` are ``pagoda serve``'s flags, so the two ways of starting are
the same application with the same options.
"""
from __future__ import annotations

import argparse
from typing import Any, Mapping

from ray import serve
from ray.serve.config import RequestRouterConfig

from pagoda.config import CPU_MAX_NUM_SEQS, GPU_MAX_NUM_SEQS
from pagoda.entrypoints.ray.args import (DEFAULT_HEALTH_CHECK_PERIOD_S, ScaleConfig, argv_from_config,
                                         prefix_affinity_margin)
from pagoda.entrypoints.ray.deployments import EngineReplica, Ingress

ENGINE_DEPLOYMENT = "PagodaEngine"
INGRESS_DEPLOYMENT = "PagodaIngress"
ROUTER_CLASS = "pagoda.entrypoints.ray.router.PagodaRequestRouter"
# Serve waits this long for a replica's health check before counting it failed. An engine
# busy with a long step still answers at once (check_health reads a timestamp), so this only
# has to cover a replica process under heavy load.
HEALTH_CHECK_TIMEOUT_S = 30.0
# Serve's replicas log a line per request by default; pagoda's single server logs none.
NO_ACCESS_LOG = {"enable_access_log": False}


def build_application(args: argparse.Namespace) -> Any:
    """The Serve application for parsed ``pagoda serve`` flags. Raises ``ValueError`` for
    contradictory scale-out flags."""
    scale = ScaleConfig.from_args(args)
    max_ongoing = args.max_ongoing_requests or (
        (args.max_num_seqs or max(CPU_MAX_NUM_SEQS, GPU_MAX_NUM_SEQS)) + args.max_queued_requests)
    options: dict[str, Any] = {
        "max_ongoing_requests": max_ongoing,
        "health_check_period_s": DEFAULT_HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        "logging_config": NO_ACCESS_LOG,
        "ray_actor_options": {"num_cpus": args.replica_num_cpus, "num_gpus": args.replica_num_gpus},
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"policy": args.routing, "margin": prefix_affinity_margin(args)}),
    }
    if scale.autoscaling is not None:
        options["autoscaling_config"] = scale.autoscaling
    else:
        options["num_replicas"] = scale.num_replicas
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(**options).bind(args)
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=1, max_ongoing_requests=1_000_000, ray_actor_options={"num_cpus": 0},
        logging_config=NO_ACCESS_LOG)
    return ingress.bind(engine, ENGINE_DEPLOYMENT, args.max_request_body_size, args.api_key,
                        args.request_body_timeout, args.auth_failure_delay)


def parse_config(config: Mapping[str, Any]) -> argparse.Namespace:
    """``pagoda serve``'s flags from a Serve application's ``args`` (see ``argv_from_config``);
    a bad key or value is a ``ValueError`` naming it."""
    from pagoda.entrypoints.openai.models_config import (fold_single_model, several_models_on_ray_error,
                                                         wants_several_models)
    from pagoda.entrypoints.openai.server import serve_parser

    parser = serve_parser(raise_errors=True)
    args = parser.parse_args(argv_from_config(config, parser))
    fold_single_model(args)  # a lone --model is the model; several are refused
    if wants_several_models(args):
        raise ValueError(several_models_on_ray_error("an application of pagoda.ray:build_app") +
                         " (its args take one model: no 'models' list, no models_config)")
    return args


def build_app(args: Mapping[str, Any] | None = None) -> Any:
    """Ray Serve application builder: ``serve run pagoda.ray:build_app model=DIR num_replicas=2
    routing=prefix_affinity``, or ``import_path: pagoda.ray:build_app`` with ``args:`` in a
    Serve config file (KubeRay's RayService ``serveConfigV2``)."""
    return build_application(parse_config(args or {}))
