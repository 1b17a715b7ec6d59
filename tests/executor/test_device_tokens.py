"""``DeviceTokens`` (async scheduling's greedy ids left on the device) and the placeholder fill
that gathers from them: on CPU, and on CUDA where the copy to pinned host memory and its event
are real."""
from __future__ import annotations

import pytest
import torch

from pagoda.engine.async_scheduling import fill_placeholders
from pagoda.executor.sampler import DeviceTokens, Sampler
from pagoda.step import ModelOutput

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_ids_fill_the_next_step_on_the_device_and_resolve_on_the_host(device):
    logits = torch.randn(5, 50, device=device)
    logits[3, 7] = float("nan")  # finite_logits: a NaN never wins
    logits[3, 7 + 1] = 1e4
    ids = DeviceTokens(Sampler.greedy_on_device(logits, [0, 2, 3]), ["a", "b", "c"])
    want = [int(logits[i].nan_to_num(-1e9).argmax()) for i in (0, 2, 3)]
    out = ModelOutput(pending=ids)
    # The next step: placeholders of "c" and "a" (and one of a sequence that got no token) in rows 1, 4, 0.
    input_ids = torch.full((6,), -1, dtype=torch.long, device=device)
    fill_placeholders(input_ids, [1, 4, 0], ["c", "a", "gone"], out)
    assert input_ids.tolist() == [0, want[2], -1, -1, want[0], -1]
    assert not out.results and out.resolve() is out
    assert {k: v.token_ids for k, v in out.results.items()} == {"a": [want[0]], "b": [want[1]], "c": [want[2]]}
    assert ids.resolved and out.resolve().results["c"].token_ids == [8]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_in_the_logits_dtype_picks_what_float32_picks(device, dtype):
    """Greedy ids without widening the logits: NaN never wins, +inf ties keep the first, an all
    -inf row gives 0, exact ties keep the first index, as argmax of the float32 finite logits."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 300, generator=gen).to(dtype)
    logits[0, 5] = float("nan")
    logits[0, 9] = logits[0].nan_to_num(-1e4).max() + 1  # beside a NaN
    logits[1, 40] = logits[1, 200] = float("inf")
    logits[2] = float("-inf")
    logits[3, 11] = logits[3, 250] = 100.0  # an exact tie
    logits[4, :] = float("nan")
    logits[4, 299] = -5.0
    logits = logits.to(device)
    rows = [0, 1, 2, 3, 4, 5]
    got = Sampler.greedy_on_device(logits, rows).tolist()
    reference = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max,
                                 neginf=float("-inf")).argmax(-1).tolist()
    assert got == reference and got[:5] == [9, 40, 0, 11, 299]
