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


def has_native_bf16() -> bool:
    """bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16), which oneDNN's bfloat16
    matmuls use; without them bfloat16 is emulated and slower than float32."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def prefers_bf16() -> bool:
    """Whether ``--dtype auto`` should run a half-precision checkpoint in bfloat16 here: only with
    AMX tiles, where a bf16 matmul is several times a float32 one end to end. AVX512-BF16 alone
    speeds prefill up by about 1.4x but batch-1 decode (memory-bound, and the fp32-only C++
    attention kernel) runs slower than float32, so such CPUs keep float32 by default."""
    return "amx_bf16" in cpu_flags()
