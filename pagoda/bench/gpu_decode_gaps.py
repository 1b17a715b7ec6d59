"""``pagoda bench gpu all``'s stages on the gaps between a batch-1 decode step's kernels: the
step with the decode path's Triton kernels launched without and with programmatic dependent
launch (``pdl``, ``layers/pdl.py``), and the Llama-3-8B shape's step under the profiler against
its weights' read at the copy rate (``decode-kernels-llama3-8b``), and batch-1 decode in
multi-step greedy rounds through the decode graphs (``device-rounds``), where the host launches
a round's steps ahead of the device and reads their ids once. ``gpu_stages.py`` holds the other
stages and what they share."""
from __future__ import annotations

import torch

from pagoda.bench import gpu, gpu_kernels
from pagoda.bench.gpu_model import bench_shape_dir
from pagoda.bench.gpu_stages import BARS, Ctx, Out, bandwidth_of, env_set
from pagoda.executor.cuda_graphs import STATIC_DECODE_ENV
from pagoda.layers import pdl


def stage_pdl(ctx: Ctx, out: Out) -> None:
    """Batch-1 decode of the Qwen3-0.6B shape (async scheduling, as its roofline) with the decode
    path's Triton kernels launched without and with programmatic dependent launch
    (``PAGODA_PDL``, ``layers/pdl.py``), and whether both gave the same greedy tokens."""
    plan = ctx.plan
    model_dir = bench_shape_dir("qwen3-0.6b", plan.shapes["qwen3-0.6b"])
    bandwidth = bandwidth_of(ctx.results)
    device = torch.device(gpu.DEVICE)
    for key, flag in (("off", "0"), ("on", "1")):
        with env_set(pdl.ENV, flag):
            result = gpu.measure_roofline(model_dir, bandwidth, 1, plan.roofline_input_len, plan.roofline_output_len,
                                          seed=plan.seed, async_scheduling=True, greedy=plan.pdl_greedy)
            out[key] = dict(result, pdl=pdl.enabled(device))
        gpu.free_device_memory()
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


def stage_device_rounds(ctx: Ctx, out: Out) -> None:
    """Batch-1 decode without async scheduling, one step per schedule (``single``) and in the
    engine's automatic multi-step greedy rounds (``rounds``: each step's argmax fed to the next
    on the device, ``DecodeGraphs.greedy_round``), on the Qwen3-0.6B shape with both runs' greedy
    tokens compared; then the rounds on the Llama-3-8B shape. Each shape's figure is kept as it is
    measured; the roofline stages' async figures are the comparison."""
    plan = ctx.plan
    bandwidth = bandwidth_of(ctx.results)
    # On CPU (the dry run) the decode steps go through the decode graphs' static buffers without
    # capture, so the greedy rounds take the code a GPU takes.
    with env_set(STATIC_DECODE_ENV, "1" if gpu.DEVICE != "cuda" else None):
        model_dir = bench_shape_dir("qwen3-0.6b", plan.shapes["qwen3-0.6b"])
        runs = {}
        for key, steps in (("rounds", None), ("single", 1)):
            runs[key] = gpu.measure_roofline(model_dir, bandwidth, 1, plan.roofline_input_len,
                                             plan.roofline_output_len, seed=plan.seed, greedy=plan.pdl_greedy,
                                             num_scheduler_steps=steps)
            gpu.free_device_memory()
        pairs = list(zip(runs["rounds"].pop("greedy_token_ids"), runs["single"].pop("greedy_token_ids")))
        out["qwen3-0.6b"] = dict(runs, rounds_over_single=runs["rounds"]["decode_tokens_per_s"]
                                 / runs["single"]["decode_tokens_per_s"],
                                 same_greedy_fraction=sum(a == b for a, b in pairs) / max(len(pairs), 1))
        model_dir = bench_shape_dir("llama3-8b", plan.shapes["llama3-8b"])
        out["llama3-8b"] = {"rounds": gpu.measure_roofline(model_dir, bandwidth, 1, plan.roofline_input_len,
                                                           plan.roofline_output_len, seed=plan.seed)}
    for shape, result in out.items():
        roofline = ctx.results.get(f"roofline-{shape}-bf16", {})
        if "fraction" in roofline:
            result["rounds_over_roofline_stage"] = result["rounds"]["fraction"] / roofline["fraction"]


def summary_device_rounds(out: Out) -> str:
    parts = []
    for shape, result in out.items():
        rounds = result["rounds"]
        text = (f"{shape} {rounds['decode_tokens_per_s']:,.1f} tok/s = {rounds['fraction']:.3f} of the roofline "
                f"(bar {BARS[shape]:.2f}; {rounds['device_rounds']} device rounds")
        if "rounds_over_roofline_stage" in result:
            text += f"; {result['rounds_over_roofline_stage']:.2f}x the roofline stage's figure"
        if "rounds_over_single" in result:
            text += (f"; {result['rounds_over_single']:.2f}x one step per schedule, same greedy tokens on "
                     f"{result['same_greedy_fraction']:.0%} of sequences")
        parts.append(text + ")")
    return "batch-1 greedy rounds: " + "; ".join(parts) if parts else ""
