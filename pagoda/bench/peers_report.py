"""The report of ``pagoda bench peers``: each engine's row, the tables of tokens/s and of pagoda's
ratios to each peer (with several rounds, the median of the rounds' own ratios and their range),
the greedy-token check against ``transformers`` and the plot."""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from pagoda.bench.common import print_table
from pagoda.bench.extras import MissingBenchExtra, bench_import


@dataclass
class Row:
    """One engine at one precision."""

    engine: str
    precision: str
    decode_tok_s: dict[int, float] = field(default_factory=dict)
    prefill_tok_s: float | None = None
    bytes_per_token: float | None = None
    greedy: list[int] = field(default_factory=list)
    note: str = ""
    engine_overhead: float | None = None  # pagoda: share of a batch-1 step outside the model
    # the streaming-read bytes/s measured just before and just after this engine's run (the
    # higher): the roofline of the minutes the engine ran in, where the machine's bandwidth moves
    run_bandwidth: float | None = None


def roofline_tok_s(bandwidth: float, nbytes: float) -> float:
    """Batch-1 decode tokens/s if every token read ``nbytes`` at ``bandwidth`` bytes/s."""
    return bandwidth / nbytes


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _percent(x: float | None) -> str:
    return "-" if not x else f"{x * 100:.0f}%"


def share_b1(r: Row, bandwidth: float | None) -> float | None:
    """The row's batch-1 decode over the roofline at ``bandwidth`` bytes/s (None where unknown)."""
    b1 = r.decode_tok_s.get(1)
    if not (b1 and r.bytes_per_token and bandwidth):
        return None
    return b1 / roofline_tok_s(bandwidth, r.bytes_per_token)


def run_share(r: Row) -> float | None:
    """The row's batch-1 share of the roofline of its own run's bandwidth (``run_bandwidth``)."""
    return share_b1(r, r.run_bandwidth)


def report(rows: list[Row], batch_sizes: list[int], bandwidth: float,
           rounds: list[list[Row]] | None = None) -> dict[str, Any]:
    """Print the table and ratios; return the JSON payload's results. With several ``rounds``
    the rows are their medians and each ratio is the median of the rounds' own ratios (each
    round measures every engine minutes apart, not hours), with its range."""
    header = ("engine", "precision", *(f"decode b{b}" for b in batch_sizes), "prefill", "MB/token",
              "roofline b1", "share b1", "share b1 at run")
    table = [header]
    for r in rows:
        roof = roofline_tok_s(bandwidth, r.bytes_per_token) if r.bytes_per_token else None
        table.append((r.engine, r.precision, *(_fmt(r.decode_tok_s.get(b)) for b in batch_sizes),
                      _fmt(r.prefill_tok_s), _fmt(r.bytes_per_token / 1e6 if r.bytes_per_token else None),
                      _fmt(roof), _percent(share_b1(r, bandwidth)), _percent(run_share(r))))
    print_table("decode and prefill tokens/s (decode: all sequences together)", table)
    print("roofline b1 and share b1: against the best streaming read of the whole run (before and "
          "after it); share b1 at run: against the best read just before and after the engine's own run")
    several = rounds is not None and len(rounds) > 1
    ratios = _round_ratios(rounds, batch_sizes) if several else _ratios(rows, batch_sizes)
    if ratios:
        title = "pagoda / peer (same precision)" + (f", median of {len(rounds)} rounds" if several else "")
        print_table(title, [("peer", "precision", *(f"decode b{b}" for b in batch_sizes), "prefill")] + [
            (x["peer"], x["precision"], *(_fmt(x["decode"].get(b), ".2f") + "x" for b in batch_sizes),
             _fmt(x["prefill"], ".2f") + "x") for x in ratios])
    if several:
        print_table("the rounds' ratios, lowest - highest", [("peer", "precision", *(f"decode b{b}" for b in batch_sizes),
                                                              "prefill")] + [
            (x["peer"], x["precision"], *(_span([d.get(b) for d in x["rounds"]["decode"]]) for b in batch_sizes),
             _span(x["rounds"]["prefill"])) for x in ratios])
    for r in rows:
        if r.engine_overhead is not None:
            print(f"pagoda {r.precision}: engine work outside the model is {r.engine_overhead * 100:.1f}% "
                  f"of a batch-1 decode step (bar: at most 5%)")
        if r.note:
            print(f"{r.engine} * {r.precision}: {r.note}")
    return {"rows": [dataclasses.asdict(r) | {
        "roofline_b1_tok_s": roofline_tok_s(bandwidth, r.bytes_per_token) if r.bytes_per_token else None,
        "share_b1_at_run": run_share(r)} for r in rows], "ratios": ratios}


def _round_ratios(rounds: list[list[Row]], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """Each (peer, precision)'s ratios in every round, and their medians."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rows in rounds:
        for x in _ratios(rows, batch_sizes):
            groups.setdefault((x["peer"], x["precision"]), []).append(x)
    out = []
    for (peer, precision), xs in groups.items():
        decode = {b: statistics.median(x["decode"][b] for x in xs if b in x["decode"])
                  for b in batch_sizes if any(b in x["decode"] for x in xs)}
        prefills = [x["prefill"] for x in xs if x["prefill"] is not None]
        out.append({"peer": peer, "precision": precision, "decode": decode,
                    "prefill": statistics.median(prefills) if prefills else None,
                    "rounds": {"decode": [x["decode"] for x in xs], "prefill": [x["prefill"] for x in xs]}})
    return out


def _span(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    return f"{min(got):.2f}-{max(got):.2f}x" if got else "-"


def _ratios(rows: list[Row], batch_sizes: list[int]) -> list[dict[str, Any]]:
    out = []
    for mine in (r for r in rows if r.engine == "pagoda"):
        for peer in (r for r in rows if r.engine != "pagoda" and r.precision == mine.precision):
            out.append({"peer": peer.engine + (" *" if peer.note else ""),
                        "precision": mine.precision,
                        "decode": {b: mine.decode_tok_s[b] / peer.decode_tok_s[b] for b in batch_sizes
                                   if b in mine.decode_tok_s and peer.decode_tok_s.get(b)},
                        "prefill": (mine.prefill_tok_s / peer.prefill_tok_s
                                    if mine.prefill_tok_s and peer.prefill_tok_s else None)})
    return out


def check_greedy(rows: list[Row]) -> list[str]:
    """Engines whose batch-1 greedy tokens differ from Hugging Face's at the same precision
    (fp32 only: lower precisions legitimately diverge)."""
    ref = {r.precision: r.greedy for r in rows if r.engine == "hf" and r.greedy}
    bad = []
    for r in rows:
        if r.engine != "hf" and r.precision == "fp32" and r.greedy and r.precision in ref:
            match = _common_prefix(r.greedy, ref[r.precision])
            status = "same" if match == len(ref[r.precision]) else f"first {match} of {len(ref[r.precision])} same"
            print(f"greedy tokens, {r.engine} {r.precision} vs transformers: {status}")
            if status != "same":
                bad.append(r.engine)
    return bad


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def plot(rows: list[Row], batch_sizes: list[int], path: str) -> None:
    try:
        matplotlib = bench_import("matplotlib")
        matplotlib.use("Agg")
        plt = bench_import("matplotlib.pyplot")
    except MissingBenchExtra as exc:
        print(f"no plot: {exc}")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        xs = [b for b in batch_sizes if b in r.decode_tok_s]
        ax.plot(xs, [r.decode_tok_s[b] for b in xs], marker="o", label=f"{r.engine} {r.precision}",
                linestyle="-" if r.engine == "pagoda" else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def merge_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per (engine, precision): the median of its rounds' figures (the first round's
    tokens and note). With one round, that round's rows."""
    if len(rounds) == 1:
        return rounds[0]
    merged: dict[tuple[str, str], list[Row]] = {}
    for rows in rounds:
        for r in rows:
            merged.setdefault((r.engine, r.precision), []).append(r)
    out = []
    for group in merged.values():
        first = group[0]
        row = dataclasses.replace(first, decode_tok_s={
            b: statistics.median(g.decode_tok_s[b] for g in group if b in g.decode_tok_s) for b in first.decode_tok_s})
        prefills = [g.prefill_tok_s for g in group if g.prefill_tok_s]
        row.prefill_tok_s = statistics.median(prefills) if prefills else None
        overheads = [g.engine_overhead for g in group if g.engine_overhead is not None]
        row.engine_overhead = statistics.median(overheads) if overheads else None
        bandwidths = [g.run_bandwidth for g in group if g.run_bandwidth]
        row.run_bandwidth = statistics.median(bandwidths) if bandwidths else None
        out.append(row)
    return out
