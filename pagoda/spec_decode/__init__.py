"""Speculative decoding: proposers (n-gram prompt lookup, draft model) and the exact rejection
sampler that verifies their drafts inside the ordinary continuous batch."""
