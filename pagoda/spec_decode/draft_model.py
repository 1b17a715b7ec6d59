"""Draft-model proposals: a smaller model sharing the target's tokenizer drafts ``k`` tokens per
sequence, batched over sequences, with a paged KV cache of its own.

The draft's cache follows the target's sequences lazily. Before drafting, each sequence's draft
state is compared with its tokens: the longest common prefix is kept (the target may have
rejected drafts the draft model had already computed), the rest is trimmed, and the tokens the
draft has not seen are run as one catch-up chunk whose last row also yields the first draft.
Sequences that stop running (finished, aborted, preempted) give their draft blocks back.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from pagoda.config import EngineConfig, ModelConfig
from pagoda.executor.input import build_model_input
from pagoda.executor.interface import Executor
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.sampler import SeedGenerators, adjust_logits, sample_row, sample_tokens
from pagoda.kvcache.block_table import BlockTable
from pagoda.kvcache.manager import KVCacheManager
from pagoda.kvcache.radix_cache import RadixNode
from pagoda.request import Sequence, SeqStatus
from pagoda.spec_decode.proposer import Proposer
from pagoda.step import Draft

logger = logging.getLogger(__name__)

# Share of the GPU memory still free after the target's KV cache that the draft's cache may take.
DRAFT_GPU_MEMORY_FRACTION = 0.8


class DraftState:
    """The draft model's KV for one sequence: its blocks and the tokens they hold (the
    sequence's own tokens, then possibly drafts the target has not judged yet). A
    ``kvcache.manager.BlockHolder`` for the draft's own ``KVCacheManager``."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.tokens: list[int] = []
        self.num_real = 0  # leading tokens known to be the sequence's own
        self.block_table: BlockTable = BlockTable()
        self.num_cached_blocks = 0
        self.last_cached_node: RadixNode | None = None  # always None: the draft's cache has no prefix tree

    @property
    def num_computed_tokens(self) -> int:
        return len(self.tokens)

    def sync(self) -> int:
        """Keep the longest prefix that still matches the sequence, leaving at least its last
        token to run (its logits give the first draft). Returns the new length."""
        seq_tokens = self.seq.token_ids
        n = self.num_real
        limit = min(len(self.tokens), len(seq_tokens) - 1)
        while n < limit and self.tokens[n] == seq_tokens[n]:
            n += 1
        n = min(n, limit)
        del self.tokens[n:]
        self.num_real = n
        return n


@dataclasses.dataclass
class _Job:
    state: DraftState
    feed: list[int]  # catch-up tokens for the first forward
    k: int  # drafts wanted (0: catch up only)
    drafts: list[int] = dataclasses.field(default_factory=list)
    probs: list[torch.Tensor] = dataclasses.field(default_factory=list)


class DraftRunner:
    """The draft model with its own paged KV cache and block accounting."""

    def __init__(self, config: EngineConfig, target_num_blocks: int) -> None:
        spec = config.speculative
        assert spec is not None and spec.model
        dtype = str(config.model.dtype).removeprefix("torch.")
        draft_cfg = ModelConfig.from_pretrained(spec.model, None, dtype, None, config.device)
        if draft_cfg.vocab_size != config.model.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size}) differs from the target's "
                             f"({config.model.vocab_size}): draft and target must share a tokenizer")
        self.max_len = draft_cfg.max_model_len
        self.runner = ModelRunner(dataclasses.replace(config, model=draft_cfg))
        num_blocks = self._num_blocks(target_num_blocks)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, enable_prefix_caching=False)
        logger.info("draft model %s: KV cache of %d blocks (%.2f GiB)", spec.model, num_blocks,
                    num_blocks * self.runner.kv_bytes_per_block() / 2**30)

    def _num_blocks(self, target_num_blocks: int) -> int:
        """As many tokens as the target's cache holds (each speculating sequence needs its whole
        context), but on a GPU no more than fits in what memory is left."""
        blocks = target_num_blocks
        if self.runner.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.runner.device)
            blocks = min(blocks, int(free * DRAFT_GPU_MEMORY_FRACTION) // self.runner.kv_bytes_per_block())
        return max(blocks, 1)

    def run(self, feeds: list[tuple[DraftState, list[int]]]) -> torch.Tensor:
        """One forward over each state's new tokens (blocks already allocated); returns the
        logits of each state's last new token."""
        ids: list[int] = []
        query_lens, seq_lens, tables, rows = [], [], [], []
        for state, feed in feeds:
            ids.extend(feed)
            query_lens.append(len(feed))
            seq_lens.append(len(state.tokens) + len(feed))
            tables.append(state.block_table)
            rows.append(len(ids) - 1)
        # The target's input builder: same block layout, same metadata.
        inputs = build_model_input(ids, query_lens, seq_lens, tables, rows, self.runner.device, self.runner.block_size)
        hidden = self.runner.forward(inputs)
        for state, feed in feeds:
            state.tokens.extend(feed)
        return self.runner.model.compute_logits(hidden[inputs.logits_indices]).float()


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        super().__init__(config)
        if config.parallel.tensor_parallel_size > 1:
            raise NotImplementedError("draft_model speculation does not support tensor parallelism yet; "
                                      "use method 'ngram'")
        if not executor.num_blocks:
            raise RuntimeError("draft_model speculation needs the target's KV cache allocated first")
        self.draft_runner = DraftRunner(config, executor.num_blocks)
        # The target's: a seeded request's drafts and verification draw from one stream.
        self.generators: SeedGenerators = executor.generators
        self.kv = self.draft_runner.kv
        self.states: dict[str, DraftState] = {}
        self.token_budget = config.scheduler.max_num_batched_tokens
        self.generator = torch.Generator()
        self.generator.manual_seed(config.seed + 1)

    # ---- state ---------------------------------------------------------------------------
    def release_finished(self) -> None:
        for seq_id in [i for i, s in self.states.items() if s.seq.status != SeqStatus.RUNNING]:
            self.kv.free(self.states.pop(seq_id))

    def reset(self) -> None:
        for state in self.states.values():
            self.kv.free(state)
        self.states.clear()

    def _state(self, seq: Sequence) -> DraftState:
        state = self.states.get(seq.seq_id)
        if state is None or state.seq is not seq:
            if state is not None:
                self.kv.free(state)
            state = self.states[seq.seq_id] = DraftState(seq)
        self.kv.trim(state, state.sync())
        return state

    # ---- drafting ------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, wanted: list[tuple[Sequence, int]]) -> dict[str, Draft]:
        jobs = self._plan(wanted)
        if not jobs:
            return {}
        logits = self.draft_runner.run([(j.state, j.feed) for j in jobs])
        active = [j for j in jobs if j.k > 0]
        logits = logits[[i for i, j in enumerate(jobs) if j.k > 0]]
        while active:
            self._pick(active, logits)
            active = [j for j in active if len(j.drafts) < j.k]
            if active:
                logits = self.draft_runner.run([(j.state, j.drafts[-1:]) for j in active])
        return {job.state.seq.seq_id: Draft(job.drafts, torch.stack(job.probs) if job.probs else None)
                for job in jobs if job.k}

    def _plan(self, wanted: list[tuple[Sequence, int]]) -> list[_Job]:
        """Catch-up chunks within a token budget, with blocks for the catch-up and the drafts."""
        jobs, budget = [], self.token_budget
        for seq, k in wanted:
            if budget <= 0:
                break
            # The last draft is fed at position num_tokens + k - 2: it must fit the draft's context.
            k = min(k, self.draft_runner.max_len - seq.num_tokens)
            if k <= 0:
                continue
            state = self._state(seq)
            feed = seq.token_ids[len(state.tokens):]
            if len(feed) > budget:
                feed, k = feed[:budget], 0  # a long catch-up continues next step
            if not self.kv.allocate(state, len(feed) + max(k - 1, 0)):
                continue  # the draft's cache is full: this sequence does not speculate now
            state.num_real = len(state.tokens) + len(feed)
            jobs.append(_Job(state, feed, k))
            budget -= len(feed)
        return jobs

    def _pick(self, jobs: list[_Job], logits: torch.Tensor) -> None:
        """Each job's next draft: the argmax for greedy requests, else a sample from the draft's
        distribution through the target's sampling pipeline (kept as ``q`` for verification)."""
        rows = [sample_row(j.state.seq, self.generators, drafts=j.drafts) for j in jobs]
        logits = adjust_logits(logits, rows)
        default = self.generator if logits.device.type == "cpu" else None
        tokens, random, probs = sample_tokens(logits, rows, default)
        if probs is not None:
            for row, i in enumerate(random):
                jobs[i].probs.append(probs[row])
        for job, token in zip(jobs, tokens.tolist()):
            job.drafts.append(token)
