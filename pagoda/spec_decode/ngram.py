"""Prompt-lookup (n-gram) proposals: when a sequence's last ``n`` tokens occurred earlier in its
own prompt or output, propose the tokens that followed that occurrence. Costs no model at all
and pays off when outputs quote their inputs (summaries, code edits, retrieval answers).

The proposal is a point mass (``draft_probs`` stays None), which the rejection sampler
verifies exactly."""
from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.request import Sequence
from pagoda.spec_decode.proposer import Proposer
from pagoda.step import Draft


class NgramIndex:
    """For each ``n`` in ``[n_min, n_max]``: the latest start of every n-gram of a token list
    that has a token after it. Updated incrementally as tokens are appended, so a lookup costs
    O(n_max) instead of a scan of the whole sequence."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.latest: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # tokens seen so far

    def update(self, tokens: list[int]) -> None:
        # An n-gram starting at ``i`` is indexed once the token after it exists.
        for end in range(max(self.num_indexed, 1), len(tokens)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.latest[tuple(tokens[end - n:end])] = end - n
        self.num_indexed = len(tokens)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix (``n_max`` down to ``n_min``)."""
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            start = self.latest.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


class NgramProposer(Proposer):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.indexes: dict[str, tuple[Sequence, NgramIndex]] = {}

    def draft(self, wanted: list[tuple[Sequence, int]]) -> dict[str, Draft]:
        drafts = {}
        for seq, k in wanted:
            index = self._index(seq)
            index.update(seq.token_ids)
            drafts[seq.seq_id] = Draft(index.lookup(seq.token_ids, k))
        return drafts

    def _index(self, seq: Sequence) -> NgramIndex:
        entry = self.indexes.get(seq.seq_id)
        if entry is None or entry[0] is not seq:
            entry = (seq, NgramIndex(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max))
            self.indexes[seq.seq_id] = entry
        return entry[1]

    def reset(self) -> None:
        self.indexes.clear()

    def release_finished(self) -> None:
        # Preempted sequences keep their index: their tokens are unchanged.
        for seq_id in [s for s, (seq, _) in self.indexes.items() if seq.finished]:
            del self.indexes[seq_id]
