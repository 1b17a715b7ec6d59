"""The batched delta against a per-row reference, in each of its ways (one adapter on every
row; segments over adjacent slots, read as views; segments over scattered slots, cut into
pieces), for plain and fused layers."""
from __future__ import annotations

import pytest
import torch

from pagoda.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagoda.lora.layers import LoRABatch, LoRALinear, LoRAState

IN, OUT, RANK, SLOTS = 24, 20, 4, 5


def make(kind: str) -> tuple[LoRALinear, dict]:
    torch.manual_seed(0)
    if kind == "merged":
        base = MergedColumnParallelLinear(IN, [OUT, OUT], False, torch.float32)
        subs = [("gate_proj", 0, OUT), ("up_proj", OUT, OUT)]
    else:
        base = RowParallelLinear(IN, OUT, True, torch.float32)
        base.bias.data.normal_()
        subs = [("down_proj", 0, OUT)]
    base.weight.data.normal_()
    wrapper = LoRALinear(base, subs, IN, SLOTS, RANK, kind == "row", LoRAState(), torch.float32, torch.device("cpu"))
    weights = {}
    for slot in range(SLOTS):
        for j, (_, _, size) in enumerate(subs):
            r = RANK if slot % 2 else RANK - 1  # ranks below the maximum are zero-padded
            a, b = torch.randn(r, IN), torch.randn(size, r)
            wrapper.set_sub(slot, j, a, b)
            weights[(slot, j)] = (a, b)
    return wrapper, weights


def reference(wrapper: LoRALinear, weights: dict, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    y = wrapper.base(x).clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for j, (_, offset, size) in enumerate(wrapper.subs):
            a, b = weights[(slot, j)]
            y[t, offset:offset + size] += b @ (a @ x[t])
    return y


@pytest.mark.parametrize("kind", ["merged", "row"])
@pytest.mark.parametrize("way, slots", [
    ("single", [3] * 7),
    ("adjacent", [1, -1, 3, 2, 3, 2, -1, 1]),  # slots 1..3, 2 rows each: views, no padding
    ("adjacent", [1, 3, 3, 0, 2, 2, 2, -1]),  # uneven segments: padded
    ("pieces", [1, -1, 3, 3, 0, -1, 1, 4, 4, 4]),  # slot 2 idle: A and B gathered
    ("pieces", [4] * 11 + [-1, 0, 1]),  # one long segment cut into pieces
])
def test_delta_matches_per_row_reference(kind, way, slots):
    wrapper, weights = make(kind)
    x = torch.randn(len(slots), IN)
    wrapper.state.batch = LoRABatch(torch.tensor(slots), torch.device("cpu"))
    batch = wrapper.state.batch
    assert (batch.single is not None) == (way == "single")
    if way != "single":
        assert (batch.slot_range is not None) == (way == "adjacent")
    torch.testing.assert_close(wrapper(x), reference(wrapper, weights, x, slots), rtol=1e-4, atol=1e-4)
    wrapper.clear_slot(3)  # a cleared slot adds nothing
    wrapper.state.batch = LoRABatch(torch.tensor([3, 3]), torch.device("cpu"))
    torch.testing.assert_close(wrapper(x[:2]), wrapper.base(x[:2]))


def test_long_segment_pieces_bound_the_padding():
    batch = LoRABatch(torch.tensor([4] * 30 + [0, 1]), torch.device("cpu"))
    # 3 x 30 padded rows would be 90; pieces of 11 rows: 3 of slot 4, 1 of slot 0, 1 of slot 1
    assert batch.pieces == 5 and batch.gather.shape == (5, 11)
    assert batch.gather.flatten()[batch.valid.flatten() > 0].sort().values.tolist() == list(range(32))


@pytest.mark.parametrize("kind", ["merged", "row"])
@pytest.mark.parametrize("slots", [[3] * 7, [1, -1, 3, 2, 3, 2, -1, 1], [-1, -1], [1, -1, 3, 3, 0, -1, 1, 4, 4, 4]])
def test_dense_delta_matches_per_row_reference(kind, slots):
    """The decode-graph way: a one-hot row per token picks its slot on the device; the result
    equals the per-row reference for any mix, rows without an adapter included."""
    wrapper, weights = make(kind)
    x = torch.randn(len(slots), IN)
    one_hot = LoRABatch.one_hot_rows(torch.tensor(slots), SLOTS, torch.float32)
    assert one_hot.shape == (len(slots), SLOTS) and one_hot.sum().item() == sum(s >= 0 for s in slots)
    wrapper.state.batch = LoRABatch.dense(one_hot)
    torch.testing.assert_close(wrapper(x), reference(wrapper, weights, x, slots), rtol=1e-4, atol=1e-4)
    wrapper.clear_slot(3)
    weights = {key: (a * 0, b) if key[0] == 3 else (a, b) for key, (a, b) in weights.items()}
    torch.testing.assert_close(wrapper(x), reference(wrapper, weights, x, slots), rtol=1e-4, atol=1e-4)
