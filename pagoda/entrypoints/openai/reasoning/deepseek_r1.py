"""DeepSeek-R1 style: the output is reasoning until ``</think>`` (its chat template opens the
``<think>``; a model that writes it again is fine), the answer after it. No ``</think>`` at all:
the whole output is reasoning."""
from __future__ import annotations

from pagoda.entrypoints.openai.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True
