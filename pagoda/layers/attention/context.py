"""The one forward-context global: the current step's attention metadata, set for the span of
a forward pass by a context manager so model code needs no extra arguments. Per thread: under
async scheduling an engine's forward passes run on its worker thread, and two engines in one
process may step at once."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from pagoda.layers.attention.backend import AttentionMetadata

class _Current(threading.local):
    meta: AttentionMetadata | None = None


_CURRENT = _Current()


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    previous, _CURRENT.meta = _CURRENT.meta, meta
    try:
        yield
    finally:
        _CURRENT.meta = previous


def get_attention_metadata() -> AttentionMetadata:
    meta = _CURRENT.meta
    if meta is None:
        raise RuntimeError("attention ran outside forward_context()")
    return meta


def current_abandon() -> Callable[[], bool] | None:
    """The current step's ``AttentionMetadata.abandon`` (None outside a forward pass)."""
    meta = _CURRENT.meta
    return meta.abandon if meta is not None else None
