"""The server's validation rules through the offline API: ``SamplingParams``, ``LLM.generate`` and
``LLM.chat`` raise ``ValueError`` (``ParamError``) naming the field, before any work starts, and
the engine stays usable."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from pagoda import LLM, SamplingParams
from pagoda.engine.input_processor import MAX_MESSAGES, MAX_PROMPT_CHARS_PER_TOKEN
from pagoda.sampling_params import (MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                    MAX_STOP_TOKEN_IDS, SEED_MAX, SEED_MIN, ParamError)

VOCAB = 512  # conftest's llama spec
MAX_MODEL_LEN = 1024  # the shared llama_llm's
NAN, INF = float("nan"), float("inf")

# (field, SamplingParams keyword arguments)
BAD_PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("n", dict(n=True)), ("n", dict(n=0)), ("n", dict(n=MAX_N + 1)), ("n", dict(n=2 ** 31)), ("n", dict(n=2.0)),
    ("seed", dict(seed=SEED_MAX + 1)), ("seed", dict(seed=SEED_MIN - 1)), ("seed", dict(seed=SEED_MAX, n=2)),
    ("seed", dict(seed=True)), ("seed", dict(seed=1.5)),
    ("temperature", dict(temperature=NAN)), ("temperature", dict(temperature=INF)),
    ("temperature", dict(temperature=-1)), ("temperature", dict(temperature=101)),
    ("temperature", dict(temperature=True)), ("temperature", dict(temperature="1")),
    ("top_p", dict(top_p=0)), ("top_p", dict(top_p=NAN)), ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)), ("top_k", dict(top_k=True)), ("top_k", dict(top_k=2.0)),
    ("min_p", dict(min_p=2)), ("min_p", dict(min_p=-INF)),
    ("presence_penalty", dict(presence_penalty=3)), ("presence_penalty", dict(presence_penalty=NAN)),
    ("frequency_penalty", dict(frequency_penalty=-INF)),
    ("repetition_penalty", dict(repetition_penalty=1e-310)), ("repetition_penalty", dict(repetition_penalty=0)),
    ("repetition_penalty", dict(repetition_penalty=101)), ("repetition_penalty", dict(repetition_penalty=NAN)),
    ("max_tokens", dict(max_tokens=0)), ("max_tokens", dict(max_tokens=True)), ("max_tokens", dict(max_tokens="5")),
    ("min_tokens", dict(min_tokens=-1)), ("min_tokens", dict(min_tokens=5, max_tokens=2)),
    ("logprobs", dict(logprobs=-1)), ("logprobs", dict(logprobs=True)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("stop", dict(stop=["x"] * (MAX_STOP_STRINGS + 1))), ("stop", dict(stop="x" * (MAX_STOP_STRING_CHARS + 1))),
    ("stop", dict(stop=[""])), ("stop", dict(stop=[5])), ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))),
    ("stop_token_ids", dict(stop_token_ids=[-1])), ("stop_token_ids", dict(stop_token_ids=[True])),
    ("logit_bias", dict(logit_bias={5: 100.5})), ("logit_bias", dict(logit_bias={5: -101})),
    ("logit_bias", dict(logit_bias={5: NAN})), ("logit_bias", dict(logit_bias={5: True})),
    ("logit_bias", dict(logit_bias={-1: 1.0})), ("logit_bias", dict(logit_bias={True: 1.0})),
    ("logit_bias", dict(logit_bias={"x": 1.0})), ("logit_bias", dict(logit_bias=[(5, 1.0)])),
    ("logit_bias", dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})),
]


def assert_names(err: pytest.ExceptionInfo, field: str) -> None:
    assert isinstance(err.value, ParamError), err.value
    assert err.value.param == field, (err.value.param, str(err.value))
    assert field in str(err.value), str(err.value)


def assert_usable(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv.num_used_blocks == 0
    out = llm.generate(["Still working"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("field,kwargs", BAD_PARAMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PARAMS)])
def test_bad_sampling_params_name_the_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert_names(err, field)


def test_extremes_in_range_are_accepted() -> None:
    SamplingParams(seed=SEED_MAX)
    SamplingParams(seed=SEED_MIN, n=MAX_N)
    p = SamplingParams(top_k=0, temperature=100, top_p=1e-300, repetition_penalty=0.01, presence_penalty=-2,
                       stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=[0] * MAX_STOP_TOKEN_IDS)
    assert p.top_k == -1  # 0 means off, as -1
    # vLLM's offline shape: int keys; decimal text keys (a JSON map's) become ints; {} is no bias.
    assert SamplingParams(logit_bias={"7": -100, 3: 100.0}).logit_bias == {7: -100.0, 3: 100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=2, **kw)


# (field, prompt, sampling params): rules that need the model, checked by InputProcessor.validate
BAD_REQUESTS: list[tuple[str, Any, Any]] = [
    ("top_k", "Hello", lambda: greedy(top_k=VOCAB + 1)),
    ("top_k", "Hello", lambda: greedy(top_k=2 ** 63)),
    ("stop_token_ids", "Hello", lambda: greedy(stop_token_ids=[VOCAB])),
    ("logit_bias", "Hello", lambda: greedy(logit_bias={VOCAB: 1.0})),
    ("logprobs", "Hello", lambda: greedy(logprobs=21)),
    ("prompt_logprobs", "Hello", lambda: greedy(prompt_logprobs=21)),
    ("max_tokens", "Hello", lambda: greedy().clone(max_tokens=MAX_MODEL_LEN)),
    ("max_tokens", "Hello", lambda: greedy().clone(max_tokens=2 ** 63)),
    ("min_tokens", "Hello", lambda: SamplingParams(max_tokens=None, min_tokens=MAX_MODEL_LEN)),
    ("prompt", [5, VOCAB], greedy),
    ("prompt", [-1], greedy),
    ("prompt", [True, 5], greedy),
    ("prompt", {"prompt_token_ids": [False]}, greedy),
    ("prompt", {"prompt_token_ids": []}, greedy),
    ("prompt", "", greedy),
    ("prompt", [5] * MAX_MODEL_LEN, greedy),
    ("prompt", "a" * (MAX_PROMPT_CHARS_PER_TOKEN * MAX_MODEL_LEN + 1), greedy),
    ("prompt", 5, greedy),
    ("prompt", {"text": "x"}, greedy),
    ("prompt", "a\ud800", greedy),  # a lone surrogate: not Unicode text (the tokenizer raised TypeError)
    ("prompt", {"prompt": "\udfff b"}, greedy),
    ("sampling_params", "Hello", lambda: {"temperature": 0}),
    # vLLM's image prompt form, to this text-only model; a modality pagoda does not take.
    ("multi_modal_data", {"prompt": "x", "multi_modal_data": {"image": Image.new("RGB", (4, 4))}}, greedy),
    ("multi_modal_data", {"prompt": "x", "multi_modal_data": {"audio": [b""]}}, greedy),
]


@pytest.mark.parametrize("field,prompt,params", BAD_REQUESTS,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD_REQUESTS)])
def test_generate_refuses_and_stays_usable(llama_llm: LLM, field: str, prompt: Any, params: Any) -> None:
    with pytest.raises(ValueError) as err:
        # A valid prompt first: validation of the whole batch happens before any request starts.
        llama_llm.generate(["A valid prompt", prompt], [greedy(), params()], use_tqdm=False)
    assert_names(err, field)
    assert_usable(llama_llm)


def test_params_changed_after_construction_are_rechecked(llama_llm: LLM) -> None:
    params = greedy()
    params.temperature = float("nan")
    with pytest.raises(ValueError) as err:
        llama_llm.generate(["Hello"], params, use_tqdm=False)
    assert_names(err, "temperature")
    params = greedy()
    params.top_k = True  # type: ignore[assignment]
    with pytest.raises(ValueError) as err:
        llama_llm.generate(["Hello"], params, use_tqdm=False)
    assert_names(err, "top_k")
    assert_usable(llama_llm)


@pytest.mark.parametrize("messages,needle", [
    ([], "empty"),
    ([[]], "empty"),
    ([{"role": "robot", "content": "x"}], "robot"),
    ([{"role": "function", "content": "x"}], "function"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "takes text only"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url.url"),
    ([{"role": "user", "content": [{"type": "image"}]}], "image_url part"),
    ([{"role": "user", "content": [{"type": "text"}]}], "text"),
    ([{"role": "user", "content": 5}], "content"),
    (["not a message"], "role"),
    ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), str(MAX_MESSAGES)),
    ([{"role": "user", "content": "a" * (MAX_PROMPT_CHARS_PER_TOKEN * MAX_MODEL_LEN + 1)}], "characters"),
    ([{"role": "user", "content": "a\ud800"}], "surrogate"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}], "surrogate"),
])
def test_chat_refuses_bad_messages(llama_llm: LLM, messages: list, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        llama_llm.chat(messages, greedy(), use_tqdm=False)
    assert_names(err, "messages")
    assert needle in str(err.value)
    assert_usable(llama_llm)


def test_chat_accepts_developer_role_and_text_parts(llama_llm: LLM) -> None:
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]
    out = llama_llm.chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}],
                         greedy(), use_tqdm=False)
    same = llama_llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}],
                          greedy(), use_tqdm=False)
    assert out[0].prompt_token_ids == same[0].prompt_token_ids  # developer is system; parts are joined


def test_chat_takes_vllms_template_arguments(llama_llm: LLM) -> None:
    """``LLM.chat``'s ``tools``, ``chat_template_kwargs`` and ``continue_final_message``, as vLLM's
    takes them, reach the template; the combinations the server refuses are refused here too."""
    template = ("{% for t in tools or [] %}TOOL:{{ t.function.name }}\n{% endfor %}{{ flavor | default('') }}"
                "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llama_llm.chat([{"role": "user", "content": "hi"}], greedy(), use_tqdm=False, chat_template=template,
                         tools=tools, chat_template_kwargs={"flavor": "salty "})
    assert out[0].prompt == "TOOL:get_weather\nsalty [user]hi"
    user, started = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}
    cont = llama_llm.chat([user, started], greedy(), use_tqdm=False, add_generation_prompt=False,
                          continue_final_message=True)
    assert cont[0].prompt.endswith("Once upon")  # the final message left open to continue
    for kwargs, name in ((dict(continue_final_message=True), "continue_final_message"),
                         (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
                         (dict(tools="get_weather"), "tools")):
        with pytest.raises(ValueError) as err:
            llama_llm.chat([user, started], greedy(), use_tqdm=False, **kwargs)
        assert_names(err, name)
    assert_usable(llama_llm)


def test_max_logprobs_setting(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=128, max_logprobs=2)
    try:
        with pytest.raises(ValueError) as err:
            llm.generate(["Hello"], greedy(logprobs=3), use_tqdm=False)
        assert_names(err, "logprobs")
        assert "2" in str(err.value)
        out = llm.generate(["Hello"], greedy(logprobs=2), use_tqdm=False)
        assert all(len(entry) <= 3 for entry in out[0].outputs[0].logprobs)
        with pytest.raises(ValueError) as err:  # offline, prompt + max_tokens must fit max_model_len too
            llm.generate(["Hello"], greedy().clone(max_tokens=128), use_tqdm=False)
        assert_names(err, "max_tokens")
    finally:
        llm.shutdown()
