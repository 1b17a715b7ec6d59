"""Weight quantization: the kernels every format targets, the online int8/int4/fp8 methods'
error bounds against the float layer, and the config's refusals.

Error bounds. With round-to-nearest every dequantized weight is within half a step of the float
weight (``|w - w_hat| <= s / 2``), so an output ``y_n = sum_k x_k w_nk`` is within
``sum_k |x_k| s_nk / 2``. The CPU kernels also round the activations: to bfloat16 (fp8, and
torch's ops; relative error <= 2**-9), adding at most ``2**-9 * sum_k |x_k| |w_hat_nk|``, or
(pagoda's int8/int4 kernel) to 16-bit fixed point with one scale per row (absolute error <=
``max_k |x_k| * 2**-16``), adding at most ``2**-16 * max|x| * sum_k |w_hat_nk|``; float32
accumulation adds a negligible ``K * 2**-24`` relative term, covered by a 1% margin.
"""
from __future__ import annotations

import os

import pytest
import torch

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, new_parameter
from pagoda.kernels import woq as cpu_woq
from pagoda.layers.quantization.kernels import (DequantLinear, dequantize_grouped, make_fp8_linear, make_int4_linear,
                                                make_int8_linear)
from pagoda.layers.quantization.online import quantize_fp8, quantize_int4, quantize_int8

BF16_EPS = 2.0 ** -9
# pagoda's compiled kernel where this CPU runs it, torch's ops, the dequantizing fallback.
BACKENDS = (["auto"] if cpu_woq.load() is not None else []) + ["torch", "dequant"]


def bound(x: torch.Tensor, w_hat: torch.Tensor, step_err: torch.Tensor) -> torch.Tensor:
    """Worst-case |y - x @ w.T| given per-weight error ``step_err`` [N, K]. On top of the
    weights' own error the CPU kernels round the activations and the dequantized weights (int4)
    or the output (torch's ops) to bfloat16, each at most 2**-9 relative."""
    ax, aw = x.abs().double(), w_hat.abs().double()
    fixed16 = 2.0 ** -16 * ax.amax(dim=-1, keepdim=True) * aw.sum(dim=1)
    return (ax @ step_err.double().T + 3 * BF16_EPS * ax @ aw.T + fixed16) * 1.01 + 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group_size", [32, 96, 128, 768, 16, 24])
@pytest.mark.parametrize("rows", [1, 13])
def test_int4_kernel_matches_dequantized_weight(backend: str, group_size: int, rows: int) -> None:
    """Asymmetric integer zero points, any group size dividing K (96 splits into torch's groups
    of 32, whole row 768, 16 is not a size torch's op takes, and 24 puts two groups in one
    16-value step of the kernel's row quantizer): the kernel equals x @ W_hat.T."""
    g = torch.Generator().manual_seed(group_size + rows)
    n, k = 96, 768
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g).float()
    lin = make_int4_linear(q, scales, zeros, group_size, backend=backend)
    want = {"auto": "woq", "torch": "int4pack" if group_size % 32 == 0 else "dequant", "dequant": "dequant"}
    assert lin.kernel == want[backend]
    w_hat = dequantize_grouped(q, scales, zeros, group_size, torch.float64)
    x = torch.randn(rows, k, generator=g)
    err = (lin(x, None).double() - x.double() @ w_hat.T).abs()
    assert (err <= bound(x, w_hat, torch.zeros_like(w_hat))).all(), err.max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_int4_kernel_permutation_and_bias(backend: str) -> None:
    """Act order: column j of q multiplies input column perm[j]."""
    g = torch.Generator().manual_seed(1)
    n, k, group = 64, 256, 64
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.05
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    perm = torch.randperm(k, generator=g)
    bias = torch.randn(n, generator=g)
    x = torch.randn(3, k, generator=g)
    w_hat = dequantize_grouped(q, scales, zeros, group, torch.float64)
    ref = x[:, perm].double() @ w_hat.T + bias.double()
    out = make_int4_linear(q, scales, zeros, group, perm=perm, backend=backend)(x, bias)
    assert ((out.double() - ref).abs() <= bound(x, w_hat, torch.zeros_like(w_hat))).all()


def test_int4_kernel_refuses_a_group_size_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match="group size 100 does not divide 256"):
        make_int4_linear(torch.zeros(8, 256, dtype=torch.long), torch.ones(8, 2), None, 100)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, 21])
def test_int8_kernels(backend: str, rows: int) -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 80, 192
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    lin = make_int8_linear(q, scales, backend=backend)
    assert lin.kernel == {"auto": "woq", "torch": "int8pack", "dequant": "dequant"}[backend]
    w_hat = q.double() * scales.double()[:, None]
    err = (lin(x, bias).double() - x.double() @ w_hat.T - bias.double()).abs()
    assert (err <= bound(x, w_hat, torch.zeros_like(w_hat))).all()
    # grouped with zero points: the dequantizing fallback, exact in float32
    gs = torch.rand(n, k // 64, generator=g) * 0.01
    zs = torch.randint(-8, 8, (n, k // 64), generator=g).float()
    lin = make_int8_linear(q, gs, zs, group_size=64, backend=backend)
    assert isinstance(lin, DequantLinear)
    w_hat = dequantize_grouped(q, gs, zs, 64, torch.float64)
    torch.testing.assert_close(lin(x, None).double(), x.double() @ w_hat.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_woq.supported(cpu_woq.KIND_INT4), reason="pagoda's CPU kernel needs AVX2 or AVX-512")
@pytest.mark.parametrize("n,k,group_size", [(16, 8, 8), (32, 40, 8), (48, 72, 24), (16, 136, 136), (80, 1024, 512)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9])
def test_int4_kernel_odd_shapes_against_torch(n: int, k: int, group_size: int, rows: int) -> None:
    """Group sizes torch's op does not take (8, 24, whole rows of 136), the smallest K, every row
    chunking (1-4 rows at once, then chunks of 4), with bias, against float64 torch."""
    g = torch.Generator().manual_seed(n * k + rows)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g).float()
    bias = torch.randn(n, generator=g)
    lin = make_int4_linear(q, scales, zeros, group_size)
    assert lin.kernel == "woq"
    w_hat = dequantize_grouped(q, scales, zeros, group_size, torch.float64)
    x = torch.randn(rows, k, generator=g)
    err = (lin(x, bias).double() - (x.double() @ w_hat.T + bias.double())).abs()
    assert (err <= bound(x, w_hat, torch.zeros_like(w_hat))).all(), err.max()


def test_int4_group_terms_are_float16_exact_where_the_source_is() -> None:
    """The int4 kernel's group metadata: float16 scales and zero terms, [G, N]; a float16 source
    (GGUF Q4_1's ``d`` and ``m``) unchanged, others rounded to nearest (within 2**-11 of
    themselves in float16's normal range, 2**-25 absolute below it); beyond its range: None.
    Symmetric codes (Q4_0's ``d`` and ``-8 d``) keep only the scales."""
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(48, 4, generator=g) * 0.05).to(torch.float16).float()
    m = (torch.rand(48, 4, generator=g) * -0.3).to(torch.float16).float()
    gs, gb = cpu_woq.int4_group_terms(d, m)
    assert gs.dtype == gb.dtype == torch.float16 and gs.shape == (4, 48)
    assert torch.equal(gs.float(), d.T) and torch.equal(gb.float(), m.T)
    gs, gb = cpu_woq.int4_group_terms(d, -8 * d)
    assert torch.equal(gs.float(), d.T) and gb is None
    d[5, 1] *= 1.5  # one group whose term is not -8 times its scale: the terms are kept
    assert cpu_woq.int4_group_terms(d, -8 * m.abs() - 8 * d.roll(1, 0)) is not None
    assert cpu_woq.int4_group_terms(d.roll(1, 0), -8 * d)[1] is not None
    s = torch.rand(48, 4, generator=g) * 0.05 + 1e-7  # some below float16's normal range
    s[0, 0] = 3e-6
    gs, _ = cpu_woq.int4_group_terms(s, -s)
    err = (gs.float() - s.T).abs()
    assert bool((err <= torch.maximum(s.T * 2.0 ** -11, torch.full_like(err, 2.0 ** -25))).all())
    assert float(err.max()) > 0  # float32 scales are rounded, not kept
    assert cpu_woq.int4_group_terms(s * 1e7, -s) is None


@pytest.mark.skipif(not cpu_woq.supported(cpu_woq.KIND_INT4), reason="pagoda's CPU kernel needs AVX2 or AVX-512")
def test_int4_kernel_reads_0_625_bytes_a_weight_and_refuses_out_of_range_scales() -> None:
    """Groups of 32 on the kernel: half a byte a weight plus a float16 scale and zero term per
    group (0.625 bytes a weight, no code sums; 0.5625 for symmetric codes, which need no zero
    term); scales float16 cannot hold take another path with the same results."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (64, 256), generator=g)
    scales = torch.rand(64, 8, generator=g) * 0.02 + 0.001
    lin = make_int4_linear(q, scales, None, 32)
    assert lin.kernel == "woq"
    assert lin.nbytes == 64 * 256 * 0.5625
    zeros = torch.randint(0, 16, (64, 8), generator=g).float()
    asym = make_int4_linear(q, scales, zeros, 32)
    assert asym.kernel == "woq" and asym.nbytes == 64 * 256 * 0.625
    x = torch.randn(3, 256, generator=g)
    for layer in (lin, asym):  # each against the weight its float16 metadata gives
        gs = layer.group_scale.double().T.repeat_interleave(32, 1)
        gb = -8 * gs if layer is lin else layer.group_bias.double().T.repeat_interleave(32, 1)
        w_hat = q.double() * gs + gb
        assert ((layer(x, None).double() - x.double() @ w_hat.T).abs()
                <= bound(x, w_hat, torch.zeros_like(w_hat))).all()
    big = make_int4_linear(q, scales * 1e7, None, 32)
    assert big.kernel != "woq"
    x = torch.randn(2, 256, generator=g)
    w_hat = dequantize_grouped(q, scales * 1e7, torch.full_like(scales, 8.0), 32, torch.float64)
    assert ((big(x, None).double() - x.double() @ w_hat.T).abs() <= bound(x, w_hat, torch.zeros_like(w_hat))).all()


@pytest.mark.skipif(not cpu_woq.supported(cpu_woq.KIND_INT8), reason="pagoda's CPU kernel needs AVX2 or AVX-512")
@pytest.mark.parametrize("n,k", [(16, 4), (32, 68), (48, 1412)])
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_int8_kernel_odd_shapes_and_outliers(n: int, k: int, rows: int) -> None:
    """Any K that is a multiple of 4; activations with a 1000x outlier and exact zeros (the
    per-row fixed point keeps the bound); an all-zero row gives exactly the bias."""
    g = torch.Generator().manual_seed(n + k + rows)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    x[0, k // 2] = 1000.0
    x[:, :2] = 0.0
    x[-1] = 0.0 if rows > 1 else x[-1]
    lin = make_int8_linear(q, scales)
    assert lin.kernel == "woq"
    w_hat = q.double() * scales.double()[:, None]
    out = lin(x, bias)
    err = (out.double() - x.double() @ w_hat.T - bias.double()).abs()
    assert (err <= bound(x, w_hat, torch.zeros_like(w_hat))).all(), err.max()
    if rows > 1:
        assert torch.equal(out[-1], bias)


@pytest.mark.skipif(not cpu_woq.supported(cpu_woq.KIND_INT8G), reason="pagoda's CPU kernel needs AVX2 or AVX-512")
@pytest.mark.parametrize("group_size", [32, 64, 256])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_groups_without_zeros_take_the_kernel(group_size: int, rows: int) -> None:
    """Per-group int8 scales without zero points (GGUF Q8_0, symmetric 8-bit GPTQ/compressed
    tensors) go to the kernel's grouped int8 kind: scales rounded to float16 (exact where they are
    float16 numbers), within the fixed-point bound of the dequantized weight, 1 byte a weight plus
    2 bytes a group; groups past 256 columns and zero points stay on the dequantizing path."""
    g = torch.Generator().manual_seed(group_size + rows)
    n, k = 48, 512
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group_size, generator=g) * 0.01 + 1e-3
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    lin = make_int8_linear(q, scales, None, group_size)
    assert (lin.kernel, lin.kind, lin.group_size) == ("woq", cpu_woq.KIND_INT8G, group_size)
    assert lin.nbytes == n * k + n * (k // group_size) * 2
    w_hat = dequantize_grouped(q, scales.half().double(), None, group_size, torch.float64)
    err = (lin(x, bias).double() - x.double() @ w_hat.T - bias.double()).abs()
    assert (err <= bound(x, w_hat, torch.zeros_like(w_hat)) * 1.01).all(), err.max()
    assert make_int8_linear(q, scales[:, :1], None, k).kind == cpu_woq.KIND_INT8  # one group: per channel
    assert make_int8_linear(q.repeat(1, 2), scales[:, :2], None, 512).kernel == "dequant"
    assert make_int8_linear(q, scales, torch.ones_like(scales), group_size).kernel == "dequant"


def test_shapes_the_kernel_does_not_take_fall_back() -> None:
    """int4 group sizes that are not multiples of 8 and int8 K not a multiple of 4 use torch's
    ops or the dequantizing fallback, with the same results."""
    g = torch.Generator().manual_seed(9)
    q4 = torch.randint(0, 16, (32, 96), generator=g)
    s4 = torch.rand(32, 8, generator=g) * 0.02
    lin = make_int4_linear(q4, s4, None, 12)
    assert lin.kernel == "dequant"
    x = torch.randn(2, 96, generator=g)
    w_hat = dequantize_grouped(q4, s4, torch.full_like(s4, 8.0), 12, torch.float64)
    assert ((lin(x, None).double() - x.double() @ w_hat.T).abs() <= bound(x, w_hat, torch.zeros_like(w_hat))).all()
    q8 = torch.randint(-127, 128, (32, 98), generator=g, dtype=torch.int8)
    lin8 = make_int8_linear(q8, torch.rand(32, generator=g))
    assert lin8.kernel == "int8pack"


@pytest.mark.skipif(cpu_woq.load() is None, reason="pagoda's CPU kernel needs AVX2 or AVX-512")
def test_kernel_rows_do_not_depend_on_the_batch() -> None:
    """A row of pagoda's kernel is the same alone or among 20 others (one instruction sequence
    per row), for every kind this variant has (int8 and int4 on AVX2, fp8 too on AVX-512; K 1536
    crosses the AVX2 int8 path's 512-column folds)."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(128, 1536, generator=g)
    x = torch.randn(21, 1536, generator=g)
    q, s = quantize_int8(w)
    lins = [make_int8_linear(q, s), make_int4_linear(*quantize_int4(w, 64), None, 64)]
    if cpu_woq.supported(cpu_woq.KIND_FP8):
        lins.append(make_fp8_linear(*quantize_fp8(w)))
    for lin in lins:
        assert lin.kernel == "woq"
        full = lin(x, None)
        assert all(torch.equal(lin(x[i:i + 1], None)[0], full[i]) for i in range(0, 21, 4)), lin.kernel


def test_online_int8_layer_error_bound() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g) * 0.05
    x = torch.randn(8, 256, generator=g)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    w_hat = q.double() * s.double()[:, None]
    assert ((w.double() - w_hat).abs() <= s.double()[:, None] / 2 * (1 + 1e-5)).all()  # half a step (+ the fp32 scale's rounding, times up to 15)
    step = (s.double() / 2)[:, None].expand_as(w_hat)
    for backend in BACKENDS:
        out = make_int8_linear(q, s, backend=backend)(x, None)
        assert ((out.double() - x.double() @ w.double().T).abs() <= bound(x, w_hat, step)).all(), backend


@pytest.mark.parametrize("group_size", [128, 64, 256])
def test_online_int4_layer_error_bound(group_size: int) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 512, generator=g) * 0.05
    x = torch.randn(8, 512, generator=g)
    q, s = quantize_int4(w, group_size)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    w_hat = dequantize_grouped(q, s, torch.full_like(s, 8.0), group_size, torch.float64)
    step = (s.double() / 2).repeat_interleave(group_size, dim=1)
    assert ((w.double() - w_hat).abs() <= step * (1 + 1e-5)).all()
    for backend in BACKENDS:
        out = make_int4_linear(q, s, None, group_size, backend=backend)(x, None)
        assert ((out.double() - x.double() @ w.double().T).abs() <= bound(x, w_hat, step)).all(), backend


def test_online_fp8_layer_error_bound() -> None:
    """e4m3 keeps 3 mantissa bits: a normal value is within 2**-4 of itself relatively, a
    subnormal (below 2**-6 in scaled units) within 2**-10 absolutely."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(8, 256, generator=g)
    w8, s = quantize_fp8(w)
    w_hat = w8.double() * s.double()[:, None]
    err = (w.double().abs() * 2.0 ** -4).maximum(s.double()[:, None] * 2.0 ** -10)
    assert ((w.double() - w_hat).abs() <= err + 1e-12).all()
    ref = x.double() @ w.double().T
    for backend in BACKENDS:
        out = make_fp8_linear(w8, s, backend=backend)(x, None)
        assert ((out.double() - ref).abs() <= bound(x, w_hat, err)).all(), backend


# ---- the seam: any method's parameters are sharded by their layout attributes ----------------

class PackedLayoutMethod(LinearMethod):
    """Parameters laid out like a GPTQ checkpoint: 4-bit values packed eight to an int32 along
    the input (``qweight``) or the output (``qzeros``), per-group scales, a per-projection
    scalar, and an optional per-input-column index."""

    group = 16

    def create_weights(self, layer, in_features, out_features, output_partition_sizes, dtype, weight_loader):
        g = self.group
        new_parameter(layer, "qweight", (in_features // 8, out_features), torch.int32, weight_loader,
                      input_dim=0, output_dim=1, packed_dim=0, pack_factor=8)
        new_parameter(layer, "qzeros", (in_features // g, out_features // 8), torch.int32, weight_loader,
                      input_dim=0, output_dim=1, packed_dim=1, pack_factor=8)
        new_parameter(layer, "scales", (in_features // g, out_features), dtype, weight_loader,
                      input_dim=0, output_dim=1)
        new_parameter(layer, "wscale", (len(output_partition_sizes),), dtype, weight_loader, per_shard=True)
        new_parameter(layer, "g_idx", (in_features,), torch.int32, weight_loader, input_dim=0, optional=True)

    def apply(self, layer, x, bias):
        raise AssertionError("this test only loads")


class _Method(QuantizationConfig):
    @classmethod
    def from_config(cls, config, from_checkpoint):
        return cls()

    def get_linear_method(self, layer, prefix):
        return PackedLayoutMethod()


def _checkpoint(in_f: int, out_f: int, seed: int) -> dict[str, torch.Tensor]:
    """One projection's tensors as a TP=1 checkpoint stores them."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randint(0, 1 << 30, s, generator=g, dtype=torch.int32)  # noqa: E731
    return {"qweight": r(in_f // 8, out_f), "qzeros": r(in_f // 16, out_f // 8),
            "scales": torch.randn(in_f // 16, out_f, generator=g), "wscale": torch.rand((), generator=g),
            "g_idx": r(in_f)}


LAYOUT = {"qweight": (1, 8, 0), "qzeros": (1, 8, 1), "scales": (1, 1, 1)}  # name: (output dim, pack, packed dim)


def _rank_slice(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    size = t.shape[dim] // tp
    return t.narrow(dim, rank * size, size)


@pytest.mark.parametrize("kind", ["column", "merged", "qkv", "row"])
@pytest.mark.parametrize("rank", [0, 1])
def test_tp_sharding_of_packed_parameters(monkeypatch, kind: str, rank: int) -> None:
    """Rank r of 2 holds exactly its slice of every packed / grouped / per-shard tensor: the
    slice of the output features (in packed units where packed along them) for column-parallel
    layers, each fused projection placed at its offset; the slice of the input rows/groups for
    row-parallel layers, per-channel tensors whole."""
    from pagoda.distributed import parallel_state
    from pagoda.distributed.parallel_state import TPGroup
    from pagoda.layers import linear

    tp, hidden = 2, 128
    monkeypatch.setattr(parallel_state, "_TP", TPGroup(rank, tp))
    quant = _Method()
    if kind == "column":
        layer, shards, in_f = linear.ColumnParallelLinear(hidden, 64, False, torch.float32, quant), {None: 64}, hidden
    elif kind == "merged":
        layer = linear.MergedColumnParallelLinear(hidden, [64, 128], False, torch.float32, quant)
        shards, in_f = {0: 64, 1: 128}, hidden
    elif kind == "qkv":  # 4 query heads, 2 K/V heads of 16
        layer = linear.QKVParallelLinear(hidden, 16, 4, 2, False, torch.float32, quant)
        shards, in_f = {"q": 64, "k": 32, "v": 32}, hidden
    else:
        layer, shards, in_f = linear.RowParallelLinear(256, hidden, False, torch.float32, quant), {None: hidden}, 256
    ckpts = {s: _checkpoint(in_f, out, seed=i) for i, (s, out) in enumerate(shards.items())}
    for shard, tensors in ckpts.items():
        for name, t in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, t, shard)
    for name, (out_dim, pack, packed_dim) in LAYOUT.items():
        if kind == "row":  # input rows (packed or grouped) are split; the output is whole
            want = _rank_slice(ckpts[None][name], 0, rank, tp)
        else:
            want = torch.cat([_rank_slice(t[name], out_dim, rank, tp) for t in ckpts.values()], dim=out_dim)
        assert torch.equal(getattr(layer, name).data, want), name
    want_scalars = torch.stack([t["wscale"] for t in ckpts.values()])
    assert torch.equal(layer.wscale.data, want_scalars)
    want_gidx = _rank_slice(ckpts[None]["g_idx"], 0, rank, tp) if kind == "row" else ckpts[list(ckpts)[-1]]["g_idx"]
    assert torch.equal(layer.g_idx.data, want_gidx)


# ---- the GPU kernel, under Triton's interpreter on CPU ---------------------------------------

@pytest.mark.parametrize("bits,group_size,zeros", [(4, 64, True), (4, 128, False), (8, 128, True), (8, -1, False),
                                                   (8, 16, False)])
def test_triton_dequantizing_kernel(bits: int, group_size: int, zeros: bool) -> None:
    """The Triton kernel dequantizes tile by tile (ragged M, N and K tiles) and accumulates in
    float32: it matches x @ W_hat.T to float32 rounding (groups of 16, GGUF Q6_K's, are narrower
    than a K tile)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1 before triton is imported")
    g = torch.Generator().manual_seed(bits + group_size)
    n, k = 80, 256
    groups = 1 if group_size == -1 else k // group_size
    lo, hi = (0, 16) if bits == 4 else (-127, 128)
    q = torch.randint(lo, hi, (n, k), generator=g)
    scales = torch.rand(n, groups, generator=g) * 0.02
    z = torch.randint(lo, hi, (n, groups), generator=g).float() if zeros else None
    perm = torch.randperm(k, generator=g) if bits == 4 else None
    make = make_int4_linear if bits == 4 else make_int8_linear
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs on CPU tensors, a GPU on its own

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev)

    lin = make(on(q), on(scales), on(z), group_size, perm=on(perm), backend="triton")
    assert lin.kernel == "triton"
    z_ref = torch.full_like(scales, 8.0) if bits == 4 and z is None else z  # int4's default zero point
    w_hat = dequantize_grouped(q, scales, z_ref, k if group_size == -1 else group_size, torch.float64)
    x = torch.randn(19, k, generator=g)
    bias = torch.randn(n, generator=g)
    xp = x[:, perm] if perm is not None else x
    torch.testing.assert_close(lin(on(x), on(bias)).double().cpu(), xp.double() @ w_hat.T + bias.double(),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_tied_lm_head_quantized_on_request_keeps_the_embedding(model_factory, method: str) -> None:
    """A tied head (qwen3 here) asked to quantize: its logits come from the quantized matmul of
    the same rows the embedding keeps in float, within the per-row quantization error bound."""
    from pagoda import LLM, SamplingParams

    model_dir = model_factory("qwen3")
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20, max_model_len=128, quantization=method,
              quantization_config={"lm_head": True})
    try:
        model = llm.engine.core.executor.model
        head = model.lm_head
        assert head.tied and head.qlinear is not None
        emb = model.model.embed_tokens.weight
        assert head.weight is emb and emb.numel() > 0  # the token lookup still reads the float rows
        x = torch.randn(3, emb.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            got = head.compute_logits(x)
        want = x @ emb.float().T
        # per-row int8: each weight off by at most half a step (max|row| / 254); fp8: 2**-4 relative.
        # Plus the activations' rounding (16-bit fixed point for int8, bfloat16 for fp8: <= 2**-9).
        step = emb.float().abs().amax(1) / (254 if method == "int8" else 16)
        bound = (x.abs().sum(1, keepdim=True) * step[None, :]
                 + x.abs().amax(1, keepdim=True) * 2 ** -9 * emb.float().abs().sum(1)[None, :] + 1e-5)
        assert (got[:, :want.shape[1]] - want).abs().le(bound).all()
        assert not torch.equal(got[:, :want.shape[1]], want)  # really quantized
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
