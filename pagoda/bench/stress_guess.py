"""``pagoda bench stress guess``: can one tenant learn another's prompt from the prefix cache?

Each of ``--probes`` rounds draws fresh random blocks: a public block every prompt starts with,
the victim's secret block, a wrong guess and a four-token tail. The victim sends public + secret
+ tail; the attacker sends public + filler (so its own public block is cached), then public +
wrong + tail and public + secret + tail, reading each answer's
``usage.prompt_tokens_details.cached_tokens`` and the growth of ``/metrics``'
``pagoda:prefix_cache_hits_total``. The two clients differ in bearer token, ``user`` and
``X-Tenant-Id`` (``Workload.as_client``), so any ``--tenant-id-source`` tells them apart. Bar:
in every round the right guess gets the same answer as the wrong one, in cached tokens and in
hits; against a server without ``--tenant-cache-isolation`` the right guess shows one more block
and the command exits non-zero.
"""
from __future__ import annotations

import argparse
import random
from typing import Any

from pagoda.bench.common import FIRST_ORDINARY_ID, print_table, write_json
from pagoda.bench.extras import lazy_import
from pagoda.bench.stress import Spec, Target, Workload

httpx = lazy_import("httpx")

HITS = "pagoda:prefix_cache_hits_total"


def _hits(client: Any, base: str) -> float:
    text = client.get(base + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] == HITS)


def _cached(client: Any, work: Workload, prompt: list[int], who: str) -> int:
    body = {"model": work.t.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    spec = work.as_client(Spec(body, stream=False), who)
    resp = client.post(work.t.base + "/v1/completions", json=spec.body, headers=spec.headers)
    resp.raise_for_status()
    return int(((resp.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def run_guess(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    work, rng, block = Workload(target, args), random.Random(args.seed), args.guess_block
    rounds = []
    with httpx.Client(timeout=args.request_timeout) as client:
        for _ in range(args.probes):
            public, secret, wrong, filler = ([rng.randrange(FIRST_ORDINARY_ID, args.vocab_size) for _ in range(block)]
                                             for _ in range(4))
            tail = [rng.randrange(FIRST_ORDINARY_ID, args.vocab_size) for _ in range(4)]
            _cached(client, work, public + secret + tail, "victim")
            _cached(client, work, public + filler + tail, "attacker")
            seen = {}
            for name, guess in (("wrong", wrong), ("right", secret)):
                before = _hits(client, target.base)
                tokens = _cached(client, work, public + guess + tail, "attacker")
                seen[name] = [tokens, _hits(client, target.base) - before]
            rounds.append(seen)
    told = [i for i, r in enumerate(rounds) if r["right"] != r["wrong"]]
    misses = [f"{len(told)} of {len(rounds)} rounds told the right guess from the wrong one"] if told else []
    return {"rounds": rounds, "misses": misses, "block": block}


def report_guess(args: argparse.Namespace, result: dict[str, Any]) -> int:
    rounds = result["rounds"]

    def spread(name: str, k: int) -> str:
        values = sorted({r[name][k] for r in rounds})
        return ", ".join(f"{v:g}" for v in values)

    rows = [("", "cached tokens / hit-counter growth (values seen over the rounds)"),
            ("wrong guess", f"{spread('wrong', 0)} / {spread('wrong', 1)}"),
            ("right guess", f"{spread('right', 0)} / {spread('right', 1)}"),
            ("rounds telling right from wrong", f"{sum(r['right'] != r['wrong'] for r in rounds)} of {len(rounds)}")]
    print_table(f"stress guess: a secret block of {result['block']} tokens, {len(rounds)} rounds", rows)
    missed = result["misses"]
    print("bar: " + ("all reached" if not missed else "MISSED: " + "; ".join(missed)))
    write_json(args.out, {**result, "mode": args.mode, "passed": not missed,
                          "options": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}})
    return 1 if missed else 0
