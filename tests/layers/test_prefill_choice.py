"""The GPU prefill's kernel choice (``prefill_choice.py``): measured once per shape class, the
faster kept, a failing flash build losing its class, the environment override, which steps the
flash candidate may take and how its arguments map onto torch's varlen kernel. On a GPU the real
flash kernel is compared with the Triton one; on CPU a reference attention stands in for it."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers.attention import prefill_choice as pc  # noqa: E402
from pagoda.layers.attention import triton_backend  # noqa: E402
from pagoda.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.layers.test_triton_attention import (DEVICE, assert_matches, cuda_only, make_batch,  # noqa: E402
                                                reference)

NEEDS_TRITON = True


def _meta(query_lens: list[int], context_lens: list[int]):
    return make_batch(torch.Generator().manual_seed(0), query_lens, context_lens, 4, 2, 16, 4).meta


def _kernels(calls: list[str]):
    def kernel(name: str):
        return lambda: calls.append(name) or torch.full((1,), float(len(name)))
    return kernel("triton"), kernel("flash")


def test_measures_once_per_class_and_keeps_the_faster(monkeypatch):
    monkeypatch.delenv(pc.ENV, raising=False)
    speeds = {"triton": 2.0, "flash": 1.0}
    choice = pc.PrefillChoice(timer=lambda fn: speeds["triton" if fn() == 6 else "flash"])
    q, k = torch.zeros(10, 4, 16), torch.zeros(10, 2, 16)
    calls: list[str] = []
    triton, flash = _kernels(calls)
    meta = _meta([6, 4], [0, 0])
    choice.run(q, k, meta, triton, flash)
    assert choice.winners == {(4, 2, 16, torch.float32, 4, 3): "flash"}
    calls.clear()
    assert choice.run(q, k, meta, triton, flash).item() == 5.0 and calls == ["flash"]  # no second measurement
    # Another class (more tokens) is measured on its own, and here Triton wins it.
    speeds.update(triton=0.5)
    calls.clear()
    choice.run(torch.zeros(40, 4, 16), k, _meta([30, 10], [0, 0]), triton, flash)
    assert calls.count("triton") >= 2 and choice.winners[(4, 2, 16, torch.float32, 6, 5)] == "triton"
    assert choice.winners[(4, 2, 16, torch.float32, 4, 3)] == "flash"


def test_a_failing_flash_build_loses_its_class(monkeypatch):
    monkeypatch.delenv(pc.ENV, raising=False)
    choice = pc.PrefillChoice(timer=lambda fn: pytest.fail("nothing to time once flash failed"))

    def flash():
        raise RuntimeError("FlashAttention only supports head dimension at most 256")

    out = choice.run(torch.zeros(3, 4, 512), torch.zeros(3, 4, 512), _meta([3], [0]), lambda: torch.ones(1), flash)
    assert out.item() == 1.0 and list(choice.winners.values()) == ["triton"]


def test_the_environment_forces_a_kernel(monkeypatch):
    choice = pc.PrefillChoice(timer=lambda fn: pytest.fail("a forced kernel is not measured"))
    calls: list[str] = []
    triton, flash = _kernels(calls)
    for mode in ("triton", "flash"):
        monkeypatch.setenv(pc.ENV, mode)
        choice.run(torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), _meta([3], [0]), triton, flash)
    assert calls == ["triton", "flash"] and not choice.winners
    monkeypatch.setenv(pc.ENV, "fastest")
    with pytest.raises(ValueError, match="PAGODA_PREFILL_KERNEL"):
        choice.run(torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), _meta([3], [0]), triton, flash)


def test_which_steps_the_flash_candidate_takes(monkeypatch):
    monkeypatch.setattr(pc, "_on_cuda", lambda q: True)
    monkeypatch.setattr(pc, "_varlen_params", lambda: {"scale", "window_size", "enable_gqa"})
    q, k, fresh = torch.zeros(5, 4, 16, dtype=torch.bfloat16), torch.zeros(5, 2, 16), _meta([3, 2], [0, 0])
    args = dict(scale=0.3, k_scale=None, softcap=None, sinks=None, attention_chunk_size=None, sliding_window=None)
    assert pc.flash_applies(q, k, meta=fresh, **args)
    assert not pc.flash_applies(q, k, meta=_meta([3, 2], [0, 7]), **args)  # a prefix in the cache
    assert not pc.flash_applies(q.float(), k, meta=fresh, **args)
    for option, value in (("k_scale", torch.ones(1)), ("softcap", 30.0), ("sinks", torch.ones(4)),
                          ("attention_chunk_size", 8)):
        assert not pc.flash_applies(q, k, meta=fresh, **dict(args, **{option: value}))
    assert pc.flash_applies(q, k, meta=fresh, **dict(args, sliding_window=4))
    # An older torch: no window, no grouped heads, no scale argument.
    monkeypatch.setattr(pc, "_varlen_params", lambda: {"is_causal"})
    assert not pc.flash_applies(q, k, meta=fresh, **dict(args, sliding_window=4))
    assert not pc.flash_applies(q, k, meta=fresh, **args)  # 4 query heads over 2 KV heads
    assert not pc.flash_applies(q, q, meta=fresh, **args)  # a scale other than the kernel's default
    assert pc.flash_applies(q, q, meta=fresh, **dict(args, scale=16 ** -0.5))
    monkeypatch.setattr(pc, "_varlen_params", lambda: set())  # no varlen kernel in this torch
    assert not pc.flash_applies(q, q, meta=fresh, **dict(args, scale=16 ** -0.5))


def test_flash_arguments_follow_the_step(monkeypatch):
    seen: dict = {}

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.update(cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), max_q=max_q, max_k=max_k, **kwargs)
        return q

    monkeypatch.setattr(pc, "_varlen_attn", lambda: varlen)
    monkeypatch.setattr(pc, "_varlen_params", lambda: {"scale", "window_size", "enable_gqa"})
    meta = _meta([3, 5], [0, 0])
    pc.flash_prefill(torch.zeros(8, 4, 16), torch.zeros(8, 2, 16), torch.zeros(8, 2, 16), meta, 0.3, 6)
    assert seen == dict(cu_q=[0, 3, 8], cu_k=[0, 3, 8], max_q=5, max_k=5, scale=0.3, window_size=(5, 0),
                        enable_gqa=True)
    seen.clear()
    monkeypatch.setattr(pc, "_varlen_params", lambda: {"is_causal"})
    pc.flash_prefill(torch.zeros(8, 2, 16), torch.zeros(8, 2, 16), torch.zeros(8, 2, 16), meta, 0.25, None)
    assert seen["is_causal"] is True and "window_size" not in seen and "scale" not in seen


def test_backend_serves_fresh_prompts_from_the_measured_winner(monkeypatch):
    """The backend routes a fresh-prompt step through the choice (a reference attention standing
    in for the flash kernel on CPU): same output as the Triton kernel, winner kept; a step with a
    cached prefix goes straight to Triton."""
    monkeypatch.delenv(pc.ENV, raising=False)
    gen = torch.Generator().manual_seed(3)
    batch = make_batch(gen, [9, 4], [0, 0], 4, 2, 16, 4)
    flashed: list[int] = []

    def stand_in(q, k, v, meta, scale, sliding_window):
        flashed.append(q.shape[0])
        return reference(q, batch.k_full, batch.v_full, meta, scale).to(q.dtype)

    monkeypatch.setattr(triton_backend, "flash_applies", lambda q, k, scale, *a: not any(a[-1].context_lens_cpu))
    monkeypatch.setattr(triton_backend, "flash_prefill", stand_in)
    backend = TritonAttentionBackend()

    def timer(fn) -> float:  # the stand-in for flash is the faster
        before = len(flashed)
        fn()
        return 1.0 if len(flashed) > before else 2.0

    backend.prefill_choice.timer = timer
    k_cache, v_cache = batch.k_prefix.clone(), batch.v_prefix.clone()
    out = backend.forward(batch.q, batch.k_new, batch.v_new, k_cache, v_cache, batch.meta, batch.scale)
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale), torch.float32)
    assert list(backend.prefill_choice.winners.values()) == ["flash"]
    flashed.clear()
    again = backend.forward(batch.q, batch.k_new, batch.v_new, k_cache, v_cache, batch.meta, batch.scale)
    assert flashed == [13] and torch.allclose(again, out, atol=1e-5)
    extend = make_batch(gen, [3], [6], 4, 2, 16, 4)
    flashed.clear()
    backend.forward(extend.q, extend.k_new, extend.v_new, extend.k_prefix.clone(), extend.v_prefix.clone(),
                    extend.meta, extend.scale)
    assert not flashed


@cuda_only
@pytest.mark.parametrize("window", [None, 64])
def test_flash_prefill_matches_triton_on_the_gpu(window):
    """torch's varlen flash kernel and the Triton prefill give the same attention (GQA, bf16)."""
    gen = torch.Generator().manual_seed(5)
    batch = make_batch(gen, [300, 17, 129], [0, 0, 0], 8, 2, 128, 16, torch.bfloat16)
    meta = batch.meta
    if not pc.flash_applies(batch.q, batch.k_new, batch.scale, None, None, None, None, window, meta):
        pytest.skip("this torch has no varlen flash kernel for this step")
    flash = pc.flash_prefill(batch.q, batch.k_new, batch.v_new, meta, batch.scale, window)
    assert_matches(flash, reference(batch.q, batch.k_full, batch.v_full, meta, batch.scale, window=window),
                   torch.bfloat16)
    assert DEVICE == "cuda"


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
