"""Embedding models: how a prompt's final hidden states become one vector.

``PoolerConfig`` is resolved once at start-up (``resolve_pooler``) from ``--task`` /
``--runner``, ``--pooling-type``, ``--normalize`` and the checkpoint's sentence-transformers
files (``modules.json`` naming a ``Pooling`` module, its ``config.json``, a ``Normalize``
module). The engine pools (``SamplingParams.pooling``); the front ends normalise and truncate
(``finish_embedding``). Torch-free: the config layer and the front end import it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling_mode_* keys -> pagoda's pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type``: LAST (the prompt's last position, as Qwen3-Embedding), MEAN (the mean
    of every position) or CLS (the first position); ``normalize``: scale to unit L2 norm."""

    pooling_type: str
    normalize: bool


def resolve_pooler(path: str, task: str, runner: str, pooling_type: str | None,
                   normalize: bool | None) -> PoolerConfig | None:
    """The pooler of an embedding model, or None for a generating one. The model embeds when
    ``task`` is embed, ``runner`` is pooling, or (both auto) the checkpoint has a
    sentence-transformers Pooling module; the flags override what those files say."""
    task = "embed" if task == "embedding" else task  # vLLM's older name
    if task not in ("auto", "generate", "embed"):
        raise ValueError(f"task must be auto, generate or embed, got {task!r}")
    if runner not in ("auto", "generate", "pooling"):
        raise ValueError(f"runner must be auto, generate or pooling, got {runner!r}")
    if pooling_type is not None and pooling_type.upper() not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
    files = read_sentence_transformers(Path(path))
    embed = task == "embed" or runner == "pooling"
    if task == "auto" and runner == "auto":
        embed = files is not None
    if not embed:
        return None
    found_type, found_norm = files or ("LAST", True)  # decoder embedding models: Qwen3-Embedding's choice
    return PoolerConfig((pooling_type or found_type).upper(), found_norm if normalize is None else normalize)


def read_sentence_transformers(path: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers checkpoint's files, or None when
    ``modules.json`` is absent or names no Pooling module."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return None
    cfg_file = path / pooling.get("path", "") / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    kind = next((t for key, t in _ST_MODES.items() if cfg.get(key)), None)
    if kind is None:
        mode = cfg.get("pooling_mode")  # the newer single-key form
        kind = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}.get(str(mode), "LAST" if mode is None else None)
        if kind is None:
            raise ValueError(f"{cfg_file}: pooling mode {mode!r} is not served (LAST, MEAN or CLS)")
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    return kind, normalize


def finish_embedding(vector: list[float], normalize: bool, dimensions: int | None = None) -> list[float]:
    """The pooled ``vector`` cut to its first ``dimensions`` (Matryoshka) and, with
    ``normalize``, scaled to unit L2 norm (after the cut, so a short embedding is unit too)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        norm = math.sqrt(math.fsum(x * x for x in vector))
        vector = [x / max(norm, 1e-12) for x in vector]
    return vector
