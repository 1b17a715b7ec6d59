"""``pagoda serve`` on real Ray Serve (a local Ray instance in a private network namespace), one
instance for the module (each Ray start and stop costs the suite tens of seconds):

- autoscaling: ``--min-replicas 1 --max-replicas 2 --target-ongoing-requests 1`` starts one
  replica, and a steady queue of requests above the target makes Ray Serve start the second
  (Ray's own autoscaler; the load must stay above the target for ``--autoscaling-upscale-delay``
  2 s instead of Ray's default 30), which then serves; every request of the load completes;
- with the two replicas: the official ``openai`` client gets the offline ``LLM``'s greedy
  outputs, prefix affinity keeps a shared prefix on one replica (seen in the replicas' own
  prefix-cache counters) and spills over when that replica is busy, and a replica whose engine is
  killed under load is routed around, its requests retried, and replaced."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from ray_helpers import RayServer

MODEL = "tiny"
PROMPTS = ["Hello, my name is", "The capital of France", "Once upon a time", "def fibonacci(n):"]
# Long enough for several 64-character routing blocks and 16-token KV blocks.
SHARED = ("You are a careful assistant for the pagoda project. Answer briefly, cite the file you read, "
          "and never invent flags that do not exist in the command line reference. ") * 2
MARGIN = 2
# Rounds of the prompts (each sent plain and streamed at once) the two-replica test sends at
# most until both replicas have answered some: one nearly always does it.
MAX_ROUNDS = 6
API_KEY = "ray-secret"
SCALE_UP_TIMEOUT_S = 240.0
# Serve's autoscaler hears of the load from handle and replica reports sent every 10 s, sampled
# every 6 s (a fifth of the 30 s look-back): once a second here, so the scale-up follows the
# upscale delay instead of waiting for the next report. The decision itself is Ray's, unchanged.
FAST_AUTOSCALING_REPORTS = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                            "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                            "RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR": "0.02"}


@pytest.fixture(scope="module")
def autoscaled(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    """One replica at first, at most two; scaled down again only after 600 s without load, far
    longer than the module runs."""
    server = RayServer(llama_dir, tmp_path_factory.mktemp("ray-serve"), "--min-replicas", "1", "--max-replicas", "2",
                       "--target-ongoing-requests", "1", "--autoscaling-upscale-delay", "2",
                       "--autoscaling-downscale-delay", "600",
                       "--served-model-name", MODEL, "--kv-cache-memory", "32MiB", "--max-model-len", "512",
                       "--replica-num-cpus", "0.5", "--routing", "prefix_affinity",
                       "--prefix-affinity-margin", str(MARGIN), "--disable-log-stats", api_key=API_KEY,
                       set_env=FAST_AUTOSCALING_REPORTS)
    try:
        server.wait_healthy(1)
        yield server
    finally:
        code = server.stop()
        assert code == 0, server.log()


@dataclass
class ScaleUp:
    """What a steady load above the target did to the one-replica deployment."""

    replicas_before: int
    replicas_after: int
    answers_at_scale_up: int
    finish_reasons: list[str]
    errors: list[BaseException]
    threads_alive: int


@pytest.fixture(scope="module")
def scale_up(autoscaled: RayServer) -> ScaleUp:
    """Six clients send requests back to back until Serve reports a second healthy replica, then
    a few more answers (the new replica serves too); every request must complete."""
    before = len(autoscaled.wait_healthy(1)["replicas"])
    stop = threading.Event()
    done: list[str] = []
    errors: list[BaseException] = []

    def load(worker: int) -> None:
        client = autoscaled.openai(timeout=120)
        while not stop.is_set():
            try:
                out = client.completions.create(model=MODEL, prompt=f"Load {worker}: once upon a time",
                                                max_tokens=64, temperature=0)
                done.append(out.choices[0].finish_reason)
            except BaseException as exc:  # every request must complete
                errors.append(exc)
                return

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(6)]
    try:
        for t in threads:
            t.start()
        deadline, replicas = time.monotonic() + SCALE_UP_TIMEOUT_S, 1
        while time.monotonic() < deadline and not errors:
            health = autoscaled.health()
            replicas = sum(r["healthy"] for r in health["replicas"]) if health else replicas
            if replicas == 2:
                break
            time.sleep(0.5)
        scaled_after = len(done)
        if replicas == 2:  # the new replica serves: the load keeps completing (a few more answers)
            settle = time.monotonic() + 5.0
            while time.monotonic() < settle and len(done) < scaled_after + 6:
                time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    # The replicas have counted every answer of the load before the tests below take their
    # counters' deltas.
    deadline = time.monotonic() + 30
    while sum(autoscaled.replica_metric("pagoda:request_success_total").values()) < len(done) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return ScaleUp(before, replicas, scaled_after, list(done), errors, sum(t.is_alive() for t in threads))


@pytest.fixture()
def ray_server(autoscaled: RayServer, scale_up: ScaleUp) -> RayServer:
    """The module's server once the autoscaler has given it its second replica."""
    autoscaled.wait_healthy(2, timeout=60)
    return autoscaled


def test_queue_above_the_target_adds_a_replica(autoscaled: RayServer, scale_up: ScaleUp) -> None:
    assert scale_up.replicas_before == 1
    assert not scale_up.errors, scale_up.errors[:3]
    assert scale_up.replicas_after == 2, f"still one replica after {SCALE_UP_TIMEOUT_S} s of load:\n{autoscaled.log()}"
    assert len(scale_up.finish_reasons) > scale_up.answers_at_scale_up
    assert set(scale_up.finish_reasons) == {"length"}
    assert scale_up.threads_alive == 0


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_two_replicas_serve_the_offline_greedy_outputs(ray_server: RayServer, llama_llm: LLM) -> None:
    client = ray_server.openai()
    expected = greedy(llama_llm, PROMPTS, 12)
    # The router knows both healthy replicas and has nothing in flight; Serve froze each replica
    # actor's start-up heap out of the collector's full scans (it holds its engine for life).
    health = ray_server.wait_healthy(2)
    assert all(r["gc_frozen"] > 10_000 for r in health["replicas"]), health
    replicas = {r["replica"] for r in health["replicas"]}
    _wait_router(ray_server, lambda r: set(r.get("replicas", ())) == replicas and not r["in_flight"])
    before = ray_server.replica_metric("pagoda:request_success_total")
    # Rounds of the prompts sent all at once, plain and streamed, until each replica has answered
    # some (MAX_ROUNDS at most). Serve's router sends a request to the replica with the shortest
    # queue as its cache has it, and that cache may count a replica as busier than it is for a
    # while after the load above: requests sent one by one could then all go to the other one.
    # Requests in flight together raise the counts of the replica that takes them and spread.
    # Every answer is the offline one.
    rounds, served = 0, {}
    while rounds < MAX_ROUNDS and not all(served.get(r, 0) > 0 for r in replicas):
        got, streamed = asyncio.run(_plain_and_streamed(ray_server, PROMPTS, 12))
        assert got == expected
        assert streamed == expected
        rounds += 1
        after = ray_server.replica_metric("pagoda:request_success_total")
        served = {r: after.get(r, 0) - before.get(r, 0) for r in after}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    chat_expected = llama_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == chat_expected.outputs[0].text
    assert out.usage.completion_tokens == len(chat_expected.outputs[0].token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_expected.outputs[0].text

    # Both replicas took part, and the endpoint is one model with everything the server has.
    after = ray_server.replica_metric("pagoda:request_success_total")
    served = {r: after.get(r, 0) - before.get(r, 0) for r in after}
    assert set(served) == replicas and all(n > 0 for n in served.values()), (served, rounds)
    assert sum(served.values()) == rounds * 2 * len(PROMPTS) + 2
    assert [m.id for m in client.models.list().data] == [MODEL]
    bad = ray_server.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert ray_server.http.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404
    # n and logprobs come from the replica's own OpenAI layer.
    many = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, n=2, logprobs=2)
    assert [c.text for c in many.choices] == [expected[0][:len(many.choices[0].text)]] * 2
    logprobs = many.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 4 and all(x <= 0 for x in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)  # top 2 and the chosen token
    # The API key guards the API on every replica; probes and metrics stay open.
    with httpx.Client(transport=httpx.HTTPTransport(uds=ray_server.uds), base_url="http://pagoda") as keyless:
        refused = keyless.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert keyless.get("/debug/router").status_code == 401
        assert keyless.get("/health").status_code == 200 and keyless.get("/metrics").status_code == 200
    # A large invalid body is refused by the ingress's sandboxed body check (as the single server does).
    huge = {"model": MODEL, "prompt": [1] * 400_000, "max_tokens": "many"}
    refused = ray_server.http.post("/v1/completions", content=json.dumps(huge).encode(),
                                   headers={"content-type": "application/json"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens", refused.text


async def _plain_and_streamed(ray_server: RayServer, prompts: list[str],
                              max_tokens: int) -> tuple[list[str], list[str]]:
    """Every prompt sent twice at once through the official async client, plain and streamed:
    the texts of each."""
    async with ray_server.async_http() as http:
        client = openai.AsyncOpenAI(base_url="http://pagoda/v1", api_key=API_KEY, http_client=http, max_retries=0)

        async def plain(prompt: str) -> str:
            out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
            return out.choices[0].text

        async def streamed(prompt: str) -> str:
            chunks = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        texts = await asyncio.gather(*map(plain, prompts), *map(streamed, prompts))
    return list(texts[:len(prompts)]), list(texts[len(prompts):])


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(ray_server: RayServer) -> None:
    client = ray_server.openai()
    for group in ("alpha", "beta"):
        success0 = ray_server.replica_metric("pagoda:request_success_total")
        hits0 = ray_server.replica_metric("pagoda:prefix_cache_hits_total")
        for i in range(5):
            client.completions.create(model=MODEL, prompt=f"{group} {SHARED} question {i}?", max_tokens=2,
                                      temperature=0)
        success = {r: v - success0.get(r, 0) for r, v in ray_server.replica_metric(
            "pagoda:request_success_total").items()}
        hits = {r: v - hits0.get(r, 0) for r, v in ray_server.replica_metric(
            "pagoda:prefix_cache_hits_total").items()}
        (home,) = [r for r, n in success.items() if n > 0]  # all five on one replica
        assert success[home] == 5
        # The four after the first found the shared prefix in that replica's cache; the other
        # replica looked nothing up for this group.
        assert hits[home] >= 4 * 16 * 3, hits
        assert all(hits[r] == 0 for r in hits if r != home), hits


def test_prefix_affinity_spills_over_from_a_busy_replica(ray_server: RayServer) -> None:
    """MARGIN + 1 long streams in flight on a prompt's home replica send the next request of that
    prompt to the other replica. The premise needs the streams still running when that request
    is routed; on a loaded machine they may end first, and the attempt is made again (at most
    three times) rather than read as a routing fault."""
    client = ray_server.openai()
    prompt = "gamma " + SHARED[:150]  # two routing blocks, and room for long outputs
    for attempt in range(3):
        success0 = ray_server.replica_metric("pagoda:request_success_total")
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        (home,) = [r for r, v in ray_server.replica_metric("pagoda:request_success_total").items()
                   if v > success0.get(r, 0)]
        # The router counts nothing in flight once every earlier answer is back (a count left
        # behind would skew every later routing decision).
        router = _wait_router(ray_server, lambda r: not r["in_flight"])
        overflows0 = router["affinity_overflows"]
        texts, status, premise = asyncio.run(_busy_then_one_more(ray_server, prompt, home))
        if premise:
            break
    assert premise, "every attempt's streams ended before the extra request was answered"
    assert status == 200 and all(t.endswith("data: [DONE]\n\n") for t in texts)
    success = {r: v - success0.get(r, 0) for r, v in ray_server.replica_metric(
        "pagoda:request_success_total").items()}
    other = next(r for r in success if r != home)
    assert success == {home: 1 + MARGIN + 1, other: 1}, success
    assert ray_server.http.get("/debug/router").json()["affinity_overflows"] == overflows0 + 1


async def _busy_then_one_more(ray_server: RayServer, prompt: str, home: str) -> tuple[list[str], int, bool]:
    """MARGIN + 1 long streams of ``prompt`` in flight on ``home``, none elsewhere, then one more
    request of it: (the streams' texts, that request's status, whether every stream was still
    running when its answer came)."""
    async with ray_server.async_http() as http:
        started = [asyncio.Event() for _ in range(MARGIN + 1)]
        ended: list[int] = []
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}

        async def stream(i: int) -> str:
            text = await _stream(http, body, started[i])
            ended.append(i)
            return text

        streams = [asyncio.create_task(stream(i)) for i in range(MARGIN + 1)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        state = await asyncio.to_thread(_wait_router, ray_server,
                                        lambda r: r["in_flight"].get(home, 0) == MARGIN + 1)
        load = state["in_flight"]
        assert sum(load.values()) == MARGIN + 1, load
        extra = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        still_running = not ended  # no stream had ended when the answer came
        return await asyncio.gather(*streams), extra.status_code, still_running


def _wait_router(ray_server: RayServer, ready: Any, timeout: float = 60) -> dict[str, Any]:
    """The router's ``/debug/router`` state once ``ready(state)`` holds (its counters follow
    Serve's completion callbacks, which may trail the HTTP answer by a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        state = ray_server.http.get("/debug/router").json()
        if ready(state) or time.monotonic() > deadline:
            assert ready(state), state
            return state
        time.sleep(0.05)


def test_killed_engine_is_routed_around_retried_and_replaced(ray_server: RayServer, llama_llm: LLM) -> None:
    health = ray_server.wait_healthy(2)
    victim = health["replicas"][0]
    prompts = [f"{SHARED} item {i}" for i in range(10)]
    expected = greedy(llama_llm, prompts, 24)

    async def load() -> tuple[list[Any], list[str]]:
        async with ray_server.async_http() as http:
            body = {"model": MODEL, "max_tokens": 24, "temperature": 0}
            plain = [asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": p})) for p in prompts]
            streams = [asyncio.create_task(_stream(http, {**body, "prompt": p, "stream": True})) for p in prompts[:4]]
            await asyncio.sleep(0.3)
            os.kill(victim["engine_pid"], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*plain), 120)  # nothing hangs
            events = await asyncio.wait_for(asyncio.gather(*streams), 120)
            return results, events

    results, events = asyncio.run(load())
    # Every non-streaming request succeeds with the right text (retried on the other replica
    # when the killed engine had it).
    assert [r.status_code for r in results] == [200] * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in results] == expected
    # A stream completes, or ends with an error event and [DONE]; none hangs (wait_for above).
    for text in events:
        assert text.endswith("data: [DONE]\n\n")
    # New requests keep being answered, then the dead replica is replaced by a new one.
    client = ray_server.openai()
    for p in prompts[:4]:
        assert client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text \
            == expected[prompts.index(p)]
    replaced = ray_server.wait_healthy(2, timeout=180, exclude={victim["replica"]})
    assert victim["engine_pid"] not in {r["engine_pid"] for r in replaced["replicas"]}
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert out.choices[0].text


async def _stream(http: Any, body: dict[str, Any], started: asyncio.Event | None = None) -> str:
    text = ""
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for chunk in response.aiter_text():
            text += chunk
            if started is not None and "data: {" in text:
                started.set()
    for line in text.split("\n\n"):
        if line.startswith("data: {") and '"error"' in line:
            assert json.loads(line[6:])["error"]["code"] == "engine_unavailable"
    return text
