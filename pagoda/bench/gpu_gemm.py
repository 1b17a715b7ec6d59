"""The fp8 GEMMs of the GPU path beside bf16, at one batch of rows (``pagoda bench gpu all``'s
``fp8-gemms`` stage).

For each weight shape ``[N, K]`` (the Llama-3-8B projections by default): bf16 ``F.linear``;
per-channel W8A8 (``Fp8ScaledMM``: the per-token activation quantizer and ``torch._scaled_mm``);
block-scaled W8A8 (``Fp8BlockScaledMM``: the per-token-group quantizer and the Triton block GEMM,
blocks of 128). Each time includes its activation quantization, as a linear layer pays it. The
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
        r["bf16_weight_bytes_per_s"] = 2 * n * k / (r["bf16_ms"] / 1e3)
        r["block_weight_bytes_per_s"] = n * k / (r["block_ms"] / 1e3)
        out[name] = r
    return out


def summary(results: dict[str, Any]) -> str:
    gemms = results.get("gemms")
    if not gemms:
        return ""
    parts = [f"{name} bf16/channel {r['bf16_over_channel']:.2f}x, bf16/block {r['bf16_over_block']:.2f}x"
             for name, r in gemms.items()]
    worst = max(r["block_rel_err"] for r in gemms.values())
    return f"{results['rows']} rows: " + "; ".join(parts) + f"; block fp8 error {worst:.1e} of bf16"
