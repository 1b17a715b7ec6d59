"""Qwen3 style: reasoning only inside ``<think>…</think>`` that the model writes; an output
without ``<think>`` (thinking turned off by ``enable_thinking: false``, whose template writes an
empty ``<think></think>`` into the prompt) is all answer. A ``<think>`` never closed (cut off by
``max_tokens``) leaves everything after it reasoning, in whole and streamed responses alike."""
from __future__ import annotations

from pagoda.entrypoints.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_start = False
