"""Speculative decoding's proposers (n-gram prompt lookup, draft model): each step they return
``Draft``s (``pagoda.step``) for the engine core to schedule; the executor verifies them
with the exact rejection sampler (``executor.rejection``).

``make_proposer`` is the one place that knows every proposer; the proposers import only their
base class (``proposer.Proposer``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.executor.interface import Executor
    from pagoda.spec_decode.proposer import Proposer


def make_proposer(config: "EngineConfig", executor: "Executor") -> "Proposer":
    """The proposer named by ``config.speculative.method`` (imported here, on first use: the
    draft model's pulls in the model runner)."""
    assert config.speculative is not None
    method = config.speculative.method
    if method == "ngram":
        from pagoda.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    if method == "draft_model":
        from pagoda.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, executor)
    raise ValueError(f"unknown speculative method {method!r}")
