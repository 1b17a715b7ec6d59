"""The decode graphs' one-launch input loader (``graph_inputs_kernel.py``, interpreter on CPU)
against the torch way it replaces: after every load of a sequence of batches that grow, shrink
and change table width, both sets of static buffers hold the same values."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first ``import triton`` (see conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.executor import cuda_graphs  # noqa: E402
from pagoda.executor.cuda_graphs import PAD_SLOT, StaticDecodeInputs  # noqa: E402
from pagoda.executor.input import build_model_input  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4


def _batch(n: int, width: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tables = [torch.randint(1, 500, (int(torch.randint(1, width + 1, (1,), generator=gen)),),
                            generator=gen).tolist() for _ in range(n)]
    tables[0] = tables[0] + [9] * (width - len(tables[0]))  # one row as wide as the batch
    seq_lens = [len(t) * PAGE - int(torch.randint(0, PAGE, (1,), generator=gen)) for t in tables]
    ids = torch.randint(0, 1000, (n,), generator=gen).tolist()
    return build_model_input(ids, [1] * n, seq_lens, tables, list(range(n)), torch.device(DEVICE), PAGE)


def test_kernel_load_equals_the_torch_load(monkeypatch):
    calls = []
    real = cuda_graphs.load_rows
    monkeypatch.setattr(cuda_graphs, "load_rows", lambda *a: calls.append(a[2:4]) or real(*a))
    by_torch = StaticDecodeInputs.allocate(16, 12, torch.device(DEVICE))
    by_kernel = StaticDecodeInputs.allocate(16, 12, torch.device(DEVICE))
    steps = [(7, 5, 8), (3, 2, 4), (16, 3, 16), (1, 12, 1), (9, 1, 16), (2, 2, 2)]  # (n, width, size)
    kernel = {"on": False}
    monkeypatch.setattr(cuda_graphs, "use_triton", lambda t: kernel["on"])
    for i, (n, width, size) in enumerate(steps):
        inputs = _batch(n, width, i)
        kernel["on"] = False
        by_torch.load(inputs, size)
        kernel["on"] = True
        by_kernel.load(inputs, size)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "context_lens", "block_tables"):
            assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), (i, name)
        assert by_kernel.slot_mapping[n:size].tolist() == [PAD_SLOT] * (size - n)
        assert torch.equal(by_kernel.block_tables[:n, :width], inputs.meta.block_tables)
    assert by_kernel.widest == 12
    assert calls == [(n, size) for n, _, size in steps]  # the kernel ran for by_kernel's loads only


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()


def test_step_values_pick_no_specialization():
    """The compiled kernels (a child without the interpreter) specialize on none of the values
    that change from step to step: a new specialization is a JIT compile inside a decode step.
    The loader's, and a greedy round's step (``greedy_step_kernel.py``: the token buffer's row and
    whether the round goes on change each step)."""
    import subprocess
    import sys

    script = ("from pagoda.executor import graph_inputs_kernel as g\n"
              "p = {q.name: q for q in g._load_rows_kernel.params}\n"
              "assert all(p[n].do_not_specialize for n in g._INTS), g._INTS\n"
              "assert all(getattr(p[n], 'do_not_specialize_on_alignment', True) for n in g._POINTERS)\n"
              "assert set(g._INTS) | set(g._POINTERS) <= set(p)\n"
              "from pagoda.executor import greedy_step_kernel as s\n"
              "p = {q.name: q for q in s._advance_kernel.params}\n"
              "assert p['advance'].do_not_specialize\n"
              "assert getattr(p['tokens_ptr'], 'do_not_specialize_on_alignment', True)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
