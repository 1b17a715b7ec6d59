"""``pagoda bench fuzz``: throw schema-generated requests at a running server and count what
breaks.

The cases come from the server's own ``/openapi.json`` through the schemathesis driver in
``pagoda.bench.fuzz_core`` (positive data: valid by the schema; negative data: invalid by it).
Alongside, a watcher polls ``GET /health`` once a second: the engine core's pid must not
change and the answer must stay 200, so an engine that dies and is replaced (or wedges) is
caught even when every HTTP answer looked fine.

Exits non-zero on any 5xx, any request that got no answer at all, or an engine death. Schema
violations (undocumented status, content type or body; invalid data accepted) are printed and
counted; ``--strict`` makes them fail the run too.
"""
from __future__ import annotations

import argparse
import threading
from dataclasses import asdict
from typing import Any

from pagoda.bench.common import print_table, write_json
from pagoda.bench.extras import lazy_import
from pagoda.bench.fuzz_core import MODES, FuzzReport, run_fuzz
from pagoda.bench.serve import DEFAULT_BASE_URL, normalize_base_url

# bench extra, imported on first use (pagoda.bench.extras)
httpx = lazy_import("httpx")

HEALTH_POLL_S = 1.0
# The fuzz_core failure title of a 5xx answer; every other title is a schema violation.
SERVER_ERROR_TITLE = "Server error"
NO_RESPONSE_TITLE = "No response"


def add_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``fuzz`` under the ``pagoda bench`` subcommands."""
    p = bench_subparsers.add_parser("fuzz", help="schemathesis fuzzing of a running server from its OpenAPI",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--cases", type=int, default=500, help="requests to aim for, shared over operations and modes")
    p.add_argument("--seed", type=int, default=0, help="same seed and server: same requests")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: positive, negative")
    p.add_argument("--time-budget", type=float, default=3600.0, help="seconds; no new case starts after this")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds for one request")
    p.add_argument("--api-key", default=None)
    p.add_argument("--strict", action="store_true", help="schema violations fail the run too")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.set_defaults(func=run_fuzz_bench)
    return p


class HealthWatch:
    """Polls ``/health`` on a thread for as long as the fuzz runs."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.pids: list[int] = []   # every distinct engine pid seen, in order
        self.polls = 0
        self.unhealthy = 0          # polls that did not get a 200
        self.last_ok = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)

    def __enter__(self) -> "HealthWatch":
        self.poll()  # the pid before the first case, so a death during case one still shows
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(HEALTH_POLL_S):
            self.poll()

    def poll(self) -> None:
        self.polls += 1
        try:
            r = httpx.get(self.base + "/health", timeout=10.0)
            pid = r.json().get("engine_pid") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            pid = None
        self.last_ok = pid is not None
        if pid is None:
            self.unhealthy += 1
        elif not self.pids or self.pids[-1] != pid:
            self.pids.append(pid)

    @property
    def engine_deaths(self) -> int:
        # Each new pid after the first is an engine core that died and was replaced; a /health
        # that is still not 200 after the last case is one more that did not come back.
        return max(0, len(self.pids) - 1) + (0 if self.last_ok else 1)


def run_fuzz_bench(args: argparse.Namespace) -> int:
    base = normalize_base_url(args.base_url)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown --modes {sorted(unknown)}; choose from {MODES}")
    with HealthWatch(base) as watch:
        report = run_fuzz(base, cases=args.cases, seed=args.seed, modes=modes, time_budget_s=args.time_budget,
                          api_key=args.api_key, request_timeout_s=args.request_timeout)
    result = summarize(report, watch)
    print_report(args, report, result)
    write_json(args.out, {**result, "options": {k: v for k, v in vars(args).items() if k != "func"},
                          "by_operation": dict(report.by_operation),
                          "examples": [asdict(e) for e in report.examples]})
    failed = result["5xx"] or result["no_response"] or result["engine_deaths"] or \
        (args.strict and result["schema_violations"])
    return 1 if failed else 0


def summarize(report: FuzzReport, watch: HealthWatch) -> dict[str, Any]:
    kinds = dict(report.failure_kinds)
    violations = {k: v for k, v in kinds.items() if k not in (SERVER_ERROR_TITLE, NO_RESPONSE_TITLE)}
    return {"cases": report.cases, "2xx": report.by_status.get("2xx", 0), "4xx": report.by_status.get("4xx", 0),
            "5xx": report.by_status.get("5xx", 0), "no_response": report.by_status.get("error", 0),
            "engine_deaths": watch.engine_deaths, "engine_pids": watch.pids, "health_polls": watch.polls,
            "health_not_200": watch.unhealthy, "schema_violations": sum(violations.values()),
            "violations_by_kind": violations, "seconds": round(report.seconds, 1),
            "stopped_early": report.stopped_early}


def print_report(args: argparse.Namespace, report: FuzzReport, r: dict[str, Any]) -> None:
    rows = [("what", "count"), ("cases", str(r["cases"])), ("2xx", str(r["2xx"])), ("4xx", str(r["4xx"])),
            ("5xx", str(r["5xx"])), ("no answer", str(r["no_response"])),
            ("engine deaths", f"{r['engine_deaths']} (pids {r['engine_pids']}, "
                              f"{r['health_not_200']}/{r['health_polls']} /health polls not 200)"),
            ("schema violations", str(r["schema_violations"]))]
    rows += [(f"  {kind}", str(n)) for kind, n in sorted(r["violations_by_kind"].items())]
    rows.append(("seconds", f"{r['seconds']}" + (" (stopped at the time budget)" if r["stopped_early"] else "")))
    print_table(f"fuzz: {args.cases} cases asked, seed {args.seed}, modes {args.modes}", rows)
    for e in report.examples:
        print(f"\n[{e.check}] {e.mode} {e.operation} -> {e.status}\n  {e.detail[:300]}\n  {e.request[:500]}")
    bad = [f"{r['5xx']} 5xx"] * bool(r["5xx"]) + [f"{r['no_response']} unanswered"] * bool(r["no_response"]) \
        + [f"{r['engine_deaths']} engine deaths"] * bool(r["engine_deaths"])
    if args.strict and r["schema_violations"]:
        bad.append(f"{r['schema_violations']} schema violations")
    print("\nbar: " + ("0 5xx, 0 unanswered, 0 engine deaths" if not bad else "MISSED: " + "; ".join(bad)))
