"""The scale-out flags of ``pagoda serve`` and the translation of Ray Serve application args
(``serve run pagoda.ray:build_app model=DIR num_replicas=2``) into the same flags. No Ray
import: the single server parses these flags too."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping

from pagoda.entrypoints.ray.routing import DEFAULT_PREFIX_AFFINITY_MARGIN, ROUTING_POLICIES
from pagoda.entrypoints.argtypes import (non_negative_float as _non_negative_float, non_negative_int as _non_negative_int,
                                         positive_float as _positive_float, positive_int as _positive_int)

# Ray Serve's autoscaling target is requests in flight per replica; an engine batches many, so
# the default is well above Serve's own (2).
DEFAULT_TARGET_ONGOING_REQUESTS = 16
# Seconds between Serve's health checks of a replica (check_health); it replaces a replica after
# three failures in a row, so a dead engine is replaced within seconds.
DEFAULT_HEALTH_CHECK_PERIOD_S = 2.0
# Milliseconds a replica gathers a stream's events before passing them on (Ray Serve LLM's
# stream_batching_interval_ms has the same default): every message between actors costs CPU
# on both sides, and one per token is most of the Ray path's cost.
DEFAULT_STREAM_BATCHING_INTERVAL_MS = 50.0


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "scale out (Ray Serve)",
        "--num-replicas N (N > 1), --min-replicas/--max-replicas/--target-ongoing-requests or --ray-address "
        "serves MODEL as replicas of a Ray Serve deployment behind one endpoint at --host/--port (needs pip "
        "install 'pagoda[ray]'). Without them (or with --num-replicas 1 alone), one server without Ray.")
    group.add_argument("--num-replicas", type=_positive_int, default=None,
                       help="engine replicas on Ray Serve (default 1: one server, no Ray; 1 is also the single "
                            "server unless --ray-address is given)")
    group.add_argument("--min-replicas", type=_non_negative_int, default=None,
                       help="autoscaling: fewest replicas (Ray Serve autoscaling_config.min_replicas)")
    group.add_argument("--max-replicas", type=_positive_int, default=None,
                       help="autoscaling: most replicas (autoscaling_config.max_replicas)")
    group.add_argument("--target-ongoing-requests", type=_positive_float, default=None,
                       help="autoscaling: requests in flight per replica Serve scales towards "
                            f"(default {DEFAULT_TARGET_ONGOING_REQUESTS} when autoscaling)")
    group.add_argument("--autoscaling-upscale-delay", type=_non_negative_float, default=None,
                       help="autoscaling: seconds the load must stay above the target before a replica is "
                            "added (Ray Serve autoscaling_config.upscale_delay_s; Ray's default 30)")
    group.add_argument("--autoscaling-downscale-delay", type=_non_negative_float, default=None,
                       help="autoscaling: seconds the load must stay below the target before a replica is "
                            "removed (autoscaling_config.downscale_delay_s; Ray's default 600)")
    group.add_argument("--routing", choices=ROUTING_POLICIES, default="prefix_affinity",
                       help="how requests are spread over the replicas: prefix_affinity sends a request to the "
                            "replica that last ran its prompt's prefix (its prefix cache holds it)")
    group.add_argument("--prefix-affinity-margin", type=_non_negative_int, default=None,
                       help="prefix_affinity: go to the least loaded replica instead when the preferred one has "
                            f"more than this many requests in flight beyond it (default {DEFAULT_PREFIX_AFFINITY_MARGIN}; "
                            "0 with --kv-offload-redis-url, where every replica can load a prefix another computed)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. auto, ray://HOST:10001); 'local' (or no address, with "
                            "several replicas or autoscaling): start a Ray instance of its own on 127.0.0.1")
    group.add_argument("--max-ongoing-requests", type=_positive_int, default=None,
                       help="requests in flight one replica accepts from the router "
                            "(default: --max-num-seqs + --max-queued-requests)")
    group.add_argument("--replica-num-cpus", type=_non_negative_float, default=1.0,
                       help="Ray CPUs each engine replica reserves")
    group.add_argument("--pin-replicas-to-cpus", action="store_true",
                       help="pin replica r (and its engine core) to the r-th CPU this process may use, modulo their "
                            "number (benchmarks: one core per replica)")
    group.add_argument("--stream-batching-interval-ms", type=_non_negative_float,
                       default=DEFAULT_STREAM_BATCHING_INTERVAL_MS,
                       help="a replica sends a stream's events to the endpoint at most this often, several in one "
                            "message when they come faster (the first event is never held); 0 sends each at once")
    group.add_argument("--replica-num-gpus", type=_non_negative_float, default=0.0,
                       help="Ray GPUs each engine replica reserves")


# Flags that only mean something on the Ray path (their defaults are not None).
RAY_ONLY_FLAGS = ("routing", "prefix_affinity_margin", "max_ongoing_requests", "replica_num_cpus",
                  "autoscaling_upscale_delay", "autoscaling_downscale_delay",
                  "pin_replicas_to_cpus", "replica_num_gpus", "stream_batching_interval_ms")


def prefix_affinity_margin(args: argparse.Namespace) -> int:
    """The router's prefix-affinity margin: the flag's value, or by default
    ``DEFAULT_PREFIX_AFFINITY_MARGIN``; 0 when the replicas share a Redis KV tier. There a prefix
    one replica computed is a Redis hit on every other, so the least loaded replica wins and
    affinity only breaks ties between equally loaded replicas (whose device cache is faster
    still)."""
    if getattr(args, "prefix_affinity_margin", None) is not None:
        return args.prefix_affinity_margin
    return 0 if getattr(args, "kv_offload_redis_url", None) else DEFAULT_PREFIX_AFFINITY_MARGIN


def uses_ray(args: argparse.Namespace) -> bool:
    """Whether ``pagoda serve`` runs through Ray Serve: more than one replica
    (``--num-replicas N``, N > 1), autoscaling (``--min-replicas``/``--max-replicas``/
    ``--target-ongoing-requests``, even with a maximum of one: Serve does the scaling), or a Ray
    cluster (``--ray-address``; ``local`` starts a Ray instance of its own even for one replica).
    ``--num-replicas 1`` alone is the single server, without Ray."""
    if (getattr(args, "num_replicas", None) or 1) > 1:
        return True
    return any(getattr(args, name, None) is not None
               for name in ("min_replicas", "max_replicas", "target_ongoing_requests", "ray_address"))


def ray_flags(args: argparse.Namespace) -> list[str]:
    """The flags that make ``pagoda serve`` run through Ray Serve (``uses_ray``), as typed."""
    flags = ["--num-replicas"] if (getattr(args, "num_replicas", None) or 1) > 1 else []
    return flags + ["--" + name.replace("_", "-")
                    for name in ("min_replicas", "max_replicas", "target_ongoing_requests", "ray_address")
                    if getattr(args, name, None) is not None]


def check_single_server_args(args: argparse.Namespace) -> None:
    """A Ray-only flag given to the single server is a ``ValueError`` naming it (it would
    change nothing there)."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_ray_args(defaults)
    given = [name for name in RAY_ONLY_FLAGS
             if hasattr(args, name) and getattr(args, name) != defaults.get_default(name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags} only apply to Ray Serve replicas: add --num-replicas N (N > 1), "
                         "--min-replicas/--max-replicas or --ray-address (see docs/deployment.md)")


@dataclass(frozen=True)
class ScaleConfig:
    """How many replicas: a fixed number, or Ray Serve's autoscaling config."""

    num_replicas: int | None
    autoscaling: dict[str, Any] | None

    @staticmethod
    def from_args(args: argparse.Namespace) -> "ScaleConfig":
        autoscale = any(getattr(args, n) is not None
                        for n in ("min_replicas", "max_replicas", "target_ongoing_requests"))
        delays = {key: value for key, value in (
            ("upscale_delay_s", getattr(args, "autoscaling_upscale_delay", None)),
            ("downscale_delay_s", getattr(args, "autoscaling_downscale_delay", None))) if value is not None}
        if not autoscale:
            if delays:
                raise ValueError("--autoscaling-upscale-delay/--autoscaling-downscale-delay need autoscaling "
                                 "(--min-replicas/--max-replicas/--target-ongoing-requests)")
            return ScaleConfig(args.num_replicas or 1, None)
        if args.num_replicas is not None:
            raise ValueError("give either --num-replicas (a fixed number) or --min-replicas/--max-replicas/"
                             "--target-ongoing-requests (autoscaling), not both")
        low = 1 if args.min_replicas is None else args.min_replicas
        high = max(low, 1) if args.max_replicas is None else args.max_replicas
        if high < low:
            raise ValueError(f"--max-replicas ({high}) must be at least --min-replicas ({low})")
        target = args.target_ongoing_requests or DEFAULT_TARGET_ONGOING_REQUESTS
        return ScaleConfig(None, {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": target,
                                  "initial_replicas": max(low, 1), **delays})


def argv_from_config(config: Mapping[str, Any], parser: argparse.ArgumentParser) -> list[str]:
    """``pagoda serve`` arguments for a Ray Serve ``args`` mapping: ``model`` is the model
    directory, every other key a flag with ``_`` or ``-`` (``num_replicas: 2`` ->
    ``--num-replicas 2``); booleans are ``true``/``false``. A key that is no flag is a
    ``ValueError`` naming it."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in config.items():
        dest = str(key).replace("-", "_")
        if dest == "model":
            argv.insert(0, str(value))
            continue
        action = actions.get(dest)
        if action is None:
            raise ValueError(f"unknown pagoda serve option {key!r} in the application's args")
        flag = next(s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-"))
        if action.nargs == 0:  # a switch
            on = _truth(key, value)
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if on else "--no-" + flag[2:])
            elif on:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, _text(value)]
    return argv


def _truth(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"option {key!r} is a switch: give true or false, not {value!r}")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


