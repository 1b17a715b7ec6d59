"""``pagoda bench kv-tiers``: time to first token of conversations that return after other
traffic evicted their prefix from the device, with a KV tier below the device (the prefix is
loaded back) and without (it is recomputed), in one run, beside a device cache big enough to
keep every prefix (the ceiling: a hit in device memory). A tier's outputs must equal the
device-hit run's token for token (the same cached prefix, the same computation); against
recomputation they are equal in float32, while in bfloat16 a cached prefix and a recomputed one
may round differently, as they do for the device's own prefix cache.

Workload: ``--conversations`` long prefixes (system prompt + history), each asked
``--rounds`` questions, round-robin, one request at a time (so TTFT is the prefill alone). The
device KV cache holds about one conversation (``--device-blocks``), so every request after the
first round finds its prefix evicted. Round 1 is cold in both modes and is left out of the
returning-prefix TTFT. The modes' engines run side by side, each request going to each of them
in turn (``measure``), so a shared machine's load swings hit every mode alike."""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

from pagoda.bench.common import FIRST_ORDINARY_ID, add_engine_args, engine_kwargs, print_table, write_json


def workload(conversations: int, rounds: int, prefix_len: int, question_len: int, vocab: int,
             seed: int) -> list[tuple[int, list[int]]]:
    """(conversation, prompt) in arrival order: round-robin over conversations, ``rounds`` times."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]  # noqa: E731
    prefixes = [draw(prefix_len) for _ in range(conversations)]
    return [(c, prefixes[c] + draw(question_len)) for _ in range(rounds) for c in range(conversations)]


def measure(kwargs_by_mode: dict[str, dict[str, Any]], requests: list[tuple[int, list[int]]], output_len: int,
            conversations: int) -> dict[str, dict[str, Any]]:
    """Every mode's engine at once, each request sent to each of them in turn (the order
    rotating from request to request), so that on a shared machine every mode meets the same
    load. A mode's run time is the sum of its requests' wall times, each including the wait
    for its tier writes to finish (so no mode's background I/O is timed in another's)."""
    from pagoda import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engines = {}
    try:
        for name, kwargs in kwargs_by_mode.items():
            engines[name] = llm = LLM(**kwargs)
            llm.generate([{"prompt_token_ids": [FIRST_ORDINARY_ID + 1] * 8}], params, use_tqdm=False)  # warm-up
        rec: dict[str, dict[str, list]] = {n: {"ttft": [], "cached": [], "tokens": [], "wall": []} for n in engines}
        names = list(engines)
        for i, (_, prompt) in enumerate(requests):
            for name in names[i % len(names):] + names[:i % len(names)]:
                llm, r = engines[name], rec[name]
                start = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                if llm.engine.core.kv_store is not None:
                    llm.engine.core.kv_store.drain()
                r["wall"].append(time.perf_counter() - start)
                r["ttft"].append(out.metrics.first_token_time - out.metrics.arrival_time)
                r["cached"].append(out.num_cached_tokens)
                r["tokens"].append(out.outputs[0].token_ids)
        stats = {name: llm.engine.core.stats() for name, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.shutdown()
    back = slice(conversations, None)  # the returning requests (round 2 on)
    prompt_tokens = sum(len(p) for _, p in requests[back])
    return {name: {"mean_ttft_returning_s": statistics.mean(r["ttft"][back]),
                   "median_ttft_returning_s": statistics.median(r["ttft"][back]),
                   "mean_ttft_first_round_s": statistics.mean(r["ttft"][:conversations]),
                   "cached_fraction_returning": sum(r["cached"][back]) / prompt_tokens,
                   "elapsed_s": sum(r["wall"]), "kv_offload": dict(stats[name].kv_offload), "tokens": r["tokens"]}
            for name, r in rec.items()}


def run(args: argparse.Namespace) -> int:
    from pagoda.config import EngineArgs, EngineConfig

    config = EngineConfig.from_args(EngineArgs.from_namespace(args))
    m = config.model
    prefix_len = args.prefix_len or m.max_model_len - args.question_len - args.output_len - 8
    requests = workload(args.conversations, args.rounds, prefix_len, args.question_len, m.vocab_size, args.seed)
    base = engine_kwargs(args)
    if base.get("kv_cache_memory") is None:
        elem = 1 if "8" in str(config.cache.kv_cache_dtype) else config.cache.kv_cache_dtype.itemsize
        per_block = 2 * m.num_layers * m.num_kv_heads * m.head_dim * elem * config.cache.block_size
        base["kv_cache_memory"] = args.device_blocks * per_block
    with tempfile.TemporaryDirectory() as disk:
        none = {"kv_offload_cpu_bytes": None, "kv_offload_disk_path": None, "kv_offload_disk_bytes": None,
                "kv_offload_redis_url": None}
        tiers = {"off": none, "cpu": {**none, "kv_offload_cpu_bytes": args.cpu_bytes}}
        if args.with_disk:
            tiers["disk"] = {**none, "kv_offload_disk_path": disk}
        tiers["device"] = {**none, "kv_cache_memory": base["kv_cache_memory"] * (args.conversations + 1)}
        results = measure({name: {**base, **extra} for name, extra in tiers.items()}, requests, args.output_len,
                          args.conversations)
    same = all(r["tokens"] == results["device"]["tokens"] for r in results.values() if r is not results["off"])
    same_recompute = results["off"]["tokens"] == results["device"]["tokens"]
    rows = [("tier", "mean TTFT returning s", "median s", "first round s", "cached (returning)", "run s")]
    for name, r in results.items():
        rows.append((name, f"{r['mean_ttft_returning_s']:.4f}", f"{r['median_ttft_returning_s']:.4f}",
                     f"{r['mean_ttft_first_round_s']:.4f}", f"{r['cached_fraction_returning']:.1%}",
                     f"{r['elapsed_s']:.1f}"))
    print_table(f"KV tiers: {args.conversations} conversations x {args.rounds} rounds, prefix {prefix_len}, "
                f"question {args.question_len}, output {args.output_len}, device {args.device_blocks} blocks", rows)
    off = results["off"]
    ratios = {name: r["mean_ttft_returning_s"] / off["mean_ttft_returning_s"]
              for name, r in results.items() if name != "off"}  # "device": the ceiling
    median_ratios = {name: r["median_ttft_returning_s"] / off["median_ttft_returning_s"]
                     for name, r in results.items() if name != "off"}
    throughput = {name: off["elapsed_s"] / r["elapsed_s"] for name, r in results.items() if name != "off"}
    for name, ratio in ratios.items():
        what = "device cache holding every prefix" if name == "device" else f"{name} tier"
        print(f"returning-prefix TTFT, {what} / recompute: mean {ratio:.3f}x, median {median_ratios[name]:.3f}x; "
              f"requests/s (whole run, first round included) {throughput[name]:.2f}x")
    print(f"tier outputs identical to the device-hit run: {same}; recomputation identical too: {same_recompute}")
    for r in results.values():
        r.pop("tokens")
    write_json(args.output_json, {"results": results, "ttft_ratio_vs_recompute": ratios,
                                  "median_ttft_ratio_vs_recompute": median_ratios,
                                  "throughput_ratio_vs_recompute": throughput, "identical": same,
                                  "identical_to_recompute": same_recompute,
                                  "prefix_len": prefix_len, "args": {k: getattr(args, k) for k in (
                                      "conversations", "rounds", "question_len", "output_len", "device_blocks")}})
    return 0 if same else 1


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("kv-tiers", help="returning-prefix TTFT with a KV tier vs recomputation")
    p.add_argument("--conversations", type=int, default=4,
                   help="distinct long prefixes (4 x 31 blocks: ~3x the default device cache)")
    p.add_argument("--rounds", type=int, default=3, help="questions per conversation (round-robin)")
    p.add_argument("--prefix-len", type=int, default=0, help="prefix tokens (default: fill max_model_len)")
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--device-blocks", type=int, default=40,
                   help="device KV blocks when --kv-cache-memory is not given (about one conversation)")
    p.add_argument("--cpu-bytes", type=int, default=256 << 20, help="host tier budget")
    p.add_argument("--with-disk", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure a disk-only tier (a temporary directory)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run)
