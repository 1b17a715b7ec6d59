"""An earlier assistant turn's thinking sent back in a conversation reaches the chat template
under every name templates read it by: ``reasoning_content`` (Qwen3's), ``reasoning`` (vLLM's
other input name) and ``thinking`` (gpt-oss's harmony template), whichever the client used."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pagoda.engine.input_processor import InputProcessor
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.errors import ParamError
from pagoda.multimodal.options import MediaConfig
from pagoda.tokenizer import load_tokenizer

# The part of gpt-oss's template that renders an earlier reply's analysis (it reads ``thinking``).
HARMONY_HISTORY = ("{%- for m in messages -%}<|start|>{{ m.role }}"
                   "{%- if m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>{{ m.role }}"
                   "{%- endif %}<|message|>{{ m.content }}<|end|>{%- endfor -%}")
QWEN_HISTORY = "{%- for m in messages -%}[{{ m.reasoning_content or '' }}]{{ m.content }}{%- endfor -%}"


@pytest.fixture(scope="module")
def processor(llama_dir: Path) -> InputProcessor:
    model = SimpleNamespace(max_model_len=512, vocab_size=512, hf_config={}, architecture="LlamaForCausalLM",
                            is_multimodal=False)
    config = SimpleNamespace(model=model, media=MediaConfig.from_flags(None, None, None))
    return InputProcessor(config, load_tokenizer(str(llama_dir)))  # type: ignore[arg-type]


def rendered(processor: InputProcessor, turn: dict, template: str) -> str:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", **turn},
        {"role": "user", "content": "Again"}]})
    messages = processor.check_messages([m.template_input() for m in req.messages])
    return processor.apply_chat_template(messages, False, template)


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])
def test_either_input_name_reaches_every_template(processor: InputProcessor, name: str) -> None:
    harmony = rendered(processor, {name: "Let me think"}, HARMONY_HISTORY)
    assert "<|start|>assistant<|channel|>analysis<|message|>Let me think<|end|>" in harmony
    assert rendered(processor, {name: "Let me think"}, QWEN_HISTORY) == "[]Hi[Let me think]Hello[]Again"


def test_no_thinking_renders_none_and_offline_thinking_is_read_too(processor: InputProcessor) -> None:
    assert "analysis" not in rendered(processor, {}, HARMONY_HISTORY)
    offline = processor.check_messages([{"role": "assistant", "content": "x", "thinking": "t"}])
    assert offline[0]["reasoning_content"] == offline[0]["reasoning"] == offline[0]["thinking"] == "t"
    with pytest.raises(ParamError, match=r"messages\[0\]\.thinking must be a string"):
        processor.check_messages([{"role": "assistant", "content": "x", "thinking": 3}])
