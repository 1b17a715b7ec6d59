"""Which CPU kernels run here: the one place that reads the ``PAGODA_CPU_*`` environment
variables and the CPU's features and decides.

- The instruction-set level (``isa()``): the best of ``scalar < avx2 < avx512 < amx`` this CPU
  runs, or the one ``PAGODA_CPU_ISA`` forces (``auto`` by default; a level above what the CPU
  runs is an error, not a crash). Each level maps to one compiled variant of the kernel library
  (``variant()``): ``amx`` runs the ``avx512`` library with its AMX kernel allowed (that file is
  compiled with AMX instructions inside it), ``avx512`` the same library without AMX.
- Whether the kernels run at all (``PAGODA_CPU_KERNELS=0`` turns every C++ kernel off), whether
  the fused decode blocks do (``PAGODA_CPU_FUSED_DECODE=0``), which product kernel the linear
  layers use (``PAGODA_CPU_GEMM``, ``gemm_mode()``; the per-shape timing that ``auto`` runs lives
  with the layers, pagoda/layers/cpu_gemm.py), and whether the library is rebuilt from
  pagoda/kernels/csrc at first use (``PAGODA_CPU_KERNELS_JIT=1``, for kernel developers), and
  where the timed choices are kept between starts (``PAGODA_CPU_CHOICE_CACHE``, ``choice_cache_dir()``).
- Whether the avx2 variant's int8/int4 kernels use AVX-VNNI (256-bit ``vpdpbusd``) where the CPU
  has it (``PAGODA_CPU_VNNI=0`` keeps them on plain AVX2, ``avx_vnni()``).

Reads no torch, so the config layer and ``pagoda env`` can ask it cheaply.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from pagoda import cpu_features
from pagoda.env_vars import env_mode, env_off

ISA_VAR = "PAGODA_CPU_ISA"
KERNELS_VAR = "PAGODA_CPU_KERNELS"
FUSED_DECODE_VAR = "PAGODA_CPU_FUSED_DECODE"
GEMM_VAR = "PAGODA_CPU_GEMM"
JIT_VAR = "PAGODA_CPU_KERNELS_JIT"
CHOICE_CACHE_VAR = "PAGODA_CPU_CHOICE_CACHE"
VNNI_VAR = "PAGODA_CPU_VNNI"

LEVELS = ("scalar", "avx2", "avx512", "amx")
GEMM_MODES = ("auto", "onednn", "torch", "gemv", "amx", "panel")
# The CPU flags (as /proc/cpuinfo names them) each level's compiled code needs.
NEEDS: dict[str, frozenset[str]] = {
    "scalar": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd",
                         "avx512_vnni", "avx512_bf16"}),
    "amx": frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd",
                      "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}),
}
# The compiled library each level runs.
VARIANT_OF = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512", "amx": "avx512"}


def kernels_enabled() -> bool:
    """Whether the C++ CPU kernels may run at all (``PAGODA_CPU_KERNELS=0``: none do)."""
    return not env_off(KERNELS_VAR)


def fused_decode_enabled() -> bool:
    """Whether the fused decode blocks may run (``PAGODA_CPU_FUSED_DECODE=0``: op by op)."""
    return kernels_enabled() and not env_off(FUSED_DECODE_VAR)


def avx_vnni(flags: frozenset[str] | None = None) -> bool:
    """Whether the avx2 variant's int8/int4 kernels take their AVX-VNNI path: the CPU has
    ``avx_vnni`` and ``PAGODA_CPU_VNNI`` is not ``0`` (the avx512 variant has VNNI throughout)."""
    flags = cpu_features.cpu_flags() if flags is None else flags
    return "avx_vnni" in flags and not env_off(VNNI_VAR)


def jit_requested() -> bool:
    """Whether the kernel library is to be rebuilt from its sources (``PAGODA_CPU_KERNELS_JIT=1``)."""
    return os.environ.get(JIT_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def gemm_mode() -> str:
    """``PAGODA_CPU_GEMM``: auto (timed per shape), onednn, torch, gemv, amx or panel."""
    return env_mode(GEMM_VAR, GEMM_MODES)


def choice_cache_dir() -> Path | None:
    """Where the timed kernel choices are kept (pagoda/kernels/choice_cache.py):
    ``PAGODA_CPU_CHOICE_CACHE`` (a directory; ``off`` or ``0``: nowhere, every start times
    again), else ``$PAGODA_CACHE_DIR/kernel-choices``, else ``$XDG_CACHE_HOME/pagoda/kernel-choices``,
    else ``~/.cache/pagoda/kernel-choices``."""
    value = os.environ.get(CHOICE_CACHE_VAR, "").strip()
    if value.lower() in ("off", "0", "false", "no", "none"):
        return None
    if value:
        return Path(value).expanduser()
    if os.environ.get("PAGODA_CACHE_DIR"):
        return Path(os.environ["PAGODA_CACHE_DIR"]).expanduser() / "kernel-choices"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pagoda" / "kernel-choices"


def supported_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The levels this CPU runs, lowest first (x86 only above ``scalar``; on ARM the scalar
    variant is the one built, and it has NEON through vec.h)."""
    flags = cpu_features.cpu_flags() if flags is None else flags
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["scalar"]
    return [level for level in LEVELS if NEEDS[level] <= flags]


def supported_variants(flags: frozenset[str] | None = None) -> list[str]:
    """The kernel library variants this CPU runs, lowest first (AMX runs in the avx512 one)."""
    return list(dict.fromkeys(VARIANT_OF[level] for level in supported_levels(flags)))


@dataclass(frozen=True)
class IsaChoice:
    """The chosen level, the library variant it runs, and why (for the log and ``pagoda env``)."""

    level: str
    variant: str
    reason: str


def choose(requested: str | None = None, flags: frozenset[str] | None = None) -> IsaChoice:
    """The level to run: ``requested`` (default ``PAGODA_CPU_ISA``, ``auto``) where this CPU runs
    it, else the best it runs. Raises ValueError for an unknown name or a level the CPU lacks."""
    requested = (os.environ.get(ISA_VAR, "auto") if requested is None else requested).strip().lower() or "auto"
    levels = supported_levels(flags)
    if requested == "auto":
        level = levels[-1]
        why = f"the best this CPU runs ({ISA_VAR}=auto)"
        if level != LEVELS[-1] and platform.machine().lower() in ("x86_64", "amd64"):
            above = LEVELS[LEVELS.index(level) + 1]
            have = cpu_features.cpu_flags() if flags is None else flags
            why += f"; {above} needs {', '.join(sorted(NEEDS[above] - have))}"
        return IsaChoice(level, VARIANT_OF[level], why)
    if requested not in LEVELS:
        raise ValueError(f"{ISA_VAR}={requested!r} is not one of auto, {', '.join(LEVELS)}")
    if requested not in levels:
        raise ValueError(f"{ISA_VAR}={requested} but this CPU runs only {', '.join(levels)}")
    return IsaChoice(requested, VARIANT_OF[requested], f"forced by {ISA_VAR}={requested}")


def isa() -> IsaChoice:
    """``choose()`` for this process (asked once per call: cheap, no caching, so tests may change
    the environment)."""
    return choose()


def amx_allowed() -> bool:
    """Whether the AMX tile kernel may run: the chosen level is ``amx``."""
    try:
        return isa().level == "amx"
    except ValueError:
        return False
