"""Which models one ``pagoda serve`` holds: ``--model`` given more than once (each ``PATH`` or
``NAME=PATH``), a positional model plus ``--model``, or ``--models-config FILE`` (YAML), with
their per-model options; and each model's memory footprint estimate for the load budget.

One model (positional or a single ``--model``) is folded back into the single-model server's
flags (``fold_single_model``) and runs exactly as before. Several become ``ModelSpec``s: each
is the server's own flag namespace with that model's path, served name and overrides in it, so
every per-model option is the flag of the same name (``dtype``, ``max_model_len``,
``kv_cache_memory``, ``quantization``, ``lora_modules``, ...).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.config import CPU_DEFAULT_KV_CACHE_MEMORY, EngineArgs, integer as parse_int
from pagoda.entrypoints.argtypes import positive_int as _positive_int, byte_size as _size

# The per-model options of the server itself (besides every engine flag) a models file may set.
SERVER_OPTIONS = frozenset({"lora_modules", "allow_runtime_lora_updating", "reasoning_parser", "tool_call_parser",
                            "enable_auto_tool_choice", "strict_tool_arguments", "max_queued_requests",
                            "engine_stall_timeout"})
# A models file entry's own keys: not flags.
ENTRY_KEYS = frozenset({"name", "served_model_name", "model", "path", "preload"})
# Weight files counted in a model's footprint estimate.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Seconds a request waits for its model to load (room made, engine started) by default.
DEFAULT_MODEL_LOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its name (what requests put in ``model``), its flags (the server's
    namespace with this model's path and options set), whether it loads at start, and the
    bytes it is expected to take once loaded (weights + KV cache)."""

    name: str
    args: argparse.Namespace
    preload: bool = False
    footprint: int = 0
    max_model_len: int | None = None


def add_models_args(parser: argparse.ArgumentParser) -> None:
    """The several-models flags of ``pagoda serve``."""
    parser.add_argument("--model", dest="models", action="append", default=[], metavar="[NAME=]PATH",
                        help="a model to serve (instead of, or besides, the positional MODEL); give it more than "
                             "once to serve several models from one server, each in its own engine-core process "
                             "and chosen by the requests' 'model' (NAME, default PATH as given)")
    parser.add_argument("--models-config", default=None, metavar="FILE",
                        help="a YAML file listing models to serve with their own options: 'models:' a list of "
                             "{name, model, preload, and any engine flag such as dtype, max_model_len, "
                             "kv_cache_memory, quantization, lora_modules} (docs/deployment.md)")
    parser.add_argument("--max-loaded-models", type=_positive_int, default=None,
                        help="several models: at most this many loaded at once; a request for another unloads the "
                             "least recently used idle one (unset: no limit)")
    parser.add_argument("--models-memory-budget", type=_size, default=None, metavar="BYTES",
                        help="several models: the loaded models' estimated footprints (weights + KV cache) stay "
                             "within this many bytes (e.g. 16GiB); least recently used idle models are unloaded "
                             "to make room (unset: no limit)")
    parser.add_argument("--preload", action="append", default=[], metavar="NAME",
                        help="several models: load this model at start (repeatable; 'all' for every model); the "
                             "others load at their first request")
    parser.add_argument("--model-load-timeout", type=float, default=DEFAULT_MODEL_LOAD_TIMEOUT_S,
                        help="several models: seconds a request waits for its model to be loaded (room made and "
                             "engine started) before it gets 503")


def several_models_on_ray_error(ray_flags: str) -> str:
    """Why several models and Ray Serve do not go together, naming the Ray flags given."""
    return (f"several models (--model given more than once, or --models-config) are served by one pagoda server "
            f"with on-demand loading, not on Ray Serve replicas, which {ray_flags} asks for: a Ray Serve "
            "application hosts replicas of one model. Drop the Ray flags to serve the models from one server, "
            "or run one application per model (pagoda serve MODEL --num-replicas N on its own port, or one "
            "pagoda.ray:build_app application each with its own route_prefix)")


def wants_several_models(args: argparse.Namespace) -> bool:
    """Whether the flags name more than one model, or a models file (after ``fold_single_model``)."""
    return bool(getattr(args, "models_config", None)) or len(getattr(args, "models", None) or []) > 1


def fold_single_model(args: argparse.Namespace) -> None:
    """Turn ``--model`` into the single server's flags when it names the only model (its
    ``NAME=`` the served name), and a positional model given with ``--model`` into the first of
    several; ``ValueError`` for a served name given twice."""
    models = list(getattr(args, "models", None) or [])
    several = len(models) > 1 or bool(getattr(args, "models_config", None))
    if args.model is None and several and args.served_model_name is not None:
        raise ValueError("--served-model-name names the positional MODEL; give each --model its name as NAME=PATH "
                         "(or 'name:' in --models-config)")
    if args.model is not None and (models or getattr(args, "models_config", None)):
        models.insert(0, args.model if args.served_model_name is None else f"{args.served_model_name}={args.model}")
        args.model, args.served_model_name = None, None
    args.models = models
    if len(models) == 1 and not getattr(args, "models_config", None):
        name, path = split_name(models[0])
        args.model = path
        if name is not None:
            if args.served_model_name not in (None, name):
                raise ValueError(f"--model {models[0]!r} and --served-model-name {args.served_model_name!r} "
                                 "name the model twice")
            args.served_model_name = name
        args.models = []


def split_name(value: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> (NAME, PATH); a path that exists as given (``=`` and all), or one
    without ``=``, -> (None, PATH)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path or Path(value).exists():
        return None, value
    return name, path


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The served models of ``args`` (several-models mode), in order: the ``--model`` ones, then
    the models file's; ``ValueError`` naming what is wrong (a name given twice, an unknown
    option, a bad value, a missing model directory)."""
    specs = [_spec(args, *_cli_entry(value)) for value in args.models]
    if args.models_config:
        specs += [_spec(args, name, path, options) for name, path, options in read_models_file(args.models_config)]
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"the served model name(s) {', '.join(twice)} are given twice")
    if not specs:
        raise ValueError(f"{args.models_config} lists no models")
    preload = set(getattr(args, "preload", None) or [])
    unknown = preload - set(names) - {"all"}
    if unknown:
        raise ValueError(f"--preload names {', '.join(sorted(unknown))}, which are not served "
                         f"(served: {', '.join(names)})")
    return [dataclasses.replace(s, preload=s.preload or "all" in preload or s.name in preload) for s in specs]


def _cli_entry(value: str) -> tuple[str, str, dict[str, Any]]:
    name, path = split_name(value)
    return name or path, path, {}


def read_models_file(path: str) -> list[tuple[str, str, dict[str, Any]]]:
    """A models file's entries as (served name, model path, options). The file is YAML: a
    mapping with ``models:`` (or a bare list), each entry a mapping with ``model`` (or ``path``)
    and optionally ``name`` and any per-model option; relative model paths are taken from the
    file's folder when such a path exists there."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--models-config {path}: {exc}") from exc
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"--models-config {path}: expected 'models:' with a list of models")
    return [_file_entry(path, i, entry) for i, entry in enumerate(entries)]


def _file_entry(path: str, index: int, entry: Any) -> tuple[str, str, dict[str, Any]]:
    where = f"--models-config {path}: models[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping with 'model' (its path) and options")
    options = {str(k).replace("-", "_"): v for k, v in entry.items()}
    model = options.pop("model", None) or options.pop("path", None)
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where} needs 'model': the model directory, GGUF file or hub name")
    local = Path(path).parent / model
    if not Path(model).is_absolute() and local.exists():
        model = str(local)
    name = options.pop("name", None) or options.pop("served_model_name", None) or model
    if not isinstance(name, str):
        raise ValueError(f"{where}: 'name' must be a string")
    return name, model, options


_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _spec(args: argparse.Namespace, name: str, path: str, options: dict[str, Any]) -> ModelSpec:
    """``args`` copied with this model's path, name and options; validated by building its
    engine config (which reads the model's config.json)."""
    from pagoda.config import EngineConfig

    ns = copy.copy(args)
    ns.model, ns.served_model_name, ns.models = path, name, []
    preload = bool(options.pop("preload", False))
    for key, value in options.items():
        if key not in _ENGINE_FIELDS and key not in SERVER_OPTIONS:
            raise ValueError(f"model {name!r}: unknown option {key!r} (an engine flag such as dtype, "
                             f"max_model_len, kv_cache_memory, quantization, or lora_modules)")
        setattr(ns, key, _option_value(name, key, value))
    if getattr(ns, "lora_modules", None):
        ns.enable_lora = True
    try:
        config = EngineConfig.from_args(EngineArgs.from_namespace(ns))
    except (ValueError, OSError) as exc:
        raise ValueError(f"model {name!r}: {exc}") from exc
    return ModelSpec(name, ns, preload, estimate_footprint(config, ns), config.model.max_model_len)


def _option_value(name: str, key: str, value: Any) -> Any:
    """A models-file value as the flag's parser would give it (sizes such as "64MiB" for byte
    counts, a list of ``name=path`` or mappings for ``lora_modules``)."""
    if key == "lora_modules":
        import json

        items = value if isinstance(value, list) else [value]
        return [json.dumps(v) if isinstance(v, dict) else str(v) for v in items]
    kind = str(_ENGINE_FIELDS[key].type) if key in _ENGINE_FIELDS else ""
    if kind.startswith("int") and isinstance(value, str):
        try:
            return parse_int(value)
        except ValueError as exc:
            raise ValueError(f"model {name!r}: {key} must be a number of bytes or an integer, got {value!r}") from exc
    return value


def weights_bytes(path: str) -> int:
    """The size of a model's weight files (a GGUF file's own size)."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in root.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def estimate_footprint(config: Any, args: argparse.Namespace) -> int:
    """Bytes a loaded model is expected to hold: its weight files plus its KV cache budget
    (``kv_cache_memory``; on CPU 2 GiB by default; on a GPU without it, the
    ``gpu_memory_utilization`` share of the device, which holds the weights too)."""
    weights = weights_bytes(config.model.path)
    kv = config.cache.kv_cache_memory
    if kv is not None:
        return weights + kv
    if config.device.startswith("cuda"):
        import torch

        return int(config.cache.gpu_memory_utilization * torch.cuda.get_device_properties(0).total_memory)
    return weights + CPU_DEFAULT_KV_CACHE_MEMORY
