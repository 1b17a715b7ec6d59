"""``pagoda bench stress`` against a real ``pagoda serve`` subprocess on a tiny checkpoint:
nothing lost, no wrong token count, the server back to idle within the 2 s bar; and the bench
itself notices a wrong count, a missed bar and a full queue."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench.stress import Outcome, Spec, Tally, misses, open_session, parse_gauges, send
from pagoda.entrypoints.cli import build_parser
from tests.entrypoints.server_helpers import free_port, start_server

MAX_QUEUED = 8
MAX_NUM_SEQS = 16  # with MAX_QUEUED, 24 requests in flight at most: an overload of 200 must see 429s


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(llama_dir, tmp_path_factory.mktemp("stress-server"),
                       "--max-queued-requests", str(MAX_QUEUED), "--max-num-seqs", str(MAX_NUM_SEQS))
    yield srv
    srv.stop()


def run_bench(server, tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "stress.json"
    args = build_parser().parse_args(["bench", "stress", *argv, "--base-url", server.base_url,
                                      "--out", str(out), "--request-timeout", "120"])
    code = args.func(args)
    return code, json.loads(out.read_text())


def test_streams_with_disconnects(server, tmp_path) -> None:
    # 20 streams (MAX_NUM_SEQS + 4): some wait in the queue, all fit under the queue bound.
    code, result = run_bench(server, tmp_path, "streams", "--concurrency", "20", "--disconnect-fraction", "0.2")
    assert result["counts"] == {"completed": 16, "disconnected": 4}, result["examples"]
    assert result["settle"]["reached"] and result["settle"]["last"]["pagoda:kv_cache_usage_perc"] == 0
    assert result["rss"]["before"]["engine"] > 0  # found the server and its engine core by the port
    assert code == 0 and result["passed"]


def test_disconnect_storm_frees_everything(server, tmp_path) -> None:
    code, result = run_bench(server, tmp_path, "storm", "--concurrency", "24", "--max-tokens", "200")
    assert result["counts"] == {"disconnected": 24}, result["examples"]
    assert result["settle"]["reached"], result["settle"]
    assert code == 0


def test_overload_completes_or_refuses_every_request(server, tmp_path) -> None:
    code, result = run_bench(server, tmp_path, "overload", "--concurrency", "200")
    counts = result["counts"]
    assert set(counts) <= {"completed", "rejected"}, result["examples"]
    assert counts.get("completed", 0) + counts.get("rejected", 0) == 200
    assert counts.get("completed", 0) >= MAX_NUM_SEQS and counts.get("rejected", 0) > 0
    assert set(result["statuses"]) <= {"200", "429", "503"}
    assert code == 0 and result["settle"]["reached"]


def test_constraint_attacks_are_all_refused_with_a_4xx(server, tmp_path) -> None:
    # No timing bar here (--max-ratio is huge): the ratio is measured by the command itself.
    code, result = run_bench(server, tmp_path, "constraints", "--concurrency", "2", "--probes", "3",
                             "--attack-s", "0", "--warmup-s", "0.2", "--max-ratio", "1000")
    assert all(result["attacks"].values()), result["attacks"]  # every kind was sent
    statuses = {int(s) for kinds in result["attacks"].values() for s in kinds}
    assert statuses and all(400 <= s < 500 for s in statuses), result["attacks"]
    assert result["counts"] == {"completed": 9}, result["examples"]  # 3 idle, 3 under attack, 3 idle
    assert code == 0 and result["passed"], result["misses"]


def test_a_wrong_token_count_and_an_invalid_body_are_told_apart(server) -> None:
    body = {"model": str(server_model(server)), "prompt": [20, 21, 22], "max_tokens": 5, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    async def go() -> list[Outcome]:
        async with open_session(60) as session:
            return [await send(session, server.base_url, Spec(body, expect_tokens=6), 60),
                    await send(session, server.base_url, Spec({**body, "stream": False, "stream_options": None},
                                                              stream=False, expect_tokens=5), 60),
                    await send(session, server.base_url, Spec({**body, "max_tokens": -1}, invalid=True), 60)]

    wrong, right, refused = asyncio.run(go())
    assert wrong.kind == "wrong" and "completion_tokens 5" in wrong.detail
    assert right.kind == "completed"
    assert refused.kind == "refused" and 400 <= (refused.status or 0) < 500


def server_model(server) -> str:
    import httpx

    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_bars() -> None:
    tally = Tally()
    for kind in ("completed", "disconnected", "lost", "rejected"):
        tally.add(Outcome(kind, 200))
    settled = {"reached": True, "seconds": 0.1, "bar_s": 2.0}
    assert misses("streams", tally, settled) == ["1 lost", "1 rejected"]
    assert misses("overload", tally, settled) == ["1 lost"]
    assert "not back to 0 within 2.0 s (never)" in misses("storm", Tally(), {**settled, "reached": False,
                                                                             "seconds": None})
    text = 'pagoda:num_requests_running{model_name="m"} 3.0\n# HELP x\npagoda:kv_cache_usage_perc{model_name="m"} 0.5\n'
    assert parse_gauges(text) == {"pagoda:num_requests_running": 3.0, "pagoda:kv_cache_usage_perc": 0.5}


def test_a_stream_cut_short_is_lost_and_an_error_event_is_a_failure() -> None:
    """A stand-in server: one stream ends after a chunk with no usage, another carries an error."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n')
        if body["prompt"] == "error":
            await resp.write(b'data: {"error": {"message": "engine failure", "code": 500}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go() -> list[Outcome]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        try:
            async with open_session(30) as session:
                return [await send(session, base, Spec({"prompt": p}, expect_tokens=4), 30) for p in ("cut", "error")]
        finally:
            await runner.cleanup()

    lost, failed = asyncio.run(go())
    assert lost.kind == "lost" and "without its final usage chunk" in lost.detail
    assert failed.kind == "stream_error" and "engine failure" in failed.detail
    tally = Tally()
    tally.add(lost)
    tally.add(failed)
    assert misses("streams", tally, {"reached": True, "seconds": 0.0, "bar_s": 2.0}) == ["1 lost", "1 stream_error"]


def test_wrong_key_mode_measures_both_attacks(server, tmp_path) -> None:
    """The wrong-key mode end to end, small and short (this server has no key, so the bodies are
    read; the figures, not the bars, are what is checked here)."""
    from pagoda.bench.stress_auth import attack_body

    body = attack_body(5000, "tiny")
    assert len(body) == 5000 and len(json.loads(body)["prompt"]) > 500
    code, result = run_bench(server, tmp_path, "wrong-key", "--phase-s", "1", "--concurrency", "3",
                             "--slow-body-mib", "1", "--big-body-mib", "0.5", "--big-body-clients", "2")
    assert code in (0, 1) and result["passed"] == (code == 0) and result["passed"] == (not result["misses"])
    assert result["idle_s"]["n"] >= 5 and result["attacked_s"]["n"] >= 5
    assert result["slow_attack"]["connections"] >= 3 and result["big_attack"]["connections"] >= 2
    assert result["big_attack"]["bodies_completed"] >= 1  # no key here: whole bodies go in
    assert result["api_rss_mib"]["before"] > 0


def test_hog_times_a_small_request_alone_and_beside_a_hog(server, tmp_path) -> None:
    # The hog fills every slot (n = MAX_NUM_SEQS); the small client is another tenant. The bar is
    # generous here (a busy CI box): the measured figures come from runs of the command itself.
    code, result = run_bench(server, tmp_path, "hog", "--concurrency", "1", "--hog-n", str(MAX_NUM_SEQS),
                             "--hog-max-tokens", "300", "--bar-s", "60")
    assert result["counts"] == {"completed": 2}, result["examples"]
    assert result["hog_running_seqs"] >= MAX_NUM_SEQS  # the probe ran beside the whole hog
    assert len(result["small_alone_s"]) == len(result["small_beside_hog_s"]) == 1
    assert result["ratio"] == pytest.approx(result["beside_max_s"] / result["idle_median_s"], rel=0.01)
    assert result["settle"]["reached"] and code == 0


def test_guess_mode_tells_right_from_wrong_on_a_shared_cache(server, tmp_path) -> None:
    # This server shares its prefix cache between clients: the bench must see the leak and fail
    # (tests/entrypoints/test_tenant_isolation.py runs it against an isolating server).
    code, result = run_bench(server, tmp_path, "guess", "--probes", "2", "--vocab-size", "500")
    assert [r["right"] for r in result["rounds"]] == [[32, 32], [32, 32]], result["rounds"]
    assert [r["wrong"] for r in result["rounds"]] == [[16, 16], [16, 16]], result["rounds"]
    assert code == 1 and not result["passed"] and result["misses"]
