"""Front-end side of a request: incremental detokenization, stop strings and ``RequestOutput``s.

Runs wherever text lives (in the offline ``LLM``'s process, or the API server process), never
in the engine core. A stop string found here ends the sample and tells the engine to stop it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.messages import AbortRequest, EngineCoreOutput
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns token ids into text one token at a time, holding back incomplete UTF-8."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._text = ""

    def step(self, token_id: int) -> str:
        if self._backend is not None:
            return self._stream.step(self._backend, token_id) or ""
        # Slow tokenizers: decode everything and return what is new (complete characters only).
        self._ids.append(token_id)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):
            return ""
        new, self._text = text[len(self._text):], text
        return new


@dataclass
class SampleState:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    # Engine step timestamp of the last output that brought tokens (inter-token latency).
    last_token_ts: float | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    arrival_time: float
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None
    prompt_ranks: list | None = None
    embedding: list[float] | None = None
    priority: int = 0
    lora_name: str | None = None  # the adapter it runs with (None: the base model)
    # A traced request's open span (``tracing.RequestTracer``) and the engine's scheduling events.
    trace: Any = None
    trace_events: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Every sample has ended (a loop, not ``all()`` over a generator: this is asked about
        every request that changed, up to three times a step)."""
        for s in self.samples:
            if s.finish_reason is None:
                return False
        return True


@dataclass
class IterationStats:
    """What one batch of engine outputs (one step) adds to the front end's metrics.

    Times are the engine's step timestamp, not when the front end got around to reading the
    batch, so a busy event loop does not show up as inter-token latency. Only tokens the user
    sees count: outputs of samples already ended (a stop string) are skipped."""

    timestamp: float
    num_prompt_tokens: int = 0  # prompts of requests whose first token came in this step
    num_generation_tokens: int = 0
    # One per sample that got tokens this step and had tokens before (several tokens from one
    # speculative step are one interval, as they reach the client in one piece).
    inter_token_latencies: list[float] = field(default_factory=list)

    def observe(self, state: RequestState, sample: SampleState, num_new_tokens: int) -> None:
        if num_new_tokens == 0:
            return
        if all(s.last_token_ts is None for s in state.samples):
            self.num_prompt_tokens += len(state.prompt_token_ids)
        self.num_generation_tokens += num_new_tokens
        if sample.last_token_ts is not None:
            self.inter_token_latencies.append(max(0.0, self.timestamp - sample.last_token_ts))
        sample.last_token_ts = self.timestamp


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> RequestState:
        detok = params.detokenize and self.tokenizer is not None
        samples = [SampleState(i, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if detok else None,
                               logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        state = RequestState(request_id, prompt, prompt_token_ids, params, samples, arrival_time,
                             metrics=RequestMetrics(arrival_time))
        self.requests[request_id] = state
        return state

    def process(self, outputs: list[EngineCoreOutput], iteration: IterationStats | None = None
                ) -> tuple[list[RequestState], list[AbortRequest]]:
        """Fold engine outputs into request states. Returns the states that changed and the
        samples the engine must stop because a stop string appeared. With ``iteration``,
        also count what the outputs add to the metrics."""
        touched: dict[str, RequestState] = {}
        aborts: list[AbortRequest] = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            touched[out.request_id] = state
            self._update_request(state, out)
            if iteration is not None and out.embedding is not None:  # a prefill that produced no token
                iteration.num_prompt_tokens += len(state.prompt_token_ids)
            sample = state.samples[out.index]
            if sample.finish_reason is not None:
                continue
            before = len(sample.token_ids)
            stopped = self._append(state, sample, out)
            if iteration is not None:  # the tokens the sample kept (none past a stop string)
                iteration.observe(state, sample, len(sample.token_ids) - before)
            if stopped and out.finish_reason is None:
                aborts.append(AbortRequest(out.request_id, out.index, "stop", sample.stop_reason))
                if iteration is not None:  # the engine sends no final output for this sample
                    self._mark_finished(state, iteration.timestamp)
            elif not stopped and out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                self._flush_text(state, sample)
        for state in touched.values():
            if state.finished:
                self.requests.pop(state.request_id, None)
        return list(touched.values()), aborts

    def fail(self, request_id: str) -> RequestState | None:
        """End a request the engine failed (``EngineCoreOutputs.errors``): its unfinished samples
        finish with reason "error". Returns its final state, or None if it is not known."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "error"
        return state

    def _update_request(self, state: RequestState, out: EngineCoreOutput) -> None:
        state.num_cached_tokens = out.num_cached_tokens
        if out.trace_events:
            state.trace_events.extend(out.trace_events)
        if out.embedding is not None:
            state.embedding = out.embedding
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = (state.prompt_logprobs or []) + list(out.prompt_logprobs)
            ranks = out.prompt_ranks or [None] * len(out.prompt_logprobs)
            state.prompt_ranks = (state.prompt_ranks or []) + list(ranks)
        m = state.metrics
        assert m is not None
        m.first_scheduled_time = m.first_scheduled_time or out.first_scheduled_time
        m.first_token_time = m.first_token_time or out.first_token_time
        m.finished_time = out.finished_time or m.finished_time
        m.num_preemptions = max(m.num_preemptions, out.num_preemptions)
        m.spec_proposed_tokens, m.spec_accepted_tokens = out.spec_proposed, out.spec_accepted
        if out.spec_proposed:
            m.spec_emitted_tokens += len(out.new_token_ids)

    @staticmethod
    def _mark_finished(state: RequestState, timestamp: float) -> None:
        m = state.metrics
        assert m is not None
        m.finished_time = max(m.finished_time or 0.0, timestamp)

    def _append(self, state: RequestState, sample: SampleState, out: EngineCoreOutput) -> bool:
        """Add new tokens and text; True if a stop string ended the sample. Stop strings are
        looked for after each new token: an output of several tokens (a multi-step round, a
        speculative step) ends at the token that completed the match, its later tokens (and
        their logprobs) dropped, as one-token steps would have ended it."""
        params = state.params
        new = out.new_token_ids
        kept, stopped = len(new), False
        if sample.detok is not None:
            base = len(sample.token_ids)
            for i, token in enumerate(new):
                checked_from = len(sample.text)
                sample.text += sample.detok.step(token)
                # Like stop tokens, stop strings only count once the sample has min_tokens tokens.
                if (params.stop and base + i + 1 >= params.min_tokens
                        and self._check_stop_strings(sample, params, checked_from)):
                    kept, stopped = i + 1, True
                    break
        sample.token_ids.extend(new[:kept] if stopped else new)
        if sample.logprobs is not None and out.new_logprobs:
            sample.logprobs.extend(out.new_logprobs[:kept])
        if out.cumulative_logprob is not None:
            dropped = zip(new[kept:], out.new_logprobs[kept:]) if out.new_logprobs else ()
            sample.cumulative_logprob = out.cumulative_logprob - sum(entry.get(t, 0.0) for t, entry in dropped)
        return stopped

    def _flush_text(self, state: RequestState, sample: SampleState) -> None:
        """At the end, bytes held back as incomplete UTF-8 are decoded as the tokenizer would."""
        if sample.detok is not None:
            full = self.tokenizer.decode(sample.token_ids, skip_special_tokens=state.params.skip_special_tokens)
            if full.startswith(sample.text):
                sample.text = full

    @staticmethod
    def _check_stop_strings(sample: SampleState, params: SamplingParams, checked_from: int) -> bool:
        longest = max(len(s) for s in params.stop)
        start = max(0, checked_from - longest + 1)
        found: tuple[int, str] | None = None
        for stop in params.stop:
            pos = sample.text.find(stop, start)
            if pos != -1 and (found is None or pos < found[0]):
                found = (pos, stop)
        if found is None:
            return False
        pos, stop = found
        sample.text = sample.text[: pos + len(stop)] if params.include_stop_str_in_output else sample.text[:pos]
        sample.finish_reason, sample.stop_reason = "stop", stop
        return True

    # ---- building outputs ----------------------------------------------------------------
    def make_output(self, state: RequestState, delta: bool = False) -> RequestOutput:
        """The request's completions so far; with ``delta`` only what is new since last time
        (text that could still become a stop string is held back until it cannot)."""
        completions = [self._completion(state, s, delta) for s in state.samples]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, state.finished,
                             state.num_cached_tokens, state.prompt_logprobs, state.metrics,
                             prompt_logprob_ranks=state.prompt_ranks, embedding=state.embedding)

    @staticmethod
    def _completion(state: RequestState, s: SampleState, delta: bool) -> CompletionOutput:
        if not delta:
            return CompletionOutput(s.index, s.text, list(s.token_ids), s.cumulative_logprob,
                                    list(s.logprobs) if s.logprobs is not None else None, s.finish_reason,
                                    s.stop_reason)
        visible = len(s.text)
        if s.finish_reason is None and state.params.stop and not state.params.include_stop_str_in_output:
            visible = max(s.sent_chars, len(s.text) - max(len(x) for x in state.params.stop) + 1)
        text, tokens = s.text[s.sent_chars:visible], s.token_ids[s.sent_tokens:]
        logprobs = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
        s.sent_chars, s.sent_tokens = visible, len(s.token_ids)
        return CompletionOutput(s.index, text, tokens, s.cumulative_logprob, logprobs, s.finish_reason, s.stop_reason)
