"""The compiled kernel variants: every variant this CPU runs is present (a missing or broken
library is a failure here, not a skip), ``PAGODA_CPU_ISA`` runs the variant it names, and the
variants compute the same layer ops within each kernel's stated tolerance.

Tolerances: the float32 products (gemv, MoE) sum in another order per vector width, so rows
agree to float32 rounding of their sums (rtol 1e-5 on unit-scale data; MoE's AVX2 and AVX-512
paths sum in the same order and agree to the bit); the weight-only int4 product is exact in
integers on AVX2 and AVX-512 alike (the same bits), int8 within 2**-20 of its products'
magnitudes (AVX2 folds its int32 sums into float32 every 256 columns); the norms, SiLU and
rotary compute per element with the same arithmetic (exp: vec.h's one polynomial on every width;
rtol 1e-6); paged attention's softmax sums reorder (rtol 1e-5); the bitmask, the greedy argmax and
the bfloat16 rounding of the elementwise ops' outputs are exact."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagoda import cpu_features
from pagoda.kernels import build, select
from pagoda.kernels import moe as kmoe
from pagoda.kernels import woq as kwoq

LEVELS = select.supported_levels()
VARIANTS = select.supported_variants()


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
    assert build.variant_of(lib) == variant
    assert build.schema_problems(lib.name) == [], f"{variant}'s op table"
    # What each variant is built to have: the AVX-512 one has the bfloat16 panels and every
    # quantized kind; the AVX2 one the float32 panels, int8 and int4; the scalar one none of these.
    assert bool(lib.panel_available()) == (variant != "scalar")
    assert bool(lib.panel_available_bf16()) == (variant == "avx512")
    assert bool(lib.woq_available()) == (variant != "scalar")
    kinds = (kwoq.KIND_INT8, kwoq.KIND_INT4, kwoq.KIND_INT8G)
    assert [bool(lib.woq_has_kind(k)) for k in kinds] == [variant != "scalar"] * 3
    assert bool(lib.woq_has_kind(kwoq.KIND_FP8)) == (variant == "avx512")
    assert bool(lib.amx_compiled()) == (variant == "avx512")  # built on every x86 machine, run on AMX ones


def test_the_install_built_every_variant_with_every_kernel():
    """What the container build checks (deploy/Dockerfile): setup.py's libraries, not JIT builds,
    one per variant of this architecture, each with every kernel."""
    assert build.check_installed() == list(build.VARIANTS)


def test_variants_this_cpu_cannot_run_are_checked_in_their_files(tmp_path):
    """``check_installed`` never loads a library the CPU cannot execute (the AVX-512 one on an AVX2
    CPU dies of SIGILL as it loads); it finds the op table's registrations in the file instead,
    and names an op whose registration is missing."""
    import importlib.util
    from pathlib import Path

    build.check_installed()
    for variant in build.VARIANTS:
        if variant not in VARIANTS:
            assert build.module_name(variant) not in sys.modules, variant
    scalar = Path(importlib.util.find_spec(build.module_name("scalar")).origin)
    assert build.missing_registrations(scalar, "pagoda_scalar") == []
    broken = tmp_path / "broken.so"
    broken.write_bytes(scalar.read_bytes().replace(b"rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
                                                   b"rms_norX(Tensor x, Tensor weight, float eps) -> Tensor"))
    assert build.missing_registrations(broken, "pagoda_scalar") == ["rms_norm"]
    # The custom class's schema carries the namespace: another variant's name does not match.
    assert build.missing_registrations(scalar, "pagoda_avx2") == ["greedy_round"]


def test_the_amx_kernel_runs_where_the_cpu_has_amx():
    if "amx" not in LEVELS:
        pytest.skip("this CPU has no AMX-BF16 (the kernel is built into the avx512 variant and tested on AMX machines)")
    assert _lib("avx512").amx_available(), "AMX CPU, but the tile kernel is unavailable (Linux refused the tiles?)"


def _forced(level: str) -> str:
    code = "from pagoda.kernels import build, select; lib = build.ops(); print(select.isa().level, build.variant_of(lib))"
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
    results = _all(lambda lib: lib.gemv(x, w))
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
    results = _all(lambda lib: [lib.rms_norm(x, w, 1e-6), *lib.add_rms_norm(x, res, w, 1e-6),
                                lib.silu_and_mul(gu), lib.rotate(q, pos, cache)])
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
        lib.paged_decode(out, q, kc, vc, tables, lens, head_dim ** -0.5, 0, none, none, 0.0)
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
        lib.paged_decode(out, q, kc, vc, tables, lens, head_dim ** -0.5, 0, ks, vs, cap)
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
            lib.paged_decode(out, q, kc, vc, tables, lens, d ** -0.5, window, none, none, 0.0)
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
    for v, got in _all(lambda lib: lib.greedy_tokens(logits, list(range(6)))).items():
        assert got == want, v


def test_bfloat16_ops_round_as_a_dtype_conversion_does_on_every_variant():
    """A bfloat16 op's output is its float32 arithmetic rounded once to nearest even (NaN stays
    NaN): exactly the float32 op over the same widened inputs, then ``.bfloat16()``."""
    gen = torch.Generator().manual_seed(11)
    gu = (torch.randn(5, 2 * 133, generator=gen) * 3).bfloat16()
    gu[1, 7] = float("nan")
    for v, (got, f32) in _all(lambda lib: (lib.silu_and_mul(gu), lib.silu_and_mul(gu.float()))).items():
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
    results = _all(lambda lib: lib.moe_experts(x, weights, ids, p13, p2, 0, inter))
    _agree(results, 1e-5, 1e-5)
    # Against float64: each token's weighted sum of its experts' SiLU-gated MLPs.
    ref = torch.zeros(t, hidden, dtype=torch.float64)
    for i in range(t):
        for slot in range(2):
            e_ = int(ids[i, slot])
            h = w13[e_].double() @ x[i].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            ref[i] += weights[i, slot].double() * (w2[e_].double() @ act)
    for got in results.values():
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8, 40])  # one row; tiles of 6 + 2 on AVX2; two tiles of 20 rows
def test_moe_experts_avx2_equals_avx512_to_the_bit(dtype, tokens):
    """Both sum each output's products in k order with fused multiply-adds and share vec.h's
    SiLU, so the AVX2 path (rows six at a time) gives the AVX-512 one's bits."""
    if not {"avx2", "avx512"} <= set(VARIANTS):
        pytest.skip("this CPU runs no AVX-512 to compare the AVX2 path with")
    gen = torch.Generator().manual_seed(tokens)
    e, hidden, inter = 3, 40, 56  # partial last panels of both matrices
    w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    ids = torch.randint(0, e, (tokens, 2), generator=gen)
    p13, p2 = kmoe.pack_experts(w13, w2)
    a2, a5 = (_lib(v).moe_experts(x, weights, ids, p13, p2, 0, inter) for v in ("avx2", "avx512"))
    assert torch.equal(a2, a5)


@pytest.mark.parametrize("rows", [1, 2, 6, 7, 13, 32])
@pytest.mark.parametrize("n,k", [(100, 70), (48, 33), (16, 1)])
def test_float32_panels_avx2_equals_avx512_to_the_bit(rows, n, k):
    """The float32 panel kernel on every variant that has it: float32 sums of the products
    within a few ulps of float64, and AVX2's tiles (one row by three panels, six rows by one)
    give the AVX-512 tiles' bits (each output the same in-order chain of fused multiply-adds)."""
    gen = torch.Generator().manual_seed(rows * n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    have = [v for v in VARIANTS if _lib(v).panel_available()]
    assert have == [v for v in VARIANTS if v != "scalar"]
    results = {v: _lib(v).panel_linear(x, _lib(v).panel_pack(w), n) for v in have}
    ref = x.double() @ w.double().T
    for got in results.values():
        assert ((got.double() - ref).abs() <= 1e-6 * (x.abs() @ w.abs().T).double() + 1e-6).all()
    if "avx2" in results and "avx512" in results:
        assert torch.equal(results["avx2"], results["avx512"])


# ---- weight-only quantized products (woq) ------------------------------------------------------------
# Every variant with int8/int4 rounds each activation row to 16-bit fixed point (at most
# 2**-16 * max|x| per element; int4's step, max|x| / 32639, is 0.4% coarser, inside the 1.01) and multiplies exactly in integers; the bound below adds float32
# rounding of the sums (2**-20 of the products' magnitudes, far above K * 2**-24 for these K).

def _woq_variants(kind: int) -> list[str]:
    have = [v for v in VARIANTS if _lib(v).woq_has_kind(kind)]
    assert have == [v for v in VARIANTS if v != "scalar"], "a SIMD variant lacks the int8/int4 kernel"
    return have


def _woq_run(lib, kind, packed, x, n, col_scale=None, gs=None, gb=None, group=0, aux=None, bias=None):
    out = torch.empty(x.shape[0], n)
    none = torch.empty(0)
    lib.woq_linear(out, x, packed, kind, none if col_scale is None else col_scale,
                       none if gs is None else gs, none if gb is None else gb, group, aux,
                       none if bias is None else bias)
    return out


@pytest.fixture(params=[False, True], ids=["avx2-plain", "avx2-vnni"])
def avx2_vnni(request):
    """The avx2 variant's int8/int4 kernels on their plain AVX2 path, then on AVX-VNNI where the
    CPU has ``avx_vnni`` (elsewhere ``set_vnni(True)`` must refuse, and the plain path runs again);
    the process's own setting is restored afterwards."""
    if "avx2" not in VARIANTS:
        yield False
        return
    ops = _lib("avx2")
    on = bool(ops.woq_set_vnni(request.param))
    assert on == (request.param and "avx_vnni" in cpu_features.cpu_flags())
    assert bool(ops.woq_vnni()) == on
    yield on
    ops.woq_set_vnni(select.avx_vnni())


def test_avx_vnni_choice_follows_the_cpu_and_the_switch(monkeypatch):
    monkeypatch.delenv(select.VNNI_VAR, raising=False)
    assert select.avx_vnni(frozenset({"avx2", "avx_vnni"}))
    assert not select.avx_vnni(frozenset({"avx2", "fma"}))
    monkeypatch.setenv(select.VNNI_VAR, "0")
    assert not select.avx_vnni(frozenset({"avx2", "avx_vnni"}))
    for variant in VARIANTS:  # only the avx2 variant has the 256-bit path
        if variant != "avx2":
            assert not _lib(variant).woq_set_vnni(True)


def _woq_bound(x: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    ax, aw = x.abs().double(), w_hat.abs().double()
    return (2.0 ** -16 * ax.amax(dim=-1, keepdim=True) * aw.sum(dim=1)) * 1.01 + 2.0 ** -20 * ax @ aw.T + 1e-6


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("n,k,group", [(16, 8, 8), (48, 72, 24), (80, 1024, 128), (32, 1536, 1536), (64, 640, 64)])
def test_woq_int4_avx2_equals_avx512_to_the_bit_and_the_reference(rows, n, k, group, avx2_vnni):
    """int4 (asymmetric zero points, groups of 8, 24, 128, a whole row): every SIMD variant
    within the fixed-point bound of float64 on the dequantized weight, and AVX2's integer sums
    (vpmaddwd on 16-bit values, vpmaddubsw on byte planes for one row, or 256-bit vpdpbusd on
    AVX-VNNI) equal AVX-512's vpdpbusd ones, so the bits agree."""
    gen = torch.Generator().manual_seed(n * k + rows)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), generator=gen).float()
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    x[0, k // 3] = 40.0  # an outlier sets the row's scale
    packed = kwoq.pack_int4(q)
    gs, gb = kwoq.int4_group_terms(scales, -scales * zeros)  # float16 [G, N]: the kernel's own values
    assert gs.dtype == gb.dtype == torch.float16 and gs.shape == (k // group, n)
    results = {v: _woq_run(_lib(v), kwoq.KIND_INT4, packed, x, n, gs=gs, gb=gb, group=group,
                           aux=torch.empty(0, dtype=torch.int32), bias=bias)
               for v in _woq_variants(kwoq.KIND_INT4)}
    # the weight the kernel multiplies by: the float16 scale and zero term, exactly
    w_hat = (q.double() * gs.double().T.repeat_interleave(group, 1) + gb.double().T.repeat_interleave(group, 1))
    w_src = (q.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    assert float((w_hat - w_src).abs().max()) <= 2.0 ** -11 * 15 * 0.021 * 2  # float16 rounding of s and s * z
    ref = x.double() @ w_hat.T + bias.double()
    for v, got in results.items():
        err = (got.double() - ref).abs()
        assert (err <= _woq_bound(x, w_hat)).all(), (v, err.max())
    if "avx2" in results and "avx512" in results:
        assert torch.equal(results["avx2"], results["avx512"])


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("n,k,group", [(48, 72, 24), (80, 1024, 128)])
def test_woq_int4_symmetric_codes_equal_their_stored_zero_terms(rows, n, k, group, avx2_vnni):
    """Symmetric codes (every term -8 * scale: Q4_0, symmetric GPTQ) come without zero terms
    and the kernel computes them: the same bits as the layout that stores them, on every SIMD
    variant."""
    gen = torch.Generator().manual_seed(n + k + rows)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    x = torch.randn(rows, k, generator=gen)
    gs, gb = kwoq.int4_group_terms(scales, -8 * scales)
    assert gb is None
    stored = (-8 * gs.float()).half()
    packed, empty = kwoq.pack_int4(q), torch.empty(0, dtype=torch.int32)
    for v in _woq_variants(kwoq.KIND_INT4):
        lib = _lib(v)
        without = _woq_run(lib, kwoq.KIND_INT4, packed, x, n, gs=gs, gb=None, group=group, aux=empty)
        with_terms = _woq_run(lib, kwoq.KIND_INT4, packed, x, n, gs=gs, gb=stored, group=group, aux=empty)
        assert torch.equal(without, with_terms), v
        w_hat = (q.double() - 8) * gs.double().T.repeat_interleave(group, 1)
        assert ((without.double() - x.double() @ w_hat.T).abs() <= _woq_bound(x, w_hat)).all(), v


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_woq_int4_group_sums_past_int32_keep_the_bits(rows, avx2_vnni):
    """A whole-row group of 8192 columns whose sum of q * v passes 2**31 (every code 15, every
    activation at the row's largest value): plain AVX2's 16-bit products add such a group in
    spans and still round the exact integer once, so every path keeps AVX-512's bits and the
    reference."""
    n, k = 16, 8192
    q = torch.full((n, k), 15)
    scales = torch.full((n, 1), 1e-3)
    x = torch.ones(rows, k)
    x[:, ::7] = 0.75  # not every value equal, sums still far past 2**31
    gs, gb = kwoq.int4_group_terms(scales, -3 * scales)
    packed = kwoq.pack_int4(q)
    results = {v: _woq_run(_lib(v), kwoq.KIND_INT4, packed, x, n, gs=gs, gb=gb, group=k,
                           aux=torch.empty(0, dtype=torch.int32))
               for v in _woq_variants(kwoq.KIND_INT4)}
    w_hat = q.double() * gs.double().T + gb.double().T
    ref = x.double() @ w_hat.T
    v = torch.round(x.double() / x.abs().amax(dim=-1, keepdim=True) * 32639)  # the kernel's 16-bit values
    assert bool(((q[0].double() * v).sum(dim=-1) > 2**31).all())
    for v, got in results.items():
        assert ((got.double() - ref).abs() <= _woq_bound(x, w_hat)).all(), v
    if "avx2" in results and "avx512" in results:
        assert torch.equal(results["avx2"], results["avx512"])


def test_woq_int4_refuses_group_terms_that_are_not_float16():
    """The int4 layout's group scales and zero terms are float16 [G, N]; float32 ones (the layout
    before) are refused loudly by every SIMD variant rather than read as the wrong bytes."""
    q = torch.randint(0, 16, (16, 64))
    scales = torch.rand(16, 2) * 0.01 + 1e-3
    gs, gb = kwoq.int4_group_terms(scales, -7 * scales)
    x = torch.randn(1, 64)
    for v in _woq_variants(kwoq.KIND_INT4):
        with pytest.raises(RuntimeError, match="float16"):
            _woq_run(_lib(v), kwoq.KIND_INT4, kwoq.pack_int4(q), x, 16, gs=gs.float(), gb=gb.float(), group=32,
                     aux=torch.empty(0, dtype=torch.int32))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n,k", [(16, 4), (32, 68), (48, 1412), (96, 2048)])
def test_woq_int8_avx2_agrees_with_avx512_and_the_reference(rows, n, k, avx2_vnni):
    """int8 per channel (weights -128..127, an outlier and zeros in the activations): every SIMD
    variant within the fixed-point bound of float64; plain AVX2 (16-bit products, int32 sums
    folded into float32 every 256 columns) and AVX-512 (two byte planes' int32 sums, each rounded
    to float32 once) round the same exact integer sums differently, so they agree within 2**-20
    of the products' magnitudes; AVX2 on AVX-VNNI takes AVX-512's planes and epilogue, the same
    bits."""
    gen = torch.Generator().manual_seed(n + k + rows)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    x[0, k // 2] = 1000.0
    x[:, :2] = 0.0
    packed, sums = kwoq.pack_int8(q)
    results = {v: _woq_run(_lib(v), kwoq.KIND_INT8, packed, x, n, col_scale=scales, aux=sums, bias=bias)
               for v in _woq_variants(kwoq.KIND_INT8)}
    w_hat = q.double() * scales.double()[:, None]
    ref = x.double() @ w_hat.T + bias.double()
    for v, got in results.items():
        err = (got.double() - ref).abs()
        assert (err <= _woq_bound(x, w_hat)).all(), (v, err.max())
    if "avx2" in results and "avx512" in results:
        diff = (results["avx2"].double() - results["avx512"].double()).abs()
        assert (diff <= 2.0 ** -20 * x.abs().double() @ w_hat.abs().T + 1e-6).all(), diff.max()
        if avx2_vnni:
            assert torch.equal(results["avx2"], results["avx512"])


def _int8g_case(n: int, k: int, group: int, rows: int, extreme: bool = False):
    """Codes, float16-exact group scales, bias and rows for the int8-in-groups kind; ``extreme``:
    codes only -128 and 127 (channel 0 all 127, channel 1 all -128) and rows of +-3 (every
    activation at the row's largest value), the largest group sums the kind takes."""
    gen = torch.Generator().manual_seed(n * 7 + k + rows + group)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    if extreme:
        q = torch.where(torch.rand(n, k, generator=gen) < 0.5, 127, -128).to(torch.int8)
        q[0], q[1] = 127, -128
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 5e-4).half().float()  # float16 numbers (Q8_0's)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    x[0, k // 3] = 40.0  # an outlier sets the row's scale
    x[:, :2] = 0.0
    if extreme:
        x = torch.full((rows, k), 3.0)
        x[1::2] = -3.0
    return q, scales, bias, x


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("n,k,group", [(16, 4, 4), (48, 72, 8), (32, 200, 40), (80, 1056, 32), (64, 640, 64),
                                       (16, 1024, 256)])
def test_woq_int8_groups_agree_bit_for_bit_and_with_the_reference(rows, n, k, group, avx2_vnni):
    """int8 in groups (GGUF Q8_0's numbers; K not a multiple of 256, one group to many, groups of
    4 to 256): every SIMD variant and AVX2 path within the fixed-point activations' bound of float64
    on the dequantized weight, and all of them the same bits (the same exact int32 group sums and
    float epilogue)."""
    q, scales, bias, x = _int8g_case(n, k, group, rows)
    packed, gs = kwoq.pack_int8g(q, scales)
    assert packed.dtype == torch.uint8 and gs.dtype == torch.float16 and gs.shape == (n // 16, k // group, 16)
    results = {v: _woq_run(_lib(v), kwoq.KIND_INT8G, packed, x, n, gs=gs, group=group,
                           aux=torch.empty(0, dtype=torch.int32), bias=bias if rows % 2 else None)
               for v in _woq_variants(kwoq.KIND_INT8G)}
    w_hat = q.double() * scales.double().repeat_interleave(group, 1)
    ref = x.double() @ w_hat.T + (bias.double() if rows % 2 else 0)
    for v, got in results.items():
        err = (got.double() - ref).abs()
        assert (err <= _woq_bound(x, w_hat)).all(), (v, err.max())
    if "avx2" in results and "avx512" in results:
        assert torch.equal(results["avx2"], results["avx512"])


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_woq_int8_groups_of_extreme_codes_stay_exact(rows, avx2_vnni):
    """Only -128 and 127 codes, every activation at +-32639 and groups of 256: the largest sums
    the kind takes (sum (q + 128) * v near 2**31, sum q * v at 2**30) stay exact: channel 0's
    output is its float64 value within float32 rounding, every channel within the bound."""
    n, k, group = 32, 512, 256
    q, scales, _, x = _int8g_case(n, k, group, rows, extreme=True)
    packed, gs = kwoq.pack_int8g(q, scales)
    w_hat = q.double() * scales.double().repeat_interleave(group, 1)
    ref = x.double() @ w_hat.T
    for v in _woq_variants(kwoq.KIND_INT8G):
        got = _woq_run(_lib(v), kwoq.KIND_INT8G, packed, x, n, gs=gs, group=group, aux=torch.empty(0, dtype=torch.int32))
        assert ((got.double() - ref).abs() <= _woq_bound(x, w_hat)).all(), v
        # x is exactly 3 * v / 32639 at every element: the only error left is float32's
        assert ((got[:, :2].double() - ref[:, :2]).abs() <= 2.0 ** -20 * ref[:, :2].abs()).all(), v


def test_woq_int8_groups_refuse_bad_groups_and_float32_scales():
    """The grouped int8 layout's scales are float16 [N/16, G, 16] and its groups whole quads up to
    256 columns: anything else is refused loudly by every SIMD variant."""
    q, scales, _, x = _int8g_case(16, 512, 32, 1)
    packed, gs = kwoq.pack_int8g(q, scales)
    empty = torch.empty(0, dtype=torch.int32)
    assert not kwoq.usable(kwoq.KIND_INT8G, 16, 1024, torch.device("cpu"), 512)
    assert not kwoq.usable(kwoq.KIND_INT8G, 16, 96, torch.device("cpu"), 6)
    assert kwoq.pack_int8g(q, scales * 1e7) is None  # beyond float16's range (65504)
    for v in _woq_variants(kwoq.KIND_INT8G):
        with pytest.raises(RuntimeError, match="float16"):
            _woq_run(_lib(v), kwoq.KIND_INT8G, packed, x, 16, gs=gs.float(), group=32, aux=empty)
        with pytest.raises(RuntimeError, match="multiple of 4 up to 256"):
            _woq_run(_lib(v), kwoq.KIND_INT8G, packed, x, 16, gs=gs, group=512, aux=empty)


_FORCED_LAYERS = """
import json, torch
from pagoda.kernels import build
from pagoda.layers.quantization.kernels import make_fp8_linear, make_int4_linear, make_int8_linear
from pagoda.layers.quantization.online import quantize_fp8, quantize_int4, quantize_int8
w = torch.randn(64, 256)
q8 = torch.randint(-128, 128, (64, 256), dtype=torch.int8)
grouped = make_int8_linear(q8, torch.rand(64, 8) * 0.01, None, 32)
print(json.dumps({"variant": build.variant_of(build.ops()), "int8": make_int8_linear(*quantize_int8(w)).kernel,
                  "int8-groups": [grouped.kernel, getattr(grouped, "kind", None)],
                  "int4": make_int4_linear(*quantize_int4(w, 64), None, 64).kernel,
                  "fp8": make_fp8_linear(*quantize_fp8(w)).kernel}))
"""


@pytest.mark.parametrize("level", LEVELS)
def test_forced_variant_quantized_layers_choose_its_kernel(level):
    """Under ``PAGODA_CPU_ISA`` the quantized layers take the variant's own kernel where it has
    one (int8/int4 from AVX2 up, fp8 on AVX-512) and torch's ops or the dequantizing path
    otherwise: nothing skips to torch while the variant could run it."""
    import json

    env = dict(os.environ, PAGODA_CPU_ISA=level)
    proc = subprocess.run([sys.executable, "-c", _FORCED_LAYERS], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    simd = select.VARIANT_OF[level] != "scalar"
    assert got == {"variant": select.VARIANT_OF[level], "int8": "woq" if simd else "int8pack",
                   "int8-groups": ["woq", kwoq.KIND_INT8G] if simd else ["dequant", None],
                   "int4": "woq" if simd else "int4pack",
                   "fp8": "woq" if select.VARIANT_OF[level] == "avx512" else "dequant"}


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
        lib.apply_bitmask(out, mask)
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
        assert info["kernels"]["weight-only int8 / int4 / fp8"] == [choice.variant != "scalar"] * 2 + [
            choice.variant == "avx512"]
        # the 256-bit AVX-VNNI path: the avx2 variant on a CPU with avx_vnni (PAGODA_CPU_VNNI not 0)
        assert info["kernels"]["weight-only int8 / int4 on AVX-VNNI (256-bit)"] == (
            choice.variant == "avx2" and select.avx_vnni())


_GREEDY = """
import json, sys
from pagoda import LLM, SamplingParams
from pagoda.kernels import build
llm = LLM(sys.argv[1], kv_cache_memory=16 << 20, max_model_len=128, dtype="float32")
outs = llm.generate([{"prompt_token_ids": p} for p in ([5, 17, 99, 3], [300, 2, 9, 11, 40, 41])],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
print(json.dumps({"variant": build.variant_of(build.ops()),
                  "tokens": [o.outputs[0].token_ids for o in outs],
                  "logprobs": [[s[t] for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]}))
"""


def test_forced_variants_give_the_same_greedy_tokens(model_factory):
    """A whole model (gemv, attention, norms, the fused decode blocks) under each level this CPU
    runs, each in its own process: the same tokens, and logprobs within float32 reordering."""
    import json

    model = str(model_factory("llama"))
    procs = {level: subprocess.Popen([sys.executable, "-c", _GREEDY, model], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=dict(os.environ, PAGODA_CPU_ISA=level))
             for level in LEVELS}  # side by side: each is mostly start-up, one core's worth
    runs = {}
    for level, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        runs[level] = json.loads(out.strip().splitlines()[-1])
        assert runs[level]["variant"] == select.VARIANT_OF[level]
    base = runs[LEVELS[0]]
    for level, run in runs.items():
        assert run["tokens"] == base["tokens"], level
        for got, want in zip(run["logprobs"], base["logprobs"]):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, level
