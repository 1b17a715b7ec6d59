"""``pagoda bench guidellm``: run the guidellm load generator in its default streaming mode
against a running server and count its failed requests.

guidellm streams chat completions with ``stream_options: {"include_usage": true,
"continuous_usage_stats": true}`` and ``ignore_eos``, and reads the usage of every chunk. It is
not a dependency of pagoda (its requirements pin other versions of packages pagoda's
environment holds), so the command runs the ``guidellm`` executable it is given, e.g. one
installed in a virtual environment of its own:

    python -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm
    pagoda serve &
    pagoda bench guidellm --guidellm /tmp/guidellm-venv/bin/guidellm --requests 20

Exits non-zero when any request errored or was left incomplete, or guidellm itself failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pagoda.bench.common import print_table, write_json
from pagoda.bench.serve import DEFAULT_BASE_URL, normalize_base_url


def add_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``guidellm`` under the ``pagoda bench`` subcommands."""
    p = bench_subparsers.add_parser("guidellm", help="guidellm's streaming benchmark against a running server",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for guidellm's synthetic prompts (default: the built-in model's)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--profile", default="kind=synchronous",
                   help="guidellm's --profile, e.g. kind=synchronous or kind=concurrent,streams=8")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole run may take")
    p.add_argument("--out", default=None, help="write the counts as JSON here")
    p.set_defaults(func=run_guidellm_bench)
    return p


def guidellm_command(args: argparse.Namespace, tokenizer: str, report: Path) -> list[str]:
    """guidellm 0.8's command line for ``args`` (streaming is its default)."""
    return [args.guidellm, "run",
            "--backend", f"kind=openai_http,target={normalize_base_url(args.base_url)}",
            "--profile", args.profile,
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]


def request_counts(report: dict[str, Any]) -> dict[str, int]:
    """successful / errored / incomplete / total requests over the report's benchmarks."""
    counts = {"successful": 0, "errored": 0, "incomplete": 0, "total": 0}
    for bench in report.get("benchmarks", []):
        made = bench.get("scheduler_metrics", {}).get("requests_made", {})
        for key in counts:
            counts[key] += int(made.get(key, 0))
    return counts


def run_guidellm_bench(args: argparse.Namespace) -> int:
    if args.tokenizer is None:
        from pagoda.tools.make_model import default_model_path

        args.tokenizer = str(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "guidellm.json"
        cmd = guidellm_command(args, args.tokenizer, report_path)
        print(" ".join(cmd))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})  # the tokenizer is local
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"pagoda bench guidellm: error: {exc}")
            return 1
        if done.returncode != 0 or not report_path.is_file():
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
            print(f"pagoda bench guidellm: error: guidellm exited with {done.returncode}")
            return 1
        counts = request_counts(json.loads(report_path.read_text()))
    print_table("guidellm streaming requests", [("successful", "errored", "incomplete", "total"),
                                                tuple(str(counts[k]) for k in ("successful", "errored",
                                                                                "incomplete", "total"))])
    write_json(args.out, {"command": cmd, "counts": counts})
    return 0 if counts["total"] > 0 and counts["errored"] == 0 and counts["incomplete"] == 0 else 1
