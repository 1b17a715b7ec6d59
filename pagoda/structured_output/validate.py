"""The front end's check of a constraint, before the request is queued: a schema, regex or
grammar the backend cannot compile is refused with a ``ParamError`` (a 400 from the server, a
``ValueError`` offline) that names the problem. Checked constraints are remembered by key."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pagoda.structured_output.backend import GrammarBackend, make_backend
from pagoda.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

REMEMBERED = 1024


class StructuredValidator:
    def __init__(self, config: "EngineConfig", tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._ok: OrderedDict[str, None] = OrderedDict()

    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                model = self.config.model
                tokenizer = self.tokenizer
                if tokenizer is None:  # a copy of its own: tokenizers are not shared between threads
                    from pagoda.engine.input_processor import load_tokenizer

                    tokenizer = load_tokenizer(model.tokenizer)
                self._backend = make_backend(self.config.structured_outputs_backend, tokenizer,
                                             model.vocab_size, model.eos_token_ids)
            return self._backend

    def is_known(self, params: StructuredOutputsParams) -> bool:
        return params.key() in self._ok

    def validate(self, params: StructuredOutputsParams) -> None:
        key = params.key()
        if key in self._ok:
            self._ok.move_to_end(key)
            return
        self.backend().validate(params)
        self._ok[key] = None
        while len(self._ok) > REMEMBERED:
            self._ok.popitem(last=False)
