"""Kernel choices timed on this machine, kept on disk so that later starts read them instead of
timing again.

A choice (which product kernel serves a weight shape, up to how many rows) depends on the machine
and the software, so the file it lives in is named by a hash of everything that can change it:
the CPU's model name and feature flags, the kernel variant running (``select.isa()``), torch's
version, the thread count and the kernel sources' digest. Another machine, variant, torch or
thread count therefore finds no file of its own and times again; entries inside a file are keyed
by shape and dtype. Files live in ``select.choice_cache_dir()`` (``$PAGODA_CPU_CHOICE_CACHE``, else
``$PAGODA_CACHE_DIR/kernel-choices``, else ``$XDG_CACHE_HOME/pagoda/kernel-choices``, else
``~/.cache/pagoda/kernel-choices``; ``PAGODA_CPU_CHOICE_CACHE=off`` keeps nothing). A cache that
cannot be read or written is skipped with a debug line: the choice is then timed, as without one.
Processes writing one file at once (tensor-parallel ranks) merge what is on disk before each
atomic replace; an entry lost to a race is only timed again at the next start.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from pagoda import cpu_features
from pagoda.kernels import select

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the meaning of an entry changes: old files are then ignored


def machine_identity(threads: int) -> dict[str, Any]:
    """Everything a timed choice depends on besides the shape (see the module docstring)."""
    import torch

    from pagoda.kernels import build

    try:
        choice = select.isa()
        level, variant = choice.level, choice.variant
    except ValueError:
        level = variant = "unknown"
    try:
        sources = build.source_digest()
    except OSError:  # an installed package without its csrc
        sources = "installed"
    return {"format": FORMAT, "cpu": cpu_features.cpu_model(),
            "flags": hashlib.sha1(" ".join(sorted(cpu_features.cpu_flags())).encode()).hexdigest()[:16],
            "level": level, "variant": variant, "torch": torch.__version__, "threads": threads,
            "sources": sources[:16]}


class ChoiceCache:
    """One machine identity's choices: ``get(key)`` / ``put(key, value)`` (JSON values). ``put``
    merges with what is on disk (another process may have added entries) and replaces the file
    atomically."""

    def __init__(self, directory: Path | None, identity: dict[str, Any], kind: str) -> None:
        digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.identity = identity
        self.path = directory / f"{kind}-{digest}.json" if directory is not None else None
        self._entries: dict[str, Any] = self._read()

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.debug("kernel choice cache %s unreadable (%s); timing again", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("identity") != self.identity:
            return {}
        entries = data.get("choices")
        return entries if isinstance(entries, dict) else {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        return self._entries.get(key)

    def put(self, key: str, value: Any) -> None:
        self._entries[key] = value
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), **self._entries}
            tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps({"identity": self.identity, "choices": merged}, indent=1, sort_keys=True),
                           encoding="utf-8")
            os.replace(tmp, self.path)
            self._entries = merged
        except OSError as exc:
            logger.debug("kernel choice cache %s not written (%s)", self.path, exc)


_CACHES: dict[tuple[str, int, str], ChoiceCache] = {}


def for_this_machine(kind: str) -> ChoiceCache:
    """The cache of ``kind`` choices for this machine identity at the current thread count (one
    object per process and identity; the directory is re-read from the environment each call)."""
    import torch

    directory = select.choice_cache_dir()
    key = (kind, torch.get_num_threads(), str(directory))
    if key not in _CACHES:
        _CACHES[key] = ChoiceCache(directory, machine_identity(key[1]), kind)
    return _CACHES[key]
