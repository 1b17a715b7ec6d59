"""The front end's check of a constraint, before the request is queued.

A constraint comes from a client and is compiled by native code that a hostile one can crash
(a grammar nested deep enough overflows the compiler's stack), stall or make allocate without
bound. So the check runs in a ``Sandbox`` worker process, with a timeout and a memory limit:
the worker compiles the constraint and follows it for a few tokens (``GrammarBackend.probe``),
on a stack much smaller than the engine core's compile threads. A constraint it refuses, one
that crashes or exhausts the worker, and one that takes longer than ``CHECK_TIMEOUT_S`` are
each a ``ParamError`` (a 400 from the server, a ``ValueError`` offline) for that request alone;
the worker is replaced and nothing else is affected.

A constraint that compiles and can be followed may still never end: every way through it
recurses (``start: ("a" | "b") start``), or its shortest text is longer than the model's context
can hold. The worker asks the backend for a lower bound on that length (``shortest.py``) and
refuses such a constraint too: a request under it could only ever end with ``length``.

The engine core only ever compiles constraints checked here. Results are remembered by key
(``StructuredOutputsParams.key``): a known constraint costs no round trip, and a refused one is
refused again at once (except after a timeout, which a busy machine may cause).
"""
from __future__ import annotations

import threading
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from pagoda.errors import ParamError
from pagoda.sandbox import Sandbox, SandboxBusy, SandboxCrash, SandboxMemoryError, SandboxTimeout
from pagoda.structured_output.params import StructuredOutputsParams
from pagoda.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.structured_output.backend import GrammarBackend

REMEMBERED = 1024
CHECK_WORKERS = 2
CHECK_TIMEOUT_S = 10.0
CHECK_MEMORY_MIB = 1024


@dataclass(frozen=True)
class _Worker:
    """A sandbox worker's state: its backend, and the most bytes a model's whole context can
    decode to (``max_model_len`` times the longest token's bytes)."""
    backend: "GrammarBackend"
    max_text_bytes: int


def _worker_backend(name: str, tokenizer: str, vocab_size: int, eos_token_ids: Sequence[int],
                    max_model_len: int) -> _Worker:
    """The sandbox worker's state: a backend with its own tokenizer. The fast tokenizer class
    reads the same ``tokenizer.json`` without importing torch (``AutoTokenizer`` does), which
    makes a worker's start, and its restart after a crash, several times cheaper."""
    from pagoda.structured_output.backend import make_backend

    try:
        from transformers import PreTrainedTokenizerFast

        loaded = PreTrainedTokenizerFast.from_pretrained(tokenizer)
    except Exception:  # no tokenizer.json (a slow-only tokenizer): the engine's own loader
        loaded = load_tokenizer(tokenizer)
    # A token's text in UTF-8 is at least its bytes (byte-level and SentencePiece vocabularies).
    longest = max((len(str(t).encode("utf-8", "replace")) for t in loaded.get_vocab()), default=1)
    return _Worker(make_backend(name, loaded, vocab_size, eos_token_ids), max_model_len * max(1, longest))


def _probe(worker: _Worker, params: StructuredOutputsParams) -> str | None:
    """In the worker: None if ``params`` compiles, can be followed and can end within the
    model's context, else why not."""
    try:
        worker.backend.probe(params)
        shortest = worker.backend.shortest_bytes(params)
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # anything else the libraries raise on this input is its fault too
        return f"unsupported or invalid {params.kind} constraint: {type(exc).__name__}: {exc}"
    if shortest is not None and math.isinf(shortest):
        return (f"the {params.kind} constraint accepts no text of finite length (every way through it "
                "recurses): a request under it could only end at max_tokens")
    if shortest is not None and shortest > worker.max_text_bytes:
        return (f"the shortest text the {params.kind} constraint accepts is {int(shortest)} bytes, more than "
                f"the model's context (max_model_len) can hold")
    return None


class StructuredValidator:
    """Checks constraints in a sandbox (started on first use) and remembers the answers."""

    def __init__(self, config: "EngineConfig", tokenizer: Any = None) -> None:
        self.config = config
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()  # guards _known
        self._sandbox_lock = threading.Lock()
        # key -> None (accepted) or the refusal's message
        self._known: OrderedDict[str, str | None] = OrderedDict()

    def sandbox(self) -> Sandbox:
        with self._sandbox_lock:
            if self._sandbox is None:
                model = self.config.model
                args = (self.config.structured_outputs_backend, model.tokenizer, model.vocab_size,
                        list(model.eos_token_ids), model.max_model_len)
                self._sandbox = Sandbox(_worker_backend, args, workers=CHECK_WORKERS, timeout=CHECK_TIMEOUT_S,
                                        memory_mib=CHECK_MEMORY_MIB)
            return self._sandbox

    def is_known(self, params: StructuredOutputsParams) -> bool:
        """Whether ``validate`` answers at once (no sandbox call) for ``params``."""
        return params.key() in self._known

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``ParamError`` if ``params`` cannot be compiled and followed safely; blocks
        for the sandbox call when the constraint is new. ``SandboxBusy`` when every worker
        stays busy past the timeout (the caller answers "retry later")."""
        key = params.key()
        with self._lock:  # the server checks on several threads
            known = key in self._known
            if known:
                self._known.move_to_end(key)
                refusal = self._known[key]
        if not known:
            refusal, remember = self._check(params)
            if remember:
                with self._lock:
                    self._known[key] = refusal
                    while len(self._known) > REMEMBERED:
                        self._known.popitem(last=False)
        if refusal is not None:
            raise ParamError("structured_outputs", refusal)

    def _check(self, params: StructuredOutputsParams) -> tuple[str | None, bool]:
        """(refusal or None, whether to remember the answer)."""
        what = f"the {params.kind} constraint"
        try:
            return self.sandbox().call(_probe, params), True
        except SandboxBusy:
            raise
        except SandboxTimeout:
            return f"compiling {what} took longer than {CHECK_TIMEOUT_S:g} s; simplify it", False
        except SandboxMemoryError:
            return f"compiling {what} needs more than {CHECK_MEMORY_MIB} MiB; simplify it", True
        except SandboxCrash as exc:
            return (f"compiling {what} failed ({exc}); it is probably too deeply nested or too large; "
                    "simplify it"), True

    def shutdown(self) -> None:
        with self._sandbox_lock:
            if self._sandbox is not None:
                self._sandbox.shutdown()
                self._sandbox = None
