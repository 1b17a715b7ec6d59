"""Checkpoint module names behind pagoda's layers, for the formats' per-layer choices: a fused
layer (``qkv_proj``, ``gate_up_proj``) holds several checkpoint modules, which must agree.
Pure Python; the checkpoint formats import it."""
from __future__ import annotations

import re
from typing import Any, Iterable

# pagoda's fused layers and the checkpoint modules they hold (see DecoderForCausalLM.packed_modules).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_modules(prefix: str) -> list[str]:
    """The checkpoint module names behind pagoda's layer ``prefix``
    (``model.layers.0.self_attn.qkv_proj`` -> its q_proj, k_proj and v_proj)."""
    head, _, leaf = prefix.rpartition(".")
    parts = _FUSED.get(leaf)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def name_matches(name: str, pattern: str) -> bool:
    """compressed-tensors' target rule: ``re:<regex>`` matches from the start, anything else is
    an exact module name (a bare class name such as ``Linear`` is handled by the caller)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def one_choice(prefix: str, choices: Iterable[Any], what: str) -> Any:
    """The single value every checkpoint module of a fused layer agrees on; a fused layer whose
    parts are quantized differently cannot be one matmul."""
    values = list(choices)
    first = values[0]
    if any(v != first for v in values[1:]):
        raise ValueError(f"{prefix} fuses {', '.join(checkpoint_modules(prefix))}, which the checkpoint "
                         f"{what} differently; pagoda needs them quantized alike")
    return first
