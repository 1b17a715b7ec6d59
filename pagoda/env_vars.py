"""Environment switches shared by the kernel choices (``PAGODA_CPU_GEMM``, ``PAGODA_FP8_MATMUL``,
``PAGODA_PREFILL_KERNEL``, ``PAGODA_SKINNY_GEMM``) and the on-by-default switches
(``PAGODA_CPU_KERNELS``, ``PAGODA_GC_FREEZE``, ...): one way to read and check them."""
from __future__ import annotations

import os


def env_mode(name: str, modes: tuple[str, ...], default: str = "auto") -> str:
    """Environment variable ``name`` lower-cased (``default`` when unset or empty); a value not
    in ``modes`` is a ``ValueError`` that names the variable and the choices."""
    value = os.environ.get(name, default).strip().lower() or default
    if value not in modes:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(modes)}")
    return value


def env_off(name: str) -> bool:
    """Whether an on-by-default switch ``name`` is turned off (``0``, ``false``, ``no``, ``off``)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")
