"""The OpenAI-compatible server against a live ``pagoda serve`` subprocess: results equal the
offline ``LLM``'s, streaming, n, logprobs, stop strings, 64 concurrent streams, clients that
go away, and every error's status and shape."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import Any, Callable

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.outputs import CompletionOutput
from server_helpers import MAX_MODEL_LEN, ServerProcess, engine_pid, frozen

MODEL = "tiny"
PROMPTS = ["Hello, my name is", "The capital of France", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server  # tests/entrypoints/conftest.py: shared with the other request-only modules


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def offline_greedy(llm: LLM, prompts: list, max_tokens: int, **kw: Any) -> list[CompletionOutput]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def engine_stats(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/debug/engine", timeout=30).json()


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


# ---- results equal the offline engine's --------------------------------------------------------

def test_completion_greedy_equals_offline(client: openai.OpenAI, llama_llm: LLM) -> None:
    expected = offline_greedy(llama_llm, PROMPTS, 16)
    for prompt, exp in zip(PROMPTS, expected):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert out.choices[0].text == exp.text
        assert out.choices[0].finish_reason == exp.finish_reason
        assert out.usage.completion_tokens == len(exp.token_ids)


def test_token_id_prompts_and_tokenize_equal_offline(server: ServerProcess, client: openai.OpenAI,
                                                     llama_llm: LLM) -> None:
    ids = llama_llm.get_tokenizer().encode(PROMPTS[0])
    tok = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tok == {"tokens": ids, "count": len(ids), "max_model_len": MAX_MODEL_LEN}
    exp = offline_greedy(llama_llm, [ids], 12)[0]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=0)
    assert out.choices[0].text == exp.text
    detok = httpx.post(server.base_url + "/detokenize", json={"tokens": exp.token_ids}).json()
    assert detok["prompt"] == llama_llm.get_tokenizer().decode(exp.token_ids)


def test_streaming_completion_equals_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_equals_offline(client: openai.OpenAI, llama_llm: LLM) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    exp = llama_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == exp.text
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == exp.text
    assert chunks[-1].choices[0].finish_reason == exp.finish_reason


# ---- sampling options ---------------------------------------------------------------------------

def test_n_and_multiple_prompts_index_choices(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    # Choices 2 and 3 belong to the second prompt: with temperature 0 they equal its greedy text.
    both = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0)
    assert [c.text for c in both.choices if c.index >= 2] == [greedy.choices[0].text] * 2
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                          max_tokens=4, temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert chat.usage.completion_tokens == sum(1 for _ in chat.choices) * 4


def test_streaming_n_indexes_every_choice(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=0,
                                            stream=True))
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2, 3]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        # The top 3 and the chosen token (fewer if two tokens have the same text).
        assert 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen one is the best
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_prompt_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                    logprobs=1, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text.startswith(PROMPTS[0])
    prompt_len = out.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == prompt_len + 4
    assert choice.logprobs.token_logprobs[0] is None  # nothing precedes the first prompt token
    assert all(x is not None for x in choice.logprobs.token_logprobs[1:])


def test_logit_bias_forces_and_bans_as_offline(client: openai.OpenAI, llama_llm: LLM) -> None:
    plain = offline_greedy(llama_llm, PROMPTS[:2], 8, ignore_eos=True)
    forced = 77
    for prompt, base in zip(PROMPTS[:2], plain):
        bias = {base.token_ids[0]: -100.0, forced: 8.0}
        exp = offline_greedy(llama_llm, [prompt], 8, ignore_eos=True, logit_bias=bias)[0]
        assert exp.token_ids != base.token_ids and base.token_ids[0] not in exp.token_ids
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                        logit_bias={str(t): b for t, b in bias.items()},
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == exp.text
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           temperature=0, logit_bias={str(forced): 100}, logprobs=True,
                                           extra_body={"ignore_eos": True})
    text = llama_llm.get_tokenizer().decode([forced])
    assert [c.token for c in reply.choices[0].logprobs.content] == [text] * 4
    vocab = llama_llm.engine.config.model.vocab_size
    for bias, needle in (({str(vocab): 1}, str(vocab)), ({"5": 100.5}, "100"), ({"five": 1}, "five")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, logit_bias=bias)
        assert err.value.body["param"] == "logit_bias" and needle in err.value.body["message"]


def test_prompt_logprobs_equal_offline(client: openai.OpenAI, llama_llm: LLM) -> None:
    ids = llama_llm.get_tokenizer().encode(PROMPTS[1])
    offline = llama_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=3),
                                 use_tqdm=False)[0]
    exp, exp_ranks = offline.prompt_logprobs, offline.prompt_logprob_ranks
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 3})
    got = out.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    text = llama_llm.get_tokenizer().decode
    for pos, (entry, want) in enumerate(zip(got[1:], exp[1:])):
        assert {int(t) for t in entry} == set(want)
        for t, item in entry.items():
            assert item["logprob"] == pytest.approx(want[int(t)], abs=1e-6)
            assert item["decoded_token"] == text([int(t)])
        ranked = sorted(entry.values(), key=lambda e: -e["logprob"])[:3]
        assert [e["rank"] for e in ranked] == [1, 2, 3]
        actual = entry[str(ids[pos + 1])]
        assert actual["rank"] == exp_ranks[pos + 1] or (exp_ranks[pos + 1] <= 3 and actual["rank"] <= 3)
        assert (actual["rank"] <= 3) == (len(entry) == 3)  # outside the top 3: a fourth entry
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    body = chat.model_dump()
    assert len(body["prompt_logprobs"]) == chat.usage.prompt_tokens and body["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and list(e.values())[0]["rank"] >= 1 for e in body["prompt_logprobs"][1:])
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
    assert "prompt_logprobs" not in plain.model_dump()["choices"][0]  # absent unless asked


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt(client: openai.OpenAI, llama_llm: LLM, stream: bool) -> None:
    """lm-eval's local-completions loglikelihood request: the prompt back with its logprobs."""
    prompt = PROMPTS[2] + " there lived"
    ids = llama_llm.get_tokenizer().encode(prompt)
    exp = llama_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                             use_tqdm=False)[0].prompt_logprobs
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0,
                                    stream=stream, stream_options={"include_usage": True} if stream else None)
    if stream:
        chunks = list(out)
        usage = chunks[-1].usage
        (choice,) = [c.choices[0] for c in chunks if c.choices]  # one chunk: the prompt
    else:
        usage, choice = out.usage, out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert usage.completion_tokens == 0 and usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos, (value, top) in enumerate(zip(lp.token_logprobs[1:], lp.top_logprobs[1:])):
        assert value == pytest.approx(exp[pos + 1][ids[pos + 1]], abs=1e-6)
        assert 1 <= len(top) <= 2


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode(errors="replace") == item.token


def test_browsers_may_call_it_as_vllm_lets_them(server: ServerProcess) -> None:
    """CORS with vLLM's defaults: a preflight is answered (not 405), and answers carry the
    header a browser page needs to read them."""
    preflight = httpx.options(server.base_url + "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")
    assert "POST" in preflight.headers["access-control-allow-methods"]
    models = httpx.get(server.base_url + "/v1/models", headers={"Origin": "http://localhost:3000"})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"


def test_allowed_token_ids(client: openai.OpenAI, server: ServerProcess) -> None:
    """vLLM's ``allowed_token_ids`` on both endpoints: only those ids come out."""
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": " the cat"}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=4, logprobs=0,
                                    extra_body={"allowed_token_ids": ids[-1:], "ignore_eos": True})
    one = httpx.post(server.base_url + "/detokenize", json={"tokens": ids[-1:]}).json()["prompt"]
    assert out.choices[0].text == one * 6 and out.usage.completion_tokens == 6
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, logprobs=True,
                                          extra_body={"allowed_token_ids": ids, "ignore_eos": True})
    texts = {httpx.post(server.base_url + "/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids}
    assert {item.token for item in chat.choices[0].logprobs.content} <= texts
    bad = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "allowed_token_ids": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words(client: openai.OpenAI, server: ServerProcess) -> None:
    """vLLM's ``bad_words``: a one-token word the free output holds (as itself or after a space)
    is never generated once banned."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, logprobs=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens

    def one_token(text: str) -> bool:
        return len(httpx.post(server.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
                   .json()["tokens"]) == 1

    word = next(t.strip() for t in free if t.strip() and t in (t.strip(), " " + t.strip()) and one_token(t.strip()))
    out = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": [word]}).choices[0]
    assert out.logprobs.tokens != free and len(out.logprobs.tokens) == 24
    assert not {word, " " + word} & set(out.logprobs.tokens)


def test_truncate_prompt_tokens(client: openai.OpenAI) -> None:
    """vLLM's ``truncate_prompt_tokens``: a prompt longer than the context runs as its last k
    tokens (the same output as those tokens sent alone), on completions and chat."""
    long_ids = [(13 * i) % 400 + 3 for i in range(3000)]
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    cut = client.completions.create(prompt=long_ids, **{**kw, "extra_body": {"ignore_eos": True,
                                                                            "truncate_prompt_tokens": 40}})
    alone = client.completions.create(prompt=long_ids[-40:], **kw)
    assert cut.usage.prompt_tokens == 40 and cut.choices[0].text == alone.choices[0].text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "word " * 3000}],
                                          **{**kw, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 30}})
    assert chat.usage.prompt_tokens == 30 and chat.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(prompt="x", **{**kw, "extra_body": {"truncate_prompt_tokens": -2}})


def test_chat_logprob_bytes_rebuild_characters_split_over_tokens(client: openai.OpenAI) -> None:
    """OpenAI's ``bytes`` are each token's own bytes: where a character spans several tokens
    (each token's text then U+FFFD) they still join into the text's UTF-8."""
    text = "\u00e9\u65e5"  # two and three bytes in UTF-8
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=1,
                                         extra_body={"structured_outputs": {"regex": text}})
    assert out.choices[0].message.content == text
    content = out.choices[0].logprobs.content
    assert any(item.token == "\ufffd" for item in content)  # a character was split: what this tests
    assert b"".join(bytes(item.bytes) for item in content) == text.encode()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client: openai.OpenAI, stream: bool) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip() and len(stop) == 2
    expected = full[: full.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop],
                                    stream=stream)
    if stream:
        chunks = [c for c in out if c.choices]
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, reason = out.choices[0].text, out.choices[0].finish_reason
    assert (text, reason) == (expected, "stop")


def test_extension_params(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.5, seed=3,
                                    extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                                                "ignore_eos": True, "min_tokens": 8, "stop_token_ids": [1]})
    assert out.usage.completion_tokens == 8


def test_cached_tokens_reported(client: openai.OpenAI) -> None:
    prompt = "The same long prompt is sent twice so that its blocks are cached. " * 3
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_models_health_version_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 200 and health.json()["engine_pid"] > 0
    assert "version" in httpx.get(server.base_url + "/version").json()
    assert metric(server, "pagoda:request_success_total") > 0
    assert "pagoda:kv_cache_usage_perc" in httpx.get(server.base_url + "/metrics").text


# ---- load and cancellation ------------------------------------------------------------------------

def test_64_concurrent_streams_equal_offline(server: ServerProcess, llama_llm: LLM) -> None:
    prompts = [f"Request number {i} says" for i in range(64)]
    expected = [o.text for o in offline_greedy(llama_llm, prompts, 12)]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(run()) == expected


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    baseline = engine_stats(server)["num_used_blocks"]
    aborted = metric(server, "pagoda:request_aborted_total")
    body = {"model": MODEL, "prompt": "Stream then hang up. " * 4, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    pid = engine_pid(server.base_url)
    with contextlib.ExitStack() as paused:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as resp:
            assert next(line for line in resp.iter_lines() if line.startswith("data:"))
            # Hang up while the engine is paused, so the request is surely still running.
            paused.enter_context(frozen(pid))
        # Closing the response hung up mid-stream: the server tells the engine to stop it.
        assert wait_for(lambda: metric(server, "pagoda:request_aborted_total") == aborted + 1)
    assert wait_for(lambda: engine_stats(server)["num_used_blocks"] == baseline), engine_stats(server)
    assert engine_stats(server)["num_running"] == 0


def test_disconnect_while_waiting_for_non_streaming_response(server: ServerProcess) -> None:
    baseline = engine_stats(server)["num_used_blocks"]
    aborted = metric(server, "pagoda:request_aborted_total")
    body = {"model": MODEL, "prompt": "Wait, then hang up. " * 4, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as ac:
            task = asyncio.create_task(ac.post("/v1/completions", json=body))
            await asyncio.sleep(0.5)  # the request is in the server, waiting on the paused engine
            task.cancel()  # closes the connection
            await asyncio.gather(task, return_exceptions=True)

    with frozen(engine_pid(server.base_url)):
        asyncio.run(hang_up())
        assert wait_for(lambda: metric(server, "pagoda:request_aborted_total") == aborted + 1)
    assert wait_for(lambda: engine_stats(server)["num_used_blocks"] == baseline), engine_stats(server)
    assert engine_stats(server)["num_running"] == 0


# ---- errors --------------------------------------------------------------------------------------

ERROR_CASES = [
    # (name, path, body (dict or raw bytes), status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("not an object", "/v1/completions", b'[1, 2]', 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("bad temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("bad top_p", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ("bad n", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("too many logprobs", "/v1/completions", {"prompt": "x", "logprobs": 100}, 400, "logprobs"),
    ("prompt too long", "/v1/completions", {"prompt": [5] * 600}, 400, "prompt"),
    ("max_tokens past max_model_len", "/v1/completions", {"prompt": [5] * 100, "max_tokens": 500}, 400, "max_tokens"),
    ("token outside vocab", "/v1/completions", {"prompt": [5, 100000]}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("unknown chat model", "/v1/chat/completions", {"model": "gpt-9", "messages": []}, 404, "model"),
    ("tokenize neither", "/tokenize", {}, 400, "prompt"),
    ("detokenize bad id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("name,path,body,status,param", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_status_and_shape(server: ServerProcess, name: str, path: str, body: dict | bytes, status: int,
                                param: str | None) -> None:
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    resp = httpx.post(server.base_url + path, timeout=30, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param, error
    if name == "prompt too long":
        assert "600" in error["message"] and str(MAX_MODEL_LEN) in error["message"]


def test_unknown_route_is_openai_shaped_404(server: ServerProcess) -> None:
    resp = httpx.get(server.base_url + "/v1/nothing-here")
    assert resp.status_code == 404 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    # Runtime LoRA loading exists only with --enable-lora --allow-runtime-lora-updating.
    resp = httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert resp.status_code == 404


def test_openai_client_raises_typed_errors_and_server_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    out = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_stream_error_before_start_is_plain_http_error(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "x", "temperature": -1, "stream": True}
    resp = httpx.post(server.base_url + "/v1/completions", json=body)
    assert resp.status_code == 400
    assert json.loads(resp.text)["error"]["param"] == "temperature"
