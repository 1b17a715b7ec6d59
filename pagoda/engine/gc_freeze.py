"""The engine-core process's start-up objects kept out of the garbage collector's full scans.

After start-up the process that runs an engine for ``pagoda serve`` tracks hundreds of thousands
of objects (torch, transformers, the model's modules, the tokenizer) that live as long as it
does; every full collection scans them all, and steps that allocate much (a large batch's
outputs) trigger one now and then: about 200 ms each on the development VM (``pagoda bench
host``, which runs with and without it). ``freeze`` moves every object alive at the end of
start-up to the permanent generation, which collections skip (as vLLM and SGLang do). Only for a
process that holds one engine until it exits: an engine dropped in a process that goes on (the
offline ``LLM`` in tests or a notebook) must stay collectable. ``PAGODA_GC_FREEZE=0`` turns it off.
"""
from __future__ import annotations

import gc

from pagoda.env_vars import env_off

ENV = "PAGODA_GC_FREEZE"


def freeze() -> bool:
    """Freeze every object alive now (False, nothing done, when ``ENV`` turns it off)."""
    if env_off(ENV):
        return False
    gc.freeze()
    return True
