"""The few-rows GEMM (``skinny_gemm.py``): the Triton kernel against a float64 product (on CPU
under the interpreter), and the per-shape choice against cuBLAS with stand-in timers."""
from __future__ import annotations

import os
import zlib

import torch

if not torch.cuda.is_available():
    # Must precede the first ``import triton`` (see conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers import skinny_gemm as sg  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("config", sg.CONFIGS, ids=[f"n{c[0]}-k{c[1]}-split{c[2]}" for c in sg.CONFIGS])
@pytest.mark.parametrize("m,n,k,bias", [(1, 96, 300, False), (3, 50, 512, True), (16, 33, 129, True)])
def test_kernel_matches_the_product(request, config, m, n, k, bias):
    """Ragged N and K (neither a multiple of any tile), bias with and without splits."""
    gen = _gen(request)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, torch.bfloat16)
    b = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16) if bias else None
    got = sg.skinny_matmul(x, w, b, config)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 sums of bf16 products, one rounding to bf16 at the end.
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("config", sg.GEMV_CONFIGS, ids=[c.label() for c in sg.GEMV_CONFIGS])
@pytest.mark.parametrize("n,k,bias", [(96, 300, False), (50, 2100, True), (7, 33, True)])
def test_one_row_kernel_matches_the_product(request, config, n, k, bias):
    """The one-row kernel: ragged N and K, K shorter and longer than a K step, bias with and
    without splits; float32 sums of bf16 products as the tiled kernel's."""
    gen = _gen(request)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, torch.bfloat16)
    b = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16) if bias else None
    got = sg.skinny_matmul(x, w, b, config)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="one-row kernel got 2 rows"):
        sg.skinny_matmul(torch.cat([x, x]), w, b, config)


def test_one_row_configs_come_after_the_tiled_ones():
    """A choice for one row tries the one-row kernel too (indices of the tiled configs unchanged);
    for more rows only the tiled kernel."""
    assert sg.configs(False, 1) == sg.CONFIGS + sg.GEMV_CONFIGS and sg.configs(False, 2) == sg.CONFIGS
    assert sg.configs(True, 1) == sg.SILU_CONFIGS + sg.SILU_GEMV_CONFIGS and sg.configs(True, 3) == sg.SILU_CONFIGS
    assert all(c.gemv for c in sg.GEMV_CONFIGS + sg.SILU_GEMV_CONFIGS) and not any(c.gemv for c in sg.CONFIGS)
    assert sg.GEMV_CONFIGS[0].label() == "gemv-4x1024x1x8x3" and sg.CONFIGS[0].label() == "16x256x1x4x4"


def test_kernel_refuses_too_many_rows():
    with pytest.raises(ValueError, match="at most 16 rows"):
        sg.skinny_matmul(torch.zeros(17, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE), None)
    with pytest.raises(ValueError, match="at most 32 rows"):  # fp8 weights take up to 32
        sg.skinny_matmul(torch.zeros(33, 16, device=DEVICE, dtype=torch.bfloat16),
                         torch.zeros(4, 16, device=DEVICE).to(torch.float8_e4m3fn), None,
                         scales=torch.ones(4, device=DEVICE))


class _Stub:
    """Stand-in timer: cuBLAS takes ``cublas_ms``, config i takes ``config_ms[i]``."""

    def __init__(self, cublas_ms: float, config_ms: list[float]) -> None:
        self.cublas_ms, self.config_ms, self.calls = cublas_ms, config_ms, 0

    def __call__(self, fn) -> float:
        index = self.calls - 1
        self.calls += 1
        return self.cublas_ms if index < 0 else self.config_ms[index]


def _spy(monkeypatch):
    ran: list[object] = []
    real = sg.skinny_matmul

    def spy(x, w, b, config=None, silu_mul=False, scales=None):
        ran.append(config or sg.configs(silu_mul, x.shape[0])[0])
        return real(x, w, b, config, silu_mul, scales)

    monkeypatch.setattr(sg, "skinny_matmul", spy)
    return ran


def test_choice_keeps_the_fastest_per_class(monkeypatch):
    monkeypatch.setenv(sg.ENV, "auto")
    ran = _spy(monkeypatch)
    times = [3.0, 1.0, 2.0, 5.0, 4.0]
    choice = sg.SkinnyChoice(timer=_Stub(2.5, times), capturing=lambda: False)
    x = torch.randn(2, 64).to(DEVICE, torch.bfloat16)
    w = torch.randn(32, 64).to(DEVICE, torch.bfloat16)
    out = choice.linear(x, w, None)
    torch.testing.assert_close(out.float(), (x.float() @ w.float().T), atol=5e-2, rtol=2e-2)
    assert choice.winners == {(2, 32, 64, torch.bfloat16, False): 1}
    ran.clear()
    choice.linear(x, w, None)  # no measuring now: the winner runs once
    assert ran == [sg.CONFIGS[1]]
    # cuBLAS faster than every config: cuBLAS for that class, the kernel never runs again.
    slow = sg.SkinnyChoice(timer=_Stub(0.5, times), capturing=lambda: False)
    slow.linear(x, w, None)
    ran.clear()
    slow.linear(x, w, None)
    assert slow.winners[(2, 32, 64, torch.bfloat16, False)] == -1 and ran == []


def test_no_measuring_while_capturing(monkeypatch):
    monkeypatch.setenv(sg.ENV, "auto")
    ran = _spy(monkeypatch)
    choice = sg.SkinnyChoice(timer=lambda fn: pytest.fail("measured during capture"), capturing=lambda: True)
    x = torch.randn(1, 64).to(DEVICE, torch.bfloat16)
    w = torch.randn(32, 64).to(DEVICE, torch.bfloat16)
    choice.linear(x, w, None)
    assert ran == [] and choice.winners == {}  # cuBLAS, and the class is measured later


def test_modes(monkeypatch):
    """The switch is read on a choice's first product and kept."""
    ran = _spy(monkeypatch)

    def choice() -> sg.SkinnyChoice:
        return sg.SkinnyChoice(timer=lambda fn: pytest.fail("a forced mode measures nothing"), capturing=lambda: False)

    x = torch.randn(1, 64).to(DEVICE, torch.bfloat16)
    w = torch.randn(32, 64).to(DEVICE, torch.bfloat16)
    monkeypatch.setenv(sg.ENV, "triton")
    forced = choice()
    forced.linear(x, w, None)
    assert ran == [sg.CONFIGS[0]]
    monkeypatch.setenv(sg.ENV, "cublas")
    forced.linear(x, w, None)  # still the mode it read first
    assert ran == [sg.CONFIGS[0]] * 2
    choice().linear(x, w, None)
    assert ran == [sg.CONFIGS[0]] * 2
    monkeypatch.setenv(sg.ENV, "fast")
    with pytest.raises(ValueError, match="PAGODA_SKINNY_GEMM"):
        choice().linear(x, w, None)
    # Unset: both kinds measured (the one-row kernel beat cuBLAS on the card).
    monkeypatch.delenv(sg.ENV)
    unset = sg.SkinnyChoice(timer=_Stub(0.5, [9.0] * len(sg.configs(False, 1))), capturing=lambda: False)
    unset.linear(x, w, None)
    assert unset.mode_for(False) == "auto" and unset.mode_for(True) == "auto"
    assert unset.winners == {(1, 32, 64, torch.bfloat16, False): -1}  # measured; cuBLAS kept (stub times)


def test_applies_only_to_few_rows_of_16_bit_weights_on_cuda():
    w = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert not sg.applies(torch.zeros(1, 8, dtype=torch.bfloat16), w)  # a CPU tensor
    if torch.cuda.is_available():
        wc = w.cuda()
        assert sg.applies(torch.zeros(16, 8, dtype=torch.bfloat16, device="cuda"), wc)
        assert not sg.applies(torch.zeros(17, 8, dtype=torch.bfloat16, device="cuda"), wc)
        assert not sg.applies(torch.zeros(1, 8, device="cuda"), wc.float())




_SILU_CASES = [(c, 3) for c in sg.SILU_CONFIGS] + [(c, 1) for c in sg.SILU_GEMV_CONFIGS]


@pytest.mark.parametrize("config,m", _SILU_CASES, ids=[f"{c.label()}-m{m}" for c, m in _SILU_CASES])
def test_silu_mul_folded_into_the_loads(request, config, m):
    """``silu_mul``: the product of ``silu(gate) * up`` rounded to bf16, as the SiLU-and-mul
    kernel stores it before the product."""
    from pagoda.layers.fused_ops import torch_silu_and_mul

    gen = _gen(request)
    k, n = 200, 70
    gate_up = torch.randn(m, 2 * k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, torch.bfloat16)
    got = sg.skinny_matmul(gate_up, w, None, config, silu_mul=True)
    ref = torch_silu_and_mul(gate_up).double() @ w.double().T
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError):
        sg.skinny_matmul(gate_up[:, :k], w, None, config, silu_mul=True)


def test_silu_mul_choice_is_its_own_class(monkeypatch):
    monkeypatch.setenv(sg.ENV, "auto")
    ran = _spy(monkeypatch)
    choice = sg.SkinnyChoice(timer=_Stub(9.0, [1.0, 2.0, 3.0]), capturing=lambda: False)
    x = torch.randn(2, 64).to(DEVICE, torch.bfloat16)
    w = torch.randn(32, 32).to(DEVICE, torch.bfloat16)
    choice.linear(x, w, None, silu_mul=True)
    assert choice.winners == {(2, 32, 32, torch.bfloat16, True): 0}
    ran.clear()
    out = choice.linear(x, w, None, silu_mul=True)
    assert ran == [sg.SILU_CONFIGS[0]]
    from pagoda.layers.fused_ops import torch_silu_and_mul

    torch.testing.assert_close(out.float(), torch_silu_and_mul(x).float() @ w.float().T, atol=5e-2, rtol=2e-2)


def test_mlp_takes_the_folded_down_projection(model_factory, monkeypatch):
    """A Llama's decode step with the down projections folded (the few-rows condition forced on
    CPU, float32 so that the two ways agree closely) gives the logits of the ordinary step; each
    MLP took the folded way."""
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.executor.model_runner import ModelRunner
    from pagoda.layers.linear import RowParallelLinear
    from pagoda.request import Request, Sequence
    from pagoda.sampling_params import SamplingParams
    from pagoda.step import ScheduledSeq, SchedulerOutput

    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")  # the layers as on a GPU (no fused CPU decode layer)
    monkeypatch.setenv("PAGODA_CPU_GEMM", "torch")  # weights left unpacked, as on a GPU
    args = EngineArgs(model=str(model_factory("llama")), device=DEVICE, dtype="float32", block_size=16,
                      max_model_len=128, max_num_seqs=4, kv_cache_memory=4 << 20, enforce_eager=True)
    runner = ModelRunner(EngineConfig.from_args(args))
    runner.allocate_kv_cache(runner.determine_num_blocks())
    seqs = []
    for i, n in enumerate([9, 4, 13]):
        prompt = [(7 * i + 3 * j) % 400 + 20 for j in range(n)]
        seq = Sequence(f"r{i}#0", Request(f"r{i}", prompt, SamplingParams(temperature=0), ()), list(prompt))
        seq.block_table = [i + 1]
        seqs.append(seq)
    inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, 0, s.num_tokens) for s in seqs], 0))
    runner.forward(inputs)
    for i, seq in enumerate(seqs):
        seq.token_ids.append(300 + i)
    decode = SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], 0)
    folded = []
    real = RowParallelLinear.forward_silu_mul

    def spy(self, gate_up):
        out = real(self, gate_up)
        folded.append(out is not None)
        return out

    monkeypatch.setattr(RowParallelLinear, "forward_silu_mul", spy)
    with torch.inference_mode():
        inputs, _ = runner.prepare(decode)
        expected = runner.model.compute_logits(runner.forward(inputs))
        assert folded == [False] * 2  # a float32 weight (or a CPU tensor): the few-rows kernel does not apply
        monkeypatch.setattr(sg, "applies", lambda x, w: x.shape[0] <= sg.MAX_ROWS)
        monkeypatch.setenv(sg.ENV, "triton")
        monkeypatch.setattr(sg, "CHOICE", sg.SkinnyChoice())  # reads the switch afresh
        got = runner.model.compute_logits(runner.forward(inputs))
    assert folded == [False] * 2 + [True] * 2
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


_NORM_CASES = [(c, dt, res) for c in sg.NORM_CONFIGS for dt in (torch.bfloat16, torch.float16, torch.float32)
               for res in (True, False)]


@pytest.mark.parametrize("config,dtype,residual", _NORM_CASES,
                         ids=[f"{c.label()}-{str(dt)[6:]}-{'add' if r else 'plain'}" for c, dt, r in _NORM_CASES])
def test_norm_folded_into_the_one_row_loads(request, config, dtype, residual):
    """``norm_matmul``: (residual add +) RMSNorm in the one-row kernel's loads, ragged N and K,
    with a bias (split-K configs add it in the reduce). Rounded as the norm kernel then the
    product: under the interpreter bit for bit the Triton norm kernel then the one-row kernel of
    the same config; near the float64 product of the torch norm's output; the new residual
    the norm kernel's (``x + residual`` exactly where rounding to nearest), in a buffer of its own
    (``x`` itself without a residual)."""
    from pagoda.layers import fused_ops

    gen = _gen(request)
    n, k, eps = 50, 300, 1e-6
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    res = torch.randn(1, k, generator=gen).to(DEVICE, dtype) if residual else None
    norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype)
    res_before = res.clone() if residual else None
    y, h = sg.norm_matmul(x, res, norm_w, eps, w, b, config)
    assert y.dtype == dtype and y.shape == (1, n) and h.shape == (1, k)
    if residual:
        assert torch.equal(res, res_before) and h.data_ptr() not in (x.data_ptr(), res.data_ptr())
        normed, _ = fused_ops.torch_fused_add_rms_norm(x, res, norm_w, eps)
        unfused, unfused_h = fused_ops.triton_fused_add_rms_norm(x, res, norm_w, eps)
        assert torch.equal(h, unfused_h)
        if DEVICE != "cpu" or dtype != torch.bfloat16:  # the interpreter rounds float32 to bf16 toward zero
            assert torch.equal(h, x + res)
    else:
        assert h is x
        normed = fused_ops.torch_rms_norm(x, norm_w, eps)
        unfused = fused_ops.triton_rms_norm(x, norm_w, eps)
    expected = sg.skinny_matmul(unfused, w, b, config)
    if DEVICE == "cpu":  # the same float32 operations in the same order
        assert torch.equal(y, expected)
    else:  # the row's sum of squares may be reduced in another order
        torch.testing.assert_close(y, expected, atol=2e-2, rtol=1e-2)
    ref = normed.double() @ w.double().T + b.double()
    torch.testing.assert_close(y.double(), ref, atol=2e-2 if dtype != torch.float32 else 1e-4,
                               rtol=1e-2 if dtype != torch.float32 else 1e-4)


def test_norm_kernel_refuses_what_it_cannot_fold():
    w = torch.zeros(8, 64, device=DEVICE, dtype=torch.bfloat16)
    nw = torch.ones(64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(1, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one row"):
        sg.norm_matmul(torch.cat([x, x]), None, nw, 1e-6, w, None)
    with pytest.raises(ValueError, match="one-row config"):
        sg.norm_matmul(x, None, nw, 1e-6, w, None, sg.CONFIGS[0])
    wide = torch.zeros(8, sg.NORM_MAX_K + 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most"):
        sg.norm_matmul(torch.zeros(1, wide.shape[1], device=DEVICE, dtype=torch.bfloat16), None,
                       torch.ones(wide.shape[1], device=DEVICE, dtype=torch.bfloat16), 1e-6, wide, None)
    assert not sg.norm_applies(x, w)  # a CPU tensor (or: any tensor where ``applies`` says no)


def _norm_spy(monkeypatch):
    ran: list[object] = []
    real = sg.norm_matmul

    def spy(x, residual, norm_weight, eps, w, b, config=None):
        ran.append(config or sg.NORM_CONFIGS[0])
        return real(x, residual, norm_weight, eps, w, b, config)

    monkeypatch.setattr(sg, "norm_matmul", spy)
    return ran


def _norm_operands(k: int = 64, n: int = 32, residual: bool = True):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    res = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16) if residual else None
    nw = (1 + 0.2 * torch.randn(k, generator=gen)).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, torch.bfloat16)
    return x, res, nw, 1e-6, w, None


def _norm_reference(x, res, nw, eps, w, b):
    from pagoda.layers import fused_ops

    h = x + res if res is not None else x
    return fused_ops.torch_rms_norm(h, nw, eps).float() @ w.float().T, h


@pytest.mark.parametrize("residual", [True, False])
def test_norm_choice_measures_against_the_unfused_path(monkeypatch, residual):
    """The folded norm is its own class (with or without a residual) measured against the norm
    kernel then ``linear``'s own choice; the faster side runs from then on, with the same result."""
    monkeypatch.setenv(sg.ENV, "auto")
    ran = _norm_spy(monkeypatch)
    operands = _norm_operands(residual=residual)
    x, res, nw, eps, w, b = operands
    kind = "add_norm" if residual else "norm"
    linear_key = (1, 32, 64, torch.bfloat16, False)
    times = [3.0, 1.0, 2.0, 5.0, 4.0, 6.0]
    choice = sg.SkinnyChoice(timer=_Stub(2.5, times), capturing=lambda: False)
    choice.winners[linear_key] = -1  # the linear's own class measured already (cuBLAS won)
    y, h = choice.norm_linear(*operands)
    assert choice.winners == {linear_key: -1, (1, 32, 64, torch.bfloat16, kind): 1}
    ran.clear()
    y, h = choice.norm_linear(*operands)
    assert ran == [sg.NORM_CONFIGS[1]]
    ref, ref_h = _norm_reference(*operands)
    torch.testing.assert_close(y.float(), ref, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(h, ref_h)  # (exactness: the kernel test)
    # The unfused path faster: it runs, the folded kernel never again.
    slow = sg.SkinnyChoice(timer=_Stub(0.5, times), capturing=lambda: False)
    slow.winners[linear_key] = -1
    slow.norm_linear(*operands)
    ran.clear()
    y, h = slow.norm_linear(*operands)
    assert slow.winners[(1, 32, 64, torch.bfloat16, kind)] == -1 and ran == []
    torch.testing.assert_close(y.float(), ref, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(h, ref_h)  # (exactness: the kernel test)


def test_norm_choice_modes_and_capture(monkeypatch):
    """Capturing: the unfused path, nothing measured. ``triton``: the first config, unmeasured;
    ``cublas``: the unfused path."""
    ran = _norm_spy(monkeypatch)
    operands = _norm_operands()
    ref, ref_h = _norm_reference(*operands)
    monkeypatch.setenv(sg.ENV, "auto")
    capturing = sg.SkinnyChoice(timer=lambda fn: pytest.fail("measured during capture"), capturing=lambda: True)
    y, h = capturing.norm_linear(*operands)
    assert ran == [] and capturing.winners == {}
    torch.testing.assert_close(y.float(), ref, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(h, ref_h)  # (exactness: the kernel test)
    for mode, expected in (("triton", [sg.NORM_CONFIGS[0]]), ("cublas", [])):
        monkeypatch.setenv(sg.ENV, mode)
        ran.clear()
        forced = sg.SkinnyChoice(timer=lambda fn: pytest.fail("a forced mode measures nothing"),
                                 capturing=lambda: False)
        y, h = forced.norm_linear(*operands)
        assert ran == expected
        torch.testing.assert_close(y.float(), ref, atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(h, ref_h)  # (exactness: the kernel test)


def _fp8_weight(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from pagoda.layers.quantization.online import quantize_fp8

    wq, scales = quantize_fp8(torch.randn(n, k, generator=gen) * k ** -0.5)
    return wq.to(DEVICE), scales.to(DEVICE, torch.float32)


_FP8_CASES = [(c, m) for m in (5, 29) for c in sg.configs(False, m)] + [(c, 1) for c in sg.GEMV_CONFIGS]


@pytest.mark.parametrize("config,m", _FP8_CASES, ids=[f"{c.label()}-m{m}" for c, m in _FP8_CASES])
def test_fp8_weight_read_as_stored(request, config, m):
    """An e4m3 weight times bf16 rows (a 16-row tile, and a 32-row one), its per-channel scales
    applied to the float32 sums, with and without K splits: the float64 product of the same
    dequantized weight."""
    gen = _gen(request)
    n, k = 70, 300
    wq, scales = _fp8_weight(gen, n, k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    got = sg.skinny_matmul(x, wq, None, config, scales=scales)
    ref = x.double() @ (wq.double() * scales.double()[:, None]).T
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=1e-2)


def test_fp8_choice_measures_by_default_against_the_library(monkeypatch):
    """Unset switch: an fp8 class is measured (a 16-bit one is not), the library callable is the
    peer, and its winner is kept per class."""
    monkeypatch.delenv(sg.ENV, raising=False)
    ran = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    wq, scales = _fp8_weight(gen, 32, 64)
    x = torch.randn(2, 64, generator=gen).to(DEVICE, torch.bfloat16)
    library_calls = []

    def library():
        library_calls.append(1)
        return x.float() @ (wq.float() * scales[:, None]).T

    choice = sg.SkinnyChoice(timer=_Stub(9.0, [3.0, 1.0, 2.0, 5.0, 4.0]), capturing=lambda: False)
    out = choice.linear(x, wq, None, scales=scales, library=library)
    assert choice.winners == {(2, 32, 64, torch.float8_e4m3fn, False): 1}
    torch.testing.assert_close(out.float(), library(), atol=5e-2, rtol=2e-2)
    ran.clear()
    library_calls.clear()
    choice.linear(x, wq, None, scales=scales, library=library)
    assert ran == [sg.CONFIGS[1]] and library_calls == []
    slow = sg.SkinnyChoice(timer=_Stub(0.5, [3.0, 1.0, 2.0, 5.0, 4.0]), capturing=lambda: False)
    slow.linear(x, wq, None, scales=scales, library=library)
    ran.clear()
    library_calls.clear()
    slow.linear(x, wq, None, scales=scales, library=library)
    assert ran == [] and library_calls == [1]


def test_w8a8_layer_takes_the_kernel_for_few_rows(monkeypatch):
    """``Fp8ScaledMM`` with the few-rows condition forced on CPU: the kernel's product (forced by
    the switch) matches the layer's own W8A8 product within activation rounding."""
    from pagoda.layers.quantization import fp8_w8a8

    gen = torch.Generator().manual_seed(2)
    wq, scales = _fp8_weight(gen, 48, 64)
    layer = fp8_w8a8.Fp8ScaledMM(wq, scales)
    x = torch.randn(3, 64, generator=gen).to(DEVICE, torch.bfloat16)
    w8a8 = layer(x, None)
    monkeypatch.setattr(sg, "fp8_applies", lambda x, w: x.shape[0] <= sg.FP8_MAX_ROWS)
    monkeypatch.setenv(sg.ENV, "triton")
    monkeypatch.setattr(sg, "CHOICE", sg.SkinnyChoice())
    ran = _spy(monkeypatch)
    got = layer(x, None)
    assert ran == [sg.CONFIGS[0]] and got.dtype == x.dtype and got.shape == (3, 48)
    exact = x.double() @ (wq.double() * scales.double()[:, None]).T
    torch.testing.assert_close(got.double(), exact, atol=2e-2, rtol=1e-2)
    # W8A8 also rounds the activations to e4m3: within a few percent of the same product.
    assert ((w8a8.double() - exact).norm() / exact.norm()).item() < 0.08


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
