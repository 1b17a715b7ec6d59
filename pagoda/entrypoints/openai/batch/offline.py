"""``pagoda run-batch -i in.jsonl -o out.jsonl``: a Batch API input file run offline, with no
HTTP server, through the same routes ``pagoda serve`` answers with (in process).

Every input line gives one output line in OpenAI's result shape, in input order; a line that
cannot be read, or whose ``url`` is not one of the batch endpoints, gets a result whose
``error`` says why. The engine runs as many lines at once as it has sequence slots.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from pagoda.config import EngineArgs
from pagoda.engine.async_engine import DEFAULT_STALL_TIMEOUT_S
from pagoda.entrypoints.openai.batch.protocol import BATCH_ENDPOINTS
from pagoda.entrypoints.openai.batch.runner import batch_priority, call_app, line_body, line_error, result_line
from pagoda.entrypoints.openai.batch.service import parse_line


def add_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser("run-batch", help="run a Batch API JSONL file offline",
                                   description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-i", "--input-file", required=True, help="the JSONL of batch lines ('-': standard input)")
    parser.add_argument("-o", "--output-file", required=True, help="where the result lines go ('-': standard output)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name the lines' model field uses (default: --model as given, or pagoda-demo)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=main, max_queued_requests=None, engine_stall_timeout=DEFAULT_STALL_TIMEOUT_S)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = sys.stdin if args.input_file == "-" else open(args.input_file, encoding="utf-8")
    with source:
        lines = [text for text in source if text.strip()]
    results = asyncio.run(_run(args, lines))
    if results is None:
        return 1
    out = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
    with out:
        for result in results:
            out.write(json.dumps(result) + "\n")
    failed = sum(1 for r in results if r["response"] is None or r["response"]["status_code"] != 200)
    print(f"pagoda run-batch: {len(results) - failed} of {len(results)} lines succeeded", file=sys.stderr)
    return 0


async def _run(args: argparse.Namespace, lines: list[str]) -> list[dict[str, Any]] | None:
    from pagoda.entrypoints.openai.server import DEMO_MODEL_NAME, APIServer, _start_engine, build_app

    engine = await _start_engine(args)
    if engine is None:
        return None
    try:
        api = APIServer(engine, args.served_model_name or args.model or DEMO_MODEL_NAME, None)
        app = build_app(api)
        slots = asyncio.Semaphore(engine.config.scheduler.max_num_seqs)
        never = asyncio.Event()
        priority = batch_priority(engine.config.scheduler.policy)

        async def one(index: int, text: str) -> dict[str, Any]:
            line, error = parse_line(index, text)
            if line is None:
                return result_line(f"line-{index + 1}", None, {"code": error.code, "message": error.message})
            if line.method != "POST" or line.url not in BATCH_ENDPOINTS:
                return result_line(line.custom_id, line_error(
                    400, f"{line.method} {line.url} is not a batch endpoint; lines POST to "
                         f"{', '.join(BATCH_ENDPOINTS)}", "url", "invalid_url"))
            if line.body.get("stream"):
                return result_line(line.custom_id, line_error(400, "stream is not supported in a batch line",
                                                              "stream"))
            async with slots:
                response = await call_app(app, line.url, line_body(line.body, priority), [], {}, never)
                return result_line(line.custom_id, response)

        return list(await asyncio.gather(*(one(i, text) for i, text in enumerate(lines))))
    finally:
        await engine.shutdown()
