"""Attention-backend interface and the metadata every backend reads.

Contract (all backends):
  * The paged KV cache of one layer is two tensors, ``k_cache`` and ``v_cache``, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``.
  * ``slot_mapping[t] = block_id * block_size + offset`` is where new token ``t``'s K/V go.
  * A step's tokens are flattened: sequence ``b`` owns query rows
    ``query_start_loc[b]:query_start_loc[b+1]``. Its new tokens sit at positions
    ``context_lens[b] .. seq_lens[b]-1`` and the token at position ``p`` attends to cache
    positions ``0..p`` of that sequence (causal), read through ``block_tables[b]``.
  * ``sliding_window`` (a layer's window, None for full attention): position ``p`` attends only
    to ``p - sliding_window + 1 .. p``; older cache slots are never read.
  * ``softcap`` (attention logit soft-capping, None for none): scores become
    ``softcap * tanh(scores / softcap)`` before the mask and softmax. Only a backend whose
    ``supports_softcap`` is True takes it (the torch and Triton backends); a model that needs
    it refuses any other at build time.
  * ``sinks`` (attention sinks, None for none): a float32 ``[num_heads]`` logit per query head
    (this rank's heads) that joins every row's softmax denominator without a value: each
    head's output is scaled by ``sum(exp(s)) / (sum(exp(s)) + exp(sink))`` (gpt-oss). Only a
    backend whose ``supports_sinks`` is True takes it.
  * ``attention_chunk_size`` (chunked local attention, None for none): position ``p`` attends
    only to the positions of its own chunk, ``p - p % chunk .. p`` (Llama 4's RoPE layers).
    Only a backend whose ``supports_chunked_attention`` is True takes it.
  * ``forward`` first writes the new K/V into the cache, then attends; it returns
    ``[num_tokens, num_heads, head_dim]``.
  * A quantized cache (int8/fp8 ``k_cache``/``v_cache``) comes with ``k_scale``/``v_scale``
    ``[num_blocks, block_size, num_kv_heads]``, one scale per token and K/V head
    (``kv_quant.py`` defines the format). Writes quantize; every read, the new tokens' own K/V
    included, sees the dequantized values, so results do not depend on how a sequence was
    split into steps or which of its blocks came from the prefix cache.
  * Optional ``fuses_kv_write`` (True): ``forward`` also takes ``kv_written=True``, meaning the
    layer has already written this step's K/V into the cache (``triton_qkv.prepare_qkv``: norms,
    rotary and the write in one launch) and ``forward`` only attends. Layers pass it to no other
    backend.
  * Optional ``forward_latent(q, latent, cache, meta, scale, value_dim, cache_scale=None)``
    (multi-head latent attention, ``mla.py``): one cache of one head per token is both K and V;
    ``q`` ``[T, H, D]`` attends to the rows written from ``latent`` ``[T, 1, D]`` and the result
    ``[T, H, value_dim]`` is the weighted sum of the rows' first ``value_dim`` columns
    (``cache_scale`` the one per-token scale of an int8/fp8 cache). A backend without it gets
    latent attention through ``forward`` with ``k_cache`` and ``v_cache`` the same tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Tensors describing one forward step's batch, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context + new tokens
    context_lens: torch.Tensor  # [B] int32, tokens already in the cache before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so backends can plan without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int] = field(default_factory=list)
    context_lens_cpu: list[int] = field(default_factory=list)
    # Hybrid models: each sequence's recurrent-state slot (``kvcache/state_pool.py``), read by
    # the Mamba layers; None for models without recurrent layers.
    state_slots: list[int] | None = None
    # A step that may be given up (background rows only): asked between decoder layers; True
    # means interactive work arrived and the layers raise ``pagoda.step.StepAbandoned``.
    abandon: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if not self.query_start_loc_cpu:
            starts = [0]
            for n in self.query_lens_cpu:
                starts.append(starts[-1] + n)
            self.query_start_loc_cpu = starts
        if not self.context_lens_cpu:
            self.context_lens_cpu = [s - q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(Protocol):
    """Computes paged attention for one layer."""

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk_size: int | None = None,
    ) -> torch.Tensor: ...
