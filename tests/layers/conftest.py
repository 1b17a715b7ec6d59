"""Run pagoda's Triton kernels on hosts without CUDA through Triton's interpreter.

The interpreter has to be on before ``triton`` is first imported: Triton decorates its own
library functions (``tl.sum``, ``tl.max``, ...) at import time. This conftest switches it on
as early as pytest allows for this folder. If some earlier test module imported Triton first,
the kernel tests cannot run in this process; they then skip, and each module's
``test_rerun_in_fresh_process`` runs the module again in a child process instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

RERUN_TEST = "test_rerun_in_fresh_process"
_CHILD_FLAG = "PAGODA_TRITON_TEST_CHILD"


def triton_runs_in_process() -> bool:
    """Whether Triton kernels can run in this process (CUDA, or a correctly started interpreter)."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return HAS_CUDA or isinstance(tl.standard.sum, InterpretedFunction)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if triton_runs_in_process():
        return
    if os.environ.get(_CHILD_FLAG) == "1":
        # The child exists to run the kernels; skipping them there would hide the tests.
        raise pytest.UsageError("triton cannot run kernels even in a fresh process")
    skip = pytest.mark.skip(reason="triton was imported before its interpreter was enabled; "
                                   f"{RERUN_TEST} covers these tests in a child process")
    for item in items:
        module = getattr(item, "module", None)
        if getattr(module, "NEEDS_TRITON", False) and item.originalname != RERUN_TEST:
            item.add_marker(skip)


@pytest.fixture
def rerun_module_in_fresh_process(request: pytest.FixtureRequest) -> Callable[[], None]:
    """Runs the requesting test module in a new Python process with the interpreter enabled
    (skips when the kernels could run in this process)."""

    def run() -> None:
        if triton_runs_in_process():
            pytest.skip("the kernels ran in this process")
        env = dict(os.environ, **{_CHILD_FLAG: "1"})
        if not HAS_CUDA:
            env["TRITON_INTERPRET"] = "1"
        path = Path(request.node.path)
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
            env=env, capture_output=True, text=True, timeout=600, cwd=path.parents[2])
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

    return run


# Compiles kernels for an H100/H200 (sm_90) in a child process without the interpreter. Needs
# no GPU: Triton lowers to PTX and its bundled ptxas assembles it. Catches what the
# interpreter lets through but the compiler rejects, and register spills.
_HOPPER_PRELUDE = r'''
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def compile_kernel(fn, types, constexprs, num_warps, num_stages, launch_pdl=False):
    if "PDL" in fn.arg_names:  # launched with programmatic dependent launch or not (layers/pdl.py)
        constexprs = dict(constexprs, PDL=launch_pdl)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    # What launches specialise on in practice: 16-byte aligned pointers, strides multiple of 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in constexprs and (sig[n].startswith("*") or n.startswith("stride_"))}
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": launch_pdl})
    if launch_pdl:  # the kernel lets the next one start, then waits for the ones before it
        ptx = kernel.asm["ptx"]
        assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx, fn.__name__
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    assert stack == 0, f"{fn.__name__} {constexprs}: spills ({usage.strip()})"
    print(fn.__name__ + (" PDL" if launch_pdl else ""), re.search(r"REG:\d+", usage).group(0), flush=True)
'''


@pytest.fixture
def compile_for_hopper() -> Callable[[str], str]:
    """Runs ``script`` (which may call ``compile_kernel``) in a child without the interpreter."""
    try:
        import triton
    except ImportError:
        pytest.skip("triton is not installed")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                       "cuobjdump")):
        pytest.skip("this triton build carries no NVIDIA toolchain")

    def run(script: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        proc = subprocess.run([sys.executable, "-c", _HOPPER_PRELUDE + script], env=env,
                              capture_output=True, text=True, timeout=600,
                              cwd=Path(__file__).parents[2])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return proc.stdout

    return run
