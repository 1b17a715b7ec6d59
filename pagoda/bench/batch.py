"""``pagoda bench batch``: what a running batch costs interactive requests.

Starts ``pagoda serve`` (or uses ``--url``), then streams the same interactive requests, one at a
time, in alternating phases, ``--rounds`` times: on an idle server, then while a Batch API batch
runs (a fresh batch each round, cancelled at the round's end). Alternating spreads the noise of
a shared machine over both sides. Last, unless ``--skip-online-phase``, once while the batch's
lines arrive as plain concurrent online requests (what a client without the Batch API sends).
It prints, per phase, the interactive TTFT and inter-token latency (median and p99) pooled over
the rounds with their ratios to the idle figures, and the median over rounds of each round's
ratio; JSON with ``--output-json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import numpy as np

from pagoda.bench.common import print_table, write_json
from pagoda.bench.extras import lazy_import
from pagoda.bench.frontend import SERVED_NAME, Server
from pagoda.bench.serve import build_payload, stream_request

# bench extra, imported on first use (pagoda.bench.extras)
aiohttp = lazy_import("aiohttp")
httpx = lazy_import("httpx")

MODEL_NAME = SERVED_NAME
PROMPT = "Write a long story about a pagoda in the mountains."
TERMINAL = {"completed", "failed", "cancelled", "expired"}


def add_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("batch", help="interactive TTFT/ITL with a Batch API batch running vs without",
                                    description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model directory for the server (default: the demo model)")
    p.add_argument("--url", default=None, help="use this running server instead of starting one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--interactive-requests", type=int, default=8, help="streamed requests per phase, one at a time")
    p.add_argument("--rounds", type=int, default=3, help="idle / batch phase pairs, alternating")
    p.add_argument("--interactive-max-tokens", type=int, default=32)
    p.add_argument("--batch-lines", type=int, default=24)
    p.add_argument("--batch-max-tokens", type=int, default=128)
    p.add_argument("--skip-online-phase", action="store_true",
                   help="do not run the phase that sends the batch's lines as plain online requests")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more flag for the started server (repeat; e.g. --serve-arg=--max-num-seqs=8)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=main)
    return p


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _interactive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Stream the interactive requests one after another; their TTFTs and ITLs in ms."""
    payload = build_payload("chat", MODEL_NAME, PROMPT, args.interactive_max_tokens)
    ttft: list[float] = []
    itl: list[float] = []
    async with aiohttp.ClientSession(headers=_headers(args.api_key)) as session:
        for _ in range(args.interactive_requests):
            res = await stream_request(session, url + "/v1/chat/completions", payload, "chat")
            if res.error:
                raise RuntimeError(f"an interactive request failed: {res.error}")
            ttft.append(res.ttft * 1e3)
            itl += [x * 1e3 for x in res.itl]
    return {"ttft_ms": ttft, "itl_ms": itl}


def _batch_lines(args: argparse.Namespace) -> list[dict[str, Any]]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.batch_max_tokens,
            "temperature": 0, "ignore_eos": True}
    return [{"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": body}
            for i in range(args.batch_lines)]


async def _with_batch(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Interactive requests while a Batch API batch runs (the batch is cancelled afterwards, and
    its cancellation waited for, so the next idle phase is idle)."""
    data = "".join(json.dumps(line) + "\n" for line in _batch_lines(args)).encode()
    async with httpx.AsyncClient(base_url=url, headers=_headers(args.api_key), timeout=60) as http:
        file = (await http.post("/v1/files", files={"file": ("bench.jsonl", data)}, data={"purpose": "batch"})).json()
        batch = (await http.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                                      "completion_window": "24h"})).json()
        while (await http.get(f"/v1/batches/{batch['id']}")).json()["request_counts"]["completed"] < 1:
            await asyncio.sleep(0.05)  # measure once the batch is producing
        figures = await _polled_interactive(url, args)
        state = (await http.get(f"/v1/batches/{batch['id']}")).json()
        await http.post(f"/v1/batches/{batch['id']}/cancel")
        while (await http.get(f"/v1/batches/{batch['id']}")).json()["status"] not in TERMINAL:
            await asyncio.sleep(0.05)
    figures["batch_status_after"] = state["status"]
    figures["batch_lines_done_after"] = state["request_counts"]["completed"]
    return figures


async def _polled_interactive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """``_interactive`` while sampling the engine's unfinished requests (``_poll_in_flight``);
    every phase is polled alike, so the polling's own cost is on both sides."""
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, headers=_headers(args.api_key), timeout=60) as http:
        poller = asyncio.create_task(_poll_in_flight(http, stop))
        try:
            figures = await _interactive(url, args)
        finally:
            stop.set()
        figures["engine_requests_samples"] = await poller
    return figures


async def _poll_in_flight(http: Any, stop: asyncio.Event) -> list[float]:
    """Samples of the engine's unfinished requests (running + waiting, from ``/metrics``) every
    0.5 s until ``stop``: above 1 while an interactive request streams, batch rows were in the
    engine beside it (paused or running)."""
    samples: list[float] = []
    while not stop.is_set():
        text = (await http.get("/metrics")).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(("pagoda:num_requests_running{", "pagoda:num_requests_waiting{")):
                total += float(line.rsplit(" ", 1)[1])
        samples.append(total)
        await asyncio.sleep(0.5)
    return samples


async def _abandoned_steps(url: str, args: argparse.Namespace) -> float | None:
    """The server's count of batch steps given up for an interactive request (``/metrics``);
    None where it has no such counter."""
    async with httpx.AsyncClient(base_url=url, headers=_headers(args.api_key), timeout=60) as http:
        for line in (await http.get("/metrics")).text.splitlines():
            if line.startswith("pagoda:background_steps_abandoned_total"):
                return float(line.rsplit(" ", 1)[1])
    return None


async def _with_online_flood(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Interactive requests while the batch's lines arrive as online requests: ``--batch-lines``
    clients, each sending the next line as soon as its last one finishes, until the
    interactive requests are done."""
    body = _batch_lines(args)[0]["body"]
    stop = asyncio.Event()
    answered: list[int] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            answered.append((await http.post("/v1/chat/completions", json=body)).status_code)

    async with httpx.AsyncClient(base_url=url, headers=_headers(args.api_key), timeout=600,
                                 limits=httpx.Limits(max_connections=args.batch_lines + 4)) as http:
        flood = [asyncio.create_task(client(http)) for _ in range(args.batch_lines)]
        await asyncio.sleep(1.0)
        figures = await _interactive(url, args)
        stop.set()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    if any(status != 200 for status in answered):
        raise RuntimeError(f"an online batch line failed: statuses {sorted(set(answered))}")
    figures["online_lines_done"] = len(answered)
    return figures


def _summary(phase: dict[str, Any]) -> dict[str, float]:
    return {"ttft_p50_ms": float(np.percentile(phase["ttft_ms"], 50)),
            "ttft_p99_ms": float(np.percentile(phase["ttft_ms"], 99)),
            "itl_p50_ms": float(np.percentile(phase["itl_ms"], 50)) if phase["itl_ms"] else float("nan"),
            "itl_p99_ms": float(np.percentile(phase["itl_ms"], 99)) if phase["itl_ms"] else float("nan")}


def _pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase's figures over every round, as one phase."""
    return {"ttft_ms": [x for r in rounds for x in r["ttft_ms"]], "itl_ms": [x for r in rounds for x in r["itl_ms"]]}


async def _run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    await _interactive(url, argparse.Namespace(**{**vars(args), "interactive_requests": 2}))  # warm up
    rounds: dict[str, list[dict[str, Any]]] = {"idle": [], "batch_api": []}
    for _ in range(args.rounds):
        rounds["idle"].append(await _polled_interactive(url, args))
        rounds["batch_api"].append(await _with_batch(url, args))
    out: dict[str, Any] = {"rounds": rounds, "background_steps_abandoned": await _abandoned_steps(url, args)}
    if not args.skip_online_phase:
        await asyncio.sleep(1.0)  # let the cancelled lines' aborts land
        out["online_flood"] = await _with_online_flood(url, args)
    return out


def _ratios(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """The median over rounds of each round's batch / idle ratio (TTFT p50, ITL p50 and p99)."""
    per = [(_summary(b), _summary(i)) for b, i in zip(rounds["batch_api"], rounds["idle"])]
    return {f"{key}_ratio_median_of_rounds": float(np.median([b[key] / i[key] for b, i in per]))
            for key in ("ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")}


def main(args: argparse.Namespace) -> int:
    if args.url is not None:
        out = asyncio.run(_run(args.url, args))
    else:
        with Server(args.model, ["--disable-log-stats", *args.serve_arg], None) as server:
            out = asyncio.run(_run(server.base, args))
    rounds = out["rounds"]
    phases = {"idle": _pooled(rounds["idle"]), "batch_api": _pooled(rounds["batch_api"])}
    if "online_flood" in out:
        phases["online_flood"] = out["online_flood"]
    summary = {name: _summary(phase) for name, phase in phases.items()}
    idle = summary["idle"]
    rows = [("phase", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ratio", "ITL p50 ratio",
             "ITL p99 ratio")]
    for name, s in summary.items():
        rows.append((name, f"{s['ttft_p50_ms']:.1f}", f"{s['ttft_p99_ms']:.1f}", f"{s['itl_p50_ms']:.1f}",
                     f"{s['itl_p99_ms']:.1f}", f"{s['ttft_p50_ms'] / idle['ttft_p50_ms']:.2f}x",
                     f"{s['itl_p50_ms'] / idle['itl_p50_ms']:.2f}x", f"{s['itl_p99_ms'] / idle['itl_p99_ms']:.2f}x"))
    print_table(f"interactive latency over {args.rounds} alternating rounds (pooled): idle, with a Batch API "
                "batch, with the same lines sent online", rows)
    ratios = _ratios(rounds)
    print("median over rounds of the per-round batch/idle ratio: "
          + ", ".join(f"{k.replace('_ratio_median_of_rounds', '')} {v:.2f}x" for k, v in ratios.items()))
    done = [r["batch_lines_done_after"] for r in rounds["batch_api"]]
    print(f"batch lines done when each round's interactive requests ended: {done} of {args.batch_lines}")
    print(f"batch steps given up for an interactive request (server total): {out['background_steps_abandoned']}")
    for name in ("idle", "batch_api"):
        in_engine = [float(np.mean(r["engine_requests_samples"])) if r["engine_requests_samples"] else float("nan")
                     for r in rounds[name]]
        print(f"mean requests in the engine during each round's {name} phase (interactive + batch lines): "
              + ", ".join(f"{x:.1f}" for x in in_engine))
    write_json(args.output_json, {"config": {k: v for k, v in vars(args).items() if k != "func"},
                                  "summary": summary, "ratios": ratios, "rounds": rounds, "phases": phases,
                                  "background_steps_abandoned": out["background_steps_abandoned"]})
    return 0
