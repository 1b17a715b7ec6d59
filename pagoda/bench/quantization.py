"""``pagoda bench quantization --model DIR``: the float model and its online-quantized
variants side by side in one run: decode speed at several batch sizes (tokens/s and the ratio
to float32), the prefill of one ``--prefill-len`` prompt (512 tokens by default; where bfloat16
pays most on CPUs with AMX), and quality against the float32 model on held-out text (mean KL
divergence of the next-token distributions, perplexity, top-1 agreement).

All variants are loaded up front and measured in interleaved rounds (every variant at every
batch size, then again), so drift in a shared machine's load hits them alike; the best round
counts. Quality is teacher-forced: each variant scores the same token sequence.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.common import add_engine_args, engine_kwargs, print_table, random_workload, write_json

# variant name -> engine overrides
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32", "quantization": None},
    "bf16": {"dtype": "bfloat16", "quantization": None},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "fp8": {"dtype": "float32", "quantization": "fp8"},
}


def teacher_forced_logits(llm: Any, ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one forward over ``ids`` (row ``i`` predicts
    token ``i + 1``), through the engine's own model runner and KV cache. Call it while the
    engine is idle: it writes the K/V of blocks 0.. which nothing else holds then."""
    from pagoda.kvcache.block_table import BlockTable
    from pagoda.request import Request, Sequence
    from pagoda.sampling_params import SamplingParams
    from pagoda.step import ScheduledSeq, SchedulerOutput

    runner = llm.engine.core.executor
    bs = llm.config.cache.block_size
    req = Request("quality", list(ids), SamplingParams(max_tokens=1), ())
    seq = Sequence("quality#0", req, list(ids))
    seq.block_table = BlockTable(range(-(-len(ids) // bs)))
    inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(seq, 0, len(ids))], len(ids)))
    with torch.inference_mode():
        hidden = runner.forward(inputs)
        return runner.model.compute_logits(hidden).float()


def windows(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids) - 1, size) if len(ids[i:i + size]) > 1]


def quality(ref: torch.Tensor, test: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Mean KL(ref || test) per position (nats), perplexity of ``test`` on ``ids`` and the share
    of positions where both argmaxes agree. ``ref``/``test``: logits ``[T, V]``; row ``i``
    predicts ``ids[i + 1]``."""
    ref_lp = torch.log_softmax(ref[:-1].double(), -1)
    test_lp = torch.log_softmax(test[:-1].double(), -1)
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1)
    target = torch.tensor(ids[1:])
    nll = -test_lp.gather(1, target[:, None]).squeeze(1)
    return {"kl_sum": float(kl.sum()), "nll_sum": float(nll.sum()), "positions": len(ids) - 1,
            "top1_agree": float((ref_lp.argmax(-1) == test_lp.argmax(-1)).sum())}


def heldout_text(model_dir: str, text_file: str | None) -> str:
    if text_file:
        return Path(text_file).read_text()
    from pagoda.tools.make_model import builtin_model_path

    for root in (Path(model_dir), builtin_model_path("main")):
        if root is not None and (root / "demo_eval.json").is_file():
            return json.loads((root / "demo_eval.json").read_text())["sample_text"]
    raise FileNotFoundError("no held-out text: pass --text-file")


def time_batch(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    """Seconds to generate ``output_len`` tokens for every prompt at once (greedy)."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return elapsed


def measure_speed(llms: dict[str, Any], batches: list[int], args: argparse.Namespace,
                  vocab: int) -> dict[str, dict[int, float]]:
    """Best-of-rounds output tokens/s per variant and batch size (decode-dominated: short
    prompts, ``output_len`` tokens each)."""
    best: dict[str, dict[int, float]] = {name: {} for name in llms}
    for name, llm in llms.items():  # warm-up: first calls compile/allocate
        time_batch(llm, random_workload(2, "8", "1", vocab, 0).prompts, 4)
    for round_ in range(args.rounds):
        for b in batches:
            prompts = random_workload(b, str(args.input_len), "1", vocab, args.seed + round_).prompts
            for name, llm in llms.items():
                tps = b * args.output_len / time_batch(llm, prompts, args.output_len)
                best[name][b] = max(best[name].get(b, 0.0), tps)
                print(f"  round {round_ + 1}: {name:5s} batch {b:3d}: {tps:8.1f} tok/s", flush=True)
    return best


def measure_prefill(llms: dict[str, Any], args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """Best-of-rounds prefill tokens/s per variant: one ``prefill_len``-token prompt to its first
    token, a new prompt each round (interleaved like the decode rounds)."""
    best: dict[str, float] = {}
    for round_ in range(args.rounds):
        prompt = random_workload(1, str(args.prefill_len), "1", vocab, args.seed + 1000 + round_).prompts
        for name, llm in llms.items():
            tps = args.prefill_len / time_batch(llm, prompt, 1)
            best[name] = max(best.get(name, 0.0), tps)
            print(f"  round {round_ + 1}: {name:5s} prefill {args.prefill_len}: {tps:8.1f} tok/s", flush=True)
    return best


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagoda import LLM

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "fp32" not in names:
        raise SystemExit(f"--variants must include fp32 and name only {', '.join(VARIANTS)}; got {args.variants!r}")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    base = engine_kwargs(args, max_num_seqs=max(batches + [args.max_num_seqs or 0]),
                         kv_cache_memory=args.kv_cache_memory or 256 << 20)
    llms = {name: LLM(**{**base, **VARIANTS[name]}) for name in names}
    model_dir = llms["fp32"].config.model.path
    tok = AutoTokenizer.from_pretrained(llms["fp32"].config.model.tokenizer)
    ids = tok(heldout_text(model_dir, args.text_file))["input_ids"]
    span = min(512, llms["fp32"].config.model.max_model_len)
    refs = [teacher_forced_logits(llms["fp32"], w) for w in windows(ids, span)]
    qual: dict[str, dict[str, float]] = {}
    for name, llm in llms.items():
        sums: dict[str, float] = {}
        for w, ref in zip(windows(ids, span), refs):
            for key, value in quality(ref, teacher_forced_logits(llm, w), w).items():
                sums[key] = sums.get(key, 0.0) + value
        n = sums["positions"]
        qual[name] = {"mean_kl": sums["kl_sum"] / n, "ppl": math.exp(sums["nll_sum"] / n),
                      "top1_agree": sums["top1_agree"] / n, "positions": n}
    vocab = llms["fp32"].config.model.vocab_size
    longest = llms["fp32"].config.model.max_model_len - 1
    if args.prefill_len > longest:
        print(f"--prefill-len {args.prefill_len} is past the model's length; timing {longest} tokens")
        args.prefill_len = longest
    speed = measure_speed(llms, batches, args, vocab)
    prefill = measure_prefill(llms, args, vocab) if args.prefill_len else {}
    rows = [("variant", *[f"b={b} tok/s (x fp32)" for b in batches], "b=1 ms/token",
             *([f"prefill {args.prefill_len} tok/s (x fp32)"] if prefill else []), "mean KL", "ppl", "top1 agree")]
    for name in names:
        cells = [f"{speed[name][b]:.1f} ({speed[name][b] / speed['fp32'][b]:.2f}x)" for b in batches]
        ms = f"{1e3 / speed[name][1]:.2f}" if 1 in batches else "-"
        pre = [f"{prefill[name]:.1f} ({prefill[name] / prefill['fp32']:.2f}x)"] if prefill else []
        q = qual[name]
        rows.append((name, *cells, ms, *pre, f"{q['mean_kl']:.5f}", f"{q['ppl']:.3f}", f"{q['top1_agree']:.4f}"))
    print_table(f"quantization: {model_dir}, input {args.input_len}, output {args.output_len}, "
                f"best of {args.rounds} rounds; quality on {qual['fp32']['positions']} held-out tokens", rows)
    if 1 in batches:
        for name in names:
            if name != "fp32":
                print(f"{name}: batch-1 time per output token {speed['fp32'][1] / speed[name][1]:.3f}x fp32")
    for name in names:
        if prefill and name != "fp32":
            print(f"{name}: prefill of {args.prefill_len} tokens {prefill[name] / prefill['fp32']:.2f}x fp32's speed")
    write_json(args.output_json, {"model": model_dir, "input_len": args.input_len, "output_len": args.output_len,
                                  "tokens_per_s": speed, "prefill_len": args.prefill_len,
                                  "prefill_tokens_per_s": prefill, "quality": qual})
    for llm in llms.values():
        llm.shutdown()
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("quantization", help="float vs int8/int4/fp8 weights: speed and quality")
    p.add_argument("--variants", default="fp32,int8,int4,fp8",
                   help=f"comma-separated, from {', '.join(VARIANTS)} (fp32 is the reference)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the timed prefill prompt (0: none)")
    p.add_argument("--text-file", default=None, help="held-out text (default: the demo model's held-out sample)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run)
