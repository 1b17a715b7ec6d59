"""``pagoda bench stress MODE``: the command. The modes run in ``stress`` (streams, storm,
overload, soak, hog; the flags and the report), ``stress_auth`` (wrong-key),
``stress_constraints`` (constraints, built on ``stress``) and ``stress_guess`` (guess); only this
module imports them all."""
from __future__ import annotations

import argparse
import asyncio
from typing import Any, Awaitable, Callable

from pagoda.bench import stress, stress_auth
from pagoda.bench.serve import normalize_base_url, raise_open_file_limit
from pagoda.bench.stress_constraints import run_constraints
from pagoda.bench.stress_guess import report_guess, run_guess


def add_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``stress`` under the ``pagoda bench`` subcommands."""
    p = stress.add_parser(bench_subparsers)
    p.set_defaults(func=run_stress)
    return p


def run_stress(args: argparse.Namespace) -> int:
    for key, value in stress.MODE_DEFAULTS[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    raise_open_file_limit()
    base = normalize_base_url(args.base_url)
    target = stress.fetch_target(base, args.model, args.api_key)
    watch = stress.ServerWatch(base, args.server_pid)
    if args.mode == "wrong-key":
        return stress.report_wrong_key(args, stress_auth.run_wrong_key(args, base, target.model, watch))
    if args.mode == "guess":
        return report_guess(args, run_guess(args, target))
    runners: dict[str, Callable[..., Awaitable[dict[str, Any]]]] = {
        "soak": stress.run_soak, "hog": stress.run_hog, "constraints": run_constraints}
    runner = runners.get(args.mode, stress.run_burst)
    result = asyncio.run(runner(args, target, watch))
    return stress.report(args, result)
