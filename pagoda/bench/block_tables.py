"""``pagoda bench block-tables``: building a decode step's inputs with the block tables copied
from their int32 mirrors (``BlockTable``, what the engine does) and, as the peer, with the
Python lists flattened as the builder did before, in one run.

    pagoda bench block-tables [--contexts 100,2000,16000] [--batches 1,32,256] [--output-json OUT]

For each context length and batch size: that many sequences of about that many tokens (each a
random 0-10% longer, so most rows are padded, as in a real batch) with random block ids; both
builders' tensors are checked equal, then each is timed in alternating rounds (so both see the
same machine state), the whole step's inputs (``build_model_input``) and the block-table rows
alone. Prints microseconds per sequence step (the median round's step time over the batch) and
the ratio new / old.
"""
from __future__ import annotations

import argparse
import array
import random
import statistics
from typing import Any, Callable

import torch

from pagoda.bench.common import print_table, seconds_per_call, write_json
from pagoda.executor.input import ModelInput, _host_tensor, build_model_input, decode_input_from, table_rows
from pagoda.kvcache.block_table import BlockTable

BLOCK_SIZE = 16


def list_flattening_decode_input(token_ids: list[int], seq_lens: list[int], block_tables: list[list[int]],
                                 logits_rows: list[int], dev: torch.device, bs: int) -> ModelInput:
    """The decode step's inputs as ``build_model_input`` built them before ``BlockTable``: every
    block id of every table flattened through a Python list each step (the peer of this
    benchmark and of the builder's tests; the engine does not use it)."""
    n = len(token_ids)
    width = max(len(t) for t in block_tables)
    ctx = [s - 1 for s in seq_lens]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, ctx)]
    starts = list(range(n + 1))
    flat = [b for t in block_tables for b in (t if len(t) == width else t + [0] * (width - len(t)))]
    longs = _host_tensor(slots + token_ids + ctx + logits_rows, torch.int64)
    ints = _host_tensor(seq_lens + ctx + starts + flat, torch.int32)
    return decode_input_from(longs, ints, seq_lens, ctx, starts, width, logits_rows, dev)


STEP_TENSORS = ("input_ids", "positions", "logits_indices", "meta.slot_mapping", "meta.query_start_loc",
                "meta.seq_lens", "meta.context_lens", "meta.block_tables")


def same_inputs(a: ModelInput, b: ModelInput) -> bool:
    """Every tensor of the two step inputs equal in dtype, shape and values (and the host lists)."""
    def get(inputs: ModelInput, name: str) -> torch.Tensor:
        obj: Any = inputs
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    tensors = all(get(a, k).dtype == get(b, k).dtype and torch.equal(get(a, k), get(b, k)) for k in STEP_TENSORS)
    ma, mb = a.meta, b.meta
    return tensors and a.logits_all_rows == b.logits_all_rows and (
        ma.seq_lens_cpu, ma.context_lens_cpu, ma.query_start_loc_cpu, ma.max_seq_len) == (
        mb.seq_lens_cpu, mb.context_lens_cpu, mb.query_start_loc_cpu, mb.max_seq_len)


def batch_tables(batch: int, context: int, rng: random.Random) -> tuple[list[int], list[list[int]]]:
    """Sequence lengths (context plus the token decoded) and random block ids covering them."""
    seq_lens = [context + rng.randrange(max(context // 10, 1)) + 1 for _ in range(batch)]
    tables = [[rng.randrange(1 << 20) for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    return seq_lens, tables


def _timed(fns: dict[str, Callable[[], Any]], rounds: int, min_s: float) -> dict[str, float]:
    """Median seconds per call of each function, over ``rounds`` alternating rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 else names[::-1]):
            times[name].append(seconds_per_call(fns[name], min_s))
    return {name: statistics.median(t) for name, t in times.items()}


def measure_cell(batch: int, context: int, rounds: int, min_s: float, seed: int) -> dict[str, Any]:
    """One grid cell: both builders checked equal, then timed (step inputs; table rows alone)."""
    rng = random.Random(seed)
    seq_lens, lists = batch_tables(batch, context, rng)
    tables = [BlockTable(t) for t in lists]
    tokens = [rng.randrange(1000) for _ in range(batch)]
    rows, cpu, width = list(range(batch)), torch.device("cpu"), max(len(t) for t in lists)

    def old() -> ModelInput:
        return list_flattening_decode_input(tokens, seq_lens, lists, rows, cpu, BLOCK_SIZE)

    def new() -> ModelInput:
        return build_model_input(tokens, [1] * batch, seq_lens, tables, rows, cpu, BLOCK_SIZE)

    def old_rows() -> array.array:
        return array.array("i", [b for t in lists for b in (t if len(t) == width else t + [0] * (width - len(t)))])

    def new_rows() -> array.array:
        return table_rows(array.array("i"), tables, width)

    same = same_inputs(old(), new()) and old_rows() == new_rows()
    step = _timed({"old": old, "new": new}, rounds, min_s)
    alone = _timed({"old": old_rows, "new": new_rows}, rounds, min_s)
    us = 1e6 / batch
    return {"context": context, "batch": batch, "blocks_per_seq": width, "same_tensors": same,
            "old_us_per_seq_step": step["old"] * us, "new_us_per_seq_step": step["new"] * us,
            "ratio": step["new"] / step["old"], "old_rows_us_per_seq": alone["old"] * us,
            "new_rows_us_per_seq": alone["new"] * us, "rows_ratio": alone["new"] / alone["old"]}


def run(args: argparse.Namespace) -> int:
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    results = [measure_cell(b, c, args.rounds, args.min_time, args.seed + i)
               for i, (c, b) in enumerate((c, b) for c in contexts for b in batches)]
    rows = [("context", "batch", "old us/seq step", "new us/seq step", "new / old",
             "rows alone: old us/seq", "new us/seq", "new / old", "same tensors")]
    rows += [(str(r["context"]), str(r["batch"]), f"{r['old_us_per_seq_step']:.2f}",
              f"{r['new_us_per_seq_step']:.2f}", f"{r['ratio']:.3f}", f"{r['old_rows_us_per_seq']:.3f}",
              f"{r['new_rows_us_per_seq']:.3f}", f"{r['rows_ratio']:.3f}", "yes" if r["same_tensors"] else "NO")
             for r in results]
    print_table(f"decode step inputs, block tables flattened from lists (old) vs copied from BlockTable "
                f"mirrors (new), median of {args.rounds} rounds", rows)
    write_json(args.output_json, {"block_size": BLOCK_SIZE, "results": results})
    return 0 if all(r["same_tensors"] for r in results) else 1


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("block-tables", help="decode-step inputs: block tables from lists vs mirrors")
    p.add_argument("--contexts", default="100,2000,16000", help="comma-separated context lengths (tokens)")
    p.add_argument("--batches", default="1,32,256", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per cell")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds each timing takes at least")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
