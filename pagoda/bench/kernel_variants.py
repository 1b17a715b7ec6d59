"""``pagoda bench kernel-variants``: the paged decode-attention kernel and the elementwise ops
under every compiled instruction-set variant this CPU runs (scalar, avx2, avx512), in one process
and one run, with each variant's time as a ratio to the scalar one.

All variants are loaded side by side (``pagoda.kernels.build.library``) and called on the same
tensors; rounds alternate the variants so drift in a shared machine's speed hits them alike.
Prints the median time per call of each and the speed-up over scalar (and avx2 over avx512).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

from pagoda.bench.common import print_table, seconds_per_call, write_json


def _variants() -> dict[str, Any]:
    from pagoda.kernels import build, select

    libs = {v: build.library(v) for v in select.supported_variants()}
    missing = [v for v, lib in libs.items() if lib is None]
    if missing:
        raise SystemExit(f"kernel libraries missing: {missing}")
    return libs


def _attention_cases(batch: int, context: int) -> dict[str, Callable[[Any], None]]:
    """Decode attention of ``batch`` sequences of ``context`` tokens, 14 query heads over 2 K/V
    heads (a 0.5B model's shape) at head sizes 64, 128 and 256, float32 / bfloat16 / float16 / int8
    caches, and float32 with the scores soft-capped at 50 (Gemma 2's cap)."""
    import torch

    from pagoda.layers.attention import kv_quant

    cases: dict[str, Callable[[Any], None]] = {}
    heads, kv_heads, page = 14, 2, 16
    for dim in (64, 128, 256):
        gen = torch.Generator().manual_seed(dim)
        blocks = batch * -(-context // page)
        k = torch.randn(blocks, page, kv_heads, dim, generator=gen)
        v = torch.randn(blocks, page, kv_heads, dim, generator=gen)
        tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(batch, -1)
        lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, heads, dim, generator=gen)
        none = torch.empty(0, dtype=torch.bfloat16)
        (k8, ks), (v8, vs) = kv_quant.quantize(k, torch.int8), kv_quant.quantize(v, torch.int8)
        caches = {"fp32": (k, v, none, none), "bf16": (k.bfloat16(), v.bfloat16(), none, none),
                  "fp16": (k.half(), v.half(), none, none), "int8": (k8, v8, ks, vs)}
        runs = [(name, *cache, 0.0) for name, cache in caches.items()] + [("fp32 softcap", k, v, none, none, 50.0)]
        for name, kc, vc, ksc, vsc, cap in runs:
            def call(lib, kc=kc, vc=vc, ksc=ksc, vsc=vsc, cap=cap, q=q, tables=tables, lens=lens, dim=dim):
                out = torch.empty_like(q)
                lib.paged_decode(out, q, kc, vc, tables, lens, dim ** -0.5, 0, ksc, vsc, cap)
            cases[f"attention {name} D={dim}"] = call
    return cases


def _fused_cases(tokens: int, hidden: int) -> dict[str, Callable[[Any], None]]:
    """RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary and the greedy argmax over
    ``tokens`` rows of ``hidden`` (SiLU: 4x hidden; rotary: hidden/64 heads of 64; argmax:
    32000 logits a row), float32 and bfloat16."""
    import torch

    cases: dict[str, Callable[[Any], None]] = {}
    gen = torch.Generator().manual_seed(0)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    ang = torch.arange(4096).float()[:, None] * inv[None]
    rope = torch.cat([ang.cos(), ang.sin()], dim=-1)
    pos = torch.randint(0, 4096, (tokens,), generator=gen)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        r = torch.randn(tokens, hidden, generator=gen).to(dtype)
        w = torch.rand(hidden, generator=gen).to(dtype)
        gu = torch.randn(tokens, 8 * hidden, generator=gen).to(dtype)
        q = torch.randn(tokens, hidden // 64, 64, generator=gen).to(dtype)
        logits = torch.randn(tokens, 32000, generator=gen).to(dtype)
        rows = list(range(tokens))
        cases[f"rms_norm {name}"] = lambda lib, x=x, w=w: lib.rms_norm(x, w, 1e-6)
        cases[f"add_rms_norm {name}"] = lambda lib, x=x, r=r, w=w: lib.add_rms_norm(x, r, w, 1e-6)
        cases[f"silu_and_mul {name}"] = lambda lib, gu=gu: lib.silu_and_mul(gu)
        cases[f"rotate {name}"] = lambda lib, q=q: lib.rotate(q, pos, rope)
        cases[f"greedy argmax {name}"] = lambda lib, lg=logits, rows=rows: lib.greedy_tokens(lg, rows)
    return cases


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    libs = _variants()
    cases: dict[str, Callable[[Any], None]] = {}
    if "attention" in args.ops:
        cases.update(_attention_cases(args.batch, args.context_len))
    if "fused" in args.ops:
        cases.update(_fused_cases(args.tokens, args.hidden))
    times: dict[str, dict[str, list[float]]] = {c: {v: [] for v in libs} for c in cases}
    for r in range(args.rounds):
        order = list(libs) if r % 2 == 0 else list(reversed(libs))
        for case, fn in cases.items():
            for v in order:
                try:
                    times[case][v].append(seconds_per_call(lambda: fn(libs[v]), args.min_time))
                except RuntimeError:  # a cache dtype this library does not take
                    times[case][v].append(float("nan"))
    names = list(libs)
    header = ("case", *[f"{v} us" for v in names], *[f"{v}/scalar" for v in names[1:]])
    if "avx2" in names and "avx512" in names:
        header += ("avx2/avx512",)
    rows, results = [header], []
    for case in cases:
        med = {v: statistics.median(times[case][v]) for v in names}
        row = [case, *[f"{med[v] * 1e6:.1f}" for v in names],
               *[f"{med['scalar'] / med[v]:.2f}x" for v in names[1:]]]
        if "avx2" in names and "avx512" in names:
            row.append(f"{med['avx512'] / med['avx2']:.2f}x")
        rows.append(tuple(row))
        results.append({"case": case, "seconds_per_call": med})
    print_table(f"kernel variants: median time per call ({args.rounds} rounds, {torch.get_num_threads()} threads; "
                f"attention batch {args.batch} x {args.context_len} tokens; elementwise {args.tokens} x {args.hidden}; "
                "ratios: speed-up, higher is faster)", rows)
    write_json(args.output_json, {"results": results, "args": {k: v for k, v in vars(args).items() if k != "func"}})
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("kernel-variants", help="attention and elementwise kernels: scalar vs avx2 vs "
                                    "avx512 variants in one run")
    p.add_argument("--ops", type=lambda s: [v.strip() for v in s.split(",")], default=["attention", "fused"],
                   help="comma-separated: attention, fused")
    p.add_argument("--batch", type=int, default=4, help="attention: sequences")
    p.add_argument("--context-len", type=int, default=1024, help="attention: cached tokens a sequence")
    p.add_argument("--tokens", type=int, default=8, help="elementwise ops: rows")
    p.add_argument("--hidden", type=int, default=896, help="elementwise ops: hidden size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-time", type=float, default=0.05, help="seconds of calls per measurement")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
