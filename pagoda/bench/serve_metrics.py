"""Per-request results and the aggregate summary of a pagoda serving benchmark.

Metric definitions (all latencies reported in milliseconds):

* TTFT: request start to the first content chunk.
* ITL: gap between successive content chunks. A chunk carrying several
  tokens contributes one gap, not one per token, because that gap is what a
  user actually waits for.
* TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``; only requests
  with more than one output token have a TPOT.
* E2EL: request start to the end of the stream.
* Goodput: completed requests per second that meet every given SLO.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """What one streamed request did. Times are seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0  # end-to-end
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0  # perf_counter at send, for concurrency accounting
    error: str = ""
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class LatencyStats:
    """Distribution summary of one latency metric, in milliseconds."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = 0.0
    percentiles: dict[str, float] = field(default_factory=dict)  # "p90" -> ms

    @classmethod
    def of(cls, seconds: Sequence[float],
           percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> "LatencyStats":
        if len(seconds) == 0:
            return cls(percentiles={_pkey(p): 0.0 for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(
            mean=float(ms.mean()), median=float(np.median(ms)), std=float(ms.std()),
            min=float(ms.min()), max=float(ms.max()),
            percentiles={_pkey(p): float(np.percentile(ms, p)) for p in percentiles},
        )


def _pkey(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


@dataclass
class BenchSummary:
    """Aggregate result of one benchmark run."""

    completed: int
    failed: int
    duration: float  # seconds
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    max_concurrency_used: int = 0
    request_goodput: float | None = None
    goodput_slos_ms: dict[str, float] | None = None
    errors: list[str] = field(default_factory=list)

    def to_flat_dict(self) -> dict[str, Any]:
        """JSON form with ``<stat>_<metric>_ms`` keys, the common convention
        of serving benchmarks, so existing comparison scripts can read it."""
        out: dict[str, Any] = {
            k: v for k, v in asdict(self).items()
            if k not in LATENCY_METRICS
        }
        for name in LATENCY_METRICS:
            stats: LatencyStats = getattr(self, name)
            for stat in ("mean", "median", "std", "min", "max"):
                out[f"{stat}_{name}_ms"] = getattr(stats, stat)
            for pk, v in stats.percentiles.items():
                out[f"{pk}_{name}_ms"] = v
        return out


def parse_goodput(specs: Iterable[str] | None) -> dict[str, float]:
    """Parse ``["ttft:100", "tpot:20"]`` into ``{"ttft": 100.0, ...}`` (ms)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        for item in spec.split():
            name, sep, value = item.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(f"bad goodput SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS")
            ms = float(value)
            if ms < 0:
                raise ValueError(f"goodput SLO {item!r} must be >= 0")
            slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (bounds inclusive).

    A single-token request has no TPOT; it counts as meeting a TPOT SLO since
    it produced no inter-token wait at all.
    """
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * 1000.0 <= v for k, v in slos_ms.items())


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, from their start/end times."""
    events = []
    for r in results:
        if r.start_time <= 0.0:
            continue  # never sent
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    # Ends sort before starts at equal times: back-to-back is not overlap.
    events.sort(key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def compute_summary(
    results: Sequence[RequestResult],
    duration: float,
    goodput_slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    max_concurrency_used: int | None = None,
) -> BenchSummary:
    """Aggregate per-request results over a run of ``duration`` seconds."""
    ok = [r for r in results if r.success]
    tokens_in = sum(r.prompt_len for r in ok)
    tokens_out = sum(r.output_tokens for r in ok)
    dur = duration if duration > 0 else float("inf")
    goodput = None
    if goodput_slos_ms:
        goodput = sum(meets_slos(r, goodput_slos_ms) for r in ok) / dur
    return BenchSummary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration=duration,
        total_input_tokens=tokens_in,
        total_output_tokens=tokens_out,
        request_throughput=len(ok) / dur,
        output_throughput=tokens_out / dur,
        total_token_throughput=(tokens_in + tokens_out) / dur,
        ttft=LatencyStats.of([r.ttft for r in ok], percentiles),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot) is not None], percentiles),
        itl=LatencyStats.of([x for r in ok for x in r.itl], percentiles),
        e2el=LatencyStats.of([r.latency for r in ok], percentiles),
        max_concurrency_used=(peak_concurrency(results) if max_concurrency_used is None
                              else max_concurrency_used),
        request_goodput=goodput,
        goodput_slos_ms=dict(goodput_slos_ms) if goodput_slos_ms else None,
        errors=[r.error for r in results if not r.success][:20],
    )


_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value:<10}"


def format_summary(s: BenchSummary, extra_rows: Sequence[tuple[str, Any]] = ()) -> str:
    """A fixed-width result table in the familiar serving-benchmark layout."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Successful requests:", s.completed),
             _row("Failed requests:", s.failed),
             _row("Benchmark duration (s):", s.duration),
             _row("Total input tokens:", s.total_input_tokens),
             _row("Total generated tokens:", s.total_output_tokens),
             _row("Request throughput (req/s):", s.request_throughput)]
    if s.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", s.request_goodput))
    lines += [_row("Output token throughput (tok/s):", s.output_throughput),
              _row("Total token throughput (tok/s):", s.total_token_throughput),
              _row("Max concurrency used:", s.max_concurrency_used)]
    lines += [_row(label, value) for label, value in extra_rows]
    for name, title in _TITLES.items():
        lines += _stat_rows(name.upper(), title, getattr(s, name))
    lines.append("=" * 50)
    return "\n".join(lines)


def _stat_rows(short: str, title: str, st: LatencyStats) -> list[str]:
    rows = ["{s:{c}^{n}}".format(s=title, n=50, c="-"),
            _row(f"Mean {short} (ms):", st.mean),
            _row(f"Median {short} (ms):", st.median),
            _row(f"Std {short} (ms):", st.std)]
    rows += [_row(f"{k.upper()} {short} (ms):", v) for k, v in st.percentiles.items()
             if k != "p50"]
    rows.append(_row(f"Max {short} (ms):", st.max))
    return rows
