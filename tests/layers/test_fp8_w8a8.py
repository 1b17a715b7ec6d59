"""fp8 W8A8 (``pagoda/layers/quantization/fp8_w8a8.py``) on CPU: ``torch._scaled_mm`` runs here
too, so the numerics are checked against a float64 product of the same quantized operands, the
Triton activation quantizer (under the interpreter) against torch's, and the per-card choice
with the capability query stubbed."""
from __future__ import annotations

import logging
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first ``import triton`` (conftest.py)

import pytest  # noqa: E402

from pagoda.layers.quantization import fp8_w8a8, triton_fp8  # noqa: E402
from pagoda.layers.quantization.fp8_w8a8 import Fp8ScaledMM, matmul_mode, quantize_per_token_torch  # noqa: E402
from pagoda.layers.quantization.online import Fp8LinearMethod, quantize_fp8  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(fp8_w8a8, "_logged", set())  # each test sees its own log lines
    monkeypatch.delenv(fp8_w8a8.ENV, raising=False)


def _activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, one all zero, one with entries in e4m3's subnormal range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    x[1] = 0.0
    x[-1, : k // 4] *= 1e-4
    return x


def test_per_token_quantizer_bounds():
    x = _activations(6, 96)
    xq, scales = quantize_per_token_torch(x)
    assert xq.dtype == torch.float8_e4m3fn and scales.shape == (6, 1) and scales.dtype == torch.float32
    back = xq.to(torch.float32) * scales
    # Round to nearest: half a step, 2**-4 of the value for normals, 2**-10 of the scale below 2**-6.
    assert torch.all((back - x).abs() <= 2**-4 * x.abs() + 2**-10 * scales + 1e-30)
    rows = [i for i in range(6) if i != 1]
    assert torch.all(xq.to(torch.float32)[rows].abs().amax(dim=1) == 448.0)  # each row's max maps to 448
    assert torch.all(xq[1].to(torch.float32) == 0)


@pytest.mark.parametrize("rows", [5, 32])  # 32: the operands swapped (the weight first)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per", ["channel", "tensor"])
def test_scaled_mm_matches_a_float64_product_of_the_same_operands(dtype, per, rows):
    from pagoda.layers.quantization.fp8_w8a8 import swaps_operands

    assert swaps_operands(rows) == (rows == 32)
    n, k = 48, 64
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g)
    wq, scales = quantize_fp8(w)
    if per == "tensor":
        scales = scales.max().reshape(1)
        wq = (w / scales).clamp(-448, 448).to(torch.float8_e4m3fn)
    bias = torch.randn(n, generator=g).to(dtype)
    x = _activations(rows, k).to(dtype).reshape(rows, 1, k)  # a leading shape is kept
    got = Fp8ScaledMM(wq, scales)(x, bias)
    assert got.shape == (rows, 1, n) and got.dtype == dtype
    xq, sa = quantize_per_token_torch(x.reshape(rows, k))
    a, b = xq.double() * sa.double(), wq.double() * scales.double().reshape(-1, 1).expand(n, 1)
    ref = a @ b.T + bias.double()
    # Accumulation in float32, or a bfloat16 rounding of the product and one of the sum with the
    # bias: bounded relative to the magnitudes summed, not to the (possibly cancelling) result.
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    bound = tol * (a.abs() @ b.abs().T + bias.double().abs()) + 1e-12
    err = (got.reshape(rows, n).double() - ref).abs()
    assert torch.all(err <= bound), (err / bound).max()
    # ... and the activations were really quantized: the unquantized product is measurably elsewhere.
    exact = x.reshape(rows, k).double() @ b.T + bias.double()
    assert (exact - ref).abs().max() > 4 * err.max()


def test_w8a8_stays_near_the_dense_product():
    """End to end error of weight and activation quantization: a few percent of the output."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    y = Fp8ScaledMM(*quantize_fp8(w))(x, None)
    assert ((y - x @ w.T).norm() / (x @ w.T).norm()).item() < 0.06


@pytest.mark.skipif(not triton_fp8.HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_quantizer_equals_torch(dtype):
    """One row per program, rows longer than one block (2100 > 2048) included."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _activations(4, 2100, seed=4).to(dtype).to(device)
    q, s = triton_fp8.per_token_fp8(x)
    rq, rs = quantize_per_token_torch(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.to(torch.float32), rq.to(torch.float32))  # (-0 and 0 compare equal)


def _stub_card(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("capability,want", [((9, 0), "w8a8"), ((8, 9), "w8a8"), ((10, 0), "w8a8"),
                                             ((8, 6), "weight-only"), ((8, 0), "weight-only")])
def test_auto_picks_fp8_from_compute_capability_8_9(capability, want, monkeypatch, caplog):
    _stub_card(monkeypatch, capability)
    with caplog.at_level(logging.INFO, logger=fp8_w8a8.__name__):
        assert matmul_mode(torch.device("cuda", 0), 4096, 14336) == want
        assert matmul_mode(torch.device("cuda", 0), 1024, 4096) == want  # logged once per reason
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    if want == "w8a8":
        assert "W8A8" in lines[0] and "torch._scaled_mm" in lines[0]
    else:
        assert "weight-only" in lines[0] and "sm_{}{}".format(*capability) in lines[0]


def test_cpu_and_odd_shapes_run_weight_only_with_a_log_line(monkeypatch, caplog):
    _stub_card(monkeypatch, (9, 0))
    with caplog.at_level(logging.INFO, logger=fp8_w8a8.__name__):
        assert matmul_mode(torch.device("cpu"), 64, 128) == "weight-only"
        assert matmul_mode(torch.device("cuda", 0), 72, 120) == "weight-only"  # 120 % 16 != 0
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "cpu has no fp8" in text and "multiples of 16" in text
    # The online method follows the choice: CPU keeps its weight-only kernels.
    assert Fp8LinearMethod().quantize(None, torch.randn(64, 128)).kernel != Fp8ScaledMM.kernel


def test_the_environment_forces_or_forbids(monkeypatch):
    _stub_card(monkeypatch, (9, 0))
    monkeypatch.setenv(fp8_w8a8.ENV, "weight-only")
    assert matmul_mode(torch.device("cuda", 0), 64, 128) == "weight-only"
    monkeypatch.setenv(fp8_w8a8.ENV, "w8a8")
    assert matmul_mode(torch.device("cpu"), 64, 128) == "w8a8"
    assert Fp8LinearMethod().quantize(None, torch.randn(64, 128)).kernel == Fp8ScaledMM.kernel
    _stub_card(monkeypatch, (8, 0))
    with pytest.raises(ValueError, match="sm_80"):
        matmul_mode(torch.device("cuda", 0), 64, 128)
    monkeypatch.setenv(fp8_w8a8.ENV, "fast")
    with pytest.raises(ValueError, match="PAGODA_FP8_MATMUL"):
        matmul_mode(torch.device("cpu"), 64, 128)


# ------------------------------------------------------------------------------ block scales


def _block_weight(n: int, k: int, bn: int, bk: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight with DeepSeek-style block scales, as the loader keeps them: one row of
    ``ceil(k / bk)`` scales per output feature (each block's scale repeated over its rows)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, n)[:, None]
    blocks = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 0.02 + 1e-3
    scales = blocks.repeat_interleave(bn, dim=0)[:n]
    wq = (w / scales.repeat_interleave(bk, dim=1)[:, :k]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return wq, scales


def test_group_quantizer_bounds_each_group():
    x = _activations(5, 80)
    xq, scales = fp8_w8a8.quantize_per_token_group_torch(x, 32)
    assert xq.shape == (5, 80) and scales.shape == (5, 3)
    back = xq.to(torch.float32) * scales.repeat_interleave(32, dim=1)[:, :80]
    assert torch.all((back - x).abs() <= 2**-4 * x.abs() + 2**-10 * scales.repeat_interleave(32, dim=1)[:, :80] + 1e-30)
    for g in range(3):  # every group's own max maps to 448 (row 1 is all zero)
        part = xq.to(torch.float32)[[0, 2, 3, 4], g * 32:(g + 1) * 32]
        assert torch.all(part.abs().amax(dim=1) == 448.0)


@pytest.mark.parametrize("m, n, k, group", [(2, 48, 128, 32), (19, 80, 200, 64), (40, 33, 96, 16)])
def test_block_scaled_matmul_matches_a_float64_product(m, n, k, group):
    """The Triton block-scaled GEMM (interpreter on CPU) and its torch twin against a float64
    product of the same quantized operands, partial last groups and tiles included."""
    x = _activations(m, k, seed=m)
    wq, ws = _block_weight(n, k, 16, group)
    xq, xs = fp8_w8a8.quantize_per_token_group_torch(x, group)
    tq, ts = triton_fp8.per_token_group_fp8(x, group)
    assert torch.equal(tq.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(ts, xs)
    a = xq.double() * xs.double().repeat_interleave(group, dim=1)[:, :k]
    w = wq.double() * ws.double().repeat_interleave(group, dim=1)[:, :k]
    want = a @ w.t()
    for got in (triton_fp8.block_fp8_matmul(xq, xs, wq, ws, group, torch.float32),
                fp8_w8a8.block_matmul_torch(xq, xs, wq, ws, group, torch.float32)):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-5 * want.abs().max().item())


def test_block_layer_takes_the_kernel_on_the_gpu_path(monkeypatch):
    """``Fp8BlockScaledMM`` with W8A8 forced: the torch twin on CPU tensors, the Triton kernels on
    the GPU code path, the same result; near the dense product of the dequantized weight."""
    wq, ws = _block_weight(64, 128, 32, 32)
    monkeypatch.setenv(fp8_w8a8.ENV, "w8a8")
    layer = fp8_w8a8.block_w8a8_linear(wq, ws, 32)
    assert isinstance(layer, fp8_w8a8.Fp8BlockScaledMM)
    x, bias = _activations(7, 128), torch.randn(64)
    on_cpu = layer(x, bias)
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    # Float32 sums in another order (the kernel's tiles against torch's threads): rounding of the
    # output's scale, as for the bare products above.
    torch.testing.assert_close(layer(x, bias), on_cpu, rtol=2e-5, atol=1e-5 * on_cpu.abs().max().item())
    dense = x @ (wq.to(torch.float32) * ws.repeat_interleave(32, dim=1)).t() + bias
    assert ((on_cpu - dense).norm() / dense.norm()).item() < 0.05  # the activations' fp8 rounding
    assert fp8_w8a8.block_w8a8_linear(wq, ws, 48) is None  # not a power of two: weight-only
    monkeypatch.setenv(fp8_w8a8.ENV, "weight-only")
    assert fp8_w8a8.block_w8a8_linear(wq, ws, 32) is None


# ------------------------------------------------------------------------------ a whole model


def _fake_quant_inputs(model, group: int | None = None) -> None:
    """Each decoder linear layer of a transformers model sees its input quantized per token (per
    token and group of ``group`` columns for block-scaled weights) and dequantized (float32): the
    W8A8 arithmetic, written with none of pagoda's model code."""
    def hook(module, args):
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        if group is None:
            xq, scales = quantize_per_token_torch(rows)
        else:
            xq, scales = fp8_w8a8.quantize_per_token_group_torch(rows, group)
            scales = scales.repeat_interleave(group, dim=1)[:, :rows.shape[1]]
        return ((xq.to(torch.float32) * scales).reshape(x.shape),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_fp8_checkpoint_w8a8_matches_an_oracle_of_the_same_math(strategy, tmp_path, monkeypatch):
    """A tiny compressed-tensors FP8_DYNAMIC checkpoint (or a DeepSeek-style block-scaled one,
    blocks 32 x 32) with W8A8 forced on CPU: every linear layer takes the W8A8 kernel, and the
    log-probs of prompt and greedy tokens match transformers on the dequantized weights with
    per-token fake-quantized activations (so the greedy tokens are the oracle's). Against the
    weight-only run (activations unquantized) this random 2-layer model's top tokens are close
    calls, so that agreement is measured by ``pagoda bench gpu all``'s fp8 stage on the real
    shape, not asserted here."""
    import sys
    from pathlib import Path

    from pagoda import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from quant_checkpoints import QuantSpec, make_quantized, oracle_model

    spec = (QuantSpec("fp8-block", 8, activations="dynamic", block=(32, 32)) if strategy == "block"
            else QuantSpec("ct-fp8", 8, strategy=strategy, activations="dynamic"))
    qdir, _ = make_quantized(tmp_path, spec)
    prompts = [[5, 17, 42, 99, 7], list(range(30, 67))]
    monkeypatch.setenv(fp8_w8a8.ENV, "w8a8")
    llm = LLM(str(qdir), dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    try:
        kernels = {m.qlinear.kernel for m in llm.engine.core.executor.model.modules() if hasattr(m, "qlinear")}
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=3, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert kernels == {Fp8ScaledMM.kernel if strategy != "block" else fp8_w8a8.Fp8BlockScaledMM.kernel}
    oracle = oracle_model(qdir)
    _fake_quant_inputs(oracle, 32 if strategy == "block" else None)
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        sample = out.outputs[0]
        with torch.no_grad():
            ref = oracle(torch.tensor([prompt + sample.token_ids])).logits[0].float().log_softmax(-1)
        rows = list(enumerate(out.prompt_logprobs[1:])) + [(len(prompt) - 1 + j, e)
                                                           for j, e in enumerate(sample.logprobs)]
        worst = max(worst, max(abs(v - ref[i, t].item()) for i, entry in rows for t, v in entry.items()))
        greedy = [ref[len(prompt) - 1 + j].argmax().item() for j in range(len(sample.token_ids))]
        assert sample.token_ids == greedy
    assert worst < 5e-3, worst  # float32 summation order, and the rare activation it tips across an fp8 step


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
