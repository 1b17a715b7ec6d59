"""``pagoda bench gpu all``'s stages on the gaps between a batch-1 decode step's kernels: the
step with the decode path's Triton kernels launched without and with programmatic dependent
launch (``pdl``, ``layers/pdl.py``), and the Llama-3-8B shape's step under the profiler against
its weights' read at the copy rate (``decode-kernels-llama3-8b``). ``gpu_stages.py`` holds the
other stages and what they share."""
from __future__ import annotations

import os

import torch

from pagoda.bench import gpu, gpu_kernels
from pagoda.bench.gpu_model import bench_shape_dir
from pagoda.bench.gpu_stages import Ctx, Out, bandwidth_of
from pagoda.layers import pdl


def stage_pdl(ctx: Ctx, out: Out) -> None:
    """Batch-1 decode of the Qwen3-0.6B shape (async scheduling, as its roofline) with the decode
    path's Triton kernels launched without and with programmatic dependent launch
    (``PAGODA_PDL``, ``layers/pdl.py``), and whether both gave the same greedy tokens."""
    plan = ctx.plan
    model_dir = bench_shape_dir("qwen3-0.6b", plan.shapes["qwen3-0.6b"])
    bandwidth = bandwidth_of(ctx.results)
    device = torch.device(gpu.DEVICE)
    before = os.environ.get(pdl.ENV)
    try:
        for key, flag in (("off", "0"), ("on", "1")):
            os.environ[pdl.ENV] = flag
            result = gpu.measure_roofline(model_dir, bandwidth, 1, plan.roofline_input_len, plan.roofline_output_len,
                                          seed=plan.seed, async_scheduling=True, greedy=plan.pdl_greedy)
            out[key] = dict(result, pdl=pdl.enabled(device))
            gpu.free_device_memory()
    finally:
        if before is None:
            os.environ.pop(pdl.ENV, None)
        else:
            os.environ[pdl.ENV] = before
    off, on = out["off"], out["on"]
    out["on_over_off"] = on["decode_tokens_per_s"] / off["decode_tokens_per_s"]
    pairs = list(zip(off.pop("greedy_token_ids"), on.pop("greedy_token_ids")))
    out["same_greedy_fraction"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)


def summary_pdl(out: Out) -> str:
    if "on_over_off" not in out:
        return ""
    used = "" if out["on"]["pdl"] else " (PDL not available here: both runs without it)"
    return (f"batch-1 decode, Qwen3-0.6B shape: {out['on']['decode_tokens_per_s']:,.1f} tok/s with PDL against "
            f"{out['off']['decode_tokens_per_s']:,.1f} without ({out['on_over_off']:.3f}x; roofline fraction "
            f"{out['on']['fraction']:.3f} against {out['off']['fraction']:.3f}); same greedy tokens on "
            f"{out['same_greedy_fraction']:.0%} of sequences{used}")


def stage_decode_kernels_8b(ctx: Ctx, out: Out) -> None:
    """Batch-1 decode of the Llama-3-8B shape under the profiler, with async scheduling (as its
    roofline runs): whether the step's distance from the roofline is in the kernels (device time
    against the weights' read at the copy rate) or between them (idle time, host gap)."""
    plan = ctx.plan
    model_dir = bench_shape_dir("llama3-8b", plan.shapes["llama3-8b"])
    bandwidth = bandwidth_of(ctx.results)
    out.update(shape="llama3-8b", **gpu_kernels.profile_decode(model_dir, 1, plan.roofline_input_len,
                                                                 max(2, plan.kernel_profile_steps // 2),
                                                                 seed=plan.seed, async_scheduling=True))
    out["weights_ms_at_copy_rate"] = 1000 * out["weight_bytes_per_step"] / bandwidth


def summary_decode_kernels_8b(out: Out) -> str:
    text = gpu_kernels.summary(out)
    if not text or "weights_ms_at_copy_rate" not in out:
        return text
    weights = out["weights_ms_at_copy_rate"]
    return (f"{text}; the weights' read at the copy rate {weights:.3f} ms (device time "
            f"{out['device_ms_per_step'] / weights:.2f}x it)")
