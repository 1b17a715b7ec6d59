"""Triton paged-attention kernels against a plain torch reference.

On CPU the kernels run under Triton's interpreter (enabled here and in conftest.py before
Triton is imported). Every case draws its own data from a seed derived from its test id.
Outputs and the decode split workspace are filled with NaN before each launch and the cache
holds NaN at every slot a sequence does not own, so a missed write or a stray read fails.
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    # Must precede the first ``import triton`` (see conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers.attention import kv_quant  # noqa: E402
from pagoda.layers.attention import triton_kernels as tk  # noqa: E402
from pagoda.layers.attention import triton_backend  # noqa: E402
from pagoda.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagoda.layers.attention.backend import AttentionMetadata  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter handles fp16/bf16 too (bf16 dots are upcast there), but slowly: on CPU the
# full matrix runs in fp32 and a few cases cover the 16-bit dtypes.
MATRIX_DTYPES = [torch.float32, torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float32]
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.5e-2, 2e-2)}
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# --------------------------------------------------------------------------------------
# Batch construction and reference
# --------------------------------------------------------------------------------------


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    k_full: torch.Tensor  # cache with prefix AND new tokens written (NaN elsewhere)
    v_full: torch.Tensor
    k_prefix: torch.Tensor  # cache with only the prefix written
    v_prefix: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_batch(gen: torch.Generator, query_lens: list[int], context_lens: list[int], heads: int,
               kv_heads: int, head_dim: int, page: int, dtype: torch.dtype = torch.float32,
               spare_blocks: int = 3) -> Batch:
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks_per_seq = [math.ceil(n / page) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(max(blocks_per_seq), 1), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = physical[used:used + n]
        used += n

    def slots(b: int, positions: range) -> list[int]:
        return [int(tables[b, p // page]) * page + p % page for p in positions]

    shape = (num_blocks * page, kv_heads, head_dim)
    k_flat = torch.full(shape, float("nan"))
    v_flat = torch.full(shape, float("nan"))
    prefix = [s for b, c in enumerate(context_lens) for s in slots(b, range(c))]
    new = [s for b in range(len(seq_lens)) for s in slots(b, range(context_lens[b], seq_lens[b]))]
    k_flat[prefix] = torch.randn(len(prefix), kv_heads, head_dim, generator=gen)
    v_flat[prefix] = torch.randn(len(prefix), kv_heads, head_dim, generator=gen)
    k_new = torch.randn(len(new), kv_heads, head_dim, generator=gen)
    v_new = torch.randn(len(new), kv_heads, head_dim, generator=gen)
    k_prefix, v_prefix = k_flat.clone(), v_flat.clone()
    k_flat[new], v_flat[new] = k_new, v_new
    q = torch.randn(len(new), heads, head_dim, generator=gen)

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=DEVICE, dtype=dtype)

    def cache(x: torch.Tensor) -> torch.Tensor:
        return dev(x).view(num_blocks, page, kv_heads, head_dim)

    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return Batch(dev(q), dev(k_new), dev(v_new), cache(k_flat), cache(v_flat), cache(k_prefix),
                 cache(v_prefix), meta, 1.0 / math.sqrt(head_dim))


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, *, window: int | None = None, softcap: float | None = None,
              sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """fp64 attention: gather each sequence's K/V through its block table, causal softmax; the
    model options each paged path may implement: keys older than a sliding ``window`` hidden
    (their NaN slots never read), scores soft-capped (``tanh(s / cap) * cap``) before masking,
    a per-head ``sinks`` logit in each softmax denominator, and keys outside a query's local
    attention ``chunk`` hidden."""
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    k_cache, v_cache, q = k_cache.cpu().double(), v_cache.cpu().double(), q.cpu().double()
    tables = meta.block_tables.cpu().long()
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        pos = torch.arange(seq_len)
        blocks = tables[b, pos // page]
        keys = k_cache[blocks, pos % page]
        values = v_cache[blocks, pos % page]
        if window is not None:  # poisoned slots outside the window: zeroed in the copy only
            keys, values = keys.nan_to_num(), values.nan_to_num()
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len], keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = seq_len - q_len + torch.arange(q_len)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
        if chunk is not None:
            hidden |= pos[None, None, :] < (q_pos - q_pos % chunk)[None, :, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            column = sinks.double()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, values)
        start += q_len
    return out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "unwritten or NaN-contaminated output"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected, atol=atol, rtol=rtol)


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Fill the decode split workspace with NaN, so an unwritten partial shows."""
    real = tk._split_workspace

    def poisoned(*args, **kwargs):
        return tuple(t.fill_(float("nan")) for t in real(*args, **kwargs))

    monkeypatch.setattr(tk, "_split_workspace", poisoned)


# --------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("page,head_dim,kv_heads", [(1, 64, 2), (16, 80, 1), (32, 96, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_kv(request, page, head_dim, kv_heads, dtype):
    gen = _gen(request)
    num_blocks, tokens = 10, 9
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
    slots[[2, 5]] = -1  # padding tokens
    # K/V as strided views of one projection output, as the model produces them.
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=gen).to(DEVICE, dtype)
    k = kv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    k[[2, 5]] = float("nan")  # padding rows must never land anywhere
    k_cache = torch.full((num_blocks, page, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    tk.write_kv(k, v, k_cache, v_cache, slots.to(DEVICE))

    expected_k = torch.full_like(k_cache, 7.0).view(-1, kv_heads, head_dim)
    expected_v = expected_k.clone()
    keep = slots >= 0
    expected_k[slots[keep].to(DEVICE)] = k[keep.to(DEVICE)]
    expected_v[slots[keep].to(DEVICE)] = v[keep.to(DEVICE)]
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim), expected_k)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim), expected_v)


def test_write_kv_casts_to_cache_dtype(request):
    gen = _gen(request)
    k = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    v = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    k_cache = torch.zeros(2, 4, 2, 64, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 0, 7], device=DEVICE)
    tk.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 64)[slots], k.half())
    assert torch.equal(v_cache.view(-1, 2, 64)[slots], v.half())


# --------------------------------------------------------------------------------------
# prefill / extend / mixed
# --------------------------------------------------------------------------------------

# (page, head_dim, heads, kv_heads, query_lens, context_lens)
PREFILL_CASES = {
    "mha-fresh-prompt": (16, 64, 4, 4, [7], [0]),
    "gqa4-mixed-ctx": (16, 128, 8, 2, [20, 1, 5], [0, 30, 13]),
    "page1": (1, 64, 4, 2, [9, 3], [5, 0]),
    "d80-gqa2-multi-tile": (32, 80, 6, 3, [40], [25]),
    "d96-mqa": (32, 96, 4, 1, [3, 17], [60, 2]),
    "d256": (16, 256, 2, 1, [5, 1], [10, 40]),
    "group6": (8, 64, 12, 2, [6], [3]),
    "all-single-token": (2, 128, 4, 4, [1, 1, 1], [0, 4, 9]),
    "page256": (256, 64, 2, 1, [33], [200]),
    "mqa16": (4, 64, 16, 1, [3], [0]),
}


@pytest.mark.parametrize("dtype", MATRIX_DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill(request, case, dtype):
    page, head_dim, heads, kv_heads, query_lens, context_lens = case
    batch = make_batch(_gen(request), query_lens, context_lens, heads, kv_heads, head_dim, page, dtype)
    out = tk.paged_prefill_attention(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale,
                                     out=poisoned_like(batch.q))
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale), dtype)


@pytest.mark.parametrize("block_m,block_n,heads,kv_heads", [
    (128, 64, 4, 2),  # the GPU tile shape for head_dim <= 128
    (16, 16, 4, 1),  # many small tiles: several unmasked and diagonal key tiles per query tile
    (16, 32, 32, 1),  # group (32) larger than the tile's rows: heads split over programs
    (32, 16, 6, 1),  # 32 rows hold 5 tokens of a 6-head group, 2 rows stay empty
])
def test_prefill_tile_shapes(request, block_m, block_n, heads, kv_heads):
    batch = make_batch(_gen(request), [21, 2], [19, 40], heads, kv_heads, 64, 16)
    out = tk.paged_prefill_attention(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale,
                                     out=poisoned_like(batch.q), block_m=block_m, block_n=block_n)
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale),
                   torch.float32)


def test_prefill_strided_query(request):
    """q as a column slice of a fused qkv output (row stride != heads * head_dim)."""
    gen = _gen(request)
    batch = make_batch(gen, [6, 3], [2, 9], 4, 2, 64, 16)
    qkv = torch.randn(batch.q.shape[0], 8 * 64, generator=gen).to(DEVICE)
    qkv[:, :4 * 64] = batch.q.reshape(-1, 4 * 64)
    q = qkv[:, :4 * 64].view(-1, 4, 64)
    out = tk.paged_prefill_attention(q, batch.k_full, batch.v_full, batch.meta, batch.scale)
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale),
                   torch.float32)


# --------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------

# (page, head_dim, heads, kv_heads, seq_lens, num_splits)
DECODE_CASES = {
    "mha-short": (16, 64, 4, 4, [1, 17, 33], None),
    "gqa4-one-split": (16, 128, 8, 2, [100, 5], 1),
    "page1-mqa-split2": (1, 80, 4, 1, [40, 9], 2),
    "d96-split3": (32, 96, 6, 2, [70], 3),
    "d256-split2": (16, 256, 2, 1, [50, 3], 2),
    "mqa32": (16, 64, 32, 1, [20], 1),
    "long-auto-split": (16, 64, 8, 2, [600, 3, 257], None),
    "more-splits-than-tiles": (32, 128, 4, 2, [1000, 40], 16),
}


@pytest.mark.usefixtures("poisoned_workspace")
@pytest.mark.parametrize("dtype", MATRIX_DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode(request, case, dtype):
    page, head_dim, heads, kv_heads, seq_lens, num_splits = case
    batch = make_batch(_gen(request), [1] * len(seq_lens), [n - 1 for n in seq_lens], heads,
                       kv_heads, head_dim, page, dtype)
    out = tk.paged_decode_attention(batch.q, batch.k_full, batch.v_full, batch.meta.block_tables,
                                    batch.meta.seq_lens, batch.scale, num_splits=num_splits,
                                    max_seq_len=max(seq_lens), out=poisoned_like(batch.q))
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale), dtype)


@pytest.mark.usefixtures("poisoned_workspace")
@pytest.mark.parametrize("block_n,num_splits", [(64, 1), (64, 3), (16, 5)])
def test_decode_tile_widths(request, block_n, num_splits):
    """64 is the GPU tile width for head_dim <= 128 (the interpreter defaults to 32)."""
    batch = make_batch(_gen(request), [1, 1, 1], [150, 63, 64], 8, 2, 64, 16)
    out = tk.paged_decode_attention(batch.q, batch.k_full, batch.v_full, batch.meta.block_tables,
                                    batch.meta.seq_lens, batch.scale, num_splits=num_splits,
                                    out=poisoned_like(batch.q), block_n=block_n)
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale),
                   torch.float32)


def test_long_context_picks_several_splits():
    assert tk.choose_num_splits(3, 2, 600) > 1
    assert tk.choose_num_splits(1, 8, 32768) > 8
    # A short context splits only into whole key tiles; big batches keep one program per
    # (sequence, KV head).
    assert tk.choose_num_splits(1, 8, 200) == 3 and tk.choose_num_splits(1, 8, 63) == 1
    assert tk.choose_num_splits(256, 8, 4096) == 1
    assert tk.choose_num_splits(1, 1, 10**7) == tk._MAX_SPLITS


@pytest.mark.usefixtures("poisoned_workspace")
def test_decode_zero_length_padding_sequence(request):
    """A padding entry (seq_len 0, as CUDA-graph batches use) yields zeros, not NaN."""
    batch = make_batch(_gen(request), [1, 1], [30, 0], 4, 2, 64, 16)
    seq_lens = batch.meta.seq_lens.clone()
    seq_lens[1] = 0
    for splits in (1, 2):
        out = tk.paged_decode_attention(batch.q, batch.k_full, batch.v_full,
                                        batch.meta.block_tables, seq_lens, batch.scale,
                                        num_splits=splits, out=poisoned_like(batch.q))
        expected = reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale)
        assert_matches(out[:1], expected[:1], torch.float32)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


# --------------------------------------------------------------------------------------
# 16-bit dtypes under the interpreter (the CUDA matrix above covers them on GPU)
# --------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="covered by the full dtype matrix on CUDA")
@pytest.mark.usefixtures("poisoned_workspace")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_in_interpreter(request, dtype):
    gen = _gen(request)
    batch = make_batch(gen, [9, 1], [4, 20], 4, 2, 80, 16, dtype)
    out = tk.paged_prefill_attention(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale)
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale), dtype)
    batch = make_batch(gen, [1, 1], [70, 5], 4, 1, 64, 16, dtype)
    out = tk.paged_decode_attention(batch.q, batch.k_full, batch.v_full, batch.meta.block_tables,
                                    batch.meta.seq_lens, batch.scale, num_splits=2)
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale), dtype)


# --------------------------------------------------------------------------------------
# backend
# --------------------------------------------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records which attention kernel the backend launched."""
    calls: list[str] = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(triton_backend, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_backend, name, spy)
    return calls


@pytest.mark.usefixtures("poisoned_workspace")
@pytest.mark.parametrize("query_lens,context_lens,expected_kernel", [
    ([1, 1, 1], [40, 0, 300], "paged_decode_attention"),
    ([1, 6, 1], [12, 0, 33], "paged_prefill_attention"),
    ([5], [17], "paged_prefill_attention"),
])
def test_backend_forward(request, kernel_calls, query_lens, context_lens, expected_kernel):
    batch = make_batch(_gen(request), query_lens, context_lens, 8, 2, 64, 16)
    k_cache, v_cache = batch.k_prefix.clone(), batch.v_prefix.clone()
    out = TritonAttentionBackend().forward(batch.q, batch.k_new, batch.v_new, k_cache, v_cache,
                                              batch.meta, batch.scale)
    assert kernel_calls == [expected_kernel]
    # The cache now holds prefix + new tokens, NaN everywhere else, exactly.
    torch.testing.assert_close(k_cache, batch.k_full, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, batch.v_full, equal_nan=True, atol=0, rtol=0)
    assert_matches(out, reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale),
                   torch.float32)


def test_backend_plans_without_host_syncs(request, monkeypatch):
    """No .item()/.tolist() in forward: on CUDA they would sync and break graph capture."""

    def forbidden(self, *args, **kwargs):
        raise AssertionError("host sync in the attention hot path")

    for query_lens, context_lens in (([1, 1], [9, 70]), ([4, 1], [0, 8])):
        batch = make_batch(_gen(request), query_lens, context_lens, 4, 2, 64, 16)
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "item", forbidden)
            patch.setattr(torch.Tensor, "tolist", forbidden)
            TritonAttentionBackend().forward(batch.q, batch.k_new, batch.v_new,
                                                batch.k_prefix, batch.v_prefix, batch.meta,
                                                batch.scale)


# --------------------------------------------------------------------------------------
# Quantized caches: int8 / fp8 values with one bf16 scale per token and K/V head
# --------------------------------------------------------------------------------------

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# Largest error of one stored element as a fraction of its head vector's max |x| (half an int8
# step; half an fp8 ulp), times 1 + 2^-7 for the scale rounded up to bf16; below the smallest
# normal fp8 value the error is instead half the fixed subnormal spacing (in scaled units).
ELEMENT_BOUND = {torch.int8: 1 / 254, torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3}
SUBNORMAL_HALF_STEP = {torch.int8: 0.0, torch.float8_e4m3fn: 2.0 ** -10, torch.float8_e5m2: 2.0 ** -17}


@dataclass
class QuantCache:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_quant.dequantize(self.k, self.k_scale), kv_quant.dequantize(self.v, self.v_scale)


def quantize_cache(k_full: torch.Tensor, v_full: torch.Tensor, dtype: torch.dtype) -> QuantCache:
    """A quantized copy of a ``make_batch`` cache. Slots nobody owns (NaN there) get value 0 and
    a NaN scale, so a stray read still poisons the output."""
    parts = []
    for full in (k_full, v_full):
        owned = full.isfinite().all(-1)
        data, scale = kv_quant.quantize(torch.nan_to_num(full.float()), dtype)
        parts += [data, scale.masked_fill(~owned, float("nan"))]
    return QuantCache(parts[0], parts[2], parts[1], parts[3])


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
def test_write_kv_quantizes(request, dtype):
    gen = _gen(request)
    num_blocks, page, kv_heads, head_dim, tokens = 6, 4, 3, 80, 9
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
    slots[[1, 6]] = -1  # padding tokens
    k = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 5).to(DEVICE)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(DEVICE)
    k[2, 1] = 0.0  # an all-zero head vector stores zeros, not NaN
    k_cache = torch.zeros(num_blocks, page, kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.full((num_blocks, page, kv_heads), 7.0, dtype=torch.bfloat16, device=DEVICE)
    v_scale = k_scale.clone()
    tk.write_kv(k, v, k_cache, v_cache, slots.to(DEVICE), k_scale, v_scale)
    keep = slots >= 0
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat_scale = scale.view(-1, kv_heads).cpu()
        assert torch.all(flat_scale[[s for s in range(num_blocks * page) if s not in slots.tolist()]] == 7.0)
        written = kv_quant.dequantize(cache.view(-1, kv_heads, head_dim)[slots[keep]].cpu(), flat_scale[slots[keep]])
        x = x[keep].cpu()
        amax = x.abs().amax(-1, keepdim=True)
        # Scales are bf16(amax / QMAX), up to the last bit of rounding.
        torch.testing.assert_close(flat_scale[slots[keep]].float(), (amax[..., 0] / kv_quant.QMAX[dtype]),
                                   rtol=2.0 ** -7, atol=1e-30)
        step = amax / kv_quant.QMAX[dtype] * (1 + 2.0 ** -7)  # the scale
        bound = amax * ELEMENT_BOUND[dtype] * (1 + 2.0 ** -7) + step * SUBNORMAL_HALF_STEP[dtype]
        assert torch.all((written - x).abs() <= bound + 1e-30)
        assert torch.isfinite(written).all()


@pytest.mark.usefixtures("poisoned_workspace")
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["decode-split2", "decode", "prefill-mixed"])
def test_kernels_read_quantized_cache(request, dtype, case):
    """Against the fp64 reference over the dequantized cache: the kernels convert the stored
    values exactly and fold the scales in, so only fp32 rounding separates them."""
    gen = _gen(request)
    if case == "prefill-mixed":
        batch = make_batch(gen, [9, 1, 17], [20, 33, 0], 4, 2, 64, 16)
    else:
        batch = make_batch(gen, [1, 1, 1], [70, 5, 130], 4, 1, 64, 16)
    cache = quantize_cache(batch.k_full, batch.v_full, dtype)
    k_ref, v_ref = cache.dequantized()
    expected = reference(batch.q, k_ref, v_ref, batch.meta, batch.scale)
    if case == "prefill-mixed":
        out = tk.paged_prefill_attention(batch.q, cache.k, cache.v, batch.meta, batch.scale,
                                         out=poisoned_like(batch.q), k_scale=cache.k_scale,
                                         v_scale=cache.v_scale)
    else:
        out = tk.paged_decode_attention(batch.q, cache.k, cache.v, batch.meta.block_tables,
                                        batch.meta.seq_lens, batch.scale,
                                        num_splits=2 if case == "decode-split2" else 1,
                                        out=poisoned_like(batch.q), k_scale=cache.k_scale,
                                        v_scale=cache.v_scale)
    assert_matches(out, expected, torch.float32)


@pytest.mark.usefixtures("poisoned_workspace")
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("query_lens,context_lens", [([1, 1], [40, 17]), ([6, 1], [12, 33])],
                         ids=["decode", "mixed"])
def test_backend_forward_on_quantized_cache(request, dtype, query_lens, context_lens):
    """The backend writes the new K/V quantized, then every read (those new tokens included)
    sees the dequantized cache; the prefix and the unowned slots stay as they were."""
    batch = make_batch(_gen(request), query_lens, context_lens, 8, 2, 64, 16)
    cache = quantize_cache(batch.k_prefix, batch.v_prefix, dtype)
    before = QuantCache(cache.k.clone(), cache.v.clone(), cache.k_scale.clone(), cache.v_scale.clone())
    out = TritonAttentionBackend().forward(batch.q, batch.k_new, batch.v_new, cache.k, cache.v,
                                              batch.meta, batch.scale, k_scale=cache.k_scale,
                                              v_scale=cache.v_scale)
    new = batch.meta.slot_mapping.cpu()
    others = torch.ones(cache.k_scale.numel() // cache.k_scale.shape[-1], dtype=torch.bool)
    others[new] = False
    heads, dim = cache.k.shape[2], cache.k.shape[3]
    for now, then in ((cache.k, before.k), (cache.v, before.v)):
        assert torch.equal(kv_quant.byte_view(now).view(-1, heads, dim)[others],
                           kv_quant.byte_view(then).view(-1, heads, dim)[others])
    for now, then in ((cache.k_scale, before.k_scale), (cache.v_scale, before.v_scale)):
        torch.testing.assert_close(now.view(-1, heads)[others], then.view(-1, heads)[others], equal_nan=True,
                                   atol=0, rtol=0)
        assert now.view(-1, heads)[new].isfinite().all()
    k_ref, v_ref = cache.dequantized()
    assert_matches(out, reference(batch.q, k_ref, v_ref, batch.meta, batch.scale), torch.float32)


# --------------------------------------------------------------------------------------
# CUDA only: graphs and speed
# --------------------------------------------------------------------------------------


@cuda_only
def test_decode_in_cuda_graph(request):
    """Capture a decode step once, replay it after every sequence has grown."""
    gen = _gen(request)
    heads, kv_heads, head_dim, page = 8, 2, 128, 16
    batch = make_batch(gen, [1] * 4, [100, 7, 500, 64], heads, kv_heads, head_dim, page,
                       torch.bfloat16, spare_blocks=64)
    backend = TritonAttentionBackend(decode_num_splits=4)
    k_cache, v_cache = batch.k_prefix.clone(), batch.v_prefix.clone()
    q, k, v = batch.q.clone(), batch.k_new.clone(), batch.v_new.clone()
    meta = batch.meta
    backend.forward(q, k, v, k_cache, v_cache, meta, batch.scale)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, meta, batch.scale)
    # Next step: each sequence one token longer (same blocks, spare capacity in the last one
    # or a fresh block from the spares).
    grown = make_batch(gen, [1] * 4, [101, 8, 501, 65], heads, kv_heads, head_dim, page,
                       torch.bfloat16, spare_blocks=64)
    k_cache.copy_(grown.k_prefix)
    v_cache.copy_(grown.v_prefix)
    q.copy_(grown.q)
    k.copy_(grown.k_new)
    v.copy_(grown.v_new)
    for name in ("slot_mapping", "seq_lens", "context_lens", "query_start_loc"):
        getattr(meta, name).copy_(getattr(grown.meta, name))
    meta.block_tables.zero_()
    meta.block_tables[:, :grown.meta.block_tables.shape[1]].copy_(grown.meta.block_tables)
    graph.replay()
    torch.cuda.synchronize()
    grown.meta.block_tables = meta.block_tables
    assert_matches(out, reference(grown.q, grown.k_full, grown.v_full, grown.meta, grown.scale),
                   torch.bfloat16)


def test_prefill_work_lists_real_tiles_heaviest_first():
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0), query_start_loc=torch.zeros(0), seq_lens=torch.zeros(0),
        context_lens=torch.zeros(0), block_tables=torch.zeros(0), max_query_len=70,
        max_seq_len=100, query_lens_cpu=[1, 70, 0, 3], seq_lens_cpu=[100, 70, 5, 3])
    work = tk._prefill_work(meta, 32, torch.device("cpu")).tolist()
    # seq 0: one tile seeing 100 keys; seq 1: tiles seeing 32, 64, 70 keys; seq 2: none.
    assert work == [[0, 0], [1, 2], [1, 1], [1, 0], [3, 0]]
    assert tk._prefill_work(meta, 32, torch.device("cpu")) is tk._prefill_work(
        meta, 32, torch.device("cpu"))  # planned once per step


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
