"""Reasoning parsers (``--reasoning-parser``): split a reasoning model's thinking from its answer
into ``reasoning_content`` and ``content``. Shared objects: every API that returns chat output
(chat completions now; Responses and Messages later) builds its replies from the same split."""
from __future__ import annotations

from typing import Any

from pagoda.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningStreamer
from pagoda.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagoda.entrypoints.openai.reasoning.openai_gptoss import GptOssReasoningParser
from pagoda.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
}


def get_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The named parser for this tokenizer; ``ValueError`` for an unknown name or a tokenizer
    whose tags are not single tokens."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown --reasoning-parser {name!r}; pagoda has {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name](tokenizer)


# The reasoning parser a tool-call parser's format needs when none is named (harmony's channels
# must be split for its calls and answer to be read at all).
TOOL_FORMAT_REASONING = {"openai": "openai_gptoss"}


__all__ = ["REASONING_PARSERS", "TOOL_FORMAT_REASONING", "ReasoningParser", "ReasoningStreamer", "get_reasoning_parser"]
