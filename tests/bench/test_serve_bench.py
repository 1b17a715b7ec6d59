"""Tests for ``pagoda bench serve`` / ``pagoda bench sweep``.

The client is exercised end to end against ``fake_openai_server`` (a tiny
streaming server with known token counts) and against a live ``pagoda serve``
on a tiny model; metrics, arrivals and datasets are unit-tested with
synthetic inputs whose right answers are known.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for fake_openai_server
sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))  # for server_helpers

from fake_openai_server import FakeConfig, FakeOpenAIServer  # noqa: E402
from server_helpers import ServerProcess, start_server  # noqa: E402

from pagoda.bench.datasets import (  # noqa: E402
    NO_TOKENIZER_ID_RANGE, gen_prefix_dataset, gen_random_dataset,
    ideal_prefix_hit_fraction, load_sharegpt_dataset, parse_dataset_spec, parse_range,
)
from pagoda.bench.serve import (  # noqa: E402
    add_serve_cli, arrival_intervals, arrival_offsets, build_payload, run_serve_bench,
)
from pagoda.bench.serve_metrics import (  # noqa: E402
    LatencyStats, RequestResult, compute_summary, format_summary, meets_slos,
    parse_goodput, peak_concurrency,
)
from pagoda.bench.sweep import add_sweep_cli, parse_rates, run_sweep  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------- helpers

def _parse(cmd: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_serve_cli(sub)
    add_sweep_cli(sub)
    return parser.parse_args([cmd, *argv])


def _serve_args(base_url: str, *argv: str) -> argparse.Namespace:
    return _parse("serve", "--base-url", base_url, "--disable-tqdm", "--seed", "1", *argv)


@pytest.fixture
def server() -> Any:
    with FakeOpenAIServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A word-level HF tokenizer saved to disk: one token per space-separated
    word, the same count the fake server uses for text prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(300)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def bpe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small byte-level BPE tokenizer, whose vocab (like real ones) holds
    partial UTF-8 pieces that do not survive a decode/encode round trip."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [f"serving engine {i} pages blocks tokens caché über naïve" for i in range(300)]
    tk.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("bpe")
    fast.save_pretrained(str(path))
    return str(path)


def _result(ttft: float, latency: float, out: int, itl: list[float] | None = None,
            start: float = 1.0, prompt: int = 10, ok: bool = True) -> RequestResult:
    return RequestResult(success=ok, prompt_len=prompt, output_tokens=out, ttft=ttft,
                         latency=latency, itl=itl or [], start_time=start,
                         error="" if ok else "boom")


# ----------------------------------------------------------------- metrics

def test_latency_stats_known_values() -> None:
    ttfts = [0.010, 0.020, 0.030, 0.040, 0.050]
    st = LatencyStats.of(ttfts)
    assert st.mean == pytest.approx(30.0)
    assert st.median == pytest.approx(30.0)
    assert st.min == pytest.approx(10.0) and st.max == pytest.approx(50.0)
    assert st.std == pytest.approx(float(np.std([10, 20, 30, 40, 50])))
    # linear interpolation: p90 of 10..50 lies 0.6 of the way from 40 to 50
    assert st.percentiles["p90"] == pytest.approx(46.0)
    assert st.percentiles["p99"] == pytest.approx(49.6)


def test_summary_from_synthetic_results() -> None:
    results = [
        _result(0.1, 1.1, 11, itl=[0.1] * 10, prompt=100),   # tpot 100 ms
        _result(0.2, 2.2, 5, itl=[0.5] * 4, prompt=50),      # tpot 500 ms
        _result(0.3, 0.3, 1, prompt=20),                     # single token: no tpot
        _result(0.0, 0.5, 0, ok=False),                      # failures are excluded
    ]
    s = compute_summary(results, duration=2.0)
    assert (s.completed, s.failed) == (3, 1)
    assert s.total_input_tokens == 170 and s.total_output_tokens == 17
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(8.5)
    assert s.total_token_throughput == pytest.approx(93.5)
    assert s.ttft.mean == pytest.approx(200.0)
    assert s.tpot.mean == pytest.approx(300.0)  # mean of 100 and 500
    assert s.itl.mean == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert s.e2el.max == pytest.approx(2200.0)
    assert s.request_goodput is None
    assert s.errors == ["boom"]
    flat = s.to_flat_dict()
    assert flat["mean_ttft_ms"] == pytest.approx(200.0)
    assert flat["p99_itl_ms"] == pytest.approx(500.0)
    assert "Successful requests:" in format_summary(s)


def test_goodput_counts_requests_meeting_all_slos() -> None:
    results = [
        _result(0.050, 0.550, 11),  # ttft 50, tpot 50, e2el 550 -> meets all
        _result(0.150, 0.650, 11),  # ttft 150 -> misses ttft
        _result(0.050, 1.050, 11),  # tpot 100 -> misses tpot
        _result(0.100, 0.100, 1),   # ttft exactly on the bound; no tpot -> meets
        _result(0.010, 0.020, 2, ok=False),
    ]
    slos = parse_goodput(["ttft:100 tpot:60", "e2el:1000"])
    assert slos == {"ttft": 100.0, "tpot": 60.0, "e2el": 1000.0}
    assert [meets_slos(r, slos) for r in results] == [True, False, False, True, False]
    s = compute_summary(results, duration=4.0, goodput_slos_ms=slos)
    assert s.request_goodput == pytest.approx(2 / 4.0)
    only_e2el = compute_summary(results, 4.0, goodput_slos_ms={"e2el": 600.0})
    assert only_e2el.request_goodput == pytest.approx(2 / 4.0)  # the 550 and 100 ms ones
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_peak_concurrency_from_intervals() -> None:
    results = [_result(0.1, 1.0, 2, start=1.0), _result(0.1, 1.0, 2, start=1.5),
               _result(0.1, 1.0, 2, start=2.0), _result(0.1, 0.5, 2, start=3.0)]
    # [1,2) [1.5,2.5) [2,3) [3,3.5): at most two overlap; back-to-back is not overlap
    assert peak_concurrency(results) == 2


# ----------------------------------------------------------------- arrivals

@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_seeded_with_right_mean_and_shape(burstiness: float) -> None:
    rate, n = 8.0, 40_000
    a = arrival_intervals(n, rate, burstiness, seed=3)
    assert np.array_equal(a, arrival_intervals(n, rate, burstiness, seed=3))
    assert not np.array_equal(a, arrival_intervals(n, rate, burstiness, seed=4))
    assert a.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma with shape B has coefficient of variation 1/sqrt(B)
    assert a.std() / a.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrival_offsets_and_infinite_rate() -> None:
    off = arrival_offsets(5, 2.0, 1.0, seed=0)
    gaps = arrival_intervals(5, 2.0, 1.0, seed=0)
    assert off[0] == 0.0 and np.allclose(np.diff(off), gaps[:-1])
    assert np.all(arrival_offsets(7, math.inf) == 0.0)


# ----------------------------------------------------------------- datasets

def test_parse_helpers() -> None:
    assert parse_range("3:9") == (3, 9) and parse_range("5") == (5, 5)
    with pytest.raises(ValueError):
        parse_range("9:3")
    assert parse_dataset_spec("sharegpt:/a/b.json") == ("sharegpt", "/a/b.json")
    assert parse_dataset_spec("prefix") == ("prefix", None)
    with pytest.raises(ValueError):
        parse_dataset_spec("sharegpt")
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]


def test_random_dataset_deterministic_with_requested_lengths() -> None:
    a = gen_random_dataset(50, (5, 20), (3, 7), seed=7)
    b = gen_random_dataset(50, (5, 20), (3, 7), seed=7)
    c = gen_random_dataset(50, (5, 20), (3, 7), seed=8)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    lo, hi = NO_TOKENIZER_ID_RANGE
    for r in a.requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 5 <= r.prompt_len <= 20 and 3 <= r.expected_output_len <= 7
        assert all(lo <= t < hi for t in r.prompt)
    # chat needs text; without a tokenizer that is one word per token
    text = gen_random_dataset(4, (6, 6), (2, 2), seed=7, as_text=True)
    assert all(len(r.prompt.split()) == 6 for r in text.requests)


def test_random_dataset_with_tokenizer(tiny_tokenizer_dir: str) -> None:
    from pagoda.bench.serve import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    ds = gen_random_dataset(20, (4, 12), (2, 2), seed=0, tokenizer=tok)
    special = set(tok.all_special_ids)
    for r in ds.requests:
        ids = tok.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_len and 4 <= r.prompt_len <= 12
        assert not special & set(ids)


def test_random_dataset_exact_lengths_with_byte_level_bpe(bpe_tokenizer_dir: str) -> None:
    from pagoda.bench.serve import load_tokenizer

    tok = load_tokenizer(bpe_tokenizer_dir)
    ds = gen_random_dataset(60, (10, 200), (2, 2), seed=5, tokenizer=tok)
    requested = gen_random_dataset(60, (10, 200), (2, 2), seed=5)  # same seeded lengths
    assert [r.prompt_len for r in ds.requests] == [r.prompt_len for r in requested.requests]
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
               for r in ds.requests)


def test_prefix_dataset_lengths_and_ideal_hit_fraction() -> None:
    m, k, plen = 10, 3, 16
    ds = gen_prefix_dataset(m, k, plen, (4, 8), (5, 5), seed=2)
    again = gen_prefix_dataset(m, k, plen, (4, 8), (5, 5), seed=2)
    assert [r.prompt for r in ds.requests] == [r.prompt for r in again.requests]
    by_group: dict[int, list[list[int]]] = {}
    for r in ds.requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert plen + 4 <= r.prompt_len <= plen + 8
        by_group.setdefault(r.group, []).append(r.prompt)
    assert sorted(len(v) for v in by_group.values()) == [3, 3, 4]
    for prompts in by_group.values():
        assert all(p[:plen] == prompts[0][:plen] for p in prompts)
    total = sum(r.prompt_len for r in ds.requests)
    # every request but the first of each group reuses its prefix
    assert ds.ideal_prefix_hit_fraction == pytest.approx((m - k) * plen / total)
    assert ideal_prefix_hit_fraction(ds.requests, plen) == ds.ideal_prefix_hit_fraction


def _write_sharegpt(path: Path) -> None:
    data = [
        {"conversations": [{"from": "human", "value": "a" * 40},
                           {"from": "gpt", "value": "b" * 80}]},      # 10 / 20 tokens
        {"conversations": [{"from": "system", "value": "be brief"},
                           {"from": "human", "value": "c" * 60},
                           {"from": "gpt", "value": "d" * 100}]},     # 15 / 25
        {"conversations": [{"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "e" * 100}]},     # prompt too short
        {"conversations": [{"from": "human", "value": "f" * 5000},
                           {"from": "gpt", "value": "g" * 100}]},     # prompt too long
        {"conversations": [{"from": "human", "value": "lonely" * 10}]},  # no answer
        {"conversations": [{"from": "human", "value": "h" * 48},
                           {"from": "gpt", "value": "i" * 64}]},      # 12 / 16
    ]
    path.write_text(json.dumps(data))


def test_sharegpt_loader(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    ds = load_sharegpt_dataset(str(path), 3, seed=0)
    got = sorted((r.prompt_len, r.expected_output_len) for r in ds.requests)
    assert got == [(10, 20), (12, 16), (15, 25)]
    assert {r.prompt[0] for r in ds.requests} == {"a", "c", "h"}
    again = load_sharegpt_dataset(str(path), 3, seed=0)
    assert [r.prompt for r in ds.requests] == [r.prompt for r in again.requests]
    fixed = load_sharegpt_dataset(str(path), 2, seed=0, fixed_output_len=7)
    assert all(r.expected_output_len == 7 for r in fixed.requests)
    with pytest.raises(ValueError):
        load_sharegpt_dataset(str(path), 4, seed=0)


# ----------------------------------------------------------------- end to end

def _assert_ordered(out: dict[str, Any], metric: str) -> None:
    vals = [out[f"{s}_{metric}_ms"] for s in ("min", "p50", "p90", "p99", "max")]
    assert vals == sorted(vals), (metric, vals)


def test_serve_bench_against_fake_server(server: FakeOpenAIServer, tmp_path: Path) -> None:
    out_json, png = tmp_path / "run.json", tmp_path / "run.png"
    args = _serve_args(server.base_url, "--num-prompts", "24", "--input-len", "8:16",
                       "--output-len", "4:12", "--request-rate", "300", "--burstiness", "0.7",
                       "--max-concurrency", "4", "--goodput", "ttft:10000", "e2el:10000",
                       "--output-json", str(out_json), "--plot", str(png))
    out = run_serve_bench(args)

    assert out["completed"] == 24 and out["failed"] == 0
    sent = server.cfg.requests[1:]  # the first is the readiness probe
    assert len(sent) == 24
    assert out["total_output_tokens"] == sum(server.cfg.completion_tokens_sent[1:])
    assert out["total_output_tokens"] == sum(b["max_tokens"] for b in sent)
    assert out["total_input_tokens"] == sum(len(b["prompt"]) for b in sent)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True}
               and b["ignore_eos"] is True and b["temperature"] == 0.0
               and b["model"] == "fake-model" for b in sent)
    assert all(4 <= b["max_tokens"] <= 12 and 8 <= len(b["prompt"]) <= 16 for b in sent)
    assert 1 <= out["max_concurrency_used"] <= 4
    assert out["request_goodput"] == pytest.approx(out["request_throughput"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        _assert_ordered(out, metric)
    assert out["min_ttft_ms"] >= 5.0  # the fake server waits 5 ms before the first token
    assert out["config"]["request_rate"] == 300.0 and out["config"]["burstiness"] == 0.7

    on_disk = json.loads(out_json.read_text())
    assert on_disk["total_output_tokens"] == out["total_output_tokens"]
    # requests may reach the server out of dataset order, so compare as multisets
    assert sorted(on_disk["output_lens"]) == sorted(b["max_tokens"] for b in sent)
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_chat_multi_token_chunks_and_prefix_dataset() -> None:
    cfg = FakeConfig(tokens_per_chunk=3)
    with FakeOpenAIServer(cfg) as srv:
        args = _serve_args(srv.base_url + "/v1", "--endpoint", "chat", "--dataset", "prefix",
                           "--num-prompts", "12", "--prefix-num-groups", "3",
                           "--prefix-len", "20", "--question-len", "5", "--output-len", "7",
                           "--save-detailed")
        out = run_serve_bench(args)
    assert out["completed"] == 12
    assert out["total_output_tokens"] == 12 * 7  # from usage, not from chunk count
    # 7 tokens in chunks of 3 -> 3 chunks -> 2 gaps; the role-only delta is no token
    assert all(len(itl) == 2 for itl in out["itls"])
    assert out["total_input_tokens"] == 12 * 25
    assert out["config"]["ideal_prefix_hit_fraction"] == pytest.approx(9 * 20 / (12 * 25))
    assert all(isinstance(b["messages"][0]["content"], str) for b in cfg.requests)


def test_missing_usage_falls_back_to_chunks_and_failures_are_counted() -> None:
    cfg = FakeConfig(send_usage=False, fail_every=4)
    with FakeOpenAIServer(cfg) as srv:
        args = _serve_args(srv.base_url, "--num-prompts", "11", "--input-len", "6",
                           "--output-len", "5", "--no-ignore-eos", "--model", "m")
        out = run_serve_bench(args)
    # requests 4, 8, 12 fail; the probe was request 1
    assert (out["completed"], out["failed"]) == (8, 3)
    assert out["total_output_tokens"] == 8 * 5
    assert out["total_input_tokens"] == 8 * 6  # dataset lengths stand in for usage
    assert sum("HTTP 500" in e for e in out["errors"]) == 3
    assert all("ignore_eos" not in b and b["model"] == "m" for b in cfg.requests)


def test_tokenizer_text_prompts(server: FakeOpenAIServer, tiny_tokenizer_dir: str) -> None:
    args = _serve_args(server.base_url, "--tokenizer", tiny_tokenizer_dir,
                       "--num-prompts", "6", "--input-len", "5:9", "--output-len", "3")
    out = run_serve_bench(args)
    prompts = [b["prompt"] for b in server.cfg.requests[1:]]
    assert all(isinstance(p, str) and 5 <= len(p.split()) <= 9 for p in prompts)
    assert out["total_input_tokens"] == sum(len(p.split()) for p in prompts)


def test_build_payload_chat_requires_text() -> None:
    body = build_payload("completions", "m", [1, 2], 3, temperature=0.5,
                         extra_body={"top_p": 0.9})
    assert body["prompt"] == [1, 2] and body["top_p"] == 0.9 and body["temperature"] == 0.5
    with pytest.raises(ValueError):
        build_payload("chat", "m", [1, 2], 3)


def test_chat_requests_carry_seeded_images_as_data_urls() -> None:
    """``--images 2 --image-size 24x40``: each chat request opens with two PNG data: URLs of
    24 x 40 images, its own (no two requests, nor the probe, share one), the same ones for the
    same seed."""
    import base64
    import io

    from PIL import Image

    def sent_images(seed: str) -> list[list[str]]:
        with FakeOpenAIServer() as srv:
            out = run_serve_bench(_serve_args(srv.base_url, "--endpoint", "chat", "--num-prompts", "3",
                                              "--input-len", "4", "--output-len", "2", "--images", "2",
                                              "--image-size", "24x40", "--seed", seed))
            assert out["completed"] == 3 and out["config"]["images"] == 2
            probe, bodies = srv.cfg.requests[0], srv.cfg.requests[1:]
        urls = [[p["image_url"]["url"] for p in probe["messages"][0]["content"][:2]]]  # its own images
        for body in sorted(bodies, key=lambda b: b["messages"][0]["content"][2]["text"]):
            parts = body["messages"][0]["content"]
            assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
            urls.append([p["image_url"]["url"] for p in parts[:2]])
        return urls

    first = sent_images("1")
    assert len(first) == 4
    for url in (u for pair in first for u in pair):
        head, data = url.split(",", 1)
        assert head == "data:image/png;base64"
        im = Image.open(io.BytesIO(base64.b64decode(data)))
        assert im.format == "PNG" and im.size == (40, 24)  # (width, height)
    assert len({u for pair in first for u in pair}) == 8
    assert sent_images("1") == first and sent_images("2") != first
    with pytest.raises(ValueError, match="--endpoint chat"):
        run_serve_bench(_serve_args("http://127.0.0.1:9", "--model", "m", "--images", "1"))
    with pytest.raises(SystemExit):
        _serve_args("http://127.0.0.1:9", "--image-size", "24xwide")


def test_sweep_two_rates(server: FakeOpenAIServer, tmp_path: Path) -> None:
    out_json, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = _parse("sweep", "--base-url", server.base_url, "--disable-tqdm",
                  "--request-rates", "50,inf", "--num-prompts", "8", "--input-len", "4",
                  "--output-len", "3", "--output-json", str(out_json), "--plot", str(png))
    out = run_sweep(args)
    data = json.loads(out_json.read_text())
    assert data["request_rates"] == ["50", "inf"] == out["request_rates"]
    assert [r["config"]["request_rate"] for r in data["runs"]] == [50.0, "inf"]
    assert all(r["completed"] == 8 and r["total_output_tokens"] == 24 for r in data["runs"])
    assert png.read_bytes()[:8] == PNG_SIGNATURE


# ----------------------------------------------------------------- live pagoda

# Random prompts without a tokenizer are token ids below 1000: the model's vocabulary must hold them.
LIVE_VOCAB = 1024
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def pagoda_server(model_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = model_factory("llama", vocab_size=LIVE_VOCAB)
    srv = start_server(model, tmp_path_factory.mktemp("bench-server"), "--disable-log-stats")
    yield srv
    srv.stop()


def _pagoda_counters(srv: ServerProcess) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.endswith("_total")}


@pytest.mark.timeout(180)
def test_serve_bench_against_live_pagoda(pagoda_server: ServerProcess, tmp_path: Path) -> None:
    num, in_range, out_len = 12, (16, 48), 6
    out_json, png = tmp_path / "run.json", tmp_path / "run.png"
    before = _pagoda_counters(pagoda_server)
    args = _serve_args(pagoda_server.base_url, "--num-prompts", str(num),
                       "--input-len", f"{in_range[0]}:{in_range[1]}", "--output-len", str(out_len),
                       "--request-rate", "40", "--output-json", str(out_json), "--plot", str(png))
    out = run_serve_bench(args)
    after = _pagoda_counters(pagoda_server)

    data = json.loads(out_json.read_text())
    sent = gen_random_dataset(num, in_range, (out_len, out_len), seed=1)  # what the run sent
    assert data["completed"] == num and data["failed"] == 0
    assert data["total_output_tokens"] == num * out_len  # ignore_eos: every request runs to max_tokens
    assert data["total_input_tokens"] == sum(r.prompt_len for r in sent.requests)
    assert sorted(data["input_lens"]) == sorted(r.prompt_len for r in sent.requests)
    assert data["total_output_tokens"] == out["total_output_tokens"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        _assert_ordered(data, metric)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    # The server counted the same tokens (plus the 4-token, 2-token probe request).
    gen = after["pagoda:generation_tokens_total"] - before.get("pagoda:generation_tokens_total", 0)
    prompt = after["pagoda:prompt_tokens_total"] - before.get("pagoda:prompt_tokens_total", 0)
    assert (gen, prompt) == (num * out_len + 2, data["total_input_tokens"] + 4)


@pytest.mark.timeout(180)
def test_prefix_dataset_hit_rate_on_live_pagoda(pagoda_server: ServerProcess) -> None:
    prefix_len = 40  # not a whole number of blocks: only 32 of its tokens can be shared
    before = _pagoda_counters(pagoda_server)
    args = _serve_args(pagoda_server.base_url, "--dataset", "prefix", "--num-prompts", "16",
                       "--prefix-num-groups", "4", "--prefix-len", str(prefix_len),
                       "--question-len", "8:16", "--output-len", "4")
    out = run_serve_bench(args)
    after = _pagoda_counters(pagoda_server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert out["completed"] == 16
    measured = delta("pagoda:prefix_cache_hits_total") / delta("pagoda:prefix_cache_queries_total")
    ideal = out["config"]["ideal_prefix_hit_fraction"]
    shareable = ideal * (prefix_len // BLOCK_SIZE * BLOCK_SIZE) / prefix_len  # whole blocks only
    assert 0 < shareable - 0.05 <= measured <= ideal


def test_sse_lines_reassembles_split_and_long_lines() -> None:
    """Events arrive cut at arbitrary byte offsets, one line longer than aiohttp's readline
    limit; every line comes back whole, in order, with the time its last byte arrived."""
    import asyncio

    from pagoda.bench.serve import _parse_sse_line, _sse_lines

    long_text = "x" * 200_000
    events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": long_text}]}, {"choices": [{"text": "é"}]}]
    stream = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events) + "data: [DONE]\n\n"
    raw = stream.encode()
    inside_e = raw.index("é".encode()) + 1  # between the two bytes of "é"
    cuts = [0, 3, 7, 100, 70_000, 150_000, inside_e, len(raw) - 5, len(raw)]

    class FakeContent:
        async def iter_any(self):
            for a, b in zip(cuts, cuts[1:]):
                yield raw[a:b]

    class FakeResponse:
        content = FakeContent()

    async def collect():
        return [line async for line, _ in _sse_lines(FakeResponse())]

    lines = asyncio.run(collect())
    parsed = [d for d in map(_parse_sse_line, lines) if d is not None]
    assert [d["choices"][0]["text"] for d in parsed] == ["a", long_text, "é"]
    assert lines.count("data: [DONE]") == 1
