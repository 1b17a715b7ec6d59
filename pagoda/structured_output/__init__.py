"""Structured output: constrained decoding to a JSON schema, regex, choice or grammar.

``StructuredOutputsParams`` (pure Python) says what a request's output must match; a
``GrammarBackend`` (``backend.py``: llguidance or xgrammar) compiles it and makes per-sequence
matchers; the ``StructuredOutputManager`` (``manager.py``) in the engine core compiles off the
step loop, caches compiled grammars and fills each step's token bitmask, which the one sampling
pipeline (``executor/sampler.py``) applies before sampling.
"""
from pagoda.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
