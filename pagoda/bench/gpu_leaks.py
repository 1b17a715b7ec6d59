"""What a finished ``bench gpu all`` stage left on the device, and what holds it.

Every stage's engines are shut down and collected before the next starts; memory still
allocated after that is a leak that the next stage's memory profile counts as its own (a KV
cache budget below zero, or an out-of-memory error, in a stage that never got to measure).
``left_on_device`` names the largest CUDA tensors still alive and, for each, the chain of
objects that keeps it (found through the garbage collector's referrers), so a GPU run points at
the holder instead of only at the symptom.
"""
from __future__ import annotations

import gc
import types
from typing import Any

import torch

LEAK_BYTES = 256 << 20  # below this, what a stage left is caches and workspaces, not an engine
TOP = 3
CHAIN_DEPTH = 10


def device_bytes_in_use() -> int | None:
    """torch's allocated CUDA bytes (None without CUDA)."""
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else None


def left_on_device(limit: int = LEAK_BYTES) -> dict[str, Any] | None:
    """None when less than ``limit`` bytes are allocated; else the bytes and the ``TOP`` largest
    live CUDA tensors, each with its shape, dtype, bytes and holder chain (``holder_chain``)."""
    in_use = device_bytes_in_use()
    if in_use is None or in_use < limit:
        return None
    tensors = [obj for obj in gc.get_objects() if _is_cuda_tensor(obj)]
    tensors.sort(key=_nbytes, reverse=True)
    largest = [{"shape": list(t.shape), "dtype": str(t.dtype), "bytes": _nbytes(t),
                "held_by": holder_chain(t, skip=(tensors,))} for t in tensors[:TOP]]
    return {"bytes": in_use, "tensors": len(tensors), "largest": largest}


def holder_chain(obj: object, depth: int = CHAIN_DEPTH, skip: tuple[object, ...] = ()) -> list[str]:
    """From ``obj`` outwards: for each step the referrer that keeps it, described as its type and
    the attribute (or, for a plain dict, the key) under which it keeps the previous object; an
    object's or a module's ``__dict__`` counts as its owner, whether or not Python has made that
    dict yet. Frames and the caller's own containers (``skip``) are passed over. Ends at a
    module, a class, or ``depth`` steps."""
    chain: list[str] = []
    seen = {id(obj), *(id(x) for x in skip)}
    current = obj
    for _ in range(depth):
        referrers = [r for r in gc.get_referrers(current) if id(r) not in seen and not isinstance(r, types.FrameType)]
        if not referrers:
            break
        holder = _pick(referrers)
        owner = _owner(holder) if isinstance(holder, dict) else None
        if owner is not None:
            seen.add(id(holder))
            holder = owner
        chain.append(_describe(holder, current))
        if isinstance(holder, (types.ModuleType, type)):
            break
        seen.add(id(holder))
        current = holder
    return chain


def _owner(d: dict) -> object | None:
    """The object or module whose ``__dict__`` is ``d`` (None for a plain dict)."""
    for g in gc.get_referrers(d):
        try:
            if g.__dict__ is d:
                return g
        except Exception:  # noqa: BLE001 - objects without __dict__, or whose lookup raises
            continue
    return None


def _pick(referrers: list[object]) -> object:
    """The most telling referrer: a module first, then an object's or module's ``__dict__``,
    then anything else."""
    for r in referrers:
        if isinstance(r, types.ModuleType):
            return r
    for r in referrers:
        if isinstance(r, dict) and _owner(r) is not None:
            return r
    return referrers[0]


def _describe(holder: object, held: object) -> str:
    if isinstance(holder, dict):
        keys = [k for k, v in holder.items() if v is held][:1]
        return f"dict[{keys[0]!r}]" if keys else "dict"
    if isinstance(holder, type):
        return f"class {holder.__qualname__}"
    kind = (f"module {holder.__name__}" if isinstance(holder, types.ModuleType)
            else f"{type(holder).__module__}.{type(holder).__qualname__}")
    try:
        attrs = [k for k, v in vars(holder).items() if v is held][:1]
    except TypeError:  # no __dict__
        attrs = []
    return f"{kind}.{attrs[0]}" if attrs else kind


def _is_cuda_tensor(obj: object) -> bool:
    try:
        return isinstance(obj, torch.Tensor) and obj.is_cuda
    except Exception:  # noqa: BLE001 - objects that refuse isinstance or attribute reads
        return False


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - tensors without storage (fake, meta)
        return 0
