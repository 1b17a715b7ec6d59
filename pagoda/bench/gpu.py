"""``pagoda bench gpu``: the GPU path against the hardware and against Hugging Face.

    pagoda bench gpu roofline --shape {llama3-8b,qwen3-0.6b} [--batch 1] [--output-len 256]
    pagoda bench gpu throughput [--num-seqs 256] [--input-len 100:1024] [--output-len 100:1024]
                                [--hf-batch-size 64] [--skip-hf]
    pagoda bench gpu attention [--decode-seqs 64] [--decode-context 2047] (gpu_attention.py)

``roofline`` measures the device's copy bandwidth (a large device-to-device copy), then decode
tokens/s on a random-weight bf16 model of the given shape, and prints it as a fraction of the
memory roofline: a decode step must read every weight once and each sequence's KV cache, so at
best it takes ``(weight bytes + KV bytes) / bandwidth``.

``throughput`` runs the nano-vllm workload (256 sequences, prompt and output lengths uniform in
100..1024, ignore_eos) on a Qwen3-0.6B-shaped model, pagoda and Hugging Face ``generate`` side
by side in one run, and prints the ratio.

Both need a CUDA GPU and refuse without one. Checkpoints are written once and cached
(``gpu_model.bench_model``).
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.common import Workload, print_table, random_workload, write_json
from pagoda.bench.datasets import parse_range
from pagoda.bench.gpu_model import SHAPES, bench_model

COPY_BYTES = 2 << 30
NANO_VLLM_LEN = "100:1024"
# Where the engines run. Only the tests change it (to "cpu", to walk through the commands on a
# tiny model); the commands themselves refuse to start without CUDA.
DEVICE = "cuda"


def cuda_missing() -> str | None:
    """Why the GPU benchmarks cannot run here (None when they can)."""
    if torch.cuda.is_available():
        return None
    return ("pagoda bench gpu needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False); "
            "run it on a machine with an NVIDIA GPU and a CUDA build of torch")


# --------------------------------------------------------------------------------------
# roofline
# --------------------------------------------------------------------------------------


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def copy_bandwidth(nbytes: int = COPY_BYTES, iters: int = 20) -> float:
    """Bytes/s moved by a device-to-device copy (each byte is read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: all of them, except an untied embedding table,
    of which a lookup reads only the batch's rows."""
    total, seen = 0, set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights once
                continue
            seen.add(id(param))
            packed = getattr(module, "packed", None) if name == "weight" else None
            stored = packed if packed is not None and param.numel() == 0 else param  # CPU oneDNN layout
            total += stored.numel() * stored.element_size()
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def decode_roofline(bandwidth: float, weight_bytes: int, kv_bytes_per_token: int, batch: int,
                    prompt_len: int, output_len: int) -> float:
    """Best possible decode tokens/s: every step after the first token reads all weights once
    and each sequence's whole context (``prompt_len + s`` tokens at step ``s``)."""
    steps = output_len - 1
    context_tokens = steps * prompt_len + steps * (steps + 1) // 2
    total_bytes = steps * weight_bytes + batch * kv_bytes_per_token * context_tokens
    return batch * steps / (total_bytes / bandwidth)


def time_decode(llm: Any, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """(seconds, tokens) of the decode phase: from the step that gave every prompt its first
    token to the last step."""
    from pagoda import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    counts: dict[str, int] = {}
    start, first = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if start is None and len(counts) == len(prompts) and min(counts.values()) >= 1:
            start, first = time.perf_counter(), sum(counts.values())
    _sync()
    assert start is not None
    return time.perf_counter() - start, sum(counts.values()) - first


def run_roofline(args: argparse.Namespace) -> int:
    from pagoda import LLM

    bandwidth = copy_bandwidth()
    model_dir = bench_model(args.shape, torch.device(DEVICE))
    llm = LLM(str(model_dir), dtype="bfloat16", device=DEVICE, max_model_len=args.input_len + args.output_len,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization)
    rng = random.Random(args.seed)
    vocab = _vocab_size(model_dir)
    prompts = [[rng.randrange(16, vocab) for _ in range(args.input_len)] for _ in range(args.batch)]
    time_decode(llm, prompts, min(args.output_len, 16))  # warm-up: kernel compilation, allocator
    seconds, tokens = time_decode(llm, prompts, args.output_len)
    runner = llm.engine.core.executor
    weights = weight_bytes_per_step(runner.model)
    kv_per_token = runner.kv_bytes_per_block() // runner.block_size
    best = decode_roofline(bandwidth, weights, kv_per_token, args.batch, args.input_len, args.output_len)
    measured = tokens / seconds
    llm.shutdown()
    _report_roofline(args, bandwidth, weights, kv_per_token, measured, best)
    return 0


def _report_roofline(args: argparse.Namespace, bandwidth: float, weights: int, kv_per_token: int,
                     measured: float, best: float) -> None:
    graphs = "off (--enforce-eager)" if args.enforce_eager else "on"
    rows = [("quantity", "value"),
            ("copy bandwidth", f"{bandwidth / 1e9:.0f} GB/s"),
            ("weights read per step", f"{weights / 1e9:.2f} GB"),
            ("KV bytes per token", f"{kv_per_token / 1e3:.1f} KB"),
            ("decode tok/s (measured)", f"{measured:.1f}"),
            ("decode tok/s (roofline)", f"{best:.1f}"),
            ("fraction of roofline", f"{measured / best:.3f}")]
    print_table(f"roofline: {args.shape} bf16, batch {args.batch}, prompt {args.input_len}, "
                f"output {args.output_len}, CUDA graphs {graphs}", rows)
    write_json(args.output_json, {
        "shape": args.shape, "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
        "cuda_graphs": not args.enforce_eager, "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_per_step": weights, "kv_bytes_per_token": kv_per_token,
        "decode_tokens_per_s": measured, "roofline_tokens_per_s": best, "fraction": measured / best})


# --------------------------------------------------------------------------------------
# throughput
# --------------------------------------------------------------------------------------


def run_hf(model_dir: Path, work: Workload, batch_size: int) -> dict[str, float]:
    """Hugging Face ``generate`` in bf16 on the device, batches in workload order with left padding;
    each batch runs to its longest requested output, only requested tokens count."""
    from transformers import AutoModelForCausalLM

    from pagoda.bench.hf_peer import generate_batch
    from pagoda.bench.throughput import _rates

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(DEVICE).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    generate_batch(hf, work.prompts[:2], 4, pad, DEVICE)  # warm-up
    _sync()
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        batch = slice(i, i + batch_size)
        generate_batch(hf, work.prompts[batch], max(work.output_lens[batch]), pad, DEVICE)
    _sync()
    return _rates(time.perf_counter() - start, len(work.prompts), work.num_output_tokens, work.num_prompt_tokens)


def run_throughput(args: argparse.Namespace) -> int:
    from pagoda.bench.throughput import run_pagoda

    model_dir = bench_model("qwen3-0.6b", torch.device(DEVICE))
    work = random_workload(args.num_seqs, args.input_len, args.output_len, _vocab_size(model_dir), args.seed)
    longest = parse_range(args.input_len)[1] + parse_range(args.output_len)[1]
    kwargs = dict(model=str(model_dir), dtype="bfloat16", device=DEVICE, max_model_len=longest,
                  enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization)
    results = {"pagoda": run_pagoda(kwargs, work)}
    gc.collect()  # the engine's tensors go before transformers loads
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        results["hf"] = run_hf(model_dir, work, args.hf_batch_size)
    _report_throughput(args, work, results)
    return 0


def _report_throughput(args: argparse.Namespace, work: Workload, results: dict[str, dict[str, float]]) -> None:
    rows = [("engine", "req/s", "output tok/s", "total tok/s", "seconds")]
    for name, r in results.items():
        rows.append((name, f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                     f"{r['total_tokens_per_s']:.1f}", f"{r['elapsed_s']:.1f}"))
    print_table(f"throughput: qwen3-0.6b bf16, {args.num_seqs} sequences, input {args.input_len}, output "
                f"{args.output_len} ({work.num_output_tokens} tokens)", rows)
    payload: dict[str, Any] = {"num_seqs": args.num_seqs, "seed": args.seed, "results": results}
    if "hf" in results:
        ratio = results["pagoda"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
        payload["output_tokens_per_s_ratio_vs_hf"] = ratio
        print(f"pagoda / hf output tok/s: {ratio:.2f}x (hf batch size {args.hf_batch_size})")
    write_json(args.output_json, payload)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _needs_cuda(run: Any) -> Any:
    def guarded(args: argparse.Namespace) -> int:
        reason = cuda_missing()
        if reason is not None:
            print(reason, file=sys.stderr)
            return 2
        return run(args)

    return guarded


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enforce-eager", action="store_true", help="run without CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--output-json", default=None)


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    gpu = bench_subparsers.add_parser("gpu", help="GPU roofline, throughput against HF, attention backends "
                                                  "(needs CUDA)")
    sub = gpu.add_subparsers(dest="gpu_command", metavar="NAME", required=True)
    roof = sub.add_parser("roofline", help="decode tokens/s against the memory-bandwidth roofline")
    roof.add_argument("--shape", choices=sorted(SHAPES), required=True)
    roof.add_argument("--batch", type=int, default=1)
    roof.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    roof.add_argument("--output-len", type=int, default=256)
    _common(roof)
    roof.set_defaults(func=_needs_cuda(run_roofline))
    thr = sub.add_parser("throughput", help="nano-vllm workload, pagoda against HF generate (qwen3-0.6b)")
    thr.add_argument("--num-seqs", type=int, default=256)
    thr.add_argument("--input-len", default=NANO_VLLM_LEN, help="MIN:MAX prompt tokens")
    thr.add_argument("--output-len", default=NANO_VLLM_LEN, help="MIN:MAX output tokens")
    thr.add_argument("--hf-batch-size", type=int, default=64)
    thr.add_argument("--skip-hf", action="store_true", help="run pagoda only")
    _common(thr)
    thr.set_defaults(func=_needs_cuda(run_throughput))
    from pagoda.bench import gpu_attention

    gpu_attention.add_parser(sub, _needs_cuda)
