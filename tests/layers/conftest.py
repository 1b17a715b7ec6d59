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
