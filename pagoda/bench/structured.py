"""``pagoda bench structured``: what a JSON-schema constraint costs. The same seeded workload
runs unconstrained and constrained, at batch 1 and batch 32, in one engine and one run; it prints
output tokens/s of both and their ratio (the bar: constrained costs at most 10% at batch 32),
and the time to first token of a request whose schema is new (it compiles) and of one whose
schema is cached, next to an unconstrained request's.

The constraint is a realistic record schema (strings, enums, bounded integers and numbers,
nested objects) repeated in an array that cannot complete within ``--output-len``, so both runs
produce exactly the same number of tokens per request."""
from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from pagoda.bench.common import add_engine_args, engine_kwargs, print_table, random_workload, write_json

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["user", "group", "service", "device"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"email": {"type": "string", "maxLength": 24},
                                                   "active": {"type": "boolean"}},
                  "required": ["email", "active"], "additionalProperties": False},
    },
    "required": ["id", "name", "kind", "score", "tags", "owner"],
    "additionalProperties": False,
}


def bench_schema(tag: str = "") -> dict[str, Any]:
    """Records in an array too long to finish: every request runs to max_tokens."""
    record = RECORD if not tag else {**RECORD, "properties": {**RECORD["properties"], tag: {"type": "boolean"}}}
    return {"type": "array", "items": record, "minItems": 100000}


def _params(max_tokens: int, schema: dict | None):
    from pagoda import SamplingParams
    from pagoda.structured_output import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)


def _throughput(llm, prompts: list[list[int]], max_tokens: int, schema: dict | None, batch: int) -> dict[str, float]:
    """Output tokens/s generating for ``prompts`` ``batch`` at a time."""
    produced, start, cpu = 0, time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        chunk = [{"prompt_token_ids": p} for p in prompts[i:i + batch]]
        outs = llm.generate(chunk, _params(max_tokens, schema), use_tqdm=False)
        produced += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    return {"output_tokens": produced, "elapsed_s": elapsed, "output_tokens_per_s": produced / elapsed,
            "cpu_s": time.process_time() - cpu}


def _ttft(llm, prompt: list[int], schema: dict | None) -> float:
    """Seconds from submitting one request to its first token (engine stepped in this thread)."""
    engine = llm.engine
    rid = f"ttft-{uuid.uuid4().hex}"
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, _params(2, schema))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.outputs[0].token_ids and first is None:
                first = time.perf_counter() - start
    assert first is not None
    return first


def run_backend(args: argparse.Namespace, backend: str, vocab: int) -> dict[str, Any]:
    from pagoda import LLM

    kwargs = engine_kwargs(args, structured_outputs_backend=backend)
    kwargs["max_num_seqs"] = max(kwargs.get("max_num_seqs") or 0, 32)
    llm = LLM(**kwargs)
    try:
        n = max(32, args.batch1_requests)
        work = random_workload(n, f"{args.input_len}:{args.input_len}", "1:1", vocab, args.seed)
        schema = bench_schema()
        for warm in (None, schema):  # warm-up (and the schema's compile) outside the timings
            llm.generate([{"prompt_token_ids": p} for p in work.prompts[:2]], _params(4, warm), use_tqdm=False)
        result: dict[str, Any] = {}
        manager = llm.engine.core.structured
        sides = {"unconstrained": (None, True), "constrained": (schema, True), "masks_ahead": (schema, False)}
        for batch, prompts in ((1, work.prompts[:args.batch1_requests]), (32, work.prompts[:32])):
            # Interleaved repeats, best of each: a shared machine's load hits all sides alike.
            # "constrained" is pagoda's default (deferred masks where they apply), "masks_ahead"
            # computes every mask during the forward pass (the path before deferral).
            runs: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
            for _ in range(args.repeats):
                for side, (constraint, defer) in sides.items():
                    manager.defer_masks = defer
                    before = dict(manager.stats)
                    run = _throughput(llm, prompts, args.output_len, constraint, batch)
                    run["masks"] = {k: manager.stats[k] - before[k] for k in before}
                    runs[side].append(run)
            manager.defer_masks = True
            best = {k: max(v, key=lambda r: r["output_tokens_per_s"]) for k, v in runs.items()}
            free = best["unconstrained"]["output_tokens_per_s"]
            result[f"batch{batch}"] = {**best, "ratio": best["constrained"]["output_tokens_per_s"] / free,
                                       "ratio_masks_ahead": best["masks_ahead"]["output_tokens_per_s"] / free,
                                       "cpu_s": {k: [r["cpu_s"] for r in v] for k, v in runs.items()}}
        prompt = work.prompts[0]
        samples: dict[str, list[float]] = {"unconstrained": [], "new_schema": [], "cached_schema": []}
        for _ in range(3):  # medians of 3, interleaved
            samples["unconstrained"].append(_ttft(llm, prompt, None))
            samples["new_schema"].append(_ttft(llm, prompt, bench_schema(f"x{uuid.uuid4().hex[:8]}")))
            samples["cached_schema"].append(_ttft(llm, prompt, schema))
        result["ttft_s"] = {k: sorted(v)[1] for k, v in samples.items()}
        return result
    finally:
        llm.shutdown()


MICRO_SCHEMAS = {
    "record": RECORD,
    "defs-array": {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                              "minItems": 1, "maxItems": 5}},
                   "required": ["items"], "additionalProperties": False,
                   "$defs": {"item": {"type": "object", "properties": {
                       "id": {"type": "integer"}, "tag": {"enum": ["a", "b", "c"]},
                       "price": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["id", "tag"]}}},
    "wide-30": {"type": "object", "properties": {f"f{i}": {"type": ["string", "integer", "boolean"], "maxLength": 12}
                                                 for i in range(30)},
                "required": [f"f{i}" for i in range(0, 30, 2)], "additionalProperties": False},
}


def run_micro(vocab_sizes: list[int], steps: int = 40) -> dict[str, Any]:
    """The backend choice, measured: per backend and tokenizer size, each schema's compile time
    and the mean and worst per-step mask time along one seeded random path through the grammar."""
    import random

    import torch

    from pagoda.structured_output import StructuredOutputsParams
    from pagoda.structured_output.backend import make_backend
    from pagoda.tools.make_model import build_tokenizer

    out: dict[str, Any] = {}
    for vocab in vocab_sizes:
        tok = build_tokenizer(vocab)
        for name in ("guidance", "xgrammar"):
            backend = make_backend(name, tok, len(tok), [tok.eos_token_id])
            for schema_name, schema in MICRO_SCHEMAS.items():
                params = StructuredOutputsParams(json=schema)
                start = time.perf_counter()
                compiled = backend.compile(params)
                matcher = backend.matcher(compiled)
                compile_s = time.perf_counter() - start
                bitmask = torch.full((1, (len(tok) + 31) // 32), -1, dtype=torch.int32)
                rng, times = random.Random(0), []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    backend.fill_bitmask(bitmask, [(matcher, 0, [])])
                    times.append(time.perf_counter() - t0)
                    bits = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:len(tok)]
                    allowed = bits.nonzero().flatten().tolist()
                    token = rng.choice(allowed)
                    if not matcher.accept(token) or matcher.is_terminated():
                        break
                out[f"{name}/{len(tok)}/{schema_name}"] = {
                    "compile_ms": 1e3 * compile_s, "mask_mean_us": 1e6 * sum(times) / len(times),
                    "mask_max_us": 1e6 * max(times), "steps": len(times)}
    return out


def print_micro(micro: dict[str, Any]) -> None:
    rows = [("backend", "vocab", "schema", "compile ms", "mask mean us", "mask max us", "steps")]
    for key, r in micro.items():
        rows.append((*key.split("/"), f"{r['compile_ms']:.1f}", f"{r['mask_mean_us']:.0f}", f"{r['mask_max_us']:.0f}",
                     str(r["steps"])))
    print_table("grammar backends: compile and per-step mask", rows)


def run(args: argparse.Namespace) -> int:
    from pagoda.config import EngineArgs, EngineConfig

    if args.micro:
        micro = run_micro([int(v) for v in args.micro.split(",")])
        print_micro(micro)
        write_json(args.output_json, {"micro": micro})
        return 0

    config = EngineConfig.from_args(EngineArgs.from_namespace(args))
    results = {b: run_backend(args, b, config.model.vocab_size) for b in args.backends.split(",")}
    rows = [("backend", "batch", "free tok/s", "constrained tok/s", "ratio", "cost", "masks ahead tok/s",
             "ratio", "cost", "masks computed", "CPU s free/constrained/ahead")]
    for backend, r in results.items():
        for batch in (1, 32):
            b = r[f"batch{batch}"]
            m = b["constrained"]["masks"]
            computed = (m["ahead"] + m["refused"]) / max(1, m["ahead"] + m["deferred"])
            cpu = "/".join(f"{min(b['cpu_s'][k]):.2f}" for k in ("unconstrained", "constrained", "masks_ahead"))
            rows.append((backend, str(batch), f"{b['unconstrained']['output_tokens_per_s']:.1f}",
                         f"{b['constrained']['output_tokens_per_s']:.1f}", f"{b['ratio']:.3f}",
                         f"{100 * (1 - b['ratio']):.1f}%", f"{b['masks_ahead']['output_tokens_per_s']:.1f}",
                         f"{b['ratio_masks_ahead']:.3f}", f"{100 * (1 - b['ratio_masks_ahead']):.1f}%",
                         f"{100 * computed:.0f}%", cpu))
    print_table(f"structured output: {config.model.path} (vocab {config.model.vocab_size}), input {args.input_len}, "
                f"output {args.output_len}", rows)
    print("masks computed: the share of constrained sequence-steps that computed a mask (ahead, or deferred and "
          "then refused); a model that follows the schema needs few, a random-weight model nearly all")
    rows = [("backend", "TTFT free ms", "TTFT new schema ms", "TTFT cached schema ms")]
    for backend, r in results.items():
        t = r["ttft_s"]
        rows.append((backend, f"{1e3 * t['unconstrained']:.1f}", f"{1e3 * t['new_schema']:.1f}",
                     f"{1e3 * t['cached_schema']:.1f}"))
    print_table("time to first token", rows)
    for backend, r in results.items():
        cost = 1 - r["batch32"]["ratio"]
        print(f"{backend}: constrained decoding costs {100 * cost:.1f}% of output tok/s at batch 32 "
              f"(bar: <= 10%: {'met' if cost <= 0.10 else 'NOT met'})")
    write_json(args.output_json, {"model": config.model.path, "vocab_size": config.model.vocab_size,
                                  "input_len": args.input_len, "output_len": args.output_len, "results": results})
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("structured", help="cost of JSON-schema constrained decoding (batch 1 and 32)")
    p.add_argument("--backends", default="guidance", help="comma-separated: guidance, xgrammar")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-requests", type=int, default=4, help="requests run one at a time for batch 1")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of each side; the best counts")
    p.add_argument("--micro", default=None, metavar="VOCABS",
                   help="instead: compare the backends' compile and mask times on tokenizers of these sizes "
                        "(comma-separated, e.g. 8192,32000)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0, help="workload seed")
    add_engine_args(p)
    p.set_defaults(func=run)
