"""A server process's start-up objects kept out of the garbage collector's full scans.

After start-up the process that runs an engine for ``pagoda serve`` tracks hundreds of thousands
of objects (torch, transformers, the model's modules, the tokenizer) that live as long as it
does; every full collection scans them all, and steps that allocate much (a large batch's
outputs) trigger one now and then: about 200 ms each on the development VM (``pagoda bench
host``, which runs with and without it). ``freeze`` moves every object alive at the end of
start-up to the permanent generation, which collections skip (as vLLM and SGLang do). The single
server's HTTP front end does the same once its engine is up (its ~360k objects: torch,
transformers, FastAPI, the tokenizers): there a full collection pauses the event loop, every
stream with it (Ray Serve does the same for each replica actor after its ``__init__``:
``RAY_SERVE_FREEZE_GC_ON_STARTUP``; the ingress's ``/health`` reports each replica's
``gc_frozen``). Only for a process that holds one engine until it exits: an engine dropped in a
process that goes on (the offline ``LLM`` in tests or a notebook, the several-models server)
must stay collectable. ``PAGODA_GC_FREEZE=0`` turns it off.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

from pagoda.env_vars import env_off

ENV = "PAGODA_GC_FREEZE"


def freeze(collect_first: bool = False) -> bool:
    """Freeze every object alive now (False, nothing done, when ``ENV`` turns it off);
    ``collect_first``: collect start-up's garbage first, so that none of it is kept."""
    if env_off(ENV):
        return False
    if collect_first:
        gc.collect()
    gc.freeze()
    return True


def frozen_count() -> int:
    """How many objects the permanent generation holds."""
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen(collect_first: bool = False) -> Iterator[None]:
    """Every object alive now frozen inside (whatever ``ENV`` says: for runs that measure with
    it or sweep often), thawed after unless objects were frozen before: Python thaws all or
    nothing, so a caller's freeze stands (and what was frozen here with it)."""
    thaw = gc.get_freeze_count() == 0
    if collect_first:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if thaw:
            gc.unfreeze()
