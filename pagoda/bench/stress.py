"""``pagoda bench stress MODE``: does one bad client, an overload or a dying connection cost
anyone else anything?

Modes, each bounded in requests and time, each with a bar it exits non-zero for missing:

  streams   K concurrent streamed completions (``ignore_eos``, fixed ``max_tokens``, greedy or
            sampled); a fraction closes the connection after a few chunks. Every other stream
            must end with its final usage chunk carrying exactly the tokens it asked for.
  storm     K streams that all hang up mid-stream (some before their first token).
  overload  N requests offered at once; each must complete with the right token count or be
            refused with 429/503. Meant for a server started with a small
            ``--max-queued-requests``.
  wrong-key clients with a wrong API key send unfinished and complete huge bodies; the API
            process's RSS and small authenticated requests' p99 must hold (``bench/stress_auth.py``).
  soak      a mixed workload for ``--duration`` seconds (streamed and plain, n=1..2, varying
            prompt lengths, disconnects, invalid bodies that must get a 4xx); server RSS is
            sampled throughout and must grow less than 5% after the first sixth (at most 5 min).
  hog       another client's small request (8 prompt tokens, ``--max-tokens`` 8) timed alone,
            then beside a hog: ``--hog-requests`` requests of ``--hog-n`` samples and
            ``--hog-max-tokens`` tokens each from one client (default one ``n: 128, max_tokens:
            500`` request; twenty streams of ``n: 8``: ``--hog-requests 20 --hog-n 8``). Bar: each
            small request beside the hog ends within ``--bar-s`` (2 s). The two clients differ in
            bearer token, ``user`` and ``X-Tenant-Id`` header, so any ``--tenant-id-source``
            tells them apart (with ``--api-key KEY`` the token is KEY for both). The hog is
            cancelled once the probes are done.
  constraints  hostile structured-output constraints from ``--concurrency`` attackers while a
            small request is timed idle and under attack (``pagoda.bench.stress_constraints``):
            every attack must end in a 4xx, the ratio of medians must stay within ``--max-ratio``.
  guess     one tenant guesses a block of another's prompt from ``cached_tokens`` and the prefix
            hit counter, ``--probes`` rounds (``pagoda.bench.stress_guess``): bar, a right guess
            answered exactly as a wrong one (meant for ``--tenant-cache-isolation``).

After the load, every mode polls ``GET /metrics`` until ``pagoda:num_requests_running``,
``pagoda:num_requests_waiting`` and ``pagoda:kv_cache_usage_perc`` are all 0, and reports how
long that took (bar: ``--settle-s``). Server RSS (API process plus its children, the engine
core among them) comes from psutil, for the process given by ``--server-pid`` or the one
listening on the URL's port. Only the public HTTP API is used.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psutil

from pagoda.bench import stress_auth
from pagoda.bench.common import FIRST_ORDINARY_ID, print_table, write_json
from pagoda.bench.datasets import parse_range
from pagoda.bench.extras import lazy_import
from pagoda.bench.serve import DEFAULT_BASE_URL, _parse_sse_line, _sse_lines

# bench extra, imported on first use (pagoda.bench.extras)
aiohttp = lazy_import("aiohttp")
httpx = lazy_import("httpx")

MODES = ("streams", "storm", "overload", "soak", "wrong-key", "hog", "constraints", "guess")
# Per-mode defaults of the flags whose sensible value depends on the mode.
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "streams": dict(concurrency=1000, max_tokens=16, disconnect_fraction=0.1),
    "storm": dict(concurrency=200, max_tokens=256, disconnect_fraction=1.0),
    "overload": dict(concurrency=3000, max_tokens=16, disconnect_fraction=0.0),
    "soak": dict(concurrency=16, max_tokens=32, disconnect_fraction=0.1),
    "wrong-key": dict(concurrency=40, max_tokens=2, disconnect_fraction=0.0),
    "hog": dict(concurrency=3, max_tokens=8, disconnect_fraction=0.0),
    "constraints": dict(concurrency=4, max_tokens=8, disconnect_fraction=0.0),
    "guess": dict(concurrency=1, max_tokens=1, disconnect_fraction=0.0),
}
METRIC_RUNNING = "pagoda:num_requests_running"
METRIC_WAITING = "pagoda:num_requests_waiting"
METRIC_KV = "pagoda:kv_cache_usage_perc"
SETTLE_POLL_S = 0.05
SETTLE_STABLE_S = 0.5
# Soak: RSS is compared between this mark and the end (the first minutes grow caches and pools).
SOAK_MARK_S = 300.0
SOAK_MAX_GROWTH_PCT = 5.0

# Outcomes of one request that meet the bar: "refused" is a 4xx to an invalid body (a valid one
# given a 4xx is a "client_error"); "rejected" (429/503) is fine only under overload.
ALLOWED = {"completed", "disconnected", "refused"}
# Outcomes that are failures rather than broken promises about tokens or streams.
FAILURES = ("client_error", "server_error", "stream_error", "conn_error", "bad_body", "rejected")


def add_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """``stress`` under the ``pagoda bench`` subcommands, its flags only (``stress_cli`` sets the
    handler)."""
    p = bench_subparsers.add_parser("stress", help="robustness under many streams, disconnects, overload, soak",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=MODES)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--model", default=None, help="model name; unset: first id of GET /v1/models")
    p.add_argument("--api-key", default=None, help="the server's key (wrong-key: the one the small requests send; hog: both clients "
                                                     "send it)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="streams (streams, storm), requests offered at once (overload), clients (soak); "
                        "defaults: " + ", ".join(f"{m} {d['concurrency']}" for m, d in MODE_DEFAULTS.items()))
    p.add_argument("--max-tokens", type=int, default=None, help="tokens each request asks for")
    p.add_argument("--input-len", default="4:32", help="MIN:MAX prompt tokens (random token ids)")
    p.add_argument("--disconnect-fraction", type=float, default=None,
                   help="share of streams that hang up early (storm: all)")
    p.add_argument("--disconnect-after", type=int, default=3,
                   help="a leaving stream closes after 1..this many chunks (storm: 0..this, 0 = before any)")
    p.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn below this")
    p.add_argument("--duration", type=float, default=1800.0, help="soak: seconds of load")
    p.add_argument("--sample-every", type=float, default=5.0, help="soak: seconds between RSS samples")
    p.add_argument("--settle-s", type=float, default=2.0,
                   help="bar: running, waiting and KV usage back to 0 within this long after the load")
    p.add_argument("--request-timeout", type=float, default=300.0, help="a request past this counts as hung")
    p.add_argument("--server-pid", type=int, default=None,
                   help="API server pid for RSS (default: the process listening on the URL's port)")
    p.add_argument("--hog-requests", type=int, default=1, help="hog: concurrent requests of the hogging client")
    p.add_argument("--hog-n", type=int, default=128, help="hog: samples (n) of each hog request")
    p.add_argument("--hog-max-tokens", type=int, default=500, help="hog: max_tokens of each hog request")
    p.add_argument("--bar-s", type=float, default=2.0, help="hog: bar on each small request's latency beside it")
    p.add_argument("--probes", type=int, default=20,
                   help="constraints: small requests timed idle and under attack; guess: rounds")
    p.add_argument("--guess-block", type=int, default=16,
                   help="guess: tokens of the public and the secret block (the server's KV block size)")
    p.add_argument("--warmup-s", type=float, default=2.0, help="constraints: attack this long before timing")
    p.add_argument("--attack-s", type=float, default=30.0, help="constraints: time small requests this long under attack")
    p.add_argument("--attacks", default=None,
                   help="constraints: comma-separated subset of chain, endless, endless2, selfref, cycle, regex, choice, late, "
                        "minlength, minitems, fanout, repeat, repeat3, longregex, overbudget, overbudgetre")
    p.add_argument("--max-ratio", type=float, default=2.0,
                   help="constraints: bar on the small request's median latency, under attack / idle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    stress_auth.add_args(p)
    return p


# ---- one request -----------------------------------------------------------------------------

@dataclass
class Spec:
    """One request to send and what a correct answer to it looks like."""
    body: dict[str, Any] | bytes          # bytes: sent as is (malformed JSON)
    path: str = "/v1/completions"
    stream: bool = True
    expect_tokens: int | None = None      # completion tokens over all n samples
    n: int = 1
    disconnect_after: int | None = None   # chunks before hanging up; None: read to the end
    invalid: bool = False                 # must be refused with a 4xx
    headers: dict[str, str] | None = None  # extra request headers (hog: who the client is)


@dataclass
class Outcome:
    kind: str
    status: int | None = None
    detail: str = ""
    seconds: float = 0.0


async def send(session: aiohttp.ClientSession, base: str, spec: Spec, timeout: float) -> Outcome:
    """Send one request; never raises: every way it can end is an ``Outcome``."""
    start = time.monotonic()
    outcome = await _attempt(session, base, spec, timeout)
    outcome.seconds = time.monotonic() - start
    return outcome


async def _attempt(session: aiohttp.ClientSession, base: str, spec: Spec, timeout: float) -> Outcome:
    kwargs: dict[str, Any] = ({"data": spec.body, "headers": {"Content-Type": "application/json"}}
                              if isinstance(spec.body, bytes) else {"json": spec.body})
    if spec.headers:
        kwargs["headers"] = {**kwargs.get("headers", {}), **spec.headers}
    try:
        async with asyncio.timeout(timeout):
            async with session.post(base + spec.path, **kwargs) as resp:
                if resp.status != 200:
                    return _refusal(spec, resp.status, await resp.text(errors="replace"))
                if spec.invalid:
                    return Outcome("invalid_accepted", 200, "an invalid body got 200")
                if spec.stream:
                    return await _read_stream(resp, spec)
                return _check_plain(spec, await resp.json())
    except TimeoutError:
        return Outcome("timeout", None, f"no answer within {timeout:.0f} s")
    except (json.JSONDecodeError, UnicodeDecodeError, aiohttp.ContentTypeError) as exc:
        return Outcome("bad_body", 200, f"unparsable answer: {exc}"[:300])
    except (aiohttp.ClientError, OSError) as exc:
        return Outcome("conn_error", None, f"{type(exc).__name__}: {exc}"[:300])


def _refusal(spec: Spec, status: int, text: str) -> Outcome:
    if status in (429, 503):
        return Outcome("rejected", status, text[:200])
    if 400 <= status < 500:
        return Outcome("refused" if spec.invalid else "client_error", status, text[:200])
    return Outcome("server_error", status, text[:200])


async def _read_stream(resp: aiohttp.ClientResponse, spec: Spec) -> Outcome:
    """Follow one SSE stream to its final usage chunk, or hang up after ``disconnect_after``."""
    chunks, usage, finished = 0, None, set()
    if spec.disconnect_after == 0:
        resp.close()  # leave while the request is (most likely) still queued
        return Outcome("disconnected", 200)
    async for line, _ in _sse_lines(resp):
        data = _parse_sse_line(line)
        if data is None:
            continue
        if "error" in data:
            return Outcome("stream_error", 200, json.dumps(data["error"])[:300])
        for choice in data.get("choices") or []:
            if choice.get("finish_reason") is not None:
                finished.add(choice.get("index", 0))
        if data.get("choices"):
            chunks += 1
        usage = data.get("usage") or usage
        if spec.disconnect_after is not None and chunks >= spec.disconnect_after and not finished:
            resp.close()  # drop the TCP connection mid-stream, as a dying client does
            return Outcome("disconnected", 200)
    if usage is None or len(finished) < spec.n:
        return Outcome("lost", 200, f"stream ended after {chunks} chunks without its final usage chunk")
    return _check_tokens(spec, usage)


def _check_plain(spec: Spec, body: dict[str, Any]) -> Outcome:
    if len(body.get("choices") or []) != spec.n:
        return Outcome("wrong", 200, f"{len(body.get('choices') or [])} choices, expected {spec.n}")
    return _check_tokens(spec, body.get("usage") or {})


def _check_tokens(spec: Spec, usage: dict[str, Any]) -> Outcome:
    got = usage.get("completion_tokens")
    if spec.expect_tokens is not None and got != spec.expect_tokens:
        return Outcome("wrong", 200, f"completion_tokens {got}, expected {spec.expect_tokens}")
    return Outcome("completed", 200)


def open_session(timeout: float) -> aiohttp.ClientSession:
    # limit=0: no client-side pool cap, so "offered at once" means at once.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout))


# ---- what the server shows -------------------------------------------------------------------

class ServerWatch:
    """The server as seen from outside: its processes' memory and its ``/metrics`` gauges."""

    def __init__(self, base: str, server_pid: int | None) -> None:
        self.base = base
        self.proc = _find_server(base, server_pid)

    def rss_mb(self) -> dict[str, float] | None:
        """Resident memory of the API server and of its children (the engine core), MiB."""
        if self.proc is None:
            return None
        try:
            api = self.proc.memory_info().rss
            children = 0
            for child in self.proc.children(recursive=True):
                try:
                    children += child.memory_info().rss
                except psutil.Error:  # a child may exit between listing and reading
                    pass
        except psutil.Error:
            return None
        mib = 1 << 20
        return {"api": api / mib, "engine": children / mib, "total": (api + children) / mib}

    async def engine_pid(self, session: aiohttp.ClientSession) -> int | None:
        """The engine core's pid from ``/health``; None when it does not answer 200."""
        try:
            async with session.get(self.base + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return (await resp.json()).get("engine_pid") if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None

    async def gauges(self, session: aiohttp.ClientSession) -> dict[str, float]:
        async with session.get(self.base + "/metrics") as resp:
            return parse_gauges(await resp.text())

    async def settle(self, session: aiohttp.ClientSession, bar_s: float) -> dict[str, Any]:
        """Poll until running, waiting and KV usage all read 0; keep going past the bar (up to
        5x, at least 10 s) so a miss still reports how long it really took."""
        start = time.monotonic()
        limit = max(5 * bar_s, 10.0)
        last: dict[str, float] = {}
        zero_since: float | None = None
        while True:
            now = time.monotonic()
            try:
                last = await self.gauges(session)
            except (aiohttp.ClientError, OSError) as exc:
                last = {"error": str(exc)}  # type: ignore[dict-item]
            if not all(last.get(k) == 0 for k in (METRIC_RUNNING, METRIC_WAITING, METRIC_KV)):
                zero_since = None
            elif zero_since is None:
                zero_since = now
            # Zero must hold for a while: a request whose client left before the engine saw it
            # can still arrive after one zero reading.
            if zero_since is not None and now - zero_since >= SETTLE_STABLE_S:
                took = zero_since - start
                return {"reached": took <= bar_s, "seconds": round(took, 3), "bar_s": bar_s, "last": last}
            if now - start > limit:
                return {"reached": False, "seconds": None, "bar_s": bar_s, "last": last}
            await asyncio.sleep(SETTLE_POLL_S)


def parse_gauges(text: str) -> dict[str, float]:
    """The three gauges from a Prometheus text page (summed over label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (METRIC_RUNNING, METRIC_WAITING, METRIC_KV):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _find_server(base: str, pid: int | None) -> psutil.Process | None:
    if pid is not None:
        return psutil.Process(pid)
    port = urlsplit(base).port or 80
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return psutil.Process(conn.pid)
    except psutil.AccessDenied:
        pass
    return None


# ---- workloads -------------------------------------------------------------------------------

@dataclass
class Target:
    """What the workload needs to know about the server."""
    base: str
    model: str
    max_model_len: int


class Workload:
    """Seeded request bodies for every mode."""

    def __init__(self, target: Target, args: argparse.Namespace) -> None:
        self.t, self.args = target, args
        self.rng = random.Random(args.seed)
        self.input_len = parse_range(args.input_len)

    def prompt(self, max_len: int | None = None) -> list[int]:
        lo, hi = self.input_len
        hi = min(hi, max_len) if max_len else hi
        return [self.rng.randrange(FIRST_ORDINARY_ID, self.args.vocab_size)
                for _ in range(self.rng.randint(min(lo, hi), hi))]

    def temperature(self) -> float:
        return 0.0 if self.rng.random() < 0.5 else round(self.rng.uniform(0.5, 1.2), 2)

    def completion(self, max_tokens: int, stream: bool = True, n: int = 1,
                   disconnect_after: int | None = None) -> Spec:
        # The prompt leaves room for every asked-for token, so "length" is the only way to stop.
        max_tokens = min(max_tokens, self.t.max_model_len - self.input_len[0] - 1)
        prompt = self.prompt(self.t.max_model_len - max_tokens - 1)
        body: dict[str, Any] = {"model": self.t.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": self.temperature(), "ignore_eos": True, "n": n,
                                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return Spec(body, stream=stream, expect_tokens=n * max_tokens, n=n, disconnect_after=disconnect_after)

    def streams(self) -> list[Spec]:
        a = self.args
        leaving = set(self.rng.sample(range(a.concurrency), round(a.concurrency * a.disconnect_fraction)))
        # Leavers ask for more tokens, so they are surely still generating when they hang up.
        return [self.completion(a.max_tokens * 4, disconnect_after=self.rng.randint(1, a.disconnect_after))
                if i in leaving else self.completion(a.max_tokens) for i in range(a.concurrency)]

    def storm(self) -> list[Spec]:
        a = self.args
        return [self.completion(a.max_tokens, disconnect_after=self.rng.randint(0, a.disconnect_after))
                for _ in range(a.concurrency)]

    def overload(self) -> list[Spec]:
        # Half streamed, half plain: a full queue must refuse both kinds the same way.
        return [self.completion(self.args.max_tokens, stream=i % 2 == 0) for i in range(self.args.concurrency)]

    def soak_one(self) -> Spec:
        """One request of the soak's mix."""
        a, roll = self.args, self.rng.random()
        max_tokens = self.rng.randint(1, a.max_tokens)
        if roll < 0.10:
            return self.invalid()
        if roll < 0.10 + a.disconnect_fraction:
            return self.completion(a.max_tokens * 4, disconnect_after=self.rng.randint(0, a.disconnect_after))
        n = 2 if self.rng.random() < 0.2 else 1
        return self.completion(max_tokens, stream=self.rng.random() < 0.6, n=n)

    def as_client(self, spec: Spec, client: str) -> Spec:
        """``spec`` sent by ``client``: its bearer token (unless the server has a key), ``user``
        field and ``X-Tenant-Id`` header all name it."""
        token = self.args.api_key or client
        spec.headers = {"Authorization": f"Bearer {token}", "X-Tenant-Id": client}
        assert isinstance(spec.body, dict)
        spec.body["user"] = client
        return spec

    def small(self) -> Spec:
        """The other client's request: 8 prompt tokens, ``--max-tokens`` greedy tokens."""
        spec = self.completion(self.args.max_tokens, stream=False)
        assert isinstance(spec.body, dict)
        spec.body.update(prompt=[self.rng.randrange(FIRST_ORDINARY_ID, self.args.vocab_size) for _ in range(8)],
                         temperature=0.0)
        return self.as_client(spec, "small-client")

    def hog(self) -> list[Spec]:
        a = self.args
        return [self.as_client(self.completion(a.hog_max_tokens, stream=False, n=a.hog_n), "hog-client")
                for _ in range(a.hog_requests)]

    def invalid(self) -> Spec:
        """A body the server must refuse with a 4xx (and nothing worse)."""
        good = {"model": self.t.model, "prompt": self.prompt(), "max_tokens": 4}
        bad: list[dict[str, Any] | bytes] = [
            {**good, "max_tokens": -1},
            {k: v for k, v in good.items() if k != "prompt"},
            {**good, "temperature": "hot"},
            {**good, "n": 0},
            {**good, "model": "no-such-model"},
            {**good, "prompt": [10 ** 9]},
            {**good, "prompt": [FIRST_ORDINARY_ID] * (self.t.max_model_len + 1)},
            {**good, "stream": True, "stream_options": "yes"},
            b'{"model": "x", "prompt": [1, 2',
            b"\xff\xfe not json",
        ]
        body = bad[self.rng.randrange(len(bad))]
        return Spec(body, stream=False, invalid=True)


def fetch_target(base: str, model: str | None, api_key: str | None = None) -> Target:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base + "/v1/models", timeout=30.0, headers=headers)
    r.raise_for_status()
    card = (r.json().get("data") or [{}])[0]
    return Target(base, model or card["id"], int(card.get("max_model_len") or 2048))


# ---- tallies and bars ------------------------------------------------------------------------

@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # one detail per bad kind
    slowest: dict[str, float] = field(default_factory=dict)  # seconds, per kind

    def add(self, o: Outcome) -> None:
        self.counts[o.kind] += 1
        self.slowest[o.kind] = round(max(self.slowest.get(o.kind, 0.0), o.seconds), 3)
        if o.status is not None:
            self.statuses[str(o.status)] += 1
        if o.kind not in ALLOWED and o.detail:
            self.examples.setdefault(o.kind, o.detail)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def failed(self, allow_rejected: bool) -> int:
        return sum(self.counts[k] for k in FAILURES if k != "rejected" or not allow_rejected)


def misses(mode: str, tally: Tally, settle: dict[str, Any], extra: list[str] | None = None) -> list[str]:
    """The bars this run missed, in words (empty: all reached)."""
    allowed = ALLOWED | ({"rejected"} if mode == "overload" else set())
    out = list(extra or [])
    out += [f"{n} {kind}" for kind, n in sorted(tally.counts.items()) if n and kind not in allowed]
    if not settle["reached"]:
        took = "never" if settle["seconds"] is None else f"after {settle['seconds']} s"
        out.append(f"not back to 0 within {settle['bar_s']} s ({took})")
    return out


def summary_rows(mode: str, tally: Tally, settle: dict[str, Any], rss: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("outcome", "requests")]
    rows += [(k, f"{v}  (slowest {tally.slowest[k]:.2f} s)") for k, v in sorted(tally.counts.items())]
    rows.append(("total", str(tally.total)))
    rows.append(("failed (non-2xx, in-band error, connection)", str(tally.failed(mode == "overload"))))
    rows.append(("HTTP statuses", ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items()))))
    took = "not reached" if settle["seconds"] is None else f"{settle['seconds']:.2f} s"
    rows.append((f"back to 0 (bar {settle['bar_s']} s)", took))
    for label, value in rss.items():
        rows.append((f"server RSS {label}", "n/a" if value is None else f"{value['total']:.1f} MiB "
                     f"(api {value['api']:.1f} + engine {value['engine']:.1f})"))
    return rows


# ---- running the modes -----------------------------------------------------------------------

async def fire_all(base: str, specs: list[Spec], timeout: float) -> tuple[Tally, float]:
    """Send every spec at once; return the tally and the seconds until the last one ended."""
    tally = Tally()
    start = time.monotonic()
    async with open_session(timeout) as session:
        for o in await asyncio.gather(*(send(session, base, s, timeout) for s in specs)):
            tally.add(o)
    return tally, time.monotonic() - start


async def run_burst(args: argparse.Namespace, target: Target, watch: ServerWatch) -> dict[str, Any]:
    """streams, storm, overload: one batch of requests at once, then the settle check."""
    work = Workload(target, args)
    specs: list[Spec] = getattr(work, args.mode)()
    rss_before = watch.rss_mb()
    async with open_session(30.0) as session:
        pid_before = await watch.engine_pid(session)
    tally, elapsed = await fire_all(target.base, specs, args.request_timeout)
    async with open_session(30.0) as session:
        settle = await watch.settle(session, args.settle_s)
        pids = [pid_before, await watch.engine_pid(session)]
    rss = {"before": rss_before, "after": watch.rss_mb()}
    # How many streams were told to hang up after how many chunks (0: before the first).
    plan = Counter(s.disconnect_after for s in specs if s.disconnect_after is not None)
    return {"tally": tally, "settle": settle, "rss": rss, "load_s": round(elapsed, 2), "engine_pids": pids,
            "disconnect_plan": {str(k): plan[k] for k in sorted(plan)}, "extra_misses": engine_misses(pids, 0)}


def engine_misses(pids: list[int | None], unhealthy: int) -> list[str]:
    """A changed engine pid means the engine core died and came back; None, that /health failed."""
    out = []
    seen = [p for p in pids if p is not None]
    if len(set(seen)) > 1:
        out.append(f"engine core pid changed ({' -> '.join(map(str, dict.fromkeys(seen)))})")
    if unhealthy or pids[-1] is None:
        out.append(f"/health not 200 ({unhealthy} of {len(pids)} probes)")
    return out


async def run_soak(args: argparse.Namespace, target: Target, watch: ServerWatch) -> dict[str, Any]:
    """``--concurrency`` clients each sending the soak mix back to back for ``--duration`` s."""
    work, tally = Workload(target, args), Tally()
    start = time.monotonic()
    deadline = start + args.duration
    samples: list[tuple[float, float]] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            tally.add(await send(session, target.base, work.soak_one(), args.request_timeout))

    async def sampler(session: aiohttp.ClientSession) -> None:
        # /health is probed with the RSS: it must stay 200 with the same engine core throughout.
        while time.monotonic() < deadline:
            rss = watch.rss_mb()
            if rss is not None:
                samples.append((round(time.monotonic() - start, 1), round(rss["total"], 2)))
            pids.append(await watch.engine_pid(session))
            await asyncio.sleep(args.sample_every)

    rss_before, pids = watch.rss_mb(), []
    async with open_session(args.request_timeout) as session:
        await asyncio.gather(sampler(session), *(client(session) for _ in range(args.concurrency)))
        settle = await watch.settle(session, args.settle_s)
        pids.append(await watch.engine_pid(session))
    growth = rss_growth(samples, min(SOAK_MARK_S, args.duration / 6))
    extra = engine_misses(pids, sum(p is None for p in pids))
    if growth["pct"] is not None and growth["pct"] >= SOAK_MAX_GROWTH_PCT:
        extra.append(f"RSS grew {growth['pct']:.2f}% after {growth['mark_s']:.0f} s (bar < {SOAK_MAX_GROWTH_PCT}%)")
    rss = {"before": rss_before, "settled": watch.rss_mb()}
    return {"tally": tally, "settle": settle, "rss": rss, "load_s": round(time.monotonic() - start, 1),
            "rss_growth": growth, "rss_samples": samples, "engine_pids": sorted({p for p in pids if p}),
            "health_failures": sum(p is None for p in pids), "extra_misses": extra}


def rss_growth(samples: list[tuple[float, float]], mark_s: float) -> dict[str, Any]:
    """RSS at the first sample at or past ``mark_s`` against the last sample taken under load."""
    later = [s for s in samples if s[0] >= mark_s]
    if len(later) < 2:
        return {"mark_s": mark_s, "at_mark_mib": None, "end_mib": None, "pct": None}
    (_, at_mark), (_, end) = later[0], later[-1]
    return {"mark_s": mark_s, "at_mark_mib": at_mark, "end_mib": end, "pct": round(100 * (end - at_mark) / at_mark, 3)}


async def run_hog(args: argparse.Namespace, target: Target, watch: ServerWatch) -> dict[str, Any]:
    """Small requests alone, then beside the hog (once it runs), one after another."""
    work, tally = Workload(target, args), Tally()
    start = time.monotonic()
    async with open_session(args.request_timeout) as session:
        alone = [await send(session, target.base, work.small(), args.request_timeout) for _ in range(args.concurrency)]
        hogs = [asyncio.ensure_future(send(session, target.base, spec, args.request_timeout)) for spec in work.hog()]
        running = await _wait_running(session, watch, args.hog_requests * args.hog_n, hogs)
        beside = [await send(session, target.base, work.small(), args.request_timeout) for _ in range(args.concurrency)]
        hog_done = sum(h.done() for h in hogs)
        for h in hogs:
            h.cancel()  # the connection closes: the server aborts the hog
        await asyncio.gather(*hogs, return_exceptions=True)
        settle = await watch.settle(session, args.settle_s)
    for o in alone + beside:
        tally.add(o)
    idle = sorted(o.seconds for o in alone)[len(alone) // 2]
    worst = max(o.seconds for o in beside)
    extra = [] if worst <= args.bar_s else [f"a small request beside the hog took {worst:.2f} s (bar {args.bar_s} s)"]
    if hog_done:
        extra.append(f"{hog_done} hog request(s) ended before the probes did: the measurement is not beside it")
    return {"tally": tally, "settle": settle, "rss": {}, "load_s": round(time.monotonic() - start, 1),
            "extra_misses": extra, "hog_running_seqs": running,
            "small_alone_s": [round(o.seconds, 3) for o in alone],
            "small_beside_hog_s": [round(o.seconds, 3) for o in beside],
            # Kept to the microsecond: a ratio recomputed from millisecond-rounded times of ~10 ms
            # requests is off by several percent.
            "idle_median_s": round(idle, 6), "beside_max_s": round(worst, 6), "ratio": round(worst / idle, 4)}


async def _wait_running(session: aiohttp.ClientSession, watch: ServerWatch, want: int, hogs: list,
                        timeout_s: float = 60.0, stable_s: float = 1.0) -> float:
    """Poll the running gauge until the hog's sequences run: ``want`` of them, or as many as
    the server runs at once (the count has not risen for ``stable_s``); the count seen."""
    start = last_rise = time.monotonic()
    seen = 0.0
    while time.monotonic() - start < timeout_s and not all(h.done() for h in hogs):
        now_seen = (await watch.gauges(session)).get(METRIC_RUNNING, 0.0)
        if now_seen > seen:
            seen, last_rise = now_seen, time.monotonic()
        if seen >= want or (seen > 0 and time.monotonic() - last_rise >= stable_s):
            break
        await asyncio.sleep(0.1)
    return seen


def report_wrong_key(args: argparse.Namespace, result: dict[str, Any]) -> int:
    print_table(f"stress wrong-key: {args.phase_s:g} s per phase", stress_auth.report_rows(result, args))
    missed = result["misses"]
    print("bar: " + ("all reached" if not missed else "MISSED: " + "; ".join(missed)))
    write_json(args.out, {**result, "mode": args.mode, "passed": not missed,
                          "options": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}})
    return 1 if missed else 0


def report(args: argparse.Namespace, result: dict[str, Any]) -> int:
    tally: Tally = result["tally"]
    missed = misses(args.mode, tally, result["settle"], result["extra_misses"])
    rows = summary_rows(args.mode, tally, result["settle"], result["rss"])
    if result.get("disconnect_plan"):
        rows.append(("hang-ups planned (after N chunks: streams)",
                     ", ".join(f"{k}: {v}" for k, v in result["disconnect_plan"].items())))
    if result.get("engine_pids"):
        rows.append(("engine core pid", " -> ".join(str(p) for p in dict.fromkeys(result["engine_pids"]))))
    if "hog_running_seqs" in result:  # the hog mode (the constraints mode has a ratio too)
        rows.append(("hog sequences running", f"{result['hog_running_seqs']:.0f}"))
        rows.append(("small request alone (median)", f"{result['idle_median_s']:.3f} s  {result['small_alone_s']}"))
        rows.append(("small request beside the hog (max)",
                     f"{result['beside_max_s']:.3f} s  {result['small_beside_hog_s']}"))
        rows.append(("ratio beside / alone", f"{result['ratio']:.2f}x (bar: beside <= {args.bar_s} s)"))
    if "rss_growth" in result:
        g = result["rss_growth"]
        rows.append((f"RSS at {g['mark_s']:.0f} s / end", f"{g['at_mark_mib']} / {g['end_mib']} MiB"))
        rows.append(("RSS growth", "n/a" if g["pct"] is None else f"{g['pct']:.2f}% (bar < {SOAK_MAX_GROWTH_PCT}%)"))
    print_table(f"stress {args.mode}: {args.concurrency} {'clients' if args.mode == 'soak' else 'requests'}, "
                f"load {result['load_s']} s", rows)
    for kind, detail in tally.examples.items():
        print(f"  e.g. {kind}: {detail}")
    print("bar: " + ("all reached" if not missed else "MISSED: " + "; ".join(missed)))
    payload = {k: v for k, v in result.items() if k not in ("tally", "extra_misses")}
    payload.update(mode=args.mode, counts=dict(tally.counts), statuses=dict(tally.statuses),
                   examples=tally.examples, slowest_s=tally.slowest, misses=missed, passed=not missed,
                   options={k: v for k, v in vars(args).items() if k != "func"})
    write_json(args.out, payload)
    return 1 if missed else 0


