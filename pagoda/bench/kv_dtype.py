"""``pagoda bench kv-cache-dtype``: KV-cache dtypes side by side in one run (default float32,
int8, fp8) on the same model, memory budget and workload: capacity in tokens, decode tok/s of
a batch at a long context, and greedy agreement with the first dtype.

Without ``--model`` it builds (once, in the pagoda cache dir) a random-weight Llama whose
context is long enough for the decode to be dominated by reading the KV cache, which is where
a smaller cache pays on a CPU."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from pagoda.bench.common import add_engine_args, engine_kwargs, print_table, random_workload, write_json

LONG_CONTEXT_MODEL = dict(arch="llama", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                          vocab_size=2048, max_position_embeddings=4096)


def long_context_model() -> Path:
    from pagoda.tools import make_model as mm

    path = mm.cache_dir() / "bench-kv-dtype-llama-4k"
    if not (path / "config.json").exists():
        mm.make_model(path, **LONG_CONTEXT_MODEL)
    return path


def time_decode(llm: Any, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of the batch once every prompt is in the cache (prefill not timed), and
    the greedy outputs."""
    from pagoda import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"kv{i}", {"prompt_token_ids": p}, params)
    outputs: dict[str, list[int]] = {}
    start, produced_at_start = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        if start is None and len(outputs) == len(prompts) and all(outputs.values()):
            start, produced_at_start = time.perf_counter(), sum(len(t) for t in outputs.values())
    assert all(len(t) == output_len for t in outputs.values()), "outputs are cumulative, one per request"
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    decoded = sum(len(t) for t in outputs.values()) - produced_at_start
    return decoded / elapsed, [outputs[f"kv{i}"] for i in range(len(prompts))]


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Tokens before each sequence's first divergence, over all tokens."""
    same = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want))
    return same / max(1, sum(len(w) for w in want))


def run_kernel(args: argparse.Namespace) -> int:
    """The CPU decode kernel alone over float32 and quantized caches of the same content:
    ``--batch`` sequences of ``--context-len`` tokens, 8 query heads over 2 K/V heads of 64."""
    import torch

    from pagoda.kernels import attention as cpu_kernel
    from pagoda.layers.attention import kv_quant

    if cpu_kernel.load() is None:
        raise SystemExit("the CPU decode kernel cannot be built here")
    torch.manual_seed(args.seed)
    batch, ctx, heads, kv_heads, dim, page = args.batch, args.context_len, 8, 2, 64, 16
    num_blocks = batch * -(-ctx // page)
    k, v = torch.randn(num_blocks, page, kv_heads, dim), torch.randn(num_blocks, page, kv_heads, dim)
    caches = {"float32": (k, v, None, None)}
    for name in [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip() not in ("", "float32")]:
        dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}[name]
        (kq, ks), (vq, vs) = kv_quant.quantize(k, dtype), kv_quant.quantize(v, dtype)
        caches[name] = (kq, vq, ks, vs)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, heads, dim)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(max(args.rounds, 3) * 2):  # rounds alternate the dtypes
        for name, (kc, vc, ks, vs) in caches.items():
            start = time.perf_counter()
            cpu_kernel.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, k_scale=ks, v_scale=vs)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["float32"])
    rows = [("kv dtype", "K/V MiB read", "ms per call", "x speed")]
    for name, (kc, vc, ks, vs) in caches.items():
        size = sum(t.numel() * t.element_size() for t in (kc, vc, ks, vs) if t is not None) / 2**20
        median = statistics.median(times[name])
        rows.append((name, f"{size:.1f}", f"{median * 1e3:.2f}", f"{base / median:.2f}"))
    print_table(f"CPU decode kernel: batch {batch}, context {ctx}, 8 heads / 2 K/V heads of 64", rows)
    return 0


def run(args: argparse.Namespace) -> int:
    from pagoda import LLM

    if args.kernel:
        return run_kernel(args)

    model = args.model or str(long_context_model())
    dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    llms = {}
    for dtype in dtypes:
        llms[dtype] = LLM(**engine_kwargs(args, model=model, kv_cache_dtype=dtype,
                                          max_model_len=args.max_model_len or args.context_len + args.output_len))
    vocab = llms[dtypes[0]].config.model.vocab_size
    prompts = random_workload(args.batch, str(args.context_len), "1", vocab, args.seed).prompts
    outputs: dict[str, list[list[int]]] = {}
    speeds: dict[str, list[float]] = {d: [] for d in dtypes}
    # Rounds alternate the dtypes, so drift in a shared machine's speed hits them alike; after the
    # first round the prompts come from the prefix cache and only the decode is redone.
    for _ in range(args.rounds):
        for dtype in dtypes:
            tok_s, outs = time_decode(llms[dtype], prompts, args.output_len)
            speeds[dtype].append(tok_s)
            outputs.setdefault(dtype, outs)
    results: dict[str, dict[str, float]] = {}
    for dtype, llm in llms.items():
        core = llm.engine.core
        results[dtype] = {"capacity_tokens": core.executor.num_blocks * llm.config.cache.block_size,
                          "kv_bytes_per_token": core.executor.kv_bytes_per_block() / llm.config.cache.block_size,
                          "decode_tok_s": statistics.median(speeds[dtype]), "decode_tok_s_rounds": speeds[dtype],
                          "greedy_agreement": agreement(outputs[dtype], outputs[dtypes[0]])}
        llm.shutdown()
    base = results[dtypes[0]]
    rows = [("kv dtype", "bytes/token", "capacity (tokens)", "x capacity", "decode tok/s", "x decode",
             f"agreement vs {dtypes[0]}")]
    for dtype, r in results.items():
        rows.append((dtype, f"{r['kv_bytes_per_token']:.0f}", str(r["capacity_tokens"]),
                     f"{r['capacity_tokens'] / base['capacity_tokens']:.2f}", f"{r['decode_tok_s']:.1f}",
                     f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}", f"{100 * r['greedy_agreement']:.1f}%"))
    print_table(f"kv-cache dtypes: {Path(model).name}, batch {args.batch}, context {args.context_len}, "
                f"{args.output_len} decode steps, kv_cache_memory {args.kv_cache_memory}, median of "
                f"{args.rounds} alternating rounds", rows)
    write_json(args.output_json, {"model": model, "batch": args.batch, "context_len": args.context_len,
                                  "output_len": args.output_len, "results": results})
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("kv-cache-dtype", help="KV-cache dtypes side by side: capacity, decode "
                                                           "speed at a long context, greedy agreement")
    p.add_argument("--kv-cache-dtypes", default="float32,int8,fp8", help="comma-separated; the first is the base")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="timed decodes per dtype, alternating (median)")
    p.add_argument("--kernel", action="store_true", help="time only the CPU decode kernel over each cache")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run, kv_cache_memory=256 << 20)
