"""A greedy round's step in two launches (``greedy_step_kernel.py``, interpreter on CPU) against
the torch way it replaces (``finite_logits(...).argmax`` and ``StaticDecodeInputs.advance``):
the same tokens, NaN, infinities and ties included, and the same buffers after the move, a row
crossing a block boundary among them."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first ``import triton`` (see conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.executor.cuda_graphs import PAD_SLOT, StaticDecodeInputs  # noqa: E402
from pagoda.executor.greedy_step_kernel import CHUNK, greedy_step  # noqa: E402
from pagoda.executor.input import build_model_input  # noqa: E402
from pagoda.executor.sampler import Sampler  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4
VOCAB = 2 * CHUNK + 37  # three chunks, the last one partial


def _logits(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(n, VOCAB, generator=gen).to(dtype)
    logits[0, 100] = float("nan")
    logits[0, 3000] = 50.0  # row 0: a plain winner in the second chunk, a NaN elsewhere
    logits[1, 7] = 40.0
    logits[1, CHUNK + 9] = 40.0  # row 1: a tie across chunks: the first column wins
    # Row 2: +inf in the partial chunk counts as the dtype's largest finite value, which an
    # earlier column holds too: the earlier one wins, as after finite_logits.
    logits[2, VOCAB - 1] = float("inf")
    logits[2, 10] = torch.finfo(dtype).max
    logits[3] = float("nan")  # row 3: nothing but NaN: column 0, as torch's argmax of all -inf
    logits[4, :] = float("-inf")
    logits[4, 2 * CHUNK + 1] = -1e4  # row 4: one finite logit among -inf
    return logits.to(DEVICE)


def _loaded(n: int) -> StaticDecodeInputs:
    buffers = StaticDecodeInputs.allocate(8, 6, torch.device(DEVICE))
    tables = [[3, 9, 4], [7], [2, 5], [8, 1, 6], [11, 12]]
    seq_lens = [10, 4, 5, 9, 8]  # rows 1 and 4 cross into their next block with the move
    inputs = build_model_input(list(range(20, 20 + n)), [1] * n, seq_lens[:n], tables[:n], list(range(n)),
                               torch.device(DEVICE), PAGE)
    buffers.load(inputs, 8)
    return buffers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_step_equals_argmax_then_advance(dtype):
    n = 5
    logits = _logits(n, dtype)
    expected = Sampler.greedy_on_device(logits, list(range(n)))
    assert expected.tolist()[:5] == [3000, 7, 10, 0, 2 * CHUNK + 1]  # the cases are what they claim

    by_torch, by_kernel = _loaded(n), _loaded(n)
    by_torch.advance(expected, n, PAGE)
    tokens = torch.full((n,), -5, dtype=torch.long, device=DEVICE)
    greedy_step(logits, tokens, by_kernel, PAGE, True, PAD_SLOT)
    assert tokens.tolist() == expected.tolist()
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "context_lens", "block_tables"):
        assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), name
    assert by_kernel.slot_mapping[n:].tolist() == [PAD_SLOT] * 3  # padding rows untouched

    # The round's last step: the tokens only, the buffers as they were.
    before = {name: getattr(by_kernel, name).clone() for name in ("input_ids", "positions", "slot_mapping")}
    tokens.fill_(-5)
    greedy_step(logits, tokens, by_kernel, PAGE, False, PAD_SLOT)
    assert tokens.tolist() == expected.tolist()
    assert all(torch.equal(getattr(by_kernel, name), value) for name, value in before.items())


def test_a_position_past_the_table_gets_the_padding_slot():
    """A move past the block table's last column (never scheduled) writes the padding slot
    instead of reading past the row."""
    buffers = StaticDecodeInputs.allocate(2, 2, torch.device(DEVICE))
    inputs = build_model_input([1], [1], [2 * PAGE], [[3, 4]], [0], torch.device(DEVICE), PAGE)
    buffers.load(inputs, 1)
    tokens = torch.empty(1, dtype=torch.long, device=DEVICE)
    greedy_step(_logits(5, torch.float32)[:1], tokens, buffers, PAGE, True, PAD_SLOT)
    assert buffers.positions[0].item() == 2 * PAGE and buffers.slot_mapping[0].item() == PAD_SLOT


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
