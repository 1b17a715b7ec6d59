"""Speculative decoding's proposers (n-gram prompt lookup, draft model): each step they return
``Draft``s (``executor.output``) for the engine core to schedule; the executor verifies them
with the exact rejection sampler (``executor.rejection``)."""
