"""``pagoda bench stress wrong-key``: can clients without the API key take the server's memory
or slow the clients that have it? Meant for a server started with ``--api-key`` (given here with
``--api-key`` too); the attackers send a wrong key.

Phases of ``--phase-s`` seconds each:

  idle  small authenticated completions (``max_tokens`` 2), one after another, alone.
  slow  ``--concurrency`` connections (default 40) each declare a ``--slow-body-mib`` (30) body and
        send all of it but the last byte, then hold; a connection the server closes is opened
        again. The API process's RSS is sampled; bar: it grows less than 100 MiB.
  big   ``--big-body-clients`` (8) connections each send complete ``--big-body-mib`` (21) bodies
        in a loop while the small authenticated requests run again; bar: their p99 latency is at
        most 2x the idle p99.
  control the same big-body attackers against a minimal server of their own (a 401 from the
        headers, then close, at once every time: no wrong-key penalty) while the small requests
        run: what the attack costs a machine whose cores it shares when nothing slows it down. Then the small requests alone once more, to
        show how noisy the machine is.

All attackers share one client address, so past its burst the server's wrong-key penalty
(``--auth-failure-delay``) holds each of their 401s; run the server with
``--auth-failure-delay 0`` to measure the attack without it.

The attackers run in a child process, so the small requests' own event loop measures only the
server. Raw sockets, not an HTTP client: an attacker does not wait for an answer before sending.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from typing import Any
from urllib.parse import urlsplit

from pagoda.bench.extras import lazy_import

# bench extra, imported on first use (pagoda.bench.extras)
aiohttp = lazy_import("aiohttp")

RSS_GROWTH_BAR_MIB = 100.0
LATENCY_RATIO_BAR = 2.0
RSS_SAMPLE_S = 0.1
ATTACK_CHUNK = 64 << 10


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags only this mode reads."""
    p.add_argument("--phase-s", type=float, default=15.0, help="wrong-key: seconds of each phase")
    p.add_argument("--slow-body-mib", type=float, default=30.0, help="wrong-key: declared size of an unfinished body")
    p.add_argument("--big-body-mib", type=float, default=21.0, help="wrong-key: size of a complete body")
    p.add_argument("--big-body-clients", type=int, default=8, help="wrong-key: connections sending complete bodies")


# ---- the attackers (child process) -----------------------------------------------------------

def attack_body(size: int, model: str) -> bytes:
    """A JSON completion body of ``size`` bytes: a prompt of many token ids (costly to parse)."""
    head, tail = b'{"model": "%s", "prompt": [' % model.encode(), b'1], "max_tokens": 2}'
    ids = b"12345, " * ((size - len(head) - len(tail)) // 7)
    return head + ids + b" " * (size - len(head) - len(ids) - len(tail)) + tail


def _request_head(host: str, path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer wrong-key\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


async def _one_attacker(host: str, port: int, body: bytes, finish: bool, until: float, tally: dict[str, int]) -> None:
    """Send ``body`` (all of it, or all but its last byte and then hold) over and over until
    ``until``, on a new connection each time the server ends one."""
    head = _request_head(host, "/v1/completions", len(body))
    end = len(body) if finish else len(body) - 1
    while time.monotonic() < until:
        sent = 0
        try:
            reader, writer = await asyncio.open_connection(host, port)
            tally["connections"] += 1
            writer.write(head)
            view = memoryview(body)
            for start in range(0, end, ATTACK_CHUNK):
                if writer.transport.is_closing() or reader.at_eof() or time.monotonic() >= until:
                    break  # the server answered or closed: on to a new connection
                writer.write(view[start:min(start + ATTACK_CHUNK, end)])
                await writer.drain()
                sent = min(start + ATTACK_CHUNK, end)
            # The answer, or the server closing; an unfinished body is held open meanwhile.
            await asyncio.wait_for(reader.read(1 << 16), max(0.1, until - time.monotonic()))
            writer.close()
        except (OSError, asyncio.TimeoutError):
            pass
        tally["bytes_sent"] += sent
        tally["bodies_completed"] += sent == len(body)


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The least a server can do: a 401 once the headers are in, then close."""
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        pass
    writer.close()


def _attack_main(host: str, port: int, clients: int, body: bytes, finish: bool, seconds: float,
                 out: Any, sink: bool = False) -> None:
    async def run() -> dict[str, Any]:
        tally = {"connections": 0, "bytes_sent": 0, "bodies_completed": 0}
        target_port = port
        if sink:  # the control: the same attack on this process's own minimal server
            server = await asyncio.start_server(_sink, "127.0.0.1", 0)
            target_port = server.sockets[0].getsockname()[1]
        until = time.monotonic() + seconds
        await asyncio.gather(*(_one_attacker(host, target_port, body, finish, until, tally)
                               for _ in range(clients)))
        return tally

    out.put("ready")  # imports done: the attack starts now
    cpu = time.process_time()
    tally = asyncio.run(run())
    tally["cpu_s"] = round(time.process_time() - cpu, 2)
    out.put(tally)


class Attack:
    """Attackers in a child process for ``seconds``; ``result()`` is their tally. ``sink``: they
    attack a minimal server of their own instead (what the attack costs the machine by itself)."""

    def __init__(self, base: str, clients: int, body: bytes, finish: bool, seconds: float, sink: bool = False) -> None:
        url = urlsplit(base)
        ctx = multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        self.proc = ctx.Process(target=_attack_main, daemon=True, args=(url.hostname, url.port or 80, clients, body,
                                                                       finish, seconds, self.queue, sink))
        self.proc.start()
        if self.queue.get(timeout=120) != "ready":
            raise RuntimeError("the attacker process did not start")

    def result(self) -> dict[str, Any]:
        tally = self.queue.get(timeout=120)
        self.proc.join(30)
        return tally


# ---- the measuring side ----------------------------------------------------------------------

async def small_requests(base: str, model: str, api_key: str | None, seconds: float) -> list[float]:
    """Latencies of small authenticated completions sent one after another for ``seconds``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    out: list[float] = []
    until = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        while time.monotonic() < until or len(out) < 5:
            start = time.monotonic()
            async with session.post(base + "/v1/completions", json=body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"an authenticated small request got {resp.status}: {await resp.text()}")
            out.append(time.monotonic() - start)
    return out


async def peak_rss(watch: Any, seconds: float) -> float:
    """Highest API-process RSS (MiB) seen in ``seconds``."""
    peak = 0.0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        rss = watch.rss_mb()
        peak = max(peak, rss["api"] if rss else 0.0)
        await asyncio.sleep(RSS_SAMPLE_S)
    return peak


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def run_wrong_key(args: argparse.Namespace, base: str, model: str, watch: Any) -> dict[str, Any]:
    """The phases; returns the figures and the bars missed."""
    if watch.proc is None:
        raise SystemExit("stress wrong-key: cannot find the server process (give --server-pid)")
    idle = asyncio.run(small_requests(base, model, args.api_key, args.phase_s))
    rss_before = watch.rss_mb()["api"]
    slow = Attack(base, args.concurrency, attack_body(int(args.slow_body_mib * (1 << 20)), model), False, args.phase_s)
    rss_peak = asyncio.run(peak_rss(watch, args.phase_s))
    slow_tally = slow.result()
    big_body = attack_body(int(args.big_body_mib * (1 << 20)), model)
    attacked, big_tally = _beside(args, base, model, watch, Attack(base, args.big_body_clients, big_body, True,
                                                                   args.phase_s + 1.5))
    control, control_tally = _beside(args, base, model, watch, Attack(base, args.big_body_clients, big_body, True,
                                                                      args.phase_s + 1.5, sink=True))
    idle_after = asyncio.run(small_requests(base, model, args.api_key, args.phase_s))  # how noisy is the box
    growth = rss_peak - rss_before
    ratio = p99(attacked) / p99(idle)
    missed = []
    if growth >= RSS_GROWTH_BAR_MIB:
        missed.append(f"API RSS grew {growth:.1f} MiB under the slow bodies (bar < {RSS_GROWTH_BAR_MIB:.0f})")
    if ratio > LATENCY_RATIO_BAR:
        missed.append(f"small-request p99 {ratio:.2f}x idle under the big bodies (bar <= {LATENCY_RATIO_BAR:.0f}x)")
    return {"idle_s": _summary(idle), "attacked_s": _summary(attacked), "idle_after_s": _summary(idle_after),
            "control_s": _summary(control), "control_attack": control_tally,
            "p99_ratio": round(ratio, 3),
            "api_rss_mib": {"before": round(rss_before, 1), "peak_under_slow_bodies": round(rss_peak, 1),
                            "growth": round(growth, 1)},
            "slow_attack": slow_tally, "big_attack": big_tally, "misses": missed}


def _beside(args: argparse.Namespace, base: str, model: str, watch: Any,
            attack: Attack) -> tuple[list[float], dict[str, Any]]:
    """Small-request latencies while ``attack`` runs, and its tally (with the API's CPU time)."""
    time.sleep(0.5)  # the attackers are connected and sending
    api_cpu = _cpu_s(watch.proc)
    latencies = asyncio.run(small_requests(base, model, args.api_key, args.phase_s))
    tally = attack.result()
    tally["api_cpu_s"] = round(_cpu_s(watch.proc) - api_cpu, 2)
    return latencies, tally


def _cpu_s(proc: Any) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _summary(latencies: list[float]) -> dict[str, float]:
    return {"n": len(latencies), "median": round(statistics.median(latencies), 4), "p99": round(p99(latencies), 4),
            "max": round(max(latencies), 4)}


def report_rows(result: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, str]]:
    idle, attacked, after, rss = result["idle_s"], result["attacked_s"], result["idle_after_s"], result["api_rss_mib"]
    control = result["control_s"]
    slow, big = result["slow_attack"], result["big_attack"]
    return [
        ("figure", "value"),
        ("small request idle: n / median / p99", f"{idle['n']} / {idle['median']:.3f} s / {idle['p99']:.3f} s"),
        (f"small request beside {args.big_body_clients} wrong-key {args.big_body_mib:g} MiB bodies",
         f"{attacked['n']} / {attacked['median']:.3f} s / {attacked['p99']:.3f} s"),
        ("p99 attacked / idle", f"{result['p99_ratio']:.2f}x (bar <= {LATENCY_RATIO_BAR:.0f}x)"),
        ("control: the same attack on a minimal 401 server of its own",
         f"{control['n']} / {control['median']:.3f} s / {control['p99']:.3f} s"),
        ("small request idle again afterwards (the machine's noise)",
         f"{after['n']} / {after['median']:.3f} s / {after['p99']:.3f} s"),
        ("big-body attack: connections, bodies completed, MiB written",
         f"{big['connections']}, {big['bodies_completed']}, {big['bytes_sent'] / (1 << 20):.1f}"),
        ("big-body attack: CPU s of the API process / of the attackers",
         f"{big['api_cpu_s']:.1f} / {big['cpu_s']:.1f} (over {args.phase_s:g} s)"),
        (f"API RSS before / peak under {args.concurrency} unfinished {args.slow_body_mib:g} MiB bodies",
         f"{rss['before']:.1f} / {rss['peak_under_slow_bodies']:.1f} MiB"),
        ("API RSS growth", f"{rss['growth']:.1f} MiB (bar < {RSS_GROWTH_BAR_MIB:.0f})"),
        ("slow-body attack: connections, MiB written", f"{slow['connections']}, {slow['bytes_sent'] / (1 << 20):.1f}"),
    ]
