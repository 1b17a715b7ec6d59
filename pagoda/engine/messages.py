"""Messages between the front end (tokenizer, detokenizer, HTTP) and the engine core.

Only token ids and small structs cross; the same structs are used in-process (offline ``LLM``)
and over ZMQ (the server), where msgspec encodes them as compact msgpack arrays.
"""
from __future__ import annotations

import msgspec

from pagoda.engine.snapshot import EngineSnapshot
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request for the engine core: its id (unique among requests in
    flight; it may be reused once the request has finished), the prompt's token ids, its
    sampling parameters (``n`` samples, each reported by ``index``) and when the front end
    received it. The engine core re-checks what would fail the whole batch (ids outside the
    vocabulary, length, ``n``) and refuses the request alone (``RequestError`` 400)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest | None = None  # the adapter to run with (None: the base model)
    # Who sent it (fair shares in the scheduler); the default tenant when the front end names none.
    tenant: str = "default"
    # Prefix-cache salt: cached KV is shared only between requests with the same salt.
    cache_salt: str | None = None
    # The priority policy's order (lower runs first) and the ``time.time()`` deadline (None: none).
    priority: int = 0
    deadline: float | None = None
    # The front end traces it: the engine reports its scheduling events (``trace_events``).
    trace: bool = False
    # The prompt's images, preprocessed, in prompt order (vision-language models).
    images: list[ImageInput] = []
    # The background (batch) class: scheduled only when no interactive request is in the engine.
    background: bool = False


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one sample (``index``) of a request; ``finish_reason`` set on its last."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Engine-side timestamps, so queueing inside the engine is visible in metrics.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    prompt_ranks: list[int | None] | None = None  # beside prompt_logprobs: each prompt token's rank
    embedding: list[float] | None = None  # an embedding request's pooled vector (on its final output)
    # A traced request's scheduling events since its previous output: (name, time.time(), first
    # token position, tokens), name "prefill_chunk" or "preempted" (pagoda/tracing.py).
    trace_events: list[tuple[str, float, int, int]] | None = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Engine-wide gauges and counters after a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    num_preemptions: int = 0
    step_tokens: int = 0
    step_prefill_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    prefix_cache_blocks: int = 0  # blocks held by the prefix cache (referenced or evictable)
    # Tenants (at most TENANT_STATS_LIMIT, the busiest; the rest summed under "other"): unfinished
    # requests and running sequences of each, when more than one tenant has requests.
    tenant_requests: dict[str, int] = {}
    tenant_running_seqs: dict[str, int] = {}
    # LoRA: requests per adapter name, running and waiting (only with --enable-lora).
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}
    # KV tiers (only with --kv-offload-*): running totals keyed "TIER/EVENT": blocks hit, saved,
    # error per tier, and "all/miss" (lookups ended by a block no tier had), "all/dropped"
    # (snapshots dropped because the save queue was full); per tier read_bytes, written_bytes,
    # and read_us, write_us (microseconds spent in its reads and writes).
    kv_offload: dict[str, int] = {}
    # Steps of background rows only given up for an interactive request (running total).
    num_abandoned_steps: int = 0


class RequestError(msgspec.Struct, array_like=True):
    """One request the engine refused or ended because handling it failed; nothing else in
    the batch is affected. ``status`` is the HTTP status the client gets: 400 when the request
    itself was at fault (e.g. a duplicate id), 500 for a failure inside the engine, whose
    ``message`` is for the server log only (clients get a generic text)."""

    request_id: str
    message: str
    status: int = 500


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one engine-core step (or an abort) produced: an ``EngineCoreOutput`` per sample
    that got tokens or finished, the step's ``SchedulerStats`` and its timestamp (the output
    processor measures inter-token intervals with it), and ``errors``: requests that failed
    alone this step; they get no further outputs (their ``outputs`` are dropped), every
    other request's tokens are complete."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Requests the engine refused or ended with an error (each failed alone).
    errors: list[RequestError] = []


class AbortRequest(msgspec.Struct, array_like=True):
    """Stop a request (``index`` None) or one of its samples; ``reason`` is the finish reason."""

    request_id: str
    index: int | None = None
    reason: str = "abort"
    stop_reason: int | str | None = None


# ---- the server's wire protocol ----------------------------------------------------------
# Between the API server process and the engine-core process every message is one msgpack
# frame of a tagged union below, so the receiver decodes it with a single typed call.


class AddRequestMsg(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortMsg(msgspec.Struct, tag="abort", array_like=True):
    aborts: list[AbortRequest]


class UtilityMsg(msgspec.Struct, tag="call", array_like=True):
    """Ask the engine core for something outside the step loop ("stats", "ping", "snapshot",
    "reset_prefix_cache", "add_lora" / "remove_lora" with ``args``); answered by a
    ``UtilityResultMsg`` with the same ``call_id``."""

    call_id: int
    method: str
    args: list[str | int] = []


CoreInputMsg = AddRequestMsg | AbortMsg | UtilityMsg


class ReadyMsg(msgspec.Struct, tag="ready", array_like=True):
    """Sent once the engine core is built; the server starts serving only after it."""

    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int


class EngineErrorMsg(msgspec.Struct, tag="error", array_like=True):
    """The engine core failed (during start-up, or fatally in the loop) and is exiting."""

    message: str


class OutputsMsg(msgspec.Struct, tag="outputs", array_like=True):
    outputs: EngineCoreOutputs


class UtilityResultMsg(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    # Engine stats carry per-adapter request counts (name -> count) beside the flat gauges; the
    # dashboard's "snapshot" call returns an ``EngineSnapshot``.
    result: (dict[str, float | int | str | dict[str, int] | None] | int | float | str | EngineSnapshot
             | None) = None
    error: str | None = None


CoreOutputMsg = ReadyMsg | EngineErrorMsg | OutputsMsg | UtilityResultMsg
