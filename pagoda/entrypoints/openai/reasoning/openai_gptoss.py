"""gpt-oss (harmony): the ``analysis`` channel is the reasoning, ``final`` (and ``commentary``
preambles) the answer; function calls go on to the ``openai`` tool parser (``..harmony``). The
markers are special tokens: ``reads_special_tokens`` makes the server decode the output with them
kept, and the split takes them out of both parts."""
from __future__ import annotations

from typing import Any, Sequence

from pagoda.entrypoints.openai.harmony import HarmonySplitter
from pagoda.entrypoints.openai.reasoning.base import ReasoningParser, _single_token
from pagoda.structured_output.params import StructuredOutputsParams


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    reads_special_tokens = True

    def __init__(self, tokenizer: Any) -> None:
        # No single start or end tag: the channel markers must be tokens, the rest is text.
        self.channel_token_id = _single_token(tokenizer, "<|channel|>", self.name)
        self.message_token_id = _single_token(tokenizer, "<|message|>", self.name)
        self.end_message_token_id = _single_token(tokenizer, "<|end|>", self.name)
        # The tokens that close a message body or open a new message (a prompt ending after one
        # of them leaves no body open for a grammar), and the analysis channel's name.
        encoded = (tokenizer.encode(t, add_special_tokens=False) for t in ("<|end|>", "<|start|>", "<|return|>", "<|call|>"))
        self.closing_ids = frozenset(ids[0] for ids in encoded if len(ids) == 1)
        self.analysis_ids = list(tokenizer.encode("analysis", add_special_tokens=False))
        self.start_token_id = self.end_token_id = -1
        self.specials = frozenset(getattr(tokenizer, "all_special_tokens", []) or []) | frozenset(
            t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if t.special)

    def streamer(self, tool_calls: bool = False, forced: bool = False) -> HarmonySplitter:  # type: ignore[override]
        """The split delta by delta (``ReasoningStreamer``'s ``feed`` contract)."""
        return HarmonySplitter(self.specials, tool_calls, forced)

    def delay_grammar(self, constraint: StructuredOutputsParams, prompt_ids: Sequence[int]) -> None:
        """The grammar applies to the body of the first message that is not the analysis
        channel's: the final answer (json answers), or a call's arguments in the commentary
        channel (forced calls; the split hands that body on as the answer). It starts at once
        when the prompt itself leaves such a body open (a prefilled final message)."""
        last_message = max((i for i, t in enumerate(prompt_ids) if t == self.message_token_id), default=-1)
        closed = any(t in self.closing_ids for t in prompt_ids[last_message + 1:])
        if last_message >= 0 and not closed and not self._after_analysis(prompt_ids, last_message):
            constraint.start_after_token_id = None
            return
        constraint.start_after_token_id = self.message_token_id
        constraint.start_skip_after = [[self.channel_token_id, *self.analysis_ids]]

    def _after_analysis(self, ids: Sequence[int], at: int) -> bool:
        """Whether the ``<|message|>`` at ``at`` ends an analysis header."""
        head = [self.channel_token_id, *self.analysis_ids]
        return at >= len(head) and list(ids[at - len(head):at]) == head

    def reasoning_tokens(self, ids: Sequence[int]) -> int:
        """Output tokens through the end of the first message (the analysis, when there is
        reasoning at all)."""
        return ids.index(self.end_message_token_id) + 1 if self.end_message_token_id in ids else len(ids)
