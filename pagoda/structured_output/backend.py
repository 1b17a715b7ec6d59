"""Grammar backends: compile a ``StructuredOutputsParams`` for one tokenizer, make per-sequence
matchers, and fill token bitmasks (int32 words, bit ``t % 32`` of word ``t // 32`` set when token
``t`` is allowed).

Two implementations behind one small interface, chosen by ``--structured-outputs-backend``
(vLLM's flag): ``guidance`` (llguidance) and ``xgrammar``. ``auto`` is llguidance: on this
project's tokenizers it compiles schemas far faster (1.7-21 ms against 6.6-479 ms), its worst
per-step mask was lower, and its JSON is valid where xgrammar 0.2.8 lets control characters into
strings and ignores ``multipleOf`` (``pagoda bench structured --micro``; docs/benchmarks.md).

A ``Matcher`` follows one sequence's output: ``accept`` each emitted token, ``rollback`` tokens
taken back, ``fork`` for the samples of ``n > 1``, ``is_terminated`` once the grammar is complete
and nothing more may follow (the request then finishes with "stop").

Constraints come from clients, so every llguidance parser runs under ``GUIDANCE_LIMITS`` (fuel
per mask, Earley items, lexer states, grammar size): a mask that would cost more stops the
matcher instead of the step, and ``accept`` / ``limit_error`` report it as ``GrammarLimitError``
(the request ends alone with a 400). xgrammar has no such limits; its matchers are stopped the
same way once one step (a mask, an accepted token) costs more than ``XGRAMMAR_STEP_CPU_S`` of
CPU time (a bound enforced after that step, since native code cannot be interrupted; memory per
step is not bounded). ``probe`` compiles a constraint and follows it for a few
tokens; the front end runs it in a sandbox process (``validate.py``) before a request is queued.
"""
from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from pagoda.errors import ParamError
from pagoda.structured_output.params import StructuredOutputsParams
from pagoda.structured_output.shortest import ebnf_shortest_bytes, lark_shortest_bytes
from pagoda.structured_output.shortest_schema import regex_shortest_chars, schema_shortest_bytes

if TYPE_CHECKING:
    import torch

BACKENDS = ("auto", "guidance", "xgrammar")

# llguidance's parser limits (``LLParserLimits``): its defaults, except the fuel of the first
# lexer build, which let one regex (``(a{1000}){1000}``) spend a second on its first mask.
GUIDANCE_LIMITS: dict[str, Any] = dict(initial_lexer_fuel=200_000, step_lexer_fuel=200_000,
                                       step_max_items=50_000, max_lexer_states=250_000,
                                       max_grammar_size=500_000, verbose_errors=False)
# CPU seconds one step of an xgrammar matcher (a mask, an accepted token) may take before the
# matcher is stopped: xgrammar has no limits of its own.
XGRAMMAR_STEP_CPU_S = 0.25
# Tokens ``probe`` follows a constraint for: a constraint that breaks a limit on its first
# tokens (a grammar that can only recurse, a schema that refers only to itself) is refused up front.
PROBE_TOKENS = 8


class GrammarLimitError(ValueError):
    """Following the constraint needs more than the server's grammar limits allow (or the
    backend found it cannot be followed); the request ends alone, as the client's fault (400).
    The engine core tells these failures from its own by this class's name (``describe``)."""

    @classmethod
    def of(cls, error: str) -> "GrammarLimitError":
        """The error for a backend's message (its first line: the rest is parser state)."""
        return cls(_limit_message(error))


class Matcher(Protocol):
    # Deferred-mask policy state (manager.DeferPolicy): steps to wait before the next deferral
    # and the current back-off.
    defer_wait: int
    defer_backoff: int

    def accept(self, token: int) -> bool: ...

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next (the state is unchanged): the token's bit
        in the mask, without computing the mask."""

    def rollback(self, num_tokens: int) -> None: ...

    def fork(self) -> "Matcher": ...

    def is_terminated(self) -> bool: ...

    def limit_error(self) -> str | None:
        """Why the matcher stopped following the grammar (a limit), or None."""


# One bitmask job: a matcher (left unchanged), its first bitmask row, and draft tokens whose
# positions get the following rows (a draft the grammar refuses ends the job: later rows keep
# whatever the caller put there).
MaskJob = tuple[Matcher, int, Sequence[int]]


class GrammarBackend(Protocol):
    """``vocab_size`` is the model's logits width: tokens at or past it are never chosen.
    ``mask_words`` is a bitmask row's width in 32-bit words, which covers the tokenizer's ids too
    when the tokenizer has more entries than the model (a fine-tune that added tokens without
    resizing the embeddings): those ids have no logit and are simply never allowed."""

    name: str
    vocab_size: int
    mask_words: int

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the problem if ``params`` cannot compile."""

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (expensive; thread-safe); ``ValueError`` if it cannot compile."""

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the grammar's start."""

    def fill_bitmask(self, bitmask: "torch.Tensor", jobs: list[MaskJob]) -> None:
        """Write each job's masks into ``bitmask`` rows (int32, ``[rows, ceil(vocab / 32)]``)."""

    def probe(self, params: StructuredOutputsParams, tokens: int = PROBE_TOKENS) -> None:
        """Compile ``params`` and follow it for up to ``tokens`` tokens (each time the lowest
        allowed token that does not end the text); ``ValueError`` naming the problem if it cannot
        compile or a limit stops it. Runs untrusted native code: call it in a sandbox."""

    def shortest_bytes(self, params: StructuredOutputsParams) -> float | None:
        """A lower bound on the bytes of any text ``params`` accepts (``math.inf``: no finite
        text), or None where the backend cannot tell (``shortest.py``). Call it in a sandbox."""


def _as_lark(grammar: str) -> str:
    """A ``grammar`` constraint as Lark: Lark as given, GBNF (llama.cpp's and xgrammar's
    ``root ::= ...``, what vLLM's default backend takes) converted by llguidance's own converter."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    return grammar if is_lark_syntax(grammar) else gbnf_to_lark(grammar)


def _error(params: StructuredOutputsParams, message: str) -> ValueError:
    what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[params.kind]
    return ParamError("structured_outputs", f"unsupported or invalid {what}: {message.strip()}")


def _first_allowed(words: Any, vocab_size: int, eos: set[int]) -> int | None:
    """The lowest token set in a bitmask (any sequence of 32-bit words), end-of-sequence last."""
    found = None
    for w, word in enumerate(words):
        word = int(word) & 0xFFFFFFFF
        while word:
            bit = (word & -word).bit_length() - 1
            token = 32 * w + bit
            if token >= vocab_size:
                return found
            if token not in eos:
                return token
            found = token if found is None else found
            word &= word - 1
    return found


def _grammar_vocab(tokenizer: Any, vocab_size: int) -> int:
    """The id space the grammar library must know: the model's logits, or the tokenizer's ids
    when it has more (the extra ids are then masked: no logit exists for them)."""
    try:
        return max(vocab_size, len(tokenizer))
    except TypeError:  # a tokenizer without __len__
        return vocab_size


def _limit_message(error: str) -> str:
    return "the constraint cannot be followed within the server's grammar limits: " + error.strip().split("\n")[0]


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class GuidanceMatcher:
    __slots__ = ("m", "defer_wait", "defer_backoff")

    def __init__(self, m: Any) -> None:
        self.m = m
        self.defer_wait = self.defer_backoff = 0

    def accept(self, token: int) -> bool:
        ok = bool(self.m.consume_token(token))
        error = self.limit_error()
        if error is not None:
            raise GrammarLimitError.of(error)
        return ok

    def allows(self, token: int) -> bool:
        return self.m.validate_tokens([token]) == 1 and not self.m.is_error()

    def limit_error(self) -> str | None:
        return (self.m.get_error() or "the matcher stopped") if self.m.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def fork(self) -> "GuidanceMatcher":
        return GuidanceMatcher(self.m.deep_copy())

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())


class GuidanceBackend:
    """llguidance: the grammar is built lazily (cheap compile), masks computed per step on a
    thread pool of its own (``LLExecutor``), draft positions included."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size = vocab_size
        grammar_vocab = _grammar_vocab(tokenizer, vocab_size)
        self.mask_words = (grammar_vocab + 31) // 32
        self.eos = set(eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=grammar_vocab, eos_token=list(eos_token_ids))
        self._executor = llguidance.LLExecutor()

    @staticmethod
    def limits() -> Any:
        import llguidance

        return llguidance.LLParserLimits(**GUIDANCE_LIMITS)

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        M = self._llg.LLMatcher
        kind = params.kind
        if kind in ("json", "json_object"):
            return M.grammar_from_json_schema(params.spec(),
                                              defaults={"whitespace_flexible": params.whitespace_flexible})
        if kind == "regex":
            return M.grammar_from_regex(params.regex)
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in params.choice))
        return M.grammar_from_lark(_as_lark(params.grammar))

    def validate(self, params: StructuredOutputsParams) -> None:
        try:
            text = self.grammar_text(params)
            message = self._llg.LLMatcher.validate_grammar(text, self.tokenizer, limits=self.limits())
        except Exception as exc:  # whatever the library raises about this input: the client's 400
            raise _error(params, str(exc) or type(exc).__name__) from exc
        if message:
            raise _error(params, message)

    def compile(self, params: StructuredOutputsParams) -> Any:
        self.validate(params)
        template = self._llg.LLMatcher(self.tokenizer, self.grammar_text(params), log_level=0,
                                       limits=self.limits())
        if template.is_error():
            raise _error(params, template.get_error())
        return template

    def probe(self, params: StructuredOutputsParams, tokens: int = PROBE_TOKENS) -> None:
        m = self.compile(params).deep_copy()
        for _ in range(tokens):
            mask = m.compute_bitmask()
            token = None if m.is_error() else _first_allowed(memoryview(mask).cast("I"), self.vocab_size, self.eos)
            if token is None or not m.consume_token(token) or m.is_error():
                raise _error(params, _limit_message(m.get_error() or "no token is allowed"))
            if m.is_stopped():
                return

    def shortest_bytes(self, params: StructuredOutputsParams) -> float | None:
        # llguidance prints its grammars in no form this project reads, so each kind is read
        # from the request: Lark text, the schema (``shortest_schema``), the regex, the choices.
        kind = params.kind
        if kind == "grammar":
            return lark_shortest_bytes(_as_lark(params.grammar))
        if kind in ("json", "json_object"):
            return schema_shortest_bytes(params.spec())
        if kind == "regex":
            return regex_shortest_chars(params.regex)
        return min(len(c.encode("utf-8", "surrogatepass")) for c in params.choice)

    def matcher(self, compiled: Any) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy())

    def fill_bitmask(self, bitmask: "torch.Tensor", jobs: list[MaskJob]) -> None:
        rows, words = bitmask.shape
        plain = [(m.m, row) for m, row, drafts in jobs if not drafts]  # type: ignore[attr-defined]
        spec = [(m.m, row, list(drafts)) for m, row, drafts in jobs if drafts]  # type: ignore[attr-defined]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, rows)
        if spec:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(spec, bitmask.data_ptr(), words * 4, rows)


class XGrammarMatcher:
    """An xgrammar matcher with the per-step bound xgrammar lacks: a mask fill or an ``accept``
    that costs its thread more than ``XGRAMMAR_STEP_CPU_S`` of CPU stops the matcher (its
    request then ends with ``GrammarLimitError``, as a limit of llguidance's would end it).
    Native code cannot be interrupted, so one such step runs to its end; the next does not come."""
    __slots__ = ("m", "defer_wait", "defer_backoff", "error")

    def __init__(self, m: Any) -> None:
        self.m = m
        self.defer_wait = self.defer_backoff = 0
        self.error: str | None = None

    def accept(self, token: int) -> bool:
        if self.error is not None:
            raise GrammarLimitError.of(self.error)
        start = time.thread_time()
        ok = bool(self.m.accept_token(token))
        self.charge(time.thread_time() - start, "accepting a token")
        return ok

    def charge(self, cpu_s: float, what: str) -> None:
        """Stop the matcher if ``what`` cost more than the per-step bound."""
        if cpu_s > XGRAMMAR_STEP_CPU_S and self.error is None:
            self.error = (f"{what} took {cpu_s:.2f} s of CPU, more than the {XGRAMMAR_STEP_CPU_S:g} s one step "
                          "of a constraint may take")

    def allows(self, token: int) -> bool:
        if self.m.is_terminated() or not self.m.accept_token(token):
            return False
        self.m.rollback(1)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def fork(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self.m.fork())

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def limit_error(self) -> str | None:
        return self.error


class XGrammarBackend:
    """xgrammar: grammars compiled ahead (token masks precomputed per state), EBNF grammars.
    Its matchers stop past ``XGRAMMAR_STEP_CPU_S`` a step (``XGrammarMatcher``); a compile's time
    and memory are bounded by the front end's sandboxed check of the same constraint."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        grammar_vocab = _grammar_vocab(tokenizer, vocab_size)
        self.mask_words = (grammar_vocab + 31) // 32
        self.eos = set(eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=grammar_vocab,
                                                       stop_token_ids=list(eos_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self._lock = threading.Lock()
        self._batch: Any = None

    def shortest_bytes(self, params: StructuredOutputsParams) -> float | None:
        # Every kind: xgrammar prints any constraint as EBNF (schemas and regexes included).
        G, kind = self._xgr.Grammar, params.kind
        try:
            if kind in ("json", "json_object"):
                grammar = G.from_json_schema(json.dumps(params.spec()), any_whitespace=params.whitespace_flexible,
                                             strict_mode=True)
            elif kind == "regex":
                grammar = G.from_regex(params.regex)
            elif kind == "choice":
                grammar = G.from_ebnf("root ::= " + " | ".join(_lark_string(ch) for ch in params.choice))
            else:
                grammar = G.from_ebnf(params.grammar)
        except Exception as exc:  # compile() has already refused what does not parse
            raise _error(params, str(exc) or type(exc).__name__) from exc
        return ebnf_shortest_bytes(str(grammar))

    def compile(self, params: StructuredOutputsParams) -> Any:
        c, kind = self._compiler, params.kind
        try:
            if kind in ("json", "json_object"):
                return c.compile_json_schema(json.dumps(params.spec()), any_whitespace=params.whitespace_flexible,
                                             strict_mode=True)
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(_lark_string(ch) for ch in params.choice))
            return c.compile_grammar(params.grammar)
        except Exception as exc:  # whatever the library raises about this input: the client's 400
            raise _error(params, str(exc) or type(exc).__name__) from exc

    def validate(self, params: StructuredOutputsParams) -> None:
        self.compile(params)  # the compiler caches the result for the engine's own compile

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def probe(self, params: StructuredOutputsParams, tokens: int = PROBE_TOKENS) -> None:
        import torch

        m = self.matcher(self.compile(params)).m
        bitmask = torch.zeros((1, self.mask_words), dtype=torch.int32)
        for _ in range(tokens):
            if m.is_terminated():
                return
            m.fill_next_token_bitmask(bitmask, 0)
            token = _first_allowed(bitmask[0].tolist(), self.vocab_size, self.eos)
            if token is None or not m.accept_token(token):
                raise _error(params, "the grammar allows no token")

    def fill_bitmask(self, bitmask: "torch.Tensor", jobs: list[MaskJob]) -> None:
        plain = [(matcher, row) for matcher, row, drafts in jobs if not drafts]
        if len(plain) > 1:  # one call for the batch, on xgrammar's threads (GIL released)
            if self._batch is None:
                self._batch = self._xgr.BatchGrammarMatcher(max_threads=2)
            start = time.monotonic()
            self._batch.batch_fill_next_token_bitmask([m.m for m, _ in plain], bitmask,  # type: ignore[attr-defined]
                                                      indices=[r for _, r in plain])
            if time.monotonic() - start > XGRAMMAR_STEP_CPU_S:
                self._charge_each(bitmask, plain)  # slow (or a busy machine): find the costly rows
            jobs = [job for job in jobs if job[2]]
        for matcher, row, drafts in jobs:
            start = time.thread_time()
            self._fill_with_drafts(matcher.m, bitmask, row, drafts)  # type: ignore[attr-defined]
            matcher.charge(time.thread_time() - start, "computing a token mask")  # type: ignore[attr-defined]

    @staticmethod
    def _fill_with_drafts(m: Any, bitmask: "torch.Tensor", row: int, drafts: Sequence[int]) -> None:
        m.fill_next_token_bitmask(bitmask, row)
        taken = 0
        for j, token in enumerate(drafts):
            if m.is_terminated() or not m.accept_token(token):
                break
            taken += 1
            m.fill_next_token_bitmask(bitmask, row + j + 1)
        if taken:
            m.rollback(taken)

    @staticmethod
    def _charge_each(bitmask: "torch.Tensor", plain: list[tuple[Any, int]]) -> None:
        """Time each row's mask again on this thread, in CPU time (which a busy machine does not
        inflate), and charge it to its matcher."""
        for matcher, row in plain:
            start = time.thread_time()
            matcher.m.fill_next_token_bitmask(bitmask, row)
            matcher.charge(time.thread_time() - start, "computing a token mask")


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarBackend:
    """The backend ``name`` (``auto`` is llguidance) for ``tokenizer`` (a Hugging Face fast
    tokenizer) with a ``vocab_size``-wide logits row."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "xgrammar":
        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    return GuidanceBackend(tokenizer, vocab_size, eos_token_ids)
