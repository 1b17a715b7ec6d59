"""A hybrid model (Granite 4, ``GraniteMoeHybridForCausalLM``: Mamba-2 layers beside attention)
served by a real ``pagoda serve`` and asked through the official ``openai`` client: greedy chat
and completions, streamed and not, ``n=2`` (the prompt's recurrent state copied to each sample),
with prompts longer than the server's step budget (chunked prefill carries the state across
chunks), give the tokens the offline ``LLM`` gives on the same checkpoint without chunking."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import openai
import pytest

from pagoda import LLM, SamplingParams
from server_helpers import ServerProcess, start_server
from tests.models.granite_hybrid_helpers import make_granite_hybrid

MODEL = "granite-hybrid"
CHUNK = 16  # the server's step budget: every prompt below is longer, so it is prefilled in chunks
MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Tell me about the weather in Paris and Rome this week, and which "
                                        "of the two cities will be warmer on the weekend."}]
PROMPT_IDS = list(range(30, 70))  # 40 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Mamba, attention, Mamba with experts: every kind of layer the family has.
    return make_granite_hybrid(tmp_path_factory.mktemp("granite"), layer_types=["mamba", "attention", "mamba"])


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> dict[str, list[int] | str]:
    """The offline engine's greedy answers (whole prompts in one step), then shut down."""
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20, max_model_len=512)
    try:
        assert llm.engine.core.kv.states is not None  # recurrent-state slots: the hybrid path
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        chat = llm.chat(MESSAGES, params, use_tqdm=False)[0]
        completion = llm.generate([{"prompt_token_ids": PROMPT_IDS}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return {"chat_text": chat.outputs[0].text, "chat_prompt_len": len(chat.prompt_token_ids),
            "chat_tokens": len(chat.outputs[0].token_ids), "text": completion.outputs[0].text,
            "tokens": len(completion.outputs[0].token_ids)}


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    srv: ServerProcess = start_server(model_dir, tmp_path_factory.mktemp("hybrid-server-logs"),
                                      "--served-model-name", MODEL, "--max-num-batched-tokens", str(CHUNK))
    try:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        srv.stop()


def test_chat_n2_and_streamed_match_offline(client: openai.OpenAI, offline: dict) -> None:
    assert offline["chat_prompt_len"] > CHUNK
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, n=2)
    assert out.usage.prompt_tokens == offline["chat_prompt_len"]
    assert [c.message.content for c in out.choices] == [offline["chat_text"]] * 2
    assert out.usage.completion_tokens == 2 * offline["chat_tokens"]

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == offline["chat_text"]


def test_completion_n2_and_streamed_match_offline(client: openai.OpenAI, offline: dict) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, temperature=0, max_tokens=MAX_TOKENS, n=2)
    assert out.usage.prompt_tokens == len(PROMPT_IDS) > CHUNK
    assert [c.text for c in out.choices] == [offline["text"]] * 2
    assert out.usage.completion_tokens == 2 * offline["tokens"]

    stream = client.completions.create(model=MODEL, prompt=PROMPT_IDS, temperature=0, max_tokens=MAX_TOKENS, n=2,
                                       stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [offline["text"]] * 2


def test_serve_help_and_readme_name_every_architecture(capsys: pytest.CaptureFixture) -> None:
    from pagoda.entrypoints.cli import build_parser
    from pagoda.models.registry import ARCHITECTURES

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # wrapped at any width, even inside "Mamba-2"
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "hybrid(Mamba-2layersbesideattention):GraniteMoeHybridForCausalLM,BambaForCausalLM" in help_text
    for name in ARCHITECTURES:
        assert name in help_text and name in readme, name
