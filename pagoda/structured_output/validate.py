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
recurses (``start: ("a" | "b") start``), or its shortest text is longer than the request may
generate (``{"type": "string", "minLength": 100000}``, ``a{100000}``). The worker asks the
backend for a lower bound on that length in bytes (``shortest.py``, ``shortest_schema.py``) and
turns it into tokens by the tokenizer's longest token in bytes. A constraint with no finite text,
or whose bound exceeds the whole context, is refused for every request; one whose bound exceeds
this request's budget (its ``max_tokens``, else what ``max_model_len`` leaves after its prompt)
is refused for this request: under either it could only ever end with ``length``.

The engine core only ever compiles constraints checked here. Results are remembered by key
(``StructuredOutputsParams.key``): a known constraint costs no round trip, and a refused one is
refused again at once (except after a timeout, which a busy machine may cause).
"""
from __future__ import annotations

import json
import math
import threading
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
    """A sandbox worker's state: its backend, the most bytes one token can decode to, and the
    model's context length."""
    backend: "GrammarBackend"
    longest_token_bytes: int
    max_model_len: int


@dataclass(frozen=True)
class ConstraintVerdict:
    """The check's answer for one constraint: why it is refused for every request (None: it is
    not), and the fewest tokens any text it accepts takes (a lower bound; 0 when unknown)."""
    refusal: str | None
    min_tokens: int = 0
    min_bytes: int = 0


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
    return _Worker(make_backend(name, loaded, vocab_size, eos_token_ids), _longest_token_bytes(loaded),
                   max_model_len)


def _longest_token_bytes(tokenizer: Any) -> int:
    """At least the most bytes one token of ``tokenizer`` decodes to. A vocabulary entry's text
    in UTF-8 is never shorter than its bytes (byte-level and SentencePiece vocabularies); a
    byte-level vocabulary spells each byte as one character, so there the characters count."""
    try:
        byte_level = '"ByteLevel"' in json.dumps(json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder"))
    except Exception:  # a slow tokenizer: no decoder to read
        byte_level = False
    added = set(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else set()

    def measure(token: str) -> int:  # added tokens are plain text even in a byte-level vocabulary
        return len(token) if byte_level and token not in added else len(token.encode("utf-8", "replace"))

    return max(1, max((measure(str(t)) for t in tokenizer.get_vocab()), default=1))


def _probe(worker: _Worker, params: StructuredOutputsParams) -> ConstraintVerdict:
    """In the worker: whether ``params`` compiles, can be followed and can end within the
    model's context, and the fewest tokens its shortest text needs."""
    try:
        worker.backend.probe(params)
        shortest = worker.backend.shortest_bytes(params)
    except ValueError as exc:
        return ConstraintVerdict(str(exc))
    except Exception as exc:  # anything else the libraries raise on this input is its fault too
        return ConstraintVerdict(f"unsupported or invalid {params.kind} constraint: {type(exc).__name__}: {exc}")
    if shortest is None:
        return ConstraintVerdict(None)
    if math.isinf(shortest):
        return ConstraintVerdict(f"the {params.kind} constraint accepts no text of finite length (every way "
                                 "through it recurses): a request under it could only end at max_tokens")
    min_bytes = int(shortest)
    min_tokens = -(-min_bytes // worker.longest_token_bytes)
    if min_tokens >= worker.max_model_len:  # a prompt takes at least one token of the context
        return ConstraintVerdict(
            f"the shortest text the {params.kind} constraint accepts is {min_bytes} bytes, at least {min_tokens} "
            f"tokens (this tokenizer's longest token is {worker.longest_token_bytes} bytes), more than the model's "
            f"context (max_model_len {worker.max_model_len}) can hold")
    return ConstraintVerdict(None, min_tokens, min_bytes)


def _probe_fields(worker: _Worker, params: StructuredOutputsParams) -> list[Any]:
    """``_probe`` as the sandbox sends it back (JSON: the verdict's fields)."""
    verdict = _probe(worker, params)
    return [verdict.refusal, verdict.min_tokens, verdict.min_bytes]


class StructuredValidator:
    """Checks constraints in a sandbox (started on first use) and remembers the answers."""

    def __init__(self, config: "EngineConfig", tokenizer: Any = None) -> None:
        self.config = config
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()  # guards _known
        self._sandbox_lock = threading.Lock()
        # key -> the sandbox's verdict
        self._known: OrderedDict[str, ConstraintVerdict] = OrderedDict()

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

    def validate(self, params: StructuredOutputsParams, budget: int | None = None, budget_text: str = "") -> None:
        """Raise ``ParamError`` if ``params`` cannot be compiled and followed safely, or if its
        shortest text needs more than ``budget`` tokens (None: no request budget to compare;
        ``budget_text`` names it in the message); blocks for the sandbox call when the constraint
        is new. ``SandboxBusy`` when every worker stays busy past the timeout (the caller answers
        "retry later")."""
        key = params.key()
        with self._lock:  # the server checks on several threads
            verdict = self._known.get(key)
            if verdict is not None:
                self._known.move_to_end(key)
        if verdict is None:
            verdict, remember = self._check(params)
            if remember:
                with self._lock:
                    self._known[key] = verdict
                    while len(self._known) > REMEMBERED:
                        self._known.popitem(last=False)
        if verdict.refusal is not None:
            raise ParamError("structured_outputs", verdict.refusal)
        if budget is not None and verdict.min_tokens > budget:
            limit = budget_text or f"{budget} tokens"
            raise ParamError("structured_outputs",
                             f"the shortest text the {params.kind} constraint accepts is {verdict.min_bytes} bytes, "
                             f"at least {verdict.min_tokens} tokens, more than {limit}; a request under it could "
                             "only end at max_tokens: raise max_tokens or simplify the constraint")

    def _check(self, params: StructuredOutputsParams) -> tuple[ConstraintVerdict, bool]:
        """(the verdict, whether to remember it)."""
        what = f"the {params.kind} constraint"
        try:
            return ConstraintVerdict(*self.sandbox().call(_probe_fields, params)), True
        except SandboxBusy:
            raise
        except SandboxTimeout:
            return ConstraintVerdict(f"compiling {what} took longer than {CHECK_TIMEOUT_S:g} s; simplify it"), False
        except SandboxMemoryError:
            return ConstraintVerdict(f"compiling {what} needs more than {CHECK_MEMORY_MIB} MiB; simplify it"), True
        except SandboxCrash as exc:
            return ConstraintVerdict(f"compiling {what} failed ({exc}); it is probably too deeply nested or too "
                                     "large; simplify it"), True

    def shutdown(self) -> None:
        with self._sandbox_lock:
            if self._sandbox is not None:
                self._sandbox.shutdown()
                self._sandbox = None
