"""``pagoda bench gpu``: the GPU path against the hardware and against Hugging Face.

    pagoda bench gpu roofline --shape {llama3-8b,qwen3-0.6b} [--batch 1] [--output-len 256]
    pagoda bench gpu throughput [--num-seqs 256] [--input-len 100:1024] [--output-len 100:1024]
                                [--hf-batch-size 64] [--skip-hf]
    pagoda bench gpu attention [--decode-seqs 64] [--decode-context 2047] (gpu_attention.py)
    pagoda bench gpu all [--budget-s 420] [--json OUT] [--dry-run] (gpu_all.py)

``roofline`` measures the device's copy bandwidth (a large device-to-device copy), then decode
tokens/s on a random-weight bf16 model of the given shape, and prints it as a fraction of the
memory roofline: a decode step must read every weight once and each sequence's KV cache, so at
best it takes ``(weight bytes + KV bytes) / bandwidth``.

``throughput`` runs the nano-vllm workload (256 sequences, prompt and output lengths uniform in
100..1024, ignore_eos) on a Qwen3-0.6B-shaped model, pagoda and Hugging Face ``generate`` side
by side in one run, and prints the ratio.

``all`` (gpu_all.py) runs every measurement, a correctness smoke test first, in one command
inside a time budget.

All need a CUDA GPU and refuse without one. No weights are written: the engines take a
directory of config and tokenizer (``gpu_model.bench_shape_dir``) and draw random weights on the
device (pagoda's ``load_format="dummy"``, transformers' ``from_config``).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pagoda.bench.common import Workload, print_table, random_workload, step_stats, write_json
from pagoda.bench.gpu_model import SHAPES, bench_shape_dir

COPY_BYTES = 2 << 30
PROBE_TOKENS = 16  # transformers' step time is probed on 16 and 48 tokens of a full batch
ESTIMATE_MARGIN = 1.3  # a batch is started only if 1.3x its estimated time fits
CPU_KV_CACHE_BYTES = 64 << 20  # the walk-throughs on CPU: tiny models, no GPU memory profile
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


def engine_kwargs(model_dir: Path, max_model_len: int, enforce_eager: bool, gpu_memory_utilization: float,
                  **extra: Any) -> dict[str, Any]:
    """``LLM`` arguments of the benchmarks: bf16 random weights made on ``DEVICE`` (no weight
    file read), the GPU's memory profile or a small CPU cache."""
    kwargs: dict[str, Any] = dict(model=str(model_dir), dtype="bfloat16", device=DEVICE, max_model_len=max_model_len,
                                  enforce_eager=enforce_eager, load_format="dummy")
    if DEVICE == "cuda":
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        kwargs["kv_cache_memory"] = CPU_KV_CACHE_BYTES
    return {**kwargs, **extra}


def hf_random_model(model_dir: Path) -> Any:
    """Transformers' model of ``model_dir``'s config with its own random initialisation, in bf16
    on ``DEVICE`` (no weight file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(DEVICE):  # initialised where it runs (fast on a GPU); moved there if it was not
        model = AutoModelForCausalLM.from_config(config)
    return model.to(device=DEVICE, dtype=torch.bfloat16).eval()


def free_device_memory() -> None:
    """Return what the last engine or model held (between stages and before transformers loads)."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


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
    """Bytes of weights one decode step reads: all of them (a quantized layer's packed tensors
    and scales included), except an untied embedding table, of which a lookup reads only the
    batch's rows."""
    total, seen = 0, set()
    for module in model.modules():
        qlinear = getattr(module, "qlinear", None)  # online quantization drops the dense parameter
        total += qlinear.nbytes if qlinear is not None else 0
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


def time_decode(llm: Any, prompts: list[list[int]], output_len: int,
                step_seconds: list[float] | None = None) -> tuple[float, int]:
    """(seconds, tokens) of the decode phase: from the step that gave every prompt its first
    token to the last step; each of those steps' wall time appended to ``step_seconds``."""
    from pagoda import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    counts: dict[str, int] = {}  # finished requests' tokens
    live = engine.output_processor.requests  # the front end's state of the unfinished ones
    start, first = None, 0
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        # Outputs of finished requests only, as ``LLM.generate`` steps: a cumulative output of
        # every running request each step would put a copy of its tokens in the step's time.
        for out in engine.step(finished_only=True):
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if start is None:
            so_far = [len(live[rid].samples[0].token_ids) for rid in live] + list(counts.values())
            if len(so_far) == len(prompts) and min(so_far) >= 1:
                start, first = time.perf_counter(), sum(so_far)
        elif step_seconds is not None:
            step_seconds.append(time.perf_counter() - began)
    _sync()
    assert start is not None
    return time.perf_counter() - start, sum(counts.values()) - first


def measure_roofline(model_dir: Path, bandwidth: float, batch: int, input_len: int, output_len: int,
                     enforce_eager: bool = False, gpu_memory_utilization: float = 0.9, seed: int = 0,
                     quantization: str | None = None, async_scheduling: bool = False,
                     greedy: tuple[int, int] | None = None, num_scheduler_steps: int | None = None
                     ) -> dict[str, Any]:
    """Decode tokens/s of the model in ``model_dir`` (random weights) at ``batch`` and its memory
    roofline at ``bandwidth`` bytes/s; ``quantization`` quantizes the weights online;
    ``async_scheduling`` schedules each step while the one before runs (``--async-scheduling``);
    ``greedy`` (prompts, tokens): also the greedy token ids of that many seeded prompts
    (``greedy_token_ids``), to compare two engines' results; ``num_scheduler_steps``: decode
    steps per round without async scheduling (None: the engine's automatic choice)."""
    from pagoda import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model_dir, input_len + output_len, enforce_eager, gpu_memory_utilization,
                              max_num_seqs=batch, quantization=quantization, async_scheduling=async_scheduling,
                              num_scheduler_steps=num_scheduler_steps))
    try:
        rng = random.Random(seed)
        vocab = _vocab_size(model_dir)
        prompts = [[rng.randrange(16, vocab) for _ in range(input_len)] for _ in range(batch)]
        time_decode(llm, prompts, min(output_len, 16))  # warm-up: kernel compilation, allocator
        steps: list[float] = []
        seconds, tokens = time_decode(llm, prompts, output_len, steps)
        runner = llm.engine.core.executor
        ran_ahead = llm.engine.core._pipeline is not None  # the engine may refuse async scheduling (logged)
        graphs = getattr(runner, "decode_graphs", None)
        device_rounds = graphs.rounds if graphs is not None else 0  # greedy rounds through the decode graphs
        weights = weight_bytes_per_step(runner.model)
        kv_per_token = runner.kv_bytes_per_block() // runner.block_size
        greedy_ids = None
        if greedy is not None:
            checked = [{"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(input_len)]}
                       for _ in range(greedy[0])]
            params = SamplingParams(temperature=0, max_tokens=greedy[1], ignore_eos=True, detokenize=False)
            greedy_ids = [o.outputs[0].token_ids for o in llm.generate(checked, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    best = decode_roofline(bandwidth, weights, kv_per_token, batch, input_len, output_len)
    measured = tokens / seconds
    return {"batch": batch, "input_len": input_len, "output_len": output_len, "cuda_graphs": not enforce_eager,
            "quantization": quantization, "async_scheduling": ran_ahead, "device_rounds": device_rounds,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "weight_bytes_per_step": weights, "kv_bytes_per_token": kv_per_token, "decode_tokens_per_s": measured,
            "roofline_tokens_per_s": best, "fraction": measured / best, "steps": step_stats(steps),
            **({"greedy_token_ids": greedy_ids} if greedy_ids is not None else {})}


def run_roofline(args: argparse.Namespace) -> int:
    bandwidth = copy_bandwidth()
    result = measure_roofline(bench_shape_dir(args.shape), bandwidth, args.batch, args.input_len, args.output_len,
                              args.enforce_eager, args.gpu_memory_utilization, args.seed,
                              async_scheduling=args.async_scheduling)
    _report_roofline(args, result)
    return 0


def _report_roofline(args: argparse.Namespace, r: dict[str, Any]) -> None:
    graphs = "off (--enforce-eager)" if args.enforce_eager else "on"
    rows = [("quantity", "value"),
            ("copy bandwidth", f"{r['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s"),
            ("weights read per step", f"{r['weight_bytes_per_step'] / 1e9:.2f} GB"),
            ("KV bytes per token", f"{r['kv_bytes_per_token'] / 1e3:.1f} KB"),
            ("decode tok/s (measured)", f"{r['decode_tokens_per_s']:.1f}"),
            ("decode tok/s (roofline)", f"{r['roofline_tokens_per_s']:.1f}"),
            ("fraction of roofline", f"{r['fraction']:.3f}")]
    print_table(f"roofline: {args.shape} bf16, batch {args.batch}, prompt {args.input_len}, "
                f"output {args.output_len}, CUDA graphs {graphs}, async scheduling "
                f"{'on' if args.async_scheduling else 'off'}", rows)
    write_json(args.output_json, {"shape": args.shape, **r})


# --------------------------------------------------------------------------------------
# throughput
# --------------------------------------------------------------------------------------


def workload_head(work: Workload, n: int) -> Workload:
    """The first ``n`` requests of ``work`` (the subset both engines of a ratio run)."""
    return Workload(work.prompts[:n], work.output_lens[:n])


def pagoda_throughput(model_dir: Path, work: Workload, subsets: list[int], enforce_eager: bool,
                      gpu_memory_utilization: float, out: dict[str, Any] | None = None,
                      async_scheduling: bool = False, bandwidth: float | None = None) -> dict[str, Any]:
    """pagoda on the whole workload, then on each ``subsets`` head of it, in one engine (prefix
    caching off, so a subset's prompts gain nothing from the runs before it). Results are put in
    ``out`` as each run ends (``"all"`` and ``str(n)``), so a stopped stage keeps what it measured.
    ``async_scheduling`` schedules each step while the one before runs (``async_scheduling`` in
    ``out`` says whether the engine did). With ``bandwidth`` (bytes/s), the whole run's steps are
    profiled (``step_profile``): time in steps with prompt tokens, decode-only steps against their
    memory roofline."""
    from pagoda import LLM, SamplingParams
    from pagoda.bench.step_profile import StepProfile
    from pagoda.bench.throughput import _rates

    out = {} if out is None else out
    longest = max(len(p) for p in work.prompts) + max(work.output_lens)
    llm = LLM(**engine_kwargs(model_dir, longest, enforce_eager, gpu_memory_utilization, enable_prefix_caching=False,
                              async_scheduling=async_scheduling))
    try:
        out["async_scheduling"] = llm.engine.core._pipeline is not None  # the engine may refuse it (logged)
        llm.generate([{"prompt_token_ids": p} for p in work.prompts[:2]],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        for key, part in [("all", work)] + [(str(n), workload_head(work, n)) for n in subsets]:
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
                      for n in part.output_lens]
            profile = StepProfile(llm) if key == "all" and bandwidth else None
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in part.prompts], params, use_tqdm=False)
            _sync()
            elapsed = time.perf_counter() - start
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            assert produced == part.num_output_tokens, (produced, part.num_output_tokens)
            out[key] = _rates(elapsed, len(part.prompts), produced, part.num_prompt_tokens)
            if profile is not None:
                profile.close()
                runner = llm.engine.core.executor
                out["step_profile"] = profile.summary(weight_bytes_per_step(runner.model),
                                                      runner.kv_bytes_per_block() * runner.num_blocks, bandwidth)
    finally:
        llm.shutdown()
    return out


def hf_throughput(model_dir: Path, work: Workload, batch_size: int, deadline: float = math.inf,
                  out: dict[str, Any] | None = None, probe_tokens: int = PROBE_TOKENS) -> dict[str, Any]:
    """Hugging Face ``generate`` in bf16 on ``DEVICE`` (random weights), batches of ``batch_size``
    in workload order with left padding, each run to its longest requested output (only requested
    tokens count). Stops before a batch that would end past ``deadline`` (``time.monotonic``),
    its time estimated from two short probes and the batches before it; the figures are those of
    the whole batches done (``num_seqs`` of them), with ``stopped`` saying why it ended early."""
    from pagoda.bench.hf_peer import generate_batch
    from pagoda.bench.throughput import _rates

    out = {} if out is None else out
    hf = hf_random_model(model_dir)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    generate_batch(hf, work.prompts[:2], 4, pad, DEVICE)  # warm-up
    prefill, per_token = 0.0, 0.0  # no deadline: no estimate needed
    if deadline < math.inf:
        prefill, per_token = _probe_generate(
            lambda n, model=hf: generate_batch(model, work.prompts[:batch_size], n, pad, DEVICE), probe_tokens)
    elapsed, done, produced, prompt_tokens = 0.0, 0, 0, 0
    for i in range(0, len(work.prompts), batch_size):
        part = workload_head(Workload(work.prompts[i:], work.output_lens[i:]), batch_size)
        longest = max(part.output_lens)
        estimate = ESTIMATE_MARGIN * (prefill + per_token * longest)
        if time.monotonic() + estimate > deadline:
            out["stopped"] = f"batch {i // batch_size + 1} (~{estimate:.0f} s) would end past the deadline"
            break
        start = time.perf_counter()
        generate_batch(hf, part.prompts, longest, pad, DEVICE)
        _sync()
        took = time.perf_counter() - start
        per_token = max(per_token, (took - prefill) / longest)  # longer contexts cost more a step
        elapsed, done = elapsed + took, done + len(part.prompts)
        produced, prompt_tokens = produced + part.num_output_tokens, prompt_tokens + part.num_prompt_tokens
        out.update(_rates(elapsed, done, produced, prompt_tokens), num_seqs=done)
    del hf
    free_device_memory()
    return out


def _probe_generate(generate: Callable[[int], None], tokens: int) -> tuple[float, float]:
    """(prefill seconds, seconds per generated token) of a batch, from runs of ``tokens`` and
    3 x ``tokens`` tokens."""
    times = []
    for n in (tokens, 3 * tokens):
        start = time.perf_counter()
        generate(n)
        _sync()
        times.append(time.perf_counter() - start)
    per_token = max((times[1] - times[0]) / (2 * tokens), times[0] / tokens / 4)
    return max(times[0] - tokens * per_token, 0.0), per_token


def run_throughput(args: argparse.Namespace) -> int:
    model_dir = bench_shape_dir("qwen3-0.6b")
    work = random_workload(args.num_seqs, args.input_len, args.output_len, _vocab_size(model_dir), args.seed)
    results = {"pagoda": pagoda_throughput(model_dir, work, [], args.enforce_eager, args.gpu_memory_utilization,
                                           async_scheduling=args.async_scheduling)["all"]}
    free_device_memory()  # the engine's tensors go before transformers loads
    if not args.skip_hf:
        results["hf"] = hf_throughput(model_dir, work, args.hf_batch_size)
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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enforce-eager", action="store_true", help="run without CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--output-json", default=None)


def add_parsers(sub: argparse._SubParsersAction, guard: Callable) -> None:
    """``pagoda bench gpu roofline`` and ``throughput``; ``guard`` wraps a run that needs CUDA."""
    roof = sub.add_parser("roofline", help="decode tokens/s against the memory-bandwidth roofline")
    roof.add_argument("--shape", choices=sorted(SHAPES), required=True)
    roof.add_argument("--batch", type=int, default=1)
    roof.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    roof.add_argument("--output-len", type=int, default=256)
    roof.add_argument("--async-scheduling", action="store_true", help="schedule each step while the one before runs")
    _common(roof)
    roof.set_defaults(func=guard(run_roofline))
    thr = sub.add_parser("throughput", help="nano-vllm workload, pagoda against HF generate (qwen3-0.6b)")
    thr.add_argument("--num-seqs", type=int, default=256)
    thr.add_argument("--input-len", default=NANO_VLLM_LEN, help="MIN:MAX prompt tokens")
    thr.add_argument("--output-len", default=NANO_VLLM_LEN, help="MIN:MAX output tokens")
    thr.add_argument("--hf-batch-size", type=int, default=64)
    thr.add_argument("--skip-hf", action="store_true", help="run pagoda only")
    thr.add_argument("--async-scheduling", action="store_true", help="schedule each step while the one before runs")
    _common(thr)
    thr.set_defaults(func=guard(run_throughput))
