"""``pagoda bench stress constraints``: hostile structured-output constraints against a running
server, and what they cost another client.

Small requests (8 greedy tokens, no constraint) are sent one after another: ``--probes`` of
them on the idle server before the attack and as many after it (their latency is the baseline,
taken on both sides so that a machine whose load drifts does not bias it), and as many as fit in
``--attack-s`` seconds (at least ``--probes``) during the attack, when ``--concurrency`` attackers
send, back to back, constraints built to crash, stall or exhaust a grammar compiler (each made unique, so no
cache answers for it): 5,000 chained Lark rules, a grammar that can only recurse, a schema that
refers only to itself, a ``$ref`` cycle, ``(a{1000}){1000}``, 1 MB of choices, a grammar with no
finite text though each step has a choice, a grammar that reaches a parser limit only after
20 tokens, and constraints whose shortest text is finite but longer than the context
(``minLength``/``minItems`` 100,000, required objects nested by ``$ref``, ``a{100000}``,
``(abc){50000}``, ``a{20000}``) or than the attacker's ``max_tokens`` (``minLength`` 4,000 and
``(abc){2000}`` against 40 tokens).
Meanwhile the same small requests are timed
again. Bars: every attack ends in a 4xx (never a 5xx, never a hang), every small request
completes, ``/health`` stays 200 with the same engine core, and the small requests' median
latency under attack is at most ``--max-ratio`` times the idle one.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any, Callable

from pagoda.bench.common import print_table
from pagoda.bench.stress import Spec, Tally, Target, Workload, engine_misses, open_session, send

MAX_RATIO = 2.0


def _chain(i: int) -> dict[str, Any]:
    rules = 5000
    text = f"start: x{i}r0\n" + "".join(f'x{i}r{k}: "a" x{i}r{k + 1}\n' for k in range(rules - 1))
    return {"grammar": text + f'x{i}r{rules - 1}: "a"\n'}


def _cycle(i: int) -> dict[str, Any]:
    a, b = f"a{i}", f"b{i}"
    return {"json": {"$defs": {a: {"$ref": f"#/$defs/{b}"}, b: {"$ref": f"#/$defs/{a}"}}, "$ref": f"#/$defs/{a}"}}


def _fanout(i: int) -> dict[str, Any]:
    """Required objects three deep, 20 keys each, by ``$ref``: a 1 KB schema whose shortest
    text is 8,000 strings (about 150 KB)."""
    keys = [f"k{k:02d}" for k in range(20)]

    def level(inner: str) -> dict[str, Any]:
        return {"type": "object", "properties": {k: {"$ref": f"#/$defs/{inner}"} for k in keys}, "required": keys}

    return {"json": {"$defs": {"l1": level("l2"), "l2": level("leaf"), "leaf": {"type": "string", "minLength": 10}},
                     **level("l1"), "description": f"v{i}"}}


# name -> a unique constraint of that kind for each i (--attacks picks some)
ATTACKS: dict[str, Callable[[int], dict[str, Any]]] = {
    "chain": _chain,                                                          # 5,000 chained rules
    "endless": lambda i: {"grammar": f'start: "a{i}" start'},                 # can only recurse
    "selfref": lambda i: {"json": {"$ref": "#", "description": f"v{i}"}},     # refers only to itself
    "cycle": _cycle,                                                          # a $ref cycle
    "regex": lambda i: {"regex": f"(a{{1000}}){{1000}}z{i}"},                 # too big for the lexer
    "choice": lambda i: {"choice": [f"{i}-{k:04d}" + "x" * 1020 for k in range(1000)]},  # 1 MB
    "endless2": lambda i: {"grammar": f'start: ("a{i}" | "b") start'},      # no finite text, a choice each step
    "late": lambda i: {"grammar": f'start: "{i}" ("b" | "c")~20 %json {{"$ref": "#"}}'},  # limit after 20 tokens
    # finite texts, longer than any response (the context) or than this request's max_tokens
    "minlength": lambda i: {"json": {"type": "string", "minLength": 100_000 + i}},
    "minitems": lambda i: {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 100_000 + i}},
    "fanout": _fanout,                                                        # nested required objects
    "repeat": lambda i: {"regex": f"a{{100000}}{i}"},
    "repeat3": lambda i: {"regex": f"(abc){{50000}}{i}"},
    "longregex": lambda i: {"regex": f"a{{20000}}{i}"},                       # under the lexer's limit
    "overbudgetre": lambda i: {"regex": f"(abc){{2000}}{i}"},                 # fits the context, not 40 tokens
    "overbudget": lambda i: {"json": {"type": "string", "minLength": 4_000 + i}},  # fits the context, not 40 tokens
}


def _probe(work: Workload) -> Spec:
    body = {"model": work.t.model, "prompt": work.prompt(16), "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True}
    return Spec(body, stream=False, expect_tokens=8)


async def _timed_probes(session: Any, work: Workload, count: int, timeout: float, tally: Tally,
                        seconds: float = 0.0) -> list[float]:
    """``count`` small requests one after another, more until ``seconds`` have passed."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while len(times) < count or time.monotonic() < end:
        outcome = await send(session, work.t.base, _probe(work), timeout)
        tally.add(outcome)
        if outcome.kind != "completed":
            break
        times.append(outcome.seconds)
    return times


def _stats(times: list[float]) -> dict[str, float | None]:
    if not times:
        return {"median_s": None, "p90_s": None}
    ordered = sorted(times)
    return {"median_s": round(statistics.median(ordered), 4),
            "p90_s": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4)}


async def run_constraints(args: argparse.Namespace, target: Target, watch: Any) -> dict[str, Any]:
    work, probes, attacks = Workload(target, args), Tally(), Tally()
    chosen = [a.strip() for a in args.attacks.split(",")] if args.attacks else list(ATTACKS)
    unknown = sorted(set(chosen) - set(ATTACKS))
    if unknown:
        raise SystemExit(f"unknown attacks {unknown}; choose from {', '.join(ATTACKS)}")
    per_kind: dict[str, dict[int, int]] = {name: {} for name in chosen}
    start = time.monotonic()
    stop = asyncio.Event()
    serial = iter(range(args.seed * 1_000_000, 10 ** 12))

    async def attacker(session: Any, first: int) -> None:
        names = chosen
        k = first
        while not (stop.is_set() and all(per_kind.values())):  # every attack at least once
            name = names[k % len(names)]
            k += 1
            body = {"model": target.model, "prompt": "Go", "max_tokens": 40, "temperature": 0.0,
                    "structured_outputs": ATTACKS[name](next(serial))}
            outcome = await send(session, target.base, Spec(body, stream=False, invalid=True), args.request_timeout)
            attacks.add(outcome)
            status = outcome.status or 0
            per_kind[name][status] = per_kind[name].get(status, 0) + 1

    async with open_session(args.request_timeout) as session:
        pids = [await watch.engine_pid(session)]
        idle = await _timed_probes(session, work, args.probes, args.request_timeout, probes)
        crowd = [asyncio.create_task(attacker(session, i)) for i in range(args.concurrency)]
        await asyncio.sleep(args.warmup_s)  # the attacks are in flight before the clock starts
        loaded = await _timed_probes(session, work, args.probes, args.request_timeout, probes, args.attack_s)
        stop.set()
        await asyncio.gather(*crowd)
        settle = await watch.settle(session, args.settle_s)
        idle += await _timed_probes(session, work, args.probes, args.request_timeout, probes)
        pids.append(await watch.engine_pid(session))
    idle_s, loaded_s = _stats(idle), _stats(loaded)
    ratio = (round(loaded_s["median_s"] / idle_s["median_s"], 2)
             if idle_s["median_s"] and loaded_s["median_s"] else None)
    extra = engine_misses(pids, sum(p is None for p in pids))
    extra += [f"{n} attack(s) answered {kind}" for kind, n in attacks.counts.items() if kind != "refused"]
    if ratio is None or ratio > args.max_ratio:
        extra.append(f"small requests under attack at {ratio}x their idle median (bar <= {args.max_ratio}x)")
    rows = [("", "median s / p90 s"),
            ("small request, idle", f"{idle_s['median_s']} / {idle_s['p90_s']}  ({len(idle)} requests)"),
            ("small request, under attack", f"{loaded_s['median_s']} / {loaded_s['p90_s']}  ({len(loaded)} requests)"),
            ("ratio (median)", f"{ratio}x (bar <= {args.max_ratio}x)")]
    rows += [(f"attack: {name}", ", ".join(f"{s}: {n}" for s, n in sorted(c.items())) or "not sent")
             for name, c in per_kind.items()]
    print_table("constraint attacks: latency of a small request", rows)
    return {"tally": probes, "attack_tally": attacks.counts, "settle": settle, "rss": {"settled": watch.rss_mb()},
            "load_s": round(time.monotonic() - start, 1), "idle": idle_s, "under_attack": loaded_s,
            "ratio": ratio, "attacks": per_kind, "engine_pids": sorted({p for p in pids if p}),
            "extra_misses": extra}
