"""``prepare_qkv`` (one launch: qk norm, rotary, KV write) against the unfused ops it replaces
(interpreter on CPU, compiled on CUDA), and the attention layer taking it end to end."""
from __future__ import annotations

import os
import zlib

import torch

if not torch.cuda.is_available():
    # Must precede the first ``import triton`` (see conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers import fused_ops as fo  # noqa: E402
from pagoda.layers.attention import kv_quant  # noqa: E402
from pagoda.layers.attention import triton_kernels as tk  # noqa: E402
from pagoda.layers.attention.triton_qkv import prepare_qkv  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def _unfused(qkv, heads, kv_heads, d, positions, table, qw, kw, eps, k_cache, v_cache, slots, ks, vs):
    """The four launches ``prepare_qkv`` replaces (the Triton ops of the layer before it)."""
    t = qkv.shape[0]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
    if qw is not None:
        q, k = fo.triton_rms_norm(q, qw, eps), fo.triton_rms_norm(k, kw, eps)
    q, k = fo.triton_apply_rotary(q, k, positions, table)
    tk.write_kv(k, v, k_cache, v_cache, slots, ks, vs)
    return q, k, v


def _caches(num_blocks: int, kv_heads: int, d: int, cache_dtype: torch.dtype, model_dtype: torch.dtype):
    dtype = cache_dtype if kv_quant.is_quantized(cache_dtype) else model_dtype
    k = torch.zeros(num_blocks, PAGE, kv_heads, d, dtype=dtype, device=DEVICE)
    scales = None
    if kv_quant.is_quantized(cache_dtype):
        scales = [torch.zeros(num_blocks, PAGE, kv_heads, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    return k, torch.zeros_like(k), *(scales or (None, None))


CASES = [
    # (dtype, heads, kv_heads, head_dim, rotary width, norm, cache dtype)
    (torch.bfloat16, 4, 2, 64, 64, True, None),
    (torch.bfloat16, 6, 2, 64, 32, True, None),  # partial rotary: the normed tail too
    (torch.float32, 3, 3, 80, 80, False, None),  # head dim not a power of two
    (torch.float16, 4, 1, 32, 16, False, None),
    (torch.bfloat16, 4, 2, 64, 64, True, torch.int8),
    (torch.bfloat16, 2, 2, 64, 48, True, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("dtype,heads,kv_heads,d,rot,norm,cache_dtype", CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}-r{c[4]}-{'norm' if c[5] else 'plain'}-{c[6]}"
                              for c in CASES])
def test_matches_the_unfused_ops(request, dtype, heads, kv_heads, d, rot, norm, cache_dtype):
    gen = _gen(request)
    t, eps, max_pos = 7, 1e-6, 64
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen) * 3).to(device=DEVICE, dtype=dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(DEVICE)
    freqs = torch.outer(torch.arange(max_pos).float(), 1.0 / 10000 ** (torch.arange(rot // 2).float() / (rot // 2)))
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=DEVICE, dtype=dtype)
    qw = kw = None
    if norm:
        qw = (1 + 0.5 * torch.randn(d, generator=gen)).to(device=DEVICE, dtype=dtype)
        kw = (1 + 0.5 * torch.randn(d, generator=gen)).to(device=DEVICE, dtype=dtype)
    slots = torch.randperm(3 * PAGE, generator=gen)[:t].to(DEVICE)
    slots[2] = -1  # a padding token writes nothing
    fused_caches = _caches(3, kv_heads, d, cache_dtype or dtype, dtype)
    ref_caches = _caches(3, kv_heads, d, cache_dtype or dtype, dtype)

    ref = _unfused(qkv.clone(), heads, kv_heads, d, positions, table, qw, kw, eps, *ref_caches[:2], slots,
                   *ref_caches[2:])
    buf = qkv.clone()
    got = prepare_qkv(buf, heads, kv_heads, d, positions, table, qw, kw, eps, *fused_caches[:2], slots,
                      *fused_caches[2:])
    assert all(g.data_ptr() >= buf.data_ptr() and g.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size()
               for g in got), "q, k, v are views of the projection's output"
    # The norm's sum runs in two halves here and in one there: a last-bit difference at most.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), atol=tol, rtol=tol)
    assert torch.equal(got[2], ref[2])  # v untouched
    for g, r in zip(fused_caches, ref_caches):
        if g is None:
            continue
        if kv_quant.is_quantized(g.dtype):
            # A last-bit difference in k may move a quantized value by one step, rarely.
            assert (g.float() != r.float()).float().mean() <= 0.02
        else:
            torch.testing.assert_close(g.float(), r.float(), atol=tol, rtol=tol)
    written = fused_caches[0].view(-1, kv_heads, d)
    written = written.float()
    assert written[slots[slots >= 0]].abs().sum() > 0
    untouched = torch.ones(written.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert written[untouched.to(DEVICE)].abs().sum() == 0


def test_against_torch_reference(request):
    """Against plain torch (float32 throughout): the fused kernel is the rotation of the norm."""
    gen = _gen(request)
    t, heads, kv_heads, d, eps = 5, 4, 2, 64, 1e-5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(DEVICE)
    positions = torch.arange(3, 3 + t, device=DEVICE)
    freqs = torch.outer(torch.arange(16).float(), 1.0 / 500 ** (torch.arange(d // 2).float() / (d // 2)))
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
    qw, kw = torch.rand(d, generator=gen).to(DEVICE) + 0.5, torch.rand(d, generator=gen).to(DEVICE) + 0.5
    k_cache, v_cache, _, _ = _caches(2, kv_heads, d, torch.float32, torch.float32)
    slots = torch.arange(t, device=DEVICE)
    q_ref, k_ref, v_ref = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_ref = fo.torch_rms_norm(q_ref.reshape(t, heads, d), qw, eps)
    k_ref = fo.torch_rms_norm(k_ref.reshape(t, kv_heads, d), kw, eps)
    q_ref, k_ref = fo.torch_apply_rotary(q_ref, k_ref, positions, table)
    q, k, _ = prepare_qkv(qkv.clone(), heads, kv_heads, d, positions, table, qw, kw, eps, k_cache, v_cache, slots)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache.view(-1, kv_heads, d)[:t], k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cache.view(-1, kv_heads, d)[:t], v_ref.reshape(t, kv_heads, d))


def test_refuses_bad_shapes():
    k_cache, v_cache, _, _ = _caches(2, 2, 64, torch.float32, torch.float32)
    table = torch.zeros(8, 64, device=DEVICE)
    pos, slots = torch.zeros(3, dtype=torch.long, device=DEVICE), torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="not \\[T"):
        prepare_qkv(torch.zeros(3, 100, device=DEVICE), 4, 2, 64, pos, table, None, None, 1e-6, k_cache, v_cache,
                    slots)
    with pytest.raises(ValueError, match="together"):
        prepare_qkv(torch.zeros(3, 512, device=DEVICE), 4, 2, 64, pos, table, torch.ones(64, device=DEVICE), None,
                    1e-6, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="one entry a token"):
        prepare_qkv(torch.zeros(3, 512, device=DEVICE), 4, 2, 64, pos[:2], table, None, None, 1e-6, k_cache,
                    v_cache, slots)


def _layer_runner(model_dir):
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.executor.model_runner import ModelRunner
    from pagoda.layers.attention.triton_backend import TritonAttentionBackend

    args = EngineArgs(model=str(model_dir), device=DEVICE, dtype="float32", block_size=PAGE, max_model_len=256,
                      max_num_seqs=4, kv_cache_memory=2 << 20, enforce_eager=True)
    runner = ModelRunner(EngineConfig.from_args(args))
    runner.allocate_kv_cache(runner.determine_num_blocks())
    backend = TritonAttentionBackend()
    for layer in runner.model.attention_layers():
        layer.backend = backend
    return runner


def _steps(runner, fused: bool):
    """A prefill of three prompts, then a decode step: each step's logits and the cache after."""
    from pagoda.request import Request, Sequence
    from pagoda.sampling_params import SamplingParams
    from pagoda.step import ScheduledSeq, SchedulerOutput

    for layer in runner.model.attention_layers():
        layer.fused_prepare = fused
    runner.kv_cache.zero_()
    seqs, next_block = [], 1
    for i, n in enumerate([13, 6, 21]):
        prompt = [(11 * i + 5 * j) % 400 + 20 for j in range(n)]
        seq = Sequence(f"r{i}#0", Request(f"r{i}", prompt, SamplingParams(temperature=0), ()), list(prompt))
        blocks = -(-(n + 1) // PAGE)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    logits = []
    with torch.inference_mode():
        for scheduled in ([ScheduledSeq(s, 0, s.num_tokens) for s in seqs], None):
            if scheduled is None:
                for i, seq in enumerate(seqs):
                    seq.token_ids.append(300 + i)
                scheduled = [ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs]
            inputs, _ = runner.prepare(SchedulerOutput(scheduled, 0))
            logits.append(runner.model.compute_logits(runner.forward(inputs)[inputs.logits_indices]))
    return logits, runner.kv_cache.clone()


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma3"])
def test_layers_take_the_fused_prepare(model_factory, monkeypatch, family):
    """Qwen3 (q/k norms), Phi-3 (partial rotary) and Gemma 3 (offset norms, sliding windows) on
    the Triton backend: the fused prepare runs (one launch a layer, no separate KV write) and gives
    the unfused layers' logits and cache, prefill and decode."""
    from pagoda.layers.attention import triton_backend, triton_qkv

    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    runner = _layer_runner(model_factory(family))
    layers = runner.model.attention_layers()
    assert all(layer.fused_prepare for layer in layers)
    calls = {"prepare": 0, "write_kv": 0}

    def counting(name, real):
        def run(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(triton_qkv, "prepare_qkv", counting("prepare", triton_qkv.prepare_qkv))
    monkeypatch.setattr(triton_backend, "write_kv", counting("write_kv", triton_backend.write_kv))
    expected, expected_cache = _steps(runner, fused=False)
    assert calls == {"prepare": 0, "write_kv": 2 * len(layers)}
    got, cache = _steps(runner, fused=True)
    assert calls == {"prepare": 2 * len(layers), "write_kv": 2 * len(layers)}
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), e.argmax(-1))
    torch.testing.assert_close(cache, expected_cache, atol=1e-5, rtol=1e-5)
    assert cache.abs().sum() > 0


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
