"""gpt-oss (harmony): the ``analysis`` channel is the reasoning, ``final`` (and ``commentary``
preambles) the answer; function calls go on to the ``openai`` tool parser (``..harmony``). The
markers are special tokens: ``reads_special_tokens`` makes the server decode the output with them
kept, and the split takes them out of both parts."""
from __future__ import annotations

from typing import Any, Sequence

from pagoda.entrypoints.openai.harmony import HarmonySplitter
from pagoda.entrypoints.openai.reasoning.base import ReasoningParser, _single_token


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    reads_special_tokens = True

    def __init__(self, tokenizer: Any) -> None:
        # No single start or end tag: the channel markers must be tokens, the rest is text.
        self.channel_token_id = _single_token(tokenizer, "<|channel|>", self.name)
        self.message_token_id = _single_token(tokenizer, "<|message|>", self.name)
        self.end_message_token_id = _single_token(tokenizer, "<|end|>", self.name)
        self.start_token_id = self.end_token_id = -1
        self.specials = frozenset(getattr(tokenizer, "all_special_tokens", []) or []) | frozenset(
            t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if t.special)

    def streamer(self, tool_calls: bool = False) -> HarmonySplitter:  # type: ignore[override]
        """The split delta by delta (``ReasoningStreamer``'s ``feed`` contract)."""
        return HarmonySplitter(self.specials, tool_calls)

    def grammar_start_after(self, prompt_ids: Sequence[int]) -> int | None:
        """A grammar applies from the first token: the model then writes the shaped answer with
        no harmony framing (no analysis), which the split reads as plain content."""
        return None

    def reasoning_tokens(self, ids: Sequence[int]) -> int:
        """Output tokens through the end of the first message (the analysis, when there is
        reasoning at all)."""
        return ids.index(self.end_message_token_id) + 1 if self.end_message_token_id in ids else len(ids)
