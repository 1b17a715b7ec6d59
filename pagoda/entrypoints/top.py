"""``pagoda top``: the dashboard's snapshot (``GET /dashboard/api/state``) in a terminal.

    pagoda top [--url http://127.0.0.1:8000] [--api-key KEY] [--model NAME] [--interval 1] [--once]

Redraws the screen with plain ANSI escapes every ``--interval`` seconds until Ctrl-C;
``--once`` prints one frame without escapes and exits (0, or 1 when the server cannot be read,
2 when it refuses the key). The key defaults to ``$PAGODA_API_KEY``, as for ``pagoda serve``.
Reads with the standard library only, so it runs wherever pagoda is installed. A server of
several models shows ``--model``'s snapshot (default: its first loaded model) and a line per model.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pagoda.entrypoints.openai.dashboard import STATE_PATH

DEFAULT_URL = "http://127.0.0.1:8000"
ONCE_WIDTH = 120
_CLEAR = "\x1b[H\x1b[J"


class KeyRefused(RuntimeError):
    """The server answered 401: no key, or the wrong one."""


def fetch_state(url: str, api_key: str | None, timeout: float = 10.0, model: str | None = None) -> dict[str, Any]:
    """The dashboard snapshot of the server at ``url`` (of ``model`` on a server of several);
    raises ``KeyRefused`` on a 401 and ``OSError`` (``urllib.error.URLError``; an ``HTTPError``
    404 for a model the server does not serve) when the server cannot be read."""
    query = "?" + urllib.parse.urlencode({"model": model}) if model else ""
    request = urllib.request.Request(url.rstrip("/") + STATE_PATH + query)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise KeyRefused("the server refused the API key (give --api-key or set PAGODA_API_KEY)") from exc
        raise


# ---- formatting ---------------------------------------------------------------------------------

def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _printable(text: str) -> str:
    """A prompt's text on one line: control characters (escapes included) shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _mean_last_minute(history: list[dict[str, Any]], key: str) -> float | None:
    if not history:
        return None
    cut = history[-1]["t"] - 60
    values = [s[key] for s in history if s["t"] >= cut and s[key] is not None]
    return sum(values) / len(values) if values else None


def _bar(parts: list[tuple[int, str]], total: int, width: int) -> str:
    cells = ""
    for count, mark in parts:
        cells += mark * round(width * count / max(total, 1))
    return "[" + cells[:width].ljust(width, ".") + "]"


# ---- the frame ----------------------------------------------------------------------------------

def render(state: dict[str, Any], width: int = ONCE_WIDTH, height: int | None = None) -> str:
    """One frame of text for ``state`` (the JSON of ``/dashboard/api/state``), lines cut at
    ``width``; the request list is cut to fit ``height`` lines when given."""
    if state.get("engine") is None:  # a model of several, not loaded
        s = state["server"]
        lines = [f"pagoda top - {s['model']} - {s.get('status', 'not loaded')}: not loaded; it loads at its first "
                 "request (or POST /models/load)", *_models(state)]
        return "\n".join(line[:width] for line in lines)
    head = _summary(state) + _models(state) + _classes(state)
    tail = _prefixes(state)
    room = None if height is None else max(height - len(head) - len(tail) - 4, 1)
    return "\n".join(line[:width] for line in head + _requests(state, room) + tail)


def _summary(state: dict[str, Any]) -> list[str]:
    e, c, s, hist = state["engine"], state["counters"], state["server"], state["history"]
    k = e["kernel"]
    last = hist[-2] if len(hist) > 1 else (hist[-1] if hist else None)
    kv_total = max(e["num_blocks"], 1)
    hit = (f"{100 * c['prefix_cache_hits'] / c['prefix_cache_queries']:.1f} %"
           if c["prefix_cache_queries"] else "-")
    lines = [
        f"pagoda top - {s['model']} - {e['device']} {e['device_name']} - kernels {k.get('level', '?')}"
        + (f" (gemm {k['gemm']})" if "gemm" in k else "") + f" - up {_duration(s['uptime_s'])}"
        + (f" - ASLEEP (level {e['sleeping']})" if e["sleeping"] else ""),
        f"requests   running {e['num_running']}  waiting {e['num_waiting']}  finished {c['finished']}  "
        f"aborted {c['aborted']}  failed {c['failed']}  timed out {c['timeout']}  preemptions {c['preemptions']}",
        f"tokens/s   prompt {_num(last['prompt_tps'] if last else None, 1)}  generation "
        f"{_num(last['generation_tps'] if last else None, 1)}  (last {_num(last['dt'] if last else None)} s)   "
        f"totals: prompt {c['prompt_tokens']}  generation {c['generation_tokens']}",
        f"latency    TTFT {_ms(_mean_last_minute(hist, 'ttft_mean'))}  (p90 {_ms(_mean_last_minute(hist, 'ttft_p90'))})"
        f"  ITL {_ms(_mean_last_minute(hist, 'itl_mean'))}  (p90 {_ms(_mean_last_minute(hist, 'itl_p90'))})"
        "  over the last minute",
        f"KV cache   {_bar([(e['num_used_blocks'], '#'), (e['num_cached_blocks'], '=')], kv_total, 30)} "
        f"{100 * e['kv_cache_usage']:.1f} % used: {e['num_used_blocks']} held, {e['num_cached_blocks']} cached, "
        f"{e['num_free_blocks']} free of {e['num_blocks']} blocks ({e['block_size']} tokens); prefix hit rate {hit}",
    ]
    for t in e["tiers"]:
        lines.append(f"  tier {t['name']:<6} {_num(t['num_blocks'])} blocks  {_bytes(t['used_bytes'])} of "
                     f"{_bytes(t['capacity_bytes'])}  hits {c['kv_offload'].get(t['name'] + '/hit', '-')}  "
                     f"saved {c['kv_offload'].get(t['name'] + '/saved', '-')}")
    return lines


def _models(state: dict[str, Any]) -> list[str]:
    """A server of several models: one line per model (shown first: the one this frame is of)."""
    lines = []
    for m in state.get("models") or []:
        mark = "*" if m["name"] == state["server"]["model"] else " "
        lines.append(f"model {mark} {m['name'][:30]:<30} {m['status']:<9} in flight {m['in_flight']:<4} "
                     f"loads {m['loads']:<3}" + (f" asleep (level {m['sleeping']})" if m["sleeping"] else "")
                     + (f" adapters {', '.join(m['adapters'])}" if m["adapters"] else ""))
    return lines


def _classes(state: dict[str, Any]) -> list[str]:
    e = state["engine"]
    lines = []
    for title, live, finished, name in (("priority", e["by_priority"], state["finished_by_priority"], str),
                                        ("adapter", e["by_adapter"], state["finished_by_adapter"],
                                         lambda k: k or "(base)")):
        keys = sorted({*live.get("running", {}), *live.get("waiting", {}), *finished})
        cells = []
        for key in keys:
            f = finished.get(key, {})
            cells.append(f"{name(key)}: run {live.get('running', {}).get(key, 0)} wait "
                         f"{live.get('waiting', {}).get(key, 0)} done {f.get('finished', 0)} "
                         f"TTFT {_ms(f.get('ttft_mean'))}")
        lines.append(f"by {title:<8} " + ("  |  ".join(cells) if cells else "-"))
    return lines


def _requests(state: dict[str, Any], room: int | None) -> list[str]:
    e = state["engine"]
    rows = e["requests"] if room is None else e["requests"][:room]
    lines = ["", f"{'REQUEST':<40} {'STATE':<8} {'AGE':>7} {'PRIO':>5} {'ADAPTER':<12} {'PROMPT':>7} "
                 f"{'DONE':>7} {'OUT':>6} {'CACHED':>7} {'PREEMPT':>7}"]
    for r in rows:
        lines.append(f"{r['request_id'][:40]:<40} {r['state']:<8} {r['age_s']:>6.1f}s {r['priority']:>5} "
                     f"{(r['adapter'] or '')[:12]:<12} {r['num_prompt_tokens']:>7} {r['num_computed_tokens']:>7} "
                     f"{r['num_output_tokens']:>6} {r['num_cached_tokens']:>7} {r['num_preemptions']:>7}")
    hidden = e["num_running"] + e["num_waiting"] - len(rows)
    if hidden > 0:
        lines.append(f"... and {hidden} more")
    return lines


def _prefixes(state: dict[str, Any]) -> list[str]:
    prefixes = state["engine"]["prefixes"]
    lines = ["", f"{'HOT PREFIX':<16} {'TOKENS':>7} {'HITS':>6} {'HELD':>5}  START"]
    for p in prefixes:
        text = "(private: salted)" if p["preview"] is None else repr(_printable(p["preview"]))
        lines.append(f"{p['hash']:<16} {p['num_tokens']:>7} {p['hits']:>6} {'yes' if p['referenced'] else 'no':>5}"
                     f"  {text}")
    if not prefixes:
        lines.append("(none cached yet)")
    return lines


# ---- the command --------------------------------------------------------------------------------

def run_top(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("pagoda top: --interval must be > 0", file=sys.stderr)
        return 2
    if args.once:
        try:
            print(render(fetch_state(args.url, args.api_key, model=args.model)))
        except KeyRefused as exc:
            print(f"pagoda top: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"pagoda top: cannot read {args.url}: {exc}", file=sys.stderr)
            return 1
        return 0
    return _live(args)


def _live(args: argparse.Namespace) -> int:
    out = sys.stdout
    out.write("\x1b[?25l")  # hide the cursor while redrawing
    try:
        while True:
            size = shutil.get_terminal_size()
            try:
                frame = render(fetch_state(args.url, args.api_key, model=args.model), size.columns, size.lines)
            except KeyRefused as exc:
                out.write(_CLEAR + f"pagoda top: {exc}\n")
                return 2
            except OSError as exc:
                frame = f"pagoda top: cannot read {args.url}: {exc} (retrying)"
            out.write(_CLEAR + frame + "\n")
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        out.write("\x1b[?25h")
        out.flush()


def add_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser("top", help="the dashboard in a terminal (a running server's requests, "
                                               "throughput, KV cache, hot prefixes)",
                                   description="Show a running pagoda server's dashboard snapshot "
                                               f"({STATE_PATH}) in the terminal.")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                        help="the server's API key (default: $PAGODA_API_KEY)")
    parser.add_argument("--model", default=None,
                        help="a server of several models: the model to show (default: its first loaded model)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame without screen control and exit")
    parser.set_defaults(func=run_top)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagoda.entrypoints.top``: the same command without loading the rest of the CLI."""
    root = argparse.ArgumentParser(prog="pagoda")
    add_cli(root.add_subparsers(dest="command", required=True))
    args = root.parse_args(["top", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
