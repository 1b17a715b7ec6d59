"""Triton where it is installed: ``triton`` and ``tl`` (``triton.language``), or None for both
and ``HAS_TRITON`` False on CPU-only installs, which need not carry it. The one place the
optional import is written; the modules with Triton kernels import these names from here."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton"]
