"""Programmatic dependent launch (PDL) of the decode path's Triton kernels, on Hopper and later.

In a stream (and in a CUDA graph) a kernel normally starts only once the kernel before it has
finished and its writes are flushed, and then pays its own launch: at batch 1 a decode step is
a few hundred kernels of a few microseconds each, and those gaps are a large share of the step.
With PDL (sm_90+) a kernel launched with ``launch_pdl`` may be scheduled while the one before
it still runs. Every kernel here that takes ``PDL`` begins with ``pdl_enter``: it lets the
next kernel be scheduled (``gdc_launch_dependents``), then waits until every kernel before it
has completed with its memory visible (``gdc_wait``) before it reads or writes anything. So
the results are the same bits; only the gaps change. A kernel launched without the attribute
(cuBLAS, torch's own) waits for the one before it as usual, and one after it as usual too.

``PAGODA_PDL``: ``1`` launches with PDL where the device has it (compute capability 9.0+, not
under Triton's interpreter); unset or ``0``, off (the default until a card has measured it:
``pagoda bench gpu all``'s ``pdl`` stage). ``launch_options(device)`` is the one place that
decides; launch sites spread it into the kernel call.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch

from pagoda.kernels.triton_import import HAS_TRITON, tl, triton

ENV = "PAGODA_PDL"
MIN_CAPABILITY = (9, 0)


def requested() -> bool:
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: asked for, a CUDA device of compute
    capability 9.0 or more, and a Triton with grid dependency control, compiling (not
    interpreting)."""
    if not requested() or device.type != "cuda" or not TRITON_HAS_PDL or triton.knobs.runtime.interpret:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= MIN_CAPABILITY


def launch_options(device: torch.device) -> dict[str, Any]:
    """What a launch of a ``PDL``-taking kernel on ``device`` adds to its call: the constexpr
    and Triton's launch option, or nothing (the kernel then compiles without either)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {}


# Triton releases before grid dependency control lack these: PDL is then never enabled.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    TRITON_HAS_PDL = False
else:
    TRITON_HAS_PDL = True

if HAS_TRITON:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """First statement of a kernel that may be launched with PDL: let the next kernel be
        scheduled, then wait for every kernel before this one (their writes visible)."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
