"""Engine-side request state. A ``Request`` is what a user submitted; a ``Sequence`` is one of
its ``n`` samples and is what the scheduler schedules. Pure Python (no torch): random generators
of seeded requests belong to the executor (``executor.sampler.SeedGenerators``)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable

from pagoda.kvcache.block_table import BlockTable
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput, cache_key_ids
from pagoda.outputs import RequestMetrics
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.kvcache.radix_cache import RadixNode


# The tenant of requests that name none (offline ``LLM``, a server whose tenant source gives nothing).
DEFAULT_TENANT = "default"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """A submitted prompt with its sampling options; shared by its sequences."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float = field(default_factory=time.time)
    metrics: RequestMetrics = field(init=False)
    num_cached_tokens: int = 0
    prompt_logprobs: list = field(default_factory=list)
    # The compiled grammar of a constrained request (structured_output.manager.GrammarHandle):
    # the scheduler admits the request once ``grammar.ready``.
    grammar: Any = None
    # The adapter it runs with (None: the base model); its KV is never shared with others'.
    lora_request: LoRARequest | None = None
    # Who sent it: the scheduler shares sequence slots and step tokens fairly between tenants.
    tenant: str = DEFAULT_TENANT
    # Prefix-cache salt: requests share cached KV only when their salts (and adapters) match.
    cache_salt: str | None = None
    # The priority policy's order: lower runs first (scheduler/priority.py); 0 by default.
    priority: int = 0
    # ``time.time()`` by which it must end: waiting then, it fails (503); running, it ends ("timeout").
    deadline: float | None = None
    # The background (batch) class: it runs only in steps with no interactive request in the
    # engine (scheduler/background.py); the Batch API marks its lines so.
    background: bool = False
    # Traced requests only (the front end samples them): scheduling facts for the request's span,
    # (name, time, first token position, tokens), drained into each engine output. None: untraced.
    trace_events: list[tuple[str, float, int, int]] | None = None
    # The prompt's images, in prompt order (vision-language models; empty for text).
    images: list[ImageInput] = field(default_factory=list)
    # The prompt's prefix-cache keys when it has images (``multimodal.inputs.cache_key_ids``).
    prompt_cache_keys: list[int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.images:
            self.prompt_cache_keys = cache_key_ids(self.prompt_token_ids, self.images)

    @property
    def cache_namespace(self) -> Hashable:
        """The prefix-cache tree this request matches and fills: its adapter, joined by its salt."""
        if self.cache_salt is None:
            return self.lora_request
        return (self.lora_request, self.cache_salt)


class Sequence:
    """One sample's tokens, progress and KV blocks.

    ``token_ids`` = prompt + generated tokens. The first ``num_computed_tokens`` of them have
    their KV in the cache; the scheduler moves that counter towards ``len(token_ids)``.
    ``block_table`` is a ``BlockTable`` (a list with the int32 mirror the step builder copies).
    ``request_id`` and ``params`` are the request's, copied once: a step reads them for every
    sequence several times, and a forwarding property cost a call each time (neither is ever
    reassigned on a request; ``params`` is the same object, so changes to it are seen).
    """

    def __init__(self, seq_id: str, request: Request, token_ids: list[int], sample_index: int = 0,
                 num_samples: int = 1) -> None:
        self.seq_id = seq_id
        self.request = request
        self.request_id: str = request.request_id
        self.params: SamplingParams = request.params
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.sample_index = sample_index
        # Samples still to fork from this sequence when its prompt completes (n > 1).
        self.num_samples = num_samples
        self.num_computed_tokens = 0
        self.block_table: BlockTable = BlockTable()
        self.num_cached_blocks = 0  # leading blocks already in the prefix cache
        self.num_window_released = 0  # leading blocks given back as outside the sliding window
        self.last_cached_node: RadixNode | None = None
        # Hybrid models: the recurrent-state slot this sequence holds while running (None: none).
        self.state_slot: int | None = None
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        # A constrained sequence's grammar matcher (structured_output.backend.Matcher), in step
        # with its output tokens; made when it first samples, forked for n > 1, kept on preemption.
        self.grammar: Any = None

    # ---- derived -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def cache_key_ids(self) -> list[int]:
        """What the prefix cache keys this sequence's blocks by: its token ids, with each image's
        placeholder tokens standing for that image's content (``Request.prompt_cache_keys``)."""
        keys = self.request.prompt_cache_keys
        if keys is None:
            return self.token_ids
        return keys + self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefilling(self) -> bool:
        """More than one uncomputed token: a prompt (or a recomputation) is in progress."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.value})")
