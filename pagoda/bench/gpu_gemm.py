"""The fp8 GEMMs of the GPU path beside bf16, at one batch of rows (``pagoda bench gpu all``'s
``fp8-gemms`` stage).

For each weight shape ``[N, K]`` (the Llama-3-8B projections by default): bf16 ``F.linear``;
per-channel W8A8 (``Fp8ScaledMM``: the per-token activation quantizer and ``torch._scaled_mm``);
block-scaled W8A8 (``Fp8BlockScaledMM``: the per-token-group quantizer and the Triton block GEMM,
blocks of 128). Each time includes its activation quantization, as a linear layer pays it; the
per-channel path's quantizer and ``_scaled_mm`` are also timed apart. The
table gives milliseconds, bf16 / fp8 and the weight bytes per second each reads, and each fp8
output's distance from bf16 relative to the bf16 output's norm.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagoda.bench.gpu_attention import time_ms

# (name, N, K) of the Llama-3-8B shape's projections (q/k/v fused, o, gate/up fused, down).
LLAMA3_8B_GEMMS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
BLOCK = 128


def measure_fp8_gemms(rows: int, shapes: tuple[tuple[str, int, int], ...], iters: int, device: str,
                      block: int = BLOCK, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per shape: ``bf16_ms``, ``channel_ms``, ``block_ms``, the ratios bf16 / each, and
    ``channel_rel_err`` / ``block_rel_err`` (see the module notes)."""
    from pagoda.layers.quantization import fp8_w8a8
    from pagoda.layers.quantization.online import quantize_fp8

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, float]] = {}
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device=device, dtype=torch.bfloat16)
        x = torch.randn(rows, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        wq, row_scales = quantize_fp8(w.float())
        channel = fp8_w8a8.Fp8ScaledMM(wq, row_scales)
        groups = -(-k // block)
        padded = F.pad(w.float(), (0, groups * block - k)).view(n, groups, block)
        block_scales = padded.abs().amax(dim=2).clamp(min=1e-12) / fp8_w8a8.FP8_MAX
        bq = (padded / block_scales[:, :, None]).view(n, groups * block)[:, :k].to(torch.float8_e4m3fn)
        blocked = fp8_w8a8.Fp8BlockScaledMM(bq, block_scales, block)
        runs = {"bf16": lambda: F.linear(x, w), "channel": lambda: channel(x, None), "block": lambda: blocked(x, None)}
        ref = runs["bf16"]().float()
        r: dict[str, float] = {}
        for key, fn in runs.items():
            r[f"{key}_ms"] = time_ms(fn, iters)
            if key != "bf16":
                r[f"{key}_rel_err"] = ((fn().float() - ref).norm() / ref.norm()).item()
                r[f"bf16_over_{key}"] = r["bf16_ms"] / r[f"{key}_ms"]
        # The per-channel path's two launches apart: where its time goes.
        xq, scale_a = fp8_w8a8.quantize_per_token(x)
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        r["channel_quantize_ms"] = time_ms(lambda: fp8_w8a8.quantize_per_token(x), iters)
        r["channel_matmul_ms"] = time_ms(lambda: torch._scaled_mm(xq, channel.wq.t(), scale_a=scale_a,
                                                                  scale_b=channel.scale_b, out_dtype=out_dtype), iters)
        r["bf16_weight_bytes_per_s"] = 2 * n * k / (r["bf16_ms"] / 1e3)
        r["block_weight_bytes_per_s"] = n * k / (r["block_ms"] / 1e3)
        out[name] = r
    return out


FEW_ROWS = (1, 16, 32)  # decode batches: where the fp8 weight read as stored competes with _scaled_mm


def measure_fp8_few_rows(rows: tuple[int, ...], shapes: tuple[tuple[str, int, int], ...], iters: int, device: str,
                         seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per ``<shape>/<rows>``, each run from a cold L2 on CUDA: bf16 cuBLAS, per-channel W8A8
    (quantizer and ``_scaled_mm``) and ``skinny_gemm``'s kernel on the fp8 weight at each config
    (microseconds); the best config, bf16 / best, W8A8 / best, the fp8 bytes a second the best
    reads, its error against the float64 product, and what ``SkinnyChoice`` keeps."""
    from pagoda.bench.gpu_layers import cold_timer
    from pagoda.layers import skinny_gemm
    from pagoda.layers.quantization import fp8_w8a8
    from pagoda.layers.quantization.online import quantize_fp8

    timer = cold_timer(device)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, Any]] = {}
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device=device, dtype=torch.bfloat16)
        wq, scales = quantize_fp8(w.float())
        layer = fp8_w8a8.Fp8ScaledMM(wq, scales)
        scales = layer.scale_b.view(-1)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            exact = x.double() @ (wq.double() * scales.double()[:, None]).T
            r: dict[str, Any] = {"bf16_us": timer(lambda x=x, w=w: F.linear(x, w), iters) * 1e3,
                                 "w8a8_us": timer(lambda x=x: layer.scaled_mm(x), iters) * 1e3}
            configs = {}
            for config in skinny_gemm.configs(False, m):
                got = skinny_gemm.skinny_matmul(x, wq, None, config, scales=scales)
                us = timer(lambda x=x, c=config: skinny_gemm.skinny_matmul(x, wq, None, c, scales=scales), iters) * 1e3
                configs[config.label()] = {
                    "us": us, "rel_err": ((got.double() - exact).norm() / exact.norm()).item()}
            best = min(configs, key=lambda c: configs[c]["us"])
            r.update(configs=configs, best=best, best_us=configs[best]["us"],
                     bf16_over_best=r["bf16_us"] / configs[best]["us"], w8a8_over_best=r["w8a8_us"] / configs[best]["us"],
                     best_fp8_bytes_per_s=n * k / (configs[best]["us"] / 1e6),
                     max_rel_err=max(c["rel_err"] for c in configs.values()))
            if device == "cuda":
                choice = skinny_gemm.SkinnyChoice()
                choice.mode = "auto"
                choice.linear(x, wq, None, scales=scales, library=lambda x=x: layer.scaled_mm(x))
                kept = next(iter(choice.winners.values()))
                r["chosen"] = "w8a8" if kept < 0 else skinny_gemm.configs(False, m)[kept].label()
            out[f"{name}/{m}"] = r
    return out


def summary(results: dict[str, Any]) -> str:
    gemms = results.get("gemms")
    if not gemms:
        return ""
    parts = [f"{name} bf16/channel {r['bf16_over_channel']:.2f}x (quantize {r['channel_quantize_ms'] * 1e3:.0f} + "
             f"_scaled_mm {r['channel_matmul_ms'] * 1e3:.0f} us, bf16 {r['bf16_ms'] * 1e3:.0f}), "
             f"bf16/block {r['bf16_over_block']:.2f}x" for name, r in gemms.items()]
    worst = max(r["block_rel_err"] for r in gemms.values())
    few = results.get("few_rows", {})
    kernel = "; ".join(f"{key} bf16/kernel {r['bf16_over_best']:.2f}x, w8a8/kernel {r['w8a8_over_best']:.2f}x "
                       f"({r['best_fp8_bytes_per_s'] / 1e12:.2f} TB/s{', kept ' + r['chosen'] if 'chosen' in r else ''})"
                       for key, r in few.items())
    return (f"{results['rows']} rows: " + "; ".join(parts) + f"; block fp8 error {worst:.1e} of bf16"
            + (f" | fp8 weight read as stored, cold L2: {kernel}" if kernel else ""))
