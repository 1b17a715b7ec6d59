"""What the host CPU can do natively, read from ``/proc/cpuinfo`` (no torch import, so the
config layer can ask). Used where pagoda chooses per machine, such as ``--dtype auto``."""
from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The kernel's feature flags of the first CPU; empty where there is no ``/proc/cpuinfo``."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The first CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) ..."); "" where there is no
    ``/proc/cpuinfo`` or no such line."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def has_native_bf16() -> bool:
    """bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16), which oneDNN's bfloat16
    matmuls use; without them bfloat16 is emulated and slower than float32."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def prefers_bf16() -> bool:
    """Whether ``--dtype auto`` should run a half-precision checkpoint in bfloat16 here: where the
    CPU has bfloat16 dot products (AVX512-BF16 or AMX). Decode reads half the bytes of float32
    (the fused decode blocks, the gemv kernel and the C++ decode attention take bfloat16 weights
    and caches) and oneDNN's bfloat16 matmuls serve prefill and batches: on an AVX512-BF16 CPU
    without AMX ``pagoda bench quantization`` measures bfloat16 ahead of float32 at batch 1, 8
    and 32 (docs/benchmarks.md), and AMX widens the lead. Without either, bfloat16 is emulated
    and slower than float32, so such CPUs keep float32."""
    return has_native_bf16()
