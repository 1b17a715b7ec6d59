"""Property-based fuzzing of a live pagoda server from its own OpenAPI document (schemathesis).

``run_fuzz`` reads ``/openapi.json``, generates requests for every operation (positive data:
valid by the schema; negative data: invalid by it), sends them and checks each response:
no 5xx, a documented status, a documented content type, a body that matches the documented
schema, and invalid data refused with a 4xx. It returns counts and examples instead of
raising, so a test can assert on them and a command can print them.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup
else:  # Python 3.10: the backport schemathesis depends on there
    from exceptiongroup import BaseExceptionGroup

# The checks that define "the server does what its document says".
CHECK_NAMES = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_schema_conformance", "negative_data_rejection")
MODES = ("positive", "negative")
# Examples of each kind of failure kept in the report (the counts are complete).
MAX_EXAMPLES_PER_FAILURE = 3


@dataclass
class FuzzFailure:
    """One failed check on one request."""

    operation: str  # e.g. "POST /v1/completions"
    mode: str  # "positive" or "negative"
    check: str  # the failure's title, e.g. "Server error"
    status: int | None  # None when the request itself failed (connection refused, timeout)
    request: str  # a curl command that repeats the request
    detail: str


@dataclass
class FuzzReport:
    """What ``run_fuzz`` did and found."""

    cases: int = 0
    by_status: Counter = field(default_factory=Counter)  # "2xx", "4xx", "5xx", "error"
    by_operation: Counter = field(default_factory=Counter)
    failures: int = 0
    failure_kinds: Counter = field(default_factory=Counter)  # check title -> count
    examples: list[FuzzFailure] = field(default_factory=list)
    seconds: float = 0.0
    stopped_early: bool = False  # the time budget ran out before every operation had its cases

    @property
    def ok(self) -> bool:
        return self.failures == 0

    def summary(self) -> str:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_status.items()))
        kinds = ", ".join(f"{k}: {v}" for k, v in self.failure_kinds.most_common()) or "none"
        return (f"{self.cases} cases in {self.seconds:.1f} s ({statuses}); failures: {self.failures} ({kinds})"
                + ("; stopped early at the time budget" if self.stopped_early else ""))


def run_fuzz(base_url: str, cases: int = 300, seed: int = 0, *, modes: Iterable[str] = MODES,
             time_budget_s: float | None = None, api_key: str | None = None,
             request_timeout_s: float = 60.0, operations: Iterable[str] | None = None) -> FuzzReport:
    """Fuzz the server at ``base_url`` with about ``cases`` generated requests.

    Args:
        base_url: the server's root, e.g. ``http://127.0.0.1:8000`` (the document is read from
            ``{base_url}/openapi.json``).
        cases: the total number of requests to aim for, shared evenly over operations and
            modes (an operation with few distinct inputs, like ``GET /health``, uses fewer).
        seed: makes generation reproducible: the same seed and server give the same requests.
        modes: ``"positive"`` and/or ``"negative"`` data generation.
        time_budget_s: stop starting new cases after this many seconds (None: no limit).
        api_key: sent as ``Authorization: Bearer`` when the server needs one.
        request_timeout_s: the limit of one request.
        operations: only these operations (``"POST /v1/completions"``); default all.

    Returns:
        A ``FuzzReport``: counts of cases by status class and operation, failures by kind and
        a few examples of each.
    """
    import schemathesis

    schema = schemathesis.openapi.from_url(base_url.rstrip("/") + "/openapi.json")
    ops = [op for op in _operations(schema) if operations is None or _label(op) in set(operations)]
    modes = [m for m in modes if m in MODES]
    report = FuzzReport()
    if not ops or not modes:
        return report
    # Operations without inputs (GET /health) have one request to make; the rest share the cases.
    with_inputs = [op for op in ops if _has_inputs(op)]
    per_run = max(1, (cases - len(ops) + len(with_inputs)) // max(1, len(with_inputs) * len(modes)))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    start = time.monotonic()
    deadline = start + time_budget_s if time_budget_s is not None else None
    for mode in modes:
        for op in ops:
            _fuzz_operation(op, mode, per_run, seed, base_url, headers, request_timeout_s, deadline, report)
    report.seconds = time.monotonic() - start
    return report


def _operations(schema: Any) -> list[Any]:
    from schemathesis.core.result import Ok

    return [result.ok() for result in schema.get_all_operations() if isinstance(result, Ok)]


def _has_inputs(op: Any) -> bool:
    return any(len(getattr(op, name, ())) for name in ("body", "query", "path_parameters", "headers"))


def _label(op: Any) -> str:
    return f"{op.method.upper()} {op.path}"


def _checks() -> list[Any]:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            negative_data_rejection]


def _fuzz_operation(op: Any, mode: str, max_examples: int, seed: int, base_url: str,
                    headers: dict[str, str] | None, timeout: float, deadline: float | None,
                    report: FuzzReport) -> None:
    """Run up to ``max_examples`` generated cases of one operation, recording into ``report``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    strategy = op.as_strategy(generation_mode=GenerationMode(mode))
    checks = _checks()

    # Only Hypothesis's generate phase: no shrinking (every case is recorded, none is re-run),
    # no example database (runs must not depend on earlier ones).
    @hypothesis_seed(seed)
    @settings(max_examples=max_examples, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(case=strategy)
    def run(case: Any) -> None:
        if deadline is not None and time.monotonic() > deadline:
            report.stopped_early = True
            return
        _one_case(case, op, mode, base_url, headers, timeout, checks, report)

    try:
        run()
    except Unsatisfiable:  # nothing to negate (an operation without inputs): no cases
        pass


def _one_case(case: Any, op: Any, mode: str, base_url: str, headers: dict[str, str] | None, timeout: float,
              checks: list[Any], report: FuzzReport) -> None:
    report.cases += 1
    report.by_operation[_label(op)] += 1
    try:
        response = case.call(base_url=base_url, headers=headers, timeout=timeout)
    except Exception as exc:  # the server did not answer at all: worse than any status
        report.by_status["error"] += 1
        _record(report, op, mode, "No response", None, case, base_url, f"{type(exc).__name__}: {exc}")
        return
    status = response.status_code
    report.by_status[f"{status // 100}xx"] += 1
    try:
        case.validate_response(response, checks=checks, headers=headers)
    except (Exception, BaseExceptionGroup) as exc:  # FailureGroup: failed checks; or a check that broke
        for failure in getattr(exc, "exceptions", [exc]):
            title = getattr(failure, "title", type(failure).__name__)
            detail = getattr(failure, "message", str(failure))
            _record(report, op, mode, title, status, case, base_url, detail)


def _record(report: FuzzReport, op: Any, mode: str, title: str, status: int | None, case: Any, base_url: str,
            detail: str) -> None:
    report.failures += 1
    report.failure_kinds[title] += 1
    if report.failure_kinds[title] <= MAX_EXAMPLES_PER_FAILURE:
        try:
            request = case.as_curl_command(base_url=base_url)
        except Exception:  # a case schemathesis cannot render still deserves its report
            request = repr(case.body)[:2000]
        report.examples.append(FuzzFailure(_label(op), mode, title, status, request, str(detail)[:2000]))
