"""``pagoda bench serve``: load-test an OpenAI-compatible server.

Sends streaming completions (or chat completions) at a chosen arrival rate
and concurrency, times every chunk, and reports throughput, TTFT, TPOT, ITL,
end-to-end latency and goodput. Only the public OpenAI HTTP API is used, so
the same run can be pointed at any compatible server to compare like with
like. With ``--images N`` (chat endpoint, a vision-language model) every
request opens with ``N`` seeded noise images of ``--image-size``, sent as
``data:`` URLs in ``image_url`` parts (each request its own images).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, AsyncIterator, Sequence

import numpy as np
from tqdm import tqdm

from pagoda.bench.datasets import (
    Dataset, SampleRequest, TokenizerLike, gen_prefix_dataset, gen_random_dataset,
    load_sharegpt_dataset, parse_dataset_spec, parse_range,
)
from pagoda.bench.extras import bench_import, lazy_import
from pagoda.bench.serve_metrics import (
    RequestResult, compute_summary, format_summary, parse_goodput,
)
from pagoda.entrypoints.argtypes import non_negative_int, positive_int

# bench extra, imported on first use (pagoda.bench.extras)
aiohttp = lazy_import("aiohttp")
httpx = lazy_import("httpx")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# --------------------------------------------------------------------------- CLI

def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Options shared by ``bench serve`` and ``bench sweep``."""
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    g.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions",
                   help="completions -> /v1/completions, chat -> /v1/chat/completions")
    g.add_argument("--model", default=None, help="model name; unset: first id of GET /v1/models")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir: build text prompts and count tokens with it; "
                        "without it random prompts are token-id lists and counts come from usage")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0,
                   help="seconds; generous because queued requests can wait a long time")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random", type=_dataset_arg,
                   help="random | prefix | sharegpt:PATH")
    g.add_argument("--num-prompts", type=positive_int, default=1000, help="requests to send")
    g.add_argument("--input-len", default="1024:1024", help="random dataset prompt length MIN:MAX")
    g.add_argument("--output-len", default="128:128",
                   help="output length MIN:MAX (random, prefix)")
    g.add_argument("--prefix-num-groups", type=int, default=8,
                   help="prefix dataset: K shared prefixes")
    g.add_argument("--prefix-len", type=int, default=512,
                   help="prefix dataset: tokens per prefix")
    g.add_argument("--question-len", default="64:64",
                   help="prefix dataset: question length MIN:MAX")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: override every output length")
    g.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    g.add_argument("--images", type=non_negative_int, default=0,
                   help="images per request (chat endpoint, a vision-language model): seeded noise "
                        "images sent as data: URLs, each request its own")
    g.add_argument("--image-size", type=_image_size, default="224x224",
                   help="HEIGHTxWIDTH of each image, in pixels (as bench throughput)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_parse_rate, default=math.inf,
                   help="requests/s, or inf to send everything at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times; 1 = Poisson, <1 burstier, >1 smoother")
    g.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="cap on requests in flight (default: no cap)")

    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every request generates its full output length")
    g.add_argument("--extra-body", type=_json_object, default=None,
                   help="JSON object merged into every request body")

    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:200 tpot:50 e2el:5000")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--save-detailed", action="store_true",
                   help="also write every request's inter-token latencies to the JSON")


def add_serve_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` under the ``pagoda bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "serve", help="benchmark an OpenAI-compatible server",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(p)
    p.add_argument("--output-json", default=None, help="write the result here")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="write TTFT/ITL histograms and CDFs here")
    p.set_defaults(func=serve_main)
    return p


def serve_main(args: argparse.Namespace) -> int:
    run_serve_bench(args)
    return 0


def _dataset_arg(s: str) -> str:
    try:
        parse_dataset_spec(s)  # reject typos at parse time, not after model lookup
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _image_size(s: str) -> str:
    height, _, width = s.partition("x")
    if not (height.isdigit() and int(height) > 0 and (not width or (width.isdigit() and int(width) > 0))):
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH in pixels such as 224x224, got {s!r}")
    return s


def _json_object(s: str) -> dict[str, Any]:
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def _parse_rate(s: str) -> float:
    rate = float(s)  # float() already accepts "inf"
    if rate <= 0:
        raise argparse.ArgumentTypeError("request rate must be > 0")
    return rate


# ------------------------------------------------------------------ arrivals

def arrival_intervals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seeded gaps between successive requests, in seconds.

    Gamma with shape ``burstiness`` and scale ``1/(rate*burstiness)`` has
    mean ``1/rate`` for every shape; shape 1 is the exponential, i.e. a
    Poisson process. An infinite rate means no gaps.
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng([seed, 100])
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times relative to the start: the first request goes at 0."""
    gaps = arrival_intervals(n, rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)


# ------------------------------------------------------------------ setup

def raise_open_file_limit(target: int = 65535) -> None:
    """Lift the soft fd limit: an uncapped run holds one socket per request,
    and the common default of 1024 would fail a 1000-prompt burst."""
    try:
        import resource
    except ImportError:  # not available on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def fetch_default_model(base_url: str, api_key: str | None = None) -> str:
    """First model id the server lists."""
    r = httpx.get(f"{normalize_base_url(base_url)}/v1/models", headers=_headers(api_key),
                  timeout=30.0)
    r.raise_for_status()
    models = r.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models; pass --model")
    return str(models[0]["id"])


@lru_cache(maxsize=4)
def load_tokenizer(path: str) -> TokenizerLike:
    """Load a HF tokenizer; imported lazily since transformers is slow to import."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_dataset(args: argparse.Namespace, tokenizer: TokenizerLike | None) -> Dataset:
    name, path = parse_dataset_spec(args.dataset)
    as_text = args.endpoint == "chat"
    if name == "random":
        return gen_random_dataset(args.num_prompts, parse_range(args.input_len),
                                  parse_range(args.output_len), args.seed, tokenizer, as_text)
    if name == "prefix":
        return gen_prefix_dataset(args.num_prompts, args.prefix_num_groups, args.prefix_len,
                                  parse_range(args.question_len), parse_range(args.output_len),
                                  args.seed, tokenizer, as_text)
    assert path is not None
    return load_sharegpt_dataset(path, args.num_prompts, args.seed, tokenizer,
                                 args.sharegpt_output_len)


def image_data_urls(index: int, count: int, size: str, seed: int) -> list[str]:
    """Request ``index``'s ``count`` images (seeded noise of ``size`` HEIGHTxWIDTH, the
    throughput benchmark's ``noise_image``) as PNG ``data:`` URLs."""
    import base64
    import io

    from pagoda.bench.hf_peer import noise_image

    height, _, width = size.partition("x")
    urls = []
    for j in range(count):
        buf = io.BytesIO()
        noise_image(seed + index * count + j, int(height), int(width or height)).save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def build_payload(endpoint: str, model: str, prompt: str | list[int], max_tokens: int,
                  temperature: float = 0.0, ignore_eos: bool = True,
                  extra_body: dict[str, Any] | None = None, images: Sequence[str] = ()) -> dict[str, Any]:
    """Request body for one streamed request; ``images`` (URLs) open the chat message."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint needs text prompts")
        content: str | list[dict[str, Any]] = prompt
        if images:
            content = [*({"type": "image_url", "image_url": {"url": url}} for url in images),
                       {"type": "text", "text": prompt}]
        body["messages"] = [{"role": "user", "content": content}]
    elif images:
        raise ValueError("images go in chat requests: use --endpoint chat")
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True  # extension field: generate exactly max_tokens
    body.update(extra_body or {})
    return body


# ------------------------------------------------------------------ one request

def _chunk_text(data: dict[str, Any], endpoint: str) -> str | None:
    """Generated text in one SSE event, or None when it carries no token.

    Chat streams open with a role-only delta and completions streams may end
    with an empty finish chunk; neither is a token, so neither may start the
    TTFT clock or add an ITL gap. A completions chunk with empty text but no
    finish reason is a token that has not decoded to text yet, so it counts.
    """
    choices = data.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if endpoint == "chat":
        delta = c.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
        return text or None
    text = c.get("text") or ""
    return text if text or c.get("finish_reason") is None else None


async def stream_request(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], endpoint: str,
    prompt_len: int = 0, tokenizer: TokenizerLike | None = None,
) -> RequestResult:
    """Send one streaming request and time each content chunk."""
    res = RequestResult(prompt_len=prompt_len)
    chunks: list[str] = []
    usage: dict[str, Any] = {}
    st = res.start_time = time.perf_counter()
    last = st
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = await resp.text(errors="replace")
                res.error = f"HTTP {resp.status}: {body[:500]}"
                return res
            async for line, now in _sse_lines(resp):
                data = _parse_sse_line(line)
                if data is None:
                    continue
                if "error" in data:
                    res.error = f"stream error: {json.dumps(data['error'])[:500]}"
                    return res
                text = _chunk_text(data, endpoint)
                if text is not None:
                    if not chunks:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks.append(text)
                usage = data.get("usage") or usage
    except Exception as e:  # network errors, timeouts, bad JSON: a failed request
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency = time.perf_counter() - st
    return res if res.error else _finish(res, chunks, usage, tokenizer)


async def _sse_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, float]]:
    """Lines of an event stream with the time their bytes arrived (taken before any parsing,
    so the clock times the server, not our JSON work). Buffers by hand: a line (an event with
    many logprobs, say) may be longer than aiohttp's readline limit."""
    pending = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace").rstrip("\r"), now
    if pending:
        yield pending.decode("utf-8", errors="replace"), time.perf_counter()


def _parse_sse_line(line: str) -> dict[str, Any] | None:
    """JSON payload of a ``data:`` line; None for blanks, comments, [DONE]."""
    if not line.startswith("data:"):
        return None
    body = line[5:].strip()
    if not body or body == "[DONE]":
        return None
    return json.loads(body)


def _finish(res: RequestResult, chunks: list[str], usage: dict[str, Any],
            tokenizer: TokenizerLike | None) -> RequestResult:
    if not chunks:
        res.error = "stream ended without any content chunk"
        return res
    res.generated_text = "".join(chunks)
    if usage.get("completion_tokens") is not None:
        res.output_tokens = int(usage["completion_tokens"])
    elif tokenizer is not None:
        res.output_tokens = len(tokenizer.encode(res.generated_text, add_special_tokens=False))
    else:
        res.output_tokens = len(chunks)  # lower bound if chunks carry several tokens
    if usage.get("prompt_tokens") is not None:
        res.prompt_len = int(usage["prompt_tokens"])
    res.success = True
    return res


# ------------------------------------------------------------------ the run

async def run_requests(
    url: str, payloads: Sequence[dict[str, Any]], prompt_lens: Sequence[int],
    offsets: Sequence[float], endpoint: str, max_concurrency: int | None = None,
    headers: dict[str, str] | None = None, timeout: float = 6 * 3600.0,
    tokenizer: TokenizerLike | None = None, disable_tqdm: bool = False,
) -> tuple[list[RequestResult], float, int]:
    """Send every payload at its offset; return results, duration, peak in flight.

    Arrivals are scheduled against absolute times so that slow event-loop
    iterations do not accumulate into a lower effective rate. The
    concurrency cap is applied after arrival, as a queue in front of the
    server, so it never changes the arrival process itself.
    """
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = tqdm(total=len(payloads), disable=disable_tqdm, desc="requests")
    inflight = peak = 0

    async with _session(timeout, headers, max_concurrency) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            nonlocal inflight, peak
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem or contextlib.nullcontext():
                inflight += 1
                peak = max(peak, inflight)
                try:
                    r = await stream_request(client, url, payloads[i], endpoint,
                                             prompt_lens[i], tokenizer)
                finally:
                    inflight -= 1
            pbar.update(1)
            return r

        results = await asyncio.gather(*(one(i) for i in range(len(payloads))))
        duration = time.perf_counter() - start
    pbar.close()
    return list(results), duration, peak


def _session(timeout: float, headers: dict[str, str] | None,
             max_connections: int | None = None) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, whose C-accelerated parser keeps the client's
    own CPU use small (it shares the machine with the server in a local benchmark)."""
    connector = aiohttp.TCPConnector(limit=max_connections or 0)
    return aiohttp.ClientSession(connector=connector, headers=headers or {},
                                 timeout=aiohttp.ClientTimeout(total=timeout))


async def probe_server(url: str, payload: dict[str, Any], endpoint: str,
                       headers: dict[str, str], timeout: float) -> None:
    """Fail fast, with the server's own message, if a request is rejected."""
    async with _session(timeout, headers) as session:
        r = await stream_request(session, url, payload, endpoint)
    if not r.success:
        raise RuntimeError(f"probe request to {url} failed: {r.error}")


def _probe_prompt(sample: SampleRequest) -> str | list[int]:
    # Deliberately unrelated to the dataset so that it warms no prefix cache
    # entry the workload could later hit.
    return [11, 12, 13, 14] if isinstance(sample.prompt, list) else "Hello, probe."


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run one benchmark as configured by ``args``; print and return the result.

    Also writes ``args.output_json`` and ``args.plot`` when they are set.
    """
    raise_open_file_limit()
    base = normalize_base_url(args.base_url)
    url = base + ENDPOINT_PATHS[args.endpoint]
    headers = _headers(args.api_key)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    model = args.model or fetch_default_model(base, args.api_key)
    images = getattr(args, "images", 0)
    if images and args.endpoint != "chat":
        raise ValueError("--images sends image_url parts in chat requests: add --endpoint chat")
    dataset = build_dataset(args, tokenizer)
    payloads = [build_payload(args.endpoint, model, r.prompt, r.expected_output_len,
                              args.temperature, args.ignore_eos, args.extra_body,
                              image_data_urls(i, images, args.image_size, args.seed) if images else ())
                for i, r in enumerate(dataset.requests)]
    offsets = arrival_offsets(len(payloads), args.request_rate, args.burstiness, args.seed)
    slos = parse_goodput(args.goodput)

    # With images the probe carries its own (past the dataset's: it primes no cache entry a
    # request could hit), so a server that takes no images fails here, and the image path's
    # first-use setup is not timed.
    probe = build_payload(args.endpoint, model, _probe_prompt(dataset.requests[0]), 2,
                          args.temperature, args.ignore_eos, args.extra_body,
                          image_data_urls(len(payloads), images, args.image_size, args.seed) if images else ())
    asyncio.run(probe_server(url, probe, args.endpoint, headers, args.request_timeout))

    results, duration, peak = asyncio.run(run_requests(
        url, payloads, [r.prompt_len for r in dataset.requests], offsets.tolist(),
        args.endpoint, args.max_concurrency, headers, args.request_timeout, tokenizer,
        args.disable_tqdm))
    summary = compute_summary(results, duration, slos, max_concurrency_used=peak)

    config = _config_dict(args, base, model, dataset)
    extra = [("Request rate (req/s):", _rate_str(args.request_rate))]
    if images:
        extra.append(("Images per request:", f"{images} of {args.image_size}"))
    if dataset.ideal_prefix_hit_fraction is not None:
        extra.append(("Ideal prefix hit fraction:", dataset.ideal_prefix_hit_fraction))
    print(format_summary(summary, extra))

    out = _result_dict(config, summary, results, args.save_detailed)
    if getattr(args, "output_json", None):
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    if getattr(args, "plot", None):
        plot_run(results, args.plot, title=f"{model} @ {_rate_str(args.request_rate)} req/s")
    return out


def _rate_str(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _config_dict(args: argparse.Namespace, base: str, model: str, ds: Dataset) -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": base, "endpoint": args.endpoint, "model": model,
        "tokenizer": args.tokenizer, "dataset": args.dataset, "dataset_info": ds.info,
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len,
        # JSON has no infinity, so an unlimited rate is written as "inf".
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "seed": args.seed, "temperature": args.temperature, "ignore_eos": args.ignore_eos,
        "ideal_prefix_hit_fraction": ds.ideal_prefix_hit_fraction,
        "images": getattr(args, "images", 0), "image_size": getattr(args, "image_size", None),
    }


def _result_dict(config: dict[str, Any], summary: Any, results: list[RequestResult],
                 detailed: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"config": config, **summary.to_flat_dict()}
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_tokens for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["e2els"] = [r.latency for r in results]
    out["errors"] = [r.error for r in results]
    if detailed:
        out["itls"] = [r.itl for r in results]
    return out


# ------------------------------------------------------------------ plots

def plot_run(results: Sequence[RequestResult], path: str, title: str = "") -> None:
    """Histograms and CDFs of TTFT and ITL for one run, as a PNG."""
    matplotlib = bench_import("matplotlib")
    matplotlib.use("Agg")  # headless: benchmarks run on servers
    plt = bench_import("matplotlib.pyplot")

    ok = [r for r in results if r.success]
    series = {"TTFT (ms)": np.array([r.ttft for r in ok]) * 1000.0,
              "ITL (ms)": np.array([x for r in ok for x in r.itl]) * 1000.0}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for row, (label, ms) in enumerate(series.items()):
        _hist_and_cdf(axes[row][0], axes[row][1], ms, label)
    fig.suptitle(title or "pagoda bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _hist_and_cdf(ax_hist: Any, ax_cdf: Any, ms: np.ndarray, label: str) -> None:
    if ms.size == 0:
        for ax in (ax_hist, ax_cdf):
            ax.text(0.5, 0.5, "no data", ha="center", va="center")
        return
    ax_hist.hist(ms, bins=min(50, max(5, ms.size // 5)))
    ax_hist.set_xlabel(label)
    ax_hist.set_ylabel("count")
    xs = np.sort(ms)
    ax_cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size)
    for p in (50, 90, 99):
        ax_cdf.axvline(np.percentile(ms, p), ls="--", lw=0.8, color="gray")
    ax_cdf.set_xlabel(label)
    ax_cdf.set_ylabel("CDF")
    ax_cdf.grid(alpha=0.3)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagoda.bench.serve ...``: same as ``pagoda bench serve``."""
    parser = argparse.ArgumentParser(prog="pagoda-bench")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_serve_cli(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
