"""``pagoda bench gpu attention``: the Triton paged-attention backend beside the torch backend.

    pagoda bench gpu attention [--decode-seqs 64] [--decode-context 2047]
                               [--prefill-seqs 4] [--prefill-len 1024] [--iters 20]

Two steps on random paged caches (bf16, 32 query heads over 8 KV heads of 128, pages of 16
tokens, blocks scattered at random): a decode step (``--decode-seqs`` sequences, one new token
after ``--decode-context`` cached ones) and a prefill step (``--prefill-seqs`` fresh prompts of
``--prefill-len`` tokens). Each backend runs the whole ``forward`` (cache write included); the
table gives milliseconds per call, the torch / Triton ratio, the K/V bytes the Triton call reads
per second, and the largest difference between the two outputs (the same attention).

A third table times MLA decode (DeepSeek-V3's 128 heads over a 512 + 64 latent row, the same
sequences and context) on the latent kernel at each head/token tile and on the generic decode
kernel reading the cache as both K and V. The prefill step is also timed on the Triton kernel
alone and on torch's flash varlen kernel (where this torch has it), with the kernel the
backend's measured choice took (``prefill_choice.py``).
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
    from pagoda.layers.attention.triton_backend import TritonAttentionBackend

    cases = {
        "decode": ([1] * decode_seqs, [decode_context] * decode_seqs),
        "prefill": ([prefill_len] * prefill_seqs, [0] * prefill_seqs),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, (query_lens, context_lens) in cases.items():
        step, kv_bytes = paged_step(query_lens, context_lens, torch.bfloat16, device or gpu.DEVICE, seed)
        triton, reference = TritonAttentionBackend(), TorchAttentionBackend()  # one each: the prefill choice stays
        triton_out = triton.forward(*step)
        torch_out = reference.forward(*step)
        diff = (triton_out.float() - torch_out.float()).abs().max().item()
        triton_ms = time_ms(lambda: triton.forward(*step), iters)
        torch_ms = time_ms(lambda: reference.forward(*step), iters)
        results[name] = {"triton_ms": triton_ms, "torch_ms": torch_ms, "ratio": torch_ms / triton_ms,
                         "triton_kv_bytes_per_s": kv_bytes / (triton_ms / 1e3), "max_abs_diff": diff}
        if name == "prefill":
            results[name].update(prefill_kernels(step, iters))
            results[name]["chosen"] = sorted(set(triton.prefill_choice.winners.values())) or ["triton"]
    return results


def prefill_kernels(step: tuple, iters: int) -> dict[str, Any]:
    """The prefill step on the Triton kernel alone and on torch's flash varlen kernel where it
    applies (``prefill_choice.py``): milliseconds of each and flash / Triton (1 or more: Triton
    at flash speed)."""
    from pagoda.layers.attention import prefill_choice, triton_kernels

    q, k, v, k_cache, v_cache, meta, scale = step
    out: dict[str, Any] = {"kernel_triton_ms": time_ms(
        lambda: triton_kernels.paged_prefill_attention(q, k_cache, v_cache, meta, scale), iters)}
    if prefill_choice.flash_applies(q, k, scale, None, None, None, None, None, meta):
        out["kernel_flash_ms"] = time_ms(lambda: prefill_choice.flash_prefill(q, k, v, meta, scale, None), iters)
        out["flash_over_triton"] = out["kernel_flash_ms"] / out["kernel_triton_ms"]
    return out


# DeepSeek-V3's latent attention: 128 query heads over one cache row of kv_lora_rank + rope dims.
MLA_HEADS, MLA_VALUE_DIM, MLA_ROPE_DIM = 128, 512, 64
# (heads, tokens) a program: the sweep, the engine's own tile first (``triton_mla``'s choice for
# 128 heads), so that a stage stopped by its allotment (compiling each tile takes seconds on a
# card) has measured and checked it.
MLA_TILES = ((32, 32), (16, 32), (16, 64), (32, 64))


def measure_mla_decode(seqs: int, context: int, iters: int, seed: int = 0, device: str | None = None,
                       heads: int = MLA_HEADS, value_dim: int = MLA_VALUE_DIM, rope_dim: int = MLA_ROPE_DIM,
                       tiles: tuple[tuple[int, int], ...] = MLA_TILES,
                       into: dict[str, Any] | None = None) -> dict[str, Any]:
    """One MLA decode step (``seqs`` sequences, one new token after ``context`` cached ones, bf16)
    on the latent kernel at each ``tiles`` setting and on the generic decode kernel with K = V =
    the cache (the path before the latent kernel): milliseconds of each, the best tile, the ratio
    generic / best, the latent bytes per second the best reads, and the largest difference from
    float32 of the first tile's output (``diff_tile``). Written into ``into`` (returned) as each
    is measured, so a caller stopped part-way keeps what was done."""
    from pagoda.layers.attention import triton_kernels, triton_mla

    result: dict[str, Any] = into if into is not None else {}
    device = device or gpu.DEVICE
    gen = torch.Generator().manual_seed(seed)
    dim = value_dim + rope_dim
    blocks = seqs * math.ceil((context + 1) / PAGE)
    table = torch.randperm(blocks, generator=gen).to(torch.int32).reshape(seqs, -1).to(device)
    cache = torch.randn(blocks, PAGE, 1, dim, generator=gen).to(device=device, dtype=torch.bfloat16)
    q = torch.randn(seqs, heads, dim, generator=gen).to(device=device, dtype=torch.bfloat16)
    lens = torch.full((seqs,), context + 1, dtype=torch.int32, device=device)
    scale = dim ** -0.5

    def latent(tile: tuple[int, int]) -> torch.Tensor:
        return triton_mla.paged_mla_decode_attention(q, cache, table, lens, scale, value_dim, max_seq_len=context + 1,
                                                     block_h=tile[0], block_n=tile[1])

    def generic() -> torch.Tensor:
        return triton_kernels.paged_decode_attention(q, cache, cache, table, lens, scale,
                                                     max_seq_len=context + 1)[..., :value_dim]

    latent_bytes = seqs * (context + 1) * dim * cache.element_size()
    tile_ms: dict[str, float] = result.setdefault("tile_ms", {})
    for h, n in tiles:
        name = f"{h}x{n}"
        tile_ms[name] = time_ms(lambda t=(h, n): latent(t), iters)
        if "max_abs_diff" not in result:
            got = latent((h, n)).float()
            result.update(diff_tile=name, max_abs_diff=(got - _mla_reference(q, cache, table, context + 1, scale,
                                                                               value_dim)).abs().max().item())
        best = min(tile_ms, key=tile_ms.get)
        result.update(best_tile=best, mla_ms=tile_ms[best], latent_bytes_per_s=latent_bytes / (tile_ms[best] / 1e3))
    # The generic kernel holds a whole 576-wide K and V tile per program: on an H200 that asks
    # for more shared memory than the card has, so the comparison is reported, not required.
    try:
        result["generic_ms"] = time_ms(generic, iters)
    except Exception as exc:  # noqa: BLE001 - triton's OutOfResources among others
        result["generic_error"] = f"{type(exc).__name__}: {exc}"
    else:
        result["ratio"] = result["generic_ms"] / result["mla_ms"]
    return result


def _mla_reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, length: int, scale: float,
                   value_dim: int) -> torch.Tensor:
    """Float32 attention of every head of ``q`` ``[S, H, D]`` over each sequence's ``length``
    cached rows (K = the row, V = its first ``value_dim`` entries): ``[S, H, value_dim]``."""
    rows = cache[table.long()].flatten(1, 2)[:, :length, 0].float()  # [S, L, D]
    weights = torch.softmax(torch.einsum("shd,sld->shl", q.float(), rows) * scale, dim=-1)
    return torch.einsum("shl,sld->shd", weights, rows[..., :value_dim])


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
    pre = results["prefill"]
    if "kernel_flash_ms" in pre:
        print(f"prefill kernels alone: Triton {pre['kernel_triton_ms']:.3f} ms, flash varlen "
              f"{pre['kernel_flash_ms']:.3f} ms (flash / Triton {pre['flash_over_triton']:.2f}); the backend chose "
              f"{', '.join(pre['chosen'])}")
    else:
        print(f"prefill kernel alone: Triton {pre['kernel_triton_ms']:.3f} ms (no flash varlen kernel here)")
    mla = measure_mla_decode(args.decode_seqs, args.decode_context, args.iters, args.seed)
    print_table(f"MLA decode, bf16, {MLA_HEADS} heads over a {MLA_VALUE_DIM} + {MLA_ROPE_DIM} latent row: "
                f"{args.decode_seqs} x {args.decode_context} cached", mla_rows(mla))
    write_json(args.output_json, {"decode_seqs": args.decode_seqs, "decode_context": args.decode_context,
                                  "prefill_seqs": args.prefill_seqs, "prefill_len": args.prefill_len,
                                  "results": results, "mla_decode": mla})
    return 0


def mla_rows(mla: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("kernel", "ms", "generic / this", "latent GB/s")]
    generic = mla.get("generic_ms")
    for tile, ms in mla["tile_ms"].items():
        rows.append((f"latent, {tile} (heads x tokens){' *' if tile == mla['best_tile'] else ''}", f"{ms:.3f}",
                     f"{generic / ms:.2f}x" if generic else "-",
                     f"{mla['latent_bytes_per_s'] * mla['mla_ms'] / ms / 1e9:.0f}"))
    rows.append(("generic decode, K = V = cache", f"{generic:.3f}" if generic else mla.get("generic_error", ""),
                 "1.00x" if generic else "-", ""))
    return rows


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
