"""Loading a model's tokenizer: the front end, the engine core's grammar manager and the
structured-output checkers all load it this one way."""
from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer at ``path`` (``AutoTokenizer``), or the one in a ``.gguf`` file's
    metadata; ``ValueError`` naming the path if it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        if str(path).endswith(".gguf"):  # the tokenizer and chat template in a GGUF's metadata
            from pagoda.models.gguf_loader import load_tokenizer as load_gguf_tokenizer

            return load_gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a missing/corrupt tokenizer
        raise ValueError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
