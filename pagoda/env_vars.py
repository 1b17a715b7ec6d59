"""Environment switches shared by the kernel choices (``PAGODA_CPU_GEMM``, ``PAGODA_FP8_MATMUL``,
``PAGODA_PREFILL_KERNEL``, ``PAGODA_SKINNY_GEMM``) and the on-by-default switches
(``PAGODA_CPU_KERNELS``, ``PAGODA_GC_FREEZE``, ...): one way to read and check them; and
Triton's interpreter switched on where no GPU is (``interpret_triton_without_a_gpu``)."""
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


# Device files of an NVIDIA GPU (Linux), or of WSL 2's GPU bridge.
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/dxg")


def interpret_triton_without_a_gpu() -> bool:
    """Set ``TRITON_INTERPRET=1`` on a machine with no GPU device file, unless the variable is
    set; whether it did. Triton decides per kernel when the kernel's module is imported, so this
    must run before anything imports triton: the ``pagoda`` command calls it first, so that a
    Triton kernel called on CPU tensors (the GPU benchmark's dry run, a forced ``triton``
    backend) runs under the interpreter instead of failing for want of a driver. The engine's
    own CPU paths never call Triton kernels."""
    if "TRITON_INTERPRET" in os.environ or any(os.path.exists(p) for p in GPU_DEVICE_FILES):
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True
