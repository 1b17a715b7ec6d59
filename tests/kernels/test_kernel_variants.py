"""The compiled kernel variants: every variant this CPU runs is present (a missing or broken
library is a failure here, not a skip), ``PAGODA_CPU_ISA`` runs the variant it names, and the
variants compute the same layer ops within each kernel's stated tolerance.

Tolerances: the float32 products (gemv, MoE) sum in another order per vector width, so rows
agree to float32 rounding of their sums (rtol 1e-5 on unit-scale data); the norms, SiLU and
rotary compute per element with the same arithmetic (exp: vec.h's one polynomial on every width;
rtol 1e-6); paged attention's softmax sums reorder (rtol 1e-5); the bitmask, the greedy argmax and
the bfloat16 rounding of the elementwise ops' outputs are exact."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagoda.kernels import build, select
from pagoda.kernels import moe as kmoe

LEVELS = select.supported_levels()
VARIANTS = sorted({select.VARIANT_OF[level] for level in LEVELS}, key=list(build.VARIANTS).index)


def _lib(variant: str):
    """The variant's library; a failure (not a skip) where it is missing on a CPU that runs it."""
    if not select.kernels_enabled():
        pytest.skip("PAGODA_CPU_KERNELS=0")
    lib = build.library(variant)
    assert lib is not None, f"the {variant} kernel library is missing or failed to build (see the log)"
    return lib


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_this_cpu_runs_is_present_with_every_kernel(variant):
    lib = _lib(variant)
    assert lib.variant == variant
    for kernel in build.KERNEL_NAMES:
        assert hasattr(lib, kernel), f"{variant} lacks {kernel}"
    # What each variant is built to have: the AVX-512 one has the panel and quantized kernels.
    assert bool(lib.panel.available()) == (variant == "avx512")
    assert bool(lib.woq.available()) == (variant == "avx512")
    assert bool(lib.amx.compiled()) == (variant == "avx512")  # built on every x86 machine, run on AMX ones


def test_the_install_built_every_variant_with_every_kernel():
    """What the container build checks (deploy/Dockerfile): setup.py's libraries, not JIT builds,
    one per variant of this architecture, each with every kernel."""
    assert build.check_installed() == list(build.VARIANTS)


def test_the_amx_kernel_runs_where_the_cpu_has_amx():
    if "amx" not in LEVELS:
        pytest.skip("this CPU has no AMX-BF16 (the kernel is built into the avx512 variant and tested on AMX machines)")
    assert _lib("avx512").amx.available(), "AMX CPU, but the tile kernel is unavailable (Linux refused the tiles?)"


def _forced(level: str) -> str:
    code = "from pagoda.kernels import build, select; lib = build.load(); print(select.isa().level, lib.variant)"
    env = dict(os.environ, PAGODA_CPU_ISA=level)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()[-2:]


@pytest.mark.parametrize("level", LEVELS)
def test_pagoda_cpu_isa_runs_the_named_variant(level):
    assert _forced(level) == [level, select.VARIANT_OF[level]]


def test_a_level_the_cpu_lacks_is_refused_not_run():
    missing = [level for level in select.LEVELS if level not in LEVELS]
    if not missing:
        pytest.skip("this CPU runs every level")
    with pytest.raises(ValueError, match="this CPU runs only"):
        select.choose(missing[-1])
    with pytest.raises(ValueError, match="is not one of"):
        select.choose("avx9000")


# ---- the same results from every variant --------------------------------------------------------

def _all(fn):
    """fn(lib) for every variant, keyed by variant."""
    return {v: fn(_lib(v)) for v in VARIANTS}


def _agree(results: dict, rtol: float, atol: float) -> None:
    base = VARIANTS[0]
    for v, got in results.items():
        for a, b in zip(got if isinstance(got, (list, tuple)) else [got],
                        results[base] if isinstance(results[base], (list, tuple)) else [results[base]]):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{v} vs {base}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_agrees_across_variants_and_with_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(67, 133, generator=gen).to(dtype)  # odd sizes: every vector tail
    x = torch.randn(rows, 133, generator=gen)
    results = _all(lambda lib: lib.gemv.gemv(x, w))
    if dtype == torch.float32:  # the AVX512-BF16 path rounds a bfloat16 model's one row to bfloat16
        for got in results.values():
            torch.testing.assert_close(got, x @ w.float().T, rtol=1e-5, atol=1e-5)
        _agree(results, 1e-5, 1e-5)
    else:
        for got in results.values():
            torch.testing.assert_close(got, x @ w.float().T, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_ops_agree_across_variants(dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 72, generator=gen).to(dtype)
    res = torch.randn(5, 72, generator=gen).to(dtype)
    w = torch.rand(72, generator=gen).to(dtype)
    gu = torch.randn(5, 2 * 40, generator=gen).to(dtype) * 4
    q = torch.randn(5, 3, 32, generator=gen).to(dtype)
    pos = torch.tensor([0, 3, 9, 17, 30])
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    ang = torch.arange(64).float()[:, None] * inv[None]
    cache = torch.cat([ang.cos(), ang.sin()], dim=-1)
    results = _all(lambda lib: [lib.fused.rms_norm(x, w, 1e-6), *lib.fused.add_rms_norm(x, res, w, 1e-6),
                                lib.fused.silu_and_mul(gu), lib.fused.rotate(q, pos, cache)])
    ref_silu = (torch.nn.functional.silu(gu[:, :40].float()) * gu[:, 40:].float()).to(dtype)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    for got in results.values():
        torch.testing.assert_close(got[3], ref_silu, rtol=tol[0], atol=tol[1])
    _agree(results, *(1e-6, 1e-6) if dtype == torch.float32 else (1e-2, 1e-2))


def _attention_reference(q, kc, vc, tables, lens, window=0, softcap=0.0):
    """Each sequence's keys gathered and attended in float64 (the last ``window`` of them when > 0;
    scores soft-capped when ``softcap`` > 0)."""
    b, h, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = []
    for i in range(b):
        n = int(lens[i])
        lo = n - window if window and n > window else 0
        slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(lo, n)]
        k = kc.reshape(-1, hkv, d)[slots].double().repeat_interleave(h // hkv, dim=1)
        v = vc.reshape(-1, hkv, d)[slots].double().repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * d ** -0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        p = torch.softmax(scores, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v).float())
    return torch.stack(out)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])  # the vector paths (256: AVX2's) and the general loops
def test_paged_attention_agrees_across_variants(cache_dtype, head_dim):
    """Lengths 1, 37 and 64: a lone key, partial groups of eight and sixteen positions, whole ones."""
    gen = torch.Generator().manual_seed(head_dim)
    blocks, bs, hkv, h, b = 12, 16, 2, 4, 3
    kc = torch.randn(blocks, bs, hkv, head_dim, generator=gen).to(cache_dtype)
    vc = torch.randn(blocks, bs, hkv, head_dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(blocks, generator=gen)[: b * 4].reshape(b, 4).to(torch.int32)
    lens = torch.tensor([1, 37, 64], dtype=torch.int32)
    q = torch.randn(b, h, head_dim, generator=gen)
    none = torch.empty(0, dtype=torch.bfloat16)

    def run(lib):
        out = torch.empty_like(q)
        lib.attention.paged_decode(out, q, kc, vc, tables, lens, head_dim ** -0.5, 0, none, none, 0.0)
        return out

    results = _all(run)
    ref = _attention_reference(q, kc, vc, tables, lens)
    for got in results.values():
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    _agree(results, 1e-5, 1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])
def test_soft_capped_attention_agrees_across_variants(cache_dtype, head_dim):
    """Scores soft-capped (cap * tanh(score / cap)) on every path: the vector ones at 64 and 128,
    the general loops at 40 and over an int8 cache; large logits (q scaled up) so the cap bites."""
    from pagoda.layers.attention import kv_quant

    gen = torch.Generator().manual_seed(head_dim + 5)
    blocks, bs, hkv, h, b, cap = 12, 16, 2, 4, 3, 5.0
    k32 = torch.randn(blocks, bs, hkv, head_dim, generator=gen)
    v32 = torch.randn(blocks, bs, hkv, head_dim, generator=gen)
    if cache_dtype == torch.int8:
        (kc, ks), (vc, vs) = kv_quant.quantize(k32, cache_dtype), kv_quant.quantize(v32, cache_dtype)
        kref, vref = kv_quant.dequantize(kc, ks), kv_quant.dequantize(vc, vs)
    else:
        kc, vc = k32.to(cache_dtype), v32.to(cache_dtype)
        ks = vs = torch.empty(0, dtype=torch.bfloat16)
        kref, vref = kc, vc
    tables = torch.randperm(blocks, generator=gen)[: b * 4].reshape(b, 4).to(torch.int32)
    lens = torch.tensor([1, 37, 64], dtype=torch.int32)
    q = torch.randn(b, h, head_dim, generator=gen) * 4

    def run(lib):
        out = torch.empty_like(q)
        lib.attention.paged_decode(out, q, kc, vc, tables, lens, head_dim ** -0.5, 0, ks, vs, cap)
        return out

    results = _all(run)
    ref = _attention_reference(q, kref, vref, tables, lens, softcap=cap)
    uncapped = _attention_reference(q, kref, vref, tables, lens)
    assert (ref - uncapped).abs().max() > 0.1  # the cap changes the answer here
    for got in results.values():
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    _agree(results, 1e-5, 1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 150])
def test_paged_attention_split_over_threads_agrees_across_variants(cache_dtype, window):
    """One sequence of 301 keys on two threads: each variant splits its positions over the threads
    and merges the parts (sliding window too), and must equal its own one-thread pass and the
    reference."""
    gen = torch.Generator().manual_seed(window + 1)
    blocks, bs, hkv, h, d = 24, 16, 2, 8, 128
    kc = torch.randn(blocks, bs, hkv, d, generator=gen).to(cache_dtype)
    vc = torch.randn(blocks, bs, hkv, d, generator=gen).to(cache_dtype)
    tables = torch.randperm(blocks, generator=gen)[:20].reshape(1, 20).to(torch.int32)
    lens = torch.tensor([301], dtype=torch.int32)
    q = torch.randn(1, h, d, generator=gen)
    none = torch.empty(0, dtype=torch.bfloat16)

    def run(lib, threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = torch.empty_like(q)
            lib.attention.paged_decode(out, q, kc, vc, tables, lens, d ** -0.5, window, none, none, 0.0)
        finally:
            torch.set_num_threads(before)
        return out

    ref = _attention_reference(q, kc, vc, tables, lens, window)
    for v, (split, one) in _all(lambda lib: (run(lib, 2), run(lib, 1))).items():
        torch.testing.assert_close(split, ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{v}: {m}")
        torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-5, msg=lambda m: f"{v}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_argmax_is_exact_on_every_variant(dtype):
    """The first index of each row's maximum, NaN as -inf and +inf as the largest finite value,
    on rows long enough for the vector loops and with the answer in their tails."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1003, generator=gen)
    logits[0, 7] = float("nan")
    logits[1, 1001] = 50.0  # in the tail past the last whole vector
    logits[2] = float("-inf")
    logits[2, 600] = float("inf")
    logits[2, 900] = float("inf")  # ties: the first
    logits[3] = float("nan")  # nothing but NaN: index 0
    logits[4, 100] = logits[4, 900] = 60.0
    logits = logits.to(dtype)
    want = torch.where(logits.float().isnan(), float("-inf"), logits.float()).clamp(max=torch.finfo(torch.float32).max)
    want = [int(r.argmax()) if not torch.isinf(r).all() else 0 for r in want]
    assert want[2] == 600 and want[4] == 100
    for v, got in _all(lambda lib: lib.fused.greedy_tokens(logits, list(range(6)))).items():
        assert got == want, v


def test_bfloat16_ops_round_as_a_dtype_conversion_does_on_every_variant():
    """A bfloat16 op's output is its float32 arithmetic rounded once to nearest even (NaN stays
    NaN): exactly the float32 op over the same widened inputs, then ``.bfloat16()``."""
    gen = torch.Generator().manual_seed(11)
    gu = (torch.randn(5, 2 * 133, generator=gen) * 3).bfloat16()
    gu[1, 7] = float("nan")
    for v, (got, f32) in _all(lambda lib: (lib.fused.silu_and_mul(gu), lib.fused.silu_and_mul(gu.float()))).items():
        torch.testing.assert_close(got, f32.bfloat16(), rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{v}: {m}")


def test_moe_experts_agree_across_variants():
    gen = torch.Generator().manual_seed(5)
    e, hidden, inter, t = 5, 48, 40, 9
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) * inter ** -0.5
    x = torch.randn(t, hidden, generator=gen)
    weights = torch.rand(t, 2, generator=gen)
    ids = torch.randint(0, e, (t, 2), generator=gen)
    p13, p2 = kmoe.pack_experts(w13, w2)
    results = _all(lambda lib: lib.moe.moe_experts(x, weights, ids, p13, p2, 0, inter))
    _agree(results, 1e-5, 1e-5)


def test_bitmask_is_exact_on_every_variant():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 100, generator=gen)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    mask[1] = 0
    mask[2] = -1
    bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(3, -1)[:, :100].bool()
    want = logits.masked_fill(~bits, float("-inf"))

    def run(lib):
        out = logits.clone()
        lib.bitmask.apply_bitmask(out, mask)
        return out

    for got in _all(run).values():
        assert torch.equal(got, want)


def test_pagoda_env_reports_the_chosen_variant_and_why():
    from pagoda.tools import env

    info = env.report()
    choice = select.isa()
    assert info["isa"] == {"level": choice.level, "variant": choice.variant, "reason": choice.reason}
    assert info["isa_levels_supported"] == LEVELS
    if select.kernels_enabled():
        assert f"_C_{choice.variant}" in info["library"] or f"pagoda_kernels_{choice.variant}_" in info["library"]
        assert info["kernels"]["weight-only int8/int4/fp8"] == (choice.variant == "avx512")


_GREEDY = """
import json, sys
from pagoda import LLM, SamplingParams
from pagoda.kernels import build
llm = LLM(sys.argv[1], kv_cache_memory=16 << 20, max_model_len=128, dtype="float32")
outs = llm.generate([{"prompt_token_ids": p} for p in ([5, 17, 99, 3], [300, 2, 9, 11, 40, 41])],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
print(json.dumps({"variant": build.load().variant,
                  "tokens": [o.outputs[0].token_ids for o in outs],
                  "logprobs": [[s[t] for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]}))
"""


def test_forced_variants_give_the_same_greedy_tokens(model_factory):
    """A whole model (gemv, attention, norms, the fused decode blocks) under each level this CPU
    runs, each in its own process: the same tokens, and logprobs within float32 reordering."""
    import json

    model = str(model_factory("llama"))
    runs = {}
    for level in LEVELS:
        env = dict(os.environ, PAGODA_CPU_ISA=level)
        proc = subprocess.run([sys.executable, "-c", _GREEDY, model], capture_output=True, text=True, env=env,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[level] = json.loads(proc.stdout.strip().splitlines()[-1])
        assert runs[level]["variant"] == select.VARIANT_OF[level]
    base = runs[LEVELS[0]]
    for level, run in runs.items():
        assert run["tokens"] == base["tokens"], level
        for got, want in zip(run["logprobs"], base["logprobs"]):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, level
