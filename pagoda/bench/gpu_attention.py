"""``pagoda bench gpu attention``: the Triton paged-attention backend beside the torch backend.

    pagoda bench gpu attention [--decode-seqs 64] [--decode-context 2047]
                               [--prefill-seqs 4] [--prefill-len 1024] [--iters 20]

Two steps on random paged caches (bf16, 32 query heads over 8 KV heads of 128, pages of 16
tokens, blocks scattered at random): a decode step (``--decode-seqs`` sequences, one new token
after ``--decode-context`` cached ones) and a prefill step (``--prefill-seqs`` fresh prompts of
``--prefill-len`` tokens). Each backend runs the whole ``forward`` (cache write included); the
table gives milliseconds per call, the torch / Triton ratio, the K/V bytes the Triton call reads
per second, and the largest difference between the two outputs (the same attention).
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import torch

from pagoda.bench import gpu
from pagoda.bench.common import print_table, write_json
from pagoda.executor.input import build_model_input

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def paged_step(query_lens: list[int], context_lens: list[int], dtype: torch.dtype, device: str,
               seed: int = 0) -> tuple[tuple, int]:
    """The arguments of ``AttentionBackend.forward`` for one step over a random paged cache
    (each sequence's blocks scattered through it; the metadata from the engine's own input
    builder), and the K/V bytes the step's attention reads."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks = [math.ceil(n / PAGE) for n in seq_lens]
    physical = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, used = [], 0
    for n in blocks:
        tables.append(physical[used:used + n])
        used += n
    tokens = sum(query_lens)
    meta = build_model_input([0] * tokens, list(query_lens), seq_lens, tables, [], torch.device(device), PAGE).meta

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    k_cache, v_cache = randn(sum(blocks), PAGE, KV_HEADS, HEAD_DIM), randn(sum(blocks), PAGE, KV_HEADS, HEAD_DIM)
    args = (randn(tokens, HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM),
            k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    kv_bytes = 2 * sum(seq_lens) * KV_HEADS * HEAD_DIM * k_cache.element_size()
    return args, kv_bytes


def time_ms(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call after one warm-up call (the device synchronized around the loop)."""
    fn()
    gpu._sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    gpu._sync()
    return (time.perf_counter() - start) * 1e3 / iters


def measure_attention(decode_seqs: int, decode_context: int, prefill_seqs: int, prefill_len: int, iters: int,
                      seed: int = 0, device: str | None = None) -> dict[str, dict[str, float]]:
    """Per step (``decode``, ``prefill``): both backends' milliseconds per ``forward``, their
    ratio, the K/V bytes per second the Triton call reads and the outputs' largest difference."""
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend
    from pagoda.layers.attention.triton_kernels import TritonAttentionBackend

    cases = {
        "decode": ([1] * decode_seqs, [decode_context] * decode_seqs),
        "prefill": ([prefill_len] * prefill_seqs, [0] * prefill_seqs),
    }
    results: dict[str, dict[str, float]] = {}
    for name, (query_lens, context_lens) in cases.items():
        step, kv_bytes = paged_step(query_lens, context_lens, torch.bfloat16, device or gpu.DEVICE, seed)
        triton_out = TritonAttentionBackend().forward(*step)
        torch_out = TorchAttentionBackend().forward(*step)
        diff = (triton_out.float() - torch_out.float()).abs().max().item()
        triton_ms = time_ms(lambda: TritonAttentionBackend().forward(*step), iters)
        torch_ms = time_ms(lambda: TorchAttentionBackend().forward(*step), iters)
        results[name] = {"triton_ms": triton_ms, "torch_ms": torch_ms, "ratio": torch_ms / triton_ms,
                         "triton_kv_bytes_per_s": kv_bytes / (triton_ms / 1e3), "max_abs_diff": diff}
    return results


def run_attention(args: argparse.Namespace) -> int:
    results = measure_attention(args.decode_seqs, args.decode_context, args.prefill_seqs, args.prefill_len,
                                args.iters, args.seed)
    rows = [("step", "triton ms", "torch ms", "torch / triton", "triton K/V GB/s", "max |diff|")]
    for name, r in results.items():
        rows.append((name, f"{r['triton_ms']:.3f}", f"{r['torch_ms']:.3f}", f"{r['ratio']:.2f}x",
                     f"{r['triton_kv_bytes_per_s'] / 1e9:.0f}", f"{r['max_abs_diff']:.2e}"))
    print_table(f"attention backends, bf16, {HEADS} heads / {KV_HEADS} KV heads x {HEAD_DIM}, page {PAGE}: "
                f"decode {args.decode_seqs} x {args.decode_context} cached, prefill {args.prefill_seqs} x "
                f"{args.prefill_len}", rows)
    write_json(args.output_json, {"decode_seqs": args.decode_seqs, "decode_context": args.decode_context,
                                  "prefill_seqs": args.prefill_seqs, "prefill_len": args.prefill_len,
                                  "results": results})
    return 0


def add_parser(sub: argparse._SubParsersAction, guard: Callable) -> None:
    p = sub.add_parser("attention", help="Triton paged attention against the torch backend (decode, prefill)")
    p.add_argument("--decode-seqs", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=2047, help="cached tokens before each decode")
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=guard(run_attention))
