"""The one forward-context global: the current step's attention metadata, set for the span of
a forward pass by a context manager so model code needs no extra arguments."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from pagoda.layers.attention.backend import AttentionMetadata

_CURRENT: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _CURRENT
    previous, _CURRENT = _CURRENT, meta
    try:
        yield
    finally:
        _CURRENT = previous


def get_attention_metadata() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention ran outside forward_context()")
    return _CURRENT
