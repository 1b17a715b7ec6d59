"""The compiled kernel library: its sources, its variants' compiler flags, and loading the one
this process runs.

One library holds every C++ CPU kernel (pagoda/kernels/csrc: gemv, paged attention, the
elementwise ops, MoE experts, weight-only quantized, AMX and panel matmuls, the fused decode
blocks), so kernels that use one another call each other directly. It registers them with torch's
dispatcher as one op table (csrc/bindings.cpp) in a namespace of its own per variant
(``pagoda_avx2``, ...; a JIT build's ends in ``_jit``), so that several variants load in one
process. ``ops()`` is the op namespace (``torch.ops.<namespace>``) of the variant ``select.isa()``
chose, ``library(variant)`` any variant's: the rest of the code calls ``ops().gemv(...)`` and never
spells a namespace.

It is compiled once per instruction-set variant (``VARIANTS``) when the package is installed
(setup.py builds ``pagoda.kernels._C_<variant>`` for each, in parallel); importing that Python
module loads the library and registers its ops. Kernel developers get a rebuild from the sources
instead, into the torch extensions cache under a name that includes the variant, its flags, the
sources and torch's version: when ``PAGODA_CPU_KERNELS_JIT=1``, when no installed library exists
(a source checkout run in place), or when a source file is newer than the installed library (an
edited kernel).

This file imports nothing of pagoda or torch at module level: setup.py loads it by path.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# The translation units of the library (headers are found by the include path).
SOURCES = ("bindings.cpp", "gemv.cpp", "attention.cpp", "fused.cpp", "moe.cpp", "woq.cpp", "amx.cpp", "panel.cpp",
           "decode.cpp", "bitmask.cpp")

_X86 = platform.machine().lower() in ("x86_64", "amd64")
# Compiler flags of each variant (beyond -O3 -fopenmp -std=c++17). The scalar variant is the
# baseline of the architecture (SSE2 on x86-64, NEON on aarch64).
VARIANTS: dict[str, list[str]] = {
    "scalar": [],
    "avx2": ["-march=x86-64-v3"],  # AVX2, FMA, F16C, BMI1/2
    "avx512": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],  # + AVX-512 F/BW/DQ/VL/CD, VNNI, BF16
} if _X86 else {"scalar": []}
COMMON_FLAGS = ["-O3", "-fopenmp", "-DPAGODA_KERNELS"]


def compile_flags(variant: str) -> list[str]:
    """Every flag the variant's sources are compiled with."""
    return [*COMMON_FLAGS, *VARIANTS[variant], f"-DPAGODA_VARIANT_NAME={variant}"]


def jit_flags(variant: str) -> list[str]:
    """A JIT build's flags: the variant's, with an op namespace of its own (``pagoda_<variant>_jit``),
    so that it loads beside the installed library of the same variant."""
    return [*compile_flags(variant), f"-DPAGODA_OPS_NAMESPACE=pagoda_{variant}_jit"]


def module_name(variant: str) -> str:
    """The installed library's module name for ``variant``."""
    return f"pagoda.kernels._C_{variant}"


def source_digest() -> str:
    """A hash of every file in csrc (sources and headers)."""
    h = hashlib.sha1()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _newest_source() -> float:
    return max((p.stat().st_mtime for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")), default=0.0)


def _installed(variant: str) -> ModuleType | None:
    """The library setup.py built for ``variant``, or None where there is none or a source in csrc
    is newer than it (a kernel being edited in a source checkout)."""
    spec = importlib.util.find_spec(module_name(variant))
    if spec is None or spec.origin is None:
        return None
    import torch  # noqa: F401 - loads libc10 and libtorch, which the library links against
    # Only in a source checkout (an installed wheel's files all carry their extraction time).
    if (CSRC.parents[2] / "setup.py").exists() and _newest_source() > os.path.getmtime(spec.origin):
        logger.info("kernel sources are newer than %s; rebuilding from them", spec.origin)
        return None
    installed = importlib.import_module(module_name(variant))
    if not hasattr(installed, "ops_namespace"):  # a build from before the op table
        logger.info("%s predates the kernel op table; rebuilding from the sources", spec.origin)
        return None
    return installed


def jit_name(variant: str) -> str:
    """The JIT build's name: variant, flags, sources and torch version all change it, so a cache
    shared between machines or torch versions never hands one the other's code."""
    import torch

    key = "\0".join([variant, *jit_flags(variant), torch.__version__, source_digest()])
    return f"pagoda_kernels_{variant}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def _jit(variant: str) -> ModuleType:
    """Build (or find already built) the library from csrc with the torch extensions toolchain."""
    from torch.utils import cpp_extension

    name = jit_name(variant)
    directory = cpp_extension._get_build_directory(name, verbose=False)
    so, lock = os.path.join(directory, f"{name}.so"), os.path.join(directory, "lock")
    # An earlier build of these exact sources, imported directly: load() would take the build
    # directory's lock and run ninja just to find nothing to do, and a process killed while
    # holding the lock would leave every later start waiting. A fresh lock may be a build in
    # progress: leave that to load().
    if os.path.exists(so) and not (os.path.exists(lock) and time.time() - os.path.getmtime(lock) < 600):
        try:
            return cpp_extension._import_module_from_library(name, directory, True)
        except Exception:  # a partial or stale build: rebuild
            pass
    logger.warning("building the %s CPU kernel library from %s (a few minutes on 2 cores; "
                   "`pip install -e .` builds it ahead of time)", variant, CSRC)
    start = time.perf_counter()
    module = cpp_extension.load(name, [str(CSRC / s) for s in SOURCES], extra_cflags=jit_flags(variant),
                                extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], verbose=False)
    logger.info("%s kernel library built in %.1fs", variant, time.perf_counter() - start)
    return module


_MODULES: dict[str, ModuleType | None] = {}
_LOGGED: set[str] = set()


def module(variant: str) -> ModuleType | None:
    """The Python module of ``variant``'s library (installed, else built from csrc; its import
    registers the ops), or None where it cannot be had (no compiler and no installed build).
    It carries ``variant``, ``ops_namespace`` and ``__file__``."""
    if variant not in _MODULES:
        from pagoda.kernels import select

        loaded = None
        try:
            loaded = None if select.jit_requested() else _installed(variant)
            if loaded is None:
                loaded = _jit(variant)
        except Exception as exc:  # no compiler, no ninja, a broken build ...
            logger.warning("CPU kernel library %s unavailable (%s); the torch paths serve", variant, exc)
        _MODULES[variant] = loaded
    return _MODULES[variant]


def library(variant: str):
    """The op namespace (``torch.ops.<namespace>``) of ``variant``'s library, or None where it
    cannot be had. Several variants may be loaded at once."""
    loaded = module(variant)
    if loaded is None:
        return None
    import torch

    return getattr(torch.ops, loaded.ops_namespace)


def ops():
    """The op namespace of the variant this process runs (``select.isa()``): ``ops().gemv(x, w)``;
    None where the kernels are off (``PAGODA_CPU_KERNELS=0``) or unavailable. Logs the choice once."""
    from pagoda.kernels import select

    if not select.kernels_enabled():
        return None
    choice = select.isa()
    table = library(choice.variant)
    if choice.variant not in _LOGGED:
        _LOGGED.add(choice.variant)
        origin = getattr(_MODULES[choice.variant], "__file__", None) if table is not None else None
        logger.info("CPU kernels: %s (%s), library %s", choice.level, choice.reason, origin or "unavailable")
        import torch

        from pagoda.omp import threads_reason
        logger.info("CPU threads: %d (%s)", torch.get_num_threads(), threads_reason())
    return table


def variant_of(table) -> str:
    """The variant whose library registered the op namespace ``table`` (from ``ops()`` or
    ``library()``)."""
    return next(m.variant for m in _MODULES.values() if m is not None and m.ops_namespace == table.name)


class Kernel:
    """One kernel of the library: ``load()`` returns the op namespace it is called through, or None
    where the library is unavailable, the kernels are off, or ``supported()`` says this CPU or
    level cannot run it. ``what``/``fallback`` word the log line."""

    def __init__(self, name: str, what: str, fallback: str, supported=lambda: True) -> None:
        self.name, self.what, self.fallback, self.supported = name, what, fallback, supported
        self.module: object | None = None

    def load(self) -> object | None:
        """The op namespace, or None when the kernel cannot run here (``supported()`` is asked
        every time: a test or benchmark may switch a kernel off between engines)."""
        if not self.supported():
            return None
        if self.module is None:
            self.module = ops()
        return self.module

    def reset(self) -> None:
        """Forget the loaded kernel (tests that change ``PAGODA_CPU_ISA`` or ``PAGODA_CPU_KERNELS``)."""
        self.module = None


# Every kernel wrapper module, each defining a Kernel named ``_KERNEL``.
KERNEL_MODULES = (
    "pagoda.kernels.attention",
    "pagoda.kernels.gemv",
    "pagoda.kernels.amx",
    "pagoda.kernels.panel",
    "pagoda.kernels.fused",
    "pagoda.kernels.moe",
    "pagoda.kernels.woq",
    "pagoda.models.cpu_decode",
    "pagoda.structured_output.bitmask",
)


# Every op each variant's library registers, with its schema as torch prints it (the namespace
# left out): the op table of csrc/bindings.cpp. ``check_installed`` and the tests compare them.
OP_SCHEMAS: dict[str, str] = {
    "gemv": "(Tensor x, Tensor weight) -> Tensor",
    "paged_decode": "(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
                    "Tensor seq_lens, float scale, int window, Tensor? k_scale, Tensor? v_scale, float softcap) -> ()",
    "rms_norm": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "add_rms_norm": "(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor[]",
    "silu_and_mul": "(Tensor x) -> Tensor",
    "rotate": "(Tensor x, Tensor positions, Tensor cos_sin_cache) -> Tensor",
    "greedy_tokens": "(Tensor logits, int[] rows) -> int[]",
    "greedy_round": "(Tensor input_ids, Tensor positions, Tensor context_lens, Tensor seq_lens, "
                    "Tensor slot_mapping, Tensor block_tables, int block_size, Tensor? embed, int[][] ends, "
                    "int steps) -> __torch__.torch.classes.{namespace}.GreedyRound",
    "moe_experts": "(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2, int first_expert, "
                   "int intermediate) -> Tensor",
    "woq_available": "() -> bool",
    "woq_has_kind": "(int kind) -> bool",
    "woq_set_vnni": "(bool on) -> bool",
    "woq_vnni": "() -> bool",
    "woq_linear": "(Tensor(a!) out, Tensor x, Tensor weight, int kind, Tensor? col_scale, Tensor? group_scale, "
                  "Tensor? group_bias, int group_size, Tensor? aux, Tensor? bias) -> ()",
    "amx_compiled": "() -> bool",
    "amx_available": "() -> bool",
    "amx_pack": "(Tensor weight) -> Tensor",
    "amx_linear": "(Tensor x, Tensor packed, int out_features) -> Tensor",
    "panel_available": "() -> bool",
    "panel_available_bf16": "() -> bool",
    "panel_pack": "(Tensor weight) -> Tensor",
    "panel_pack_bf16": "(Tensor weight) -> Tensor",
    "panel_linear": "(Tensor x, Tensor packed, int out_features) -> Tensor",
    "apply_bitmask": "(Tensor(a!) logits, Tensor bitmask) -> ()",
    "decode_register_attn": "(Tensor[] tensors, Tensor[] qkv, Tensor[] o, int[] ints, float[] floats) -> int",
    "decode_register_mlp": "(Tensor norm_weight, Tensor[] gate_up, Tensor[] down, int[] ints, float eps) -> int",
    "decode_release": "(int handle) -> ()",
    "decode_attn_block": "(int handle, Tensor x, Tensor? residual, Tensor positions, Tensor slot_mapping, "
                         "Tensor block_tables, Tensor seq_lens) -> Tensor[]",
    "decode_mlp_block": "(int handle, Tensor x, Tensor residual, bool bf16_out) -> Tensor[]",
    "decode_layers": "(int[] attn_handles, int[] mlp_handles, Tensor x, Tensor? residual, Tensor positions, "
                     "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, bool bf16_out, Tensor? final_weight, "
                     "float final_eps) -> Tensor[]",
}


def schema_problems(namespace: str) -> list[str]:
    """What the op table registered under ``namespace`` lacks or registers under another schema
    than ``OP_SCHEMAS`` (empty when it is complete)."""
    import torch

    table = getattr(torch.ops, namespace)
    problems = []
    for name, want in OP_SCHEMAS.items():
        want = f"{namespace}::{name}" + want.format(namespace=namespace)
        try:
            got = str(getattr(table, name).default._schema)
        except AttributeError:
            problems.append(f"no {name}")
            continue
        if got != want:
            problems.append(f"{name} is {got}, not {want}")
    return problems


def check_installed() -> list[str]:
    """The variants whose installed library (what setup.py built, never a JIT build) registers
    every op of ``OP_SCHEMAS`` with its schema; ``RuntimeError`` naming what is missing or broken.
    The container build and the tests call it: an install without its kernels must fail loudly.
    A variant this CPU can run is imported and its op table read from torch; one it cannot (the
    AVX-512 library on an AVX2 CPU: loading it runs its static initializers, compiled for
    AVX-512, and the process dies of SIGILL) is checked in its file: the op table's schema
    strings, as the library registers them, must all be there."""
    import torch  # noqa: F401 - loads libc10 and libtorch, which the libraries link against

    from pagoda.kernels import select

    runnable = set(select.supported_variants())
    problems = []
    for variant in VARIANTS:
        spec = importlib.util.find_spec(module_name(variant))
        if spec is None or spec.origin is None:
            problems.append(f"{variant}: not installed ({module_name(variant)})")
            continue
        if variant not in runnable:
            missing = missing_registrations(Path(spec.origin), f"pagoda_{variant}")
            if missing:
                problems.append(f"{variant}: {spec.origin} lacks {', '.join(missing)}")
            continue
        try:
            installed = importlib.import_module(module_name(variant))
        except ImportError as exc:
            problems.append(f"{variant}: {exc}")
            continue
        if not hasattr(installed, "ops_namespace"):
            problems.append(f"{variant}: no op table (a build from before it)")
            continue
        wrong = schema_problems(installed.ops_namespace)
        if wrong:
            problems.append(f"{variant}: {'; '.join(wrong)}")
    if problems:
        raise RuntimeError("installed CPU kernel libraries incomplete: " + "; ".join(problems))
    return list(VARIANTS)


def missing_registrations(library: Path, namespace: str) -> list[str]:
    """The ops of ``OP_SCHEMAS`` whose registration string (``name(args) -> ret``, as
    csrc/bindings.cpp passes it to ``m.def``) is not in the library file ``library`` built under
    ``namespace``; read as bytes, never loaded."""
    data = library.read_bytes()
    return [name for name, schema in OP_SCHEMAS.items()
            if (name + schema.format(namespace=namespace)).encode() not in data]


def build_all() -> dict[str, bool]:
    """Load the library now and report which kernels are available. A process that would otherwise
    build it on first use inside a collective (a tensor-parallel worker) calls this beforehand so
    a cold cache cannot outlast a timeout."""
    return {name: importlib.import_module(name)._KERNEL.load() is not None for name in KERNEL_MODULES}


def packed_linear(linear_op, x, packed, out_features: int, bias):
    """``F.linear(x, weight, bias)`` through a tile kernel's op ``linear_op(rows, packed, n)``
    (float32 results) over the weight it packed: ``x``'s leading dims flattened and restored, the
    bias added, the result in ``x``'s dtype. The tile kernels' wrapper (``amx``, ``panel``)."""
    flat = x.reshape(-1, x.shape[-1])
    y = linear_op(flat, packed, out_features)
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)
