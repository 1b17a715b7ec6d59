"""``pagoda bench priority``: a priority-0 request's time to first token on an idle server, and
under a saturating low-priority load (more streams of ``BATCH_PRIORITY`` than the batch holds,
so some always wait), through a real ``pagoda serve --scheduling-policy priority``.

Each probe is a fresh prompt (no prefix-cache hit) with ``max_tokens: 1``, sent alone; its TTFT is
the time to its full response. With ``--control``, probes at the load's own priority show what
the same request waits without priority (they queue behind the load; bounded by
``--control-timeout``). The bar of issue 40: loaded TTFT <= 2x idle (medians).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from pagoda.bench.common import print_table, write_json
from pagoda.bench.extras import lazy_import
from pagoda.bench.frontend import SERVED_NAME, Server
from pagoda.config import EngineArgs, EngineConfig
from pagoda.scheduler.priority import BATCH_PRIORITY

# bench extra, imported on first use (pagoda.bench.extras)
httpx = lazy_import("httpx")

BAR = 2.0  # loaded / idle median TTFT


def add_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("priority", help="priority-0 TTFT under a saturating low-priority load vs idle",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probes", type=int, default=8, help="priority-0 probes, idle and under load each")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens of every prompt")
    p.add_argument("--load-streams", type=int, default=0,
                   help="low-priority requests kept in flight (default: 3 x max_num_seqs)")
    p.add_argument("--load-tokens", type=int, default=256, help="max_tokens of each low-priority request")
    p.add_argument("--control", type=int, default=1, help="probes at the load's priority (0: none)")
    p.add_argument("--control-timeout", type=float, default=10.0, help="seconds a control probe may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--server-log", default=None, help="write the server's output here (default: a temp file)")
    EngineArgs.add_cli_args(p, skip=("seed", "scheduling_policy"))
    p.set_defaults(func=run_priority, max_num_seqs=8)
    return p


def _server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--scheduling-policy", "priority"]
    for name in ("max_num_seqs", "kv_cache_memory", "max_model_len", "device", "dtype", "max_num_batched_tokens"):
        value = getattr(args, name, None)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


class Prompts:
    """Fresh random prompts of one length (a new one never hits the prefix cache)."""

    def __init__(self, length: int, vocab: int, seed: int) -> None:
        self.rng, self.length, self.vocab = random.Random(seed), length, vocab

    def next(self) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(self.length)]


async def probe(client: httpx.AsyncClient, url: str, prompt: list[int], priority: int, timeout: float) -> float:
    """Seconds from send to the response of a one-token request (its TTFT); inf on a timeout."""
    start = time.perf_counter()
    try:
        r = await client.post(url, json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1,
                                         "ignore_eos": True, "priority": priority}, timeout=timeout)
    except httpx.TimeoutException:
        return float("inf")
    r.raise_for_status()
    return time.perf_counter() - start


async def _load_worker(client: httpx.AsyncClient, url: str, prompts: Prompts, tokens: int, stop: asyncio.Event,
                       done: list[int]) -> None:
    while not stop.is_set():
        r = await client.post(url, json={"model": SERVED_NAME, "prompt": prompts.next(), "max_tokens": tokens,
                                         "ignore_eos": True, "priority": BATCH_PRIORITY}, timeout=600)
        r.raise_for_status()
        done[0] += 1


async def _waiting(client: httpx.AsyncClient, base: str) -> float:
    text = (await client.get(base + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("pagoda:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def measure(base: str, args: argparse.Namespace, vocab: int, max_num_seqs: int) -> dict[str, Any]:
    url = base + "/v1/completions"
    prompts = Prompts(args.prompt_len, vocab, args.seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        idle = [await probe(client, url, prompts.next(), 0, 120) for _ in range(args.probes)]
        streams = args.load_streams or 3 * max_num_seqs
        stop, done = asyncio.Event(), [0]
        workers = [asyncio.create_task(_load_worker(client, url, prompts, args.load_tokens, stop, done))
                   for _ in range(streams)]
        try:
            deadline = time.monotonic() + 60
            while await _waiting(client, base) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # saturated: the batch is full and requests wait
            waiting = await _waiting(client, base)
            loaded = []
            for _ in range(args.probes):
                loaded.append(await probe(client, url, prompts.next(), 0, 120))
                await asyncio.sleep(0.1)
            control = [await probe(client, url, prompts.next(), BATCH_PRIORITY, args.control_timeout)
                       for _ in range(args.control)]
        finally:
            stop.set()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    return {"idle_s": idle, "loaded_s": loaded, "control_s": control, "load_streams": streams,
            "waiting_at_start": waiting, "load_requests_done": done[0]}


def _ms(seconds: float, timeout: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds != float("inf") else f"> {timeout * 1e3:.0f} (timed out)"


def run_priority(args: argparse.Namespace) -> int:
    config = EngineConfig.from_args(EngineArgs.from_namespace(args).replace(scheduling_policy="priority"))
    model, vocab = config.model.path, config.model.vocab_size
    start = time.monotonic()
    with Server(model, _server_flags(args), args.server_log) as server:
        result = asyncio.run(measure(server.base, args, vocab, config.scheduler.max_num_seqs))
    idle, loaded = statistics.median(result["idle_s"]), statistics.median(result["loaded_s"])
    ratio = loaded / idle
    control = statistics.median(result["control_s"]) if result["control_s"] else None
    rows = [("", "median TTFT ms", "max ms"),
            ("idle, priority 0", f"{idle * 1e3:.1f}", f"{max(result['idle_s']) * 1e3:.1f}"),
            (f"loaded, priority 0 ({result['load_streams']} streams of priority {BATCH_PRIORITY})",
             f"{loaded * 1e3:.1f}", f"{max(result['loaded_s']) * 1e3:.1f}")]
    if control is not None:
        rows.append((f"loaded, priority {BATCH_PRIORITY} (control)", _ms(control, args.control_timeout),
                     _ms(max(result["control_s"]), args.control_timeout)))
    print_table(f"priority-0 TTFT, max_num_seqs {config.scheduler.max_num_seqs}, {args.prompt_len}-token prompts",
                rows)
    verdict = "met" if ratio <= BAR else "NOT met"
    print(f"\nloaded / idle = {ratio:.2f}x (bar <= {BAR:g}x: {verdict}); {result['waiting_at_start']:.0f} requests "
          f"were waiting when the probes began; the load finished {result['load_requests_done']} requests; "
          f"{time.monotonic() - start:.0f} s in all")
    finite = control if control is not None and control != float("inf") else None
    result["control_s"] = [c if c != float("inf") else None for c in result["control_s"]]  # JSON has no inf
    write_json(args.output_json, {"bench": "priority", **result, "idle_median_s": idle, "loaded_median_s": loaded,
                                  "control_median_s": finite, "control_timeout_s": args.control_timeout,
                                  "ratio": ratio, "bar": BAR})
    return 0
