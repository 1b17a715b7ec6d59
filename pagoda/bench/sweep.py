"""``pagoda bench sweep``: the serve benchmark at several request rates.

Every rate replays the same seeded workload against the same server, so the
runs differ only in load; the plot shows where throughput stops growing and
tail latency starts to climb.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from datetime import datetime, timezone
from typing import Any, Sequence

from pagoda.bench.extras import bench_import
from pagoda.bench.serve import add_serve_args, run_serve_bench


def parse_rates(spec: str) -> list[float]:
    """``"1,2,4,inf"`` -> ``[1.0, 2.0, 4.0, inf]``."""
    rates = [float(x) for x in spec.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"bad rate list {spec!r}: need positive rates")
    return rates


def add_sweep_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``sweep`` under the ``pagoda bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "sweep", help="run the serve benchmark at several request rates",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(p)
    p.add_argument("--request-rates", type=parse_rates, default=parse_rates("1,2,4,inf"),
                   help="comma-separated rates, e.g. 1,2,4,inf (replaces --request-rate)")
    p.add_argument("--output-json", default="sweep.json", help="all runs, one JSON file")
    p.add_argument("--plot", default="sweep.png", metavar="PATH.png",
                   help="throughput vs p99 TTFT / p99 ITL")
    p.set_defaults(func=sweep_main)
    return p


def sweep_main(args: argparse.Namespace) -> int:
    run_sweep(args)
    return 0


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Run every rate in ``args.request_rates``; write the JSON and plot."""
    runs = []
    for rate in args.request_rates:
        run_args = copy.copy(args)
        run_args.request_rate = rate
        run_args.output_json = None  # per-run files would just duplicate the sweep JSON
        run_args.plot = None
        print(f"\n### request rate {_label(rate)} req/s")
        runs.append(run_serve_bench(run_args))
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "request_rates": [_label(r) for r in args.request_rates], "runs": runs}
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        plot_sweep(runs, args.plot)
    return out


def _label(rate: float | str) -> str:
    if isinstance(rate, str):
        return rate
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_sweep(runs: Sequence[dict[str, Any]], path: str) -> None:
    """Two panels: output throughput against p99 TTFT and against p99 ITL."""
    matplotlib = bench_import("matplotlib")
    matplotlib.use("Agg")  # headless: benchmarks run on servers
    plt = bench_import("matplotlib.pyplot")

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, name in ((axes[0], "p99_ttft_ms", "p99 TTFT (ms)"),
                          (axes[1], "p99_itl_ms", "p99 ITL (ms)")):
        xs = [r[key] for r in runs]
        ys = [r["output_throughput"] for r in runs]
        ax.plot(xs, ys, marker="o")
        for x, y, r in zip(xs, ys, runs):
            ax.annotate(f"{_label(r['config']['request_rate'])} req/s", (x, y),
                        textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel(name)
        ax.set_ylabel("output throughput (tok/s)")
        ax.grid(alpha=0.3)
    model = runs[0]["config"]["model"] if runs else ""
    fig.suptitle(f"pagoda bench sweep: {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
