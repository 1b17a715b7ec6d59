"""``TritonAttentionBackend``: the ``AttentionBackend`` of the GPU path, on the Triton kernels of
``triton_kernels.py`` (paged write, split-K decode, prefill) and ``triton_mla.py`` (latent decode)."""
from __future__ import annotations

import torch

from pagoda.layers.attention.backend import AttentionMetadata
from pagoda.layers.attention.prefill_choice import PrefillChoice, flash_applies, flash_prefill
from pagoda.layers.attention.triton_kernels import paged_decode_attention, paged_prefill_attention, write_kv
from pagoda.layers.attention.triton_mla import paged_mla_decode_attention


def _decode_only(meta: AttentionMetadata) -> bool:
    return meta.max_query_len == 1 and meta.num_tokens == meta.num_seqs


class TritonAttentionBackend:
    """``AttentionBackend`` on the Triton kernels.

    Decode-only steps (every sequence has exactly one new token) take the split-K decode
    kernel; anything else takes the prefill kernel, which is correct for one-token
    sequences too, or, for fresh prompts where it measured faster, torch's flash varlen
    kernel (``prefill_choice.py``). Planning uses only host-side metadata, so decode steps can be captured
    in CUDA graphs. A graph bakes in the split count: set ``decode_num_splits`` before
    capture (e.g. from the longest context the graph will serve) to fix it explicitly.
    """

    supports_softcap = True  # attention logit soft-capping (``SOFTCAP``)
    supports_sinks = True  # ``SINKS``
    supports_chunked_attention = True
    fuses_kv_write = True  # ``forward(..., kv_written=True)``: the layer wrote K/V (``triton_qkv.py``)

    def __init__(self, decode_num_splits: int | None = None) -> None:
        self.decode_num_splits = decode_num_splits
        self.prefill_choice = PrefillChoice()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, attention_chunk_size: int | None = None,
                kv_written: bool = False) -> torch.Tensor:
        if not kv_written:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        extra = dict(sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, softcap=softcap, sinks=sinks,
                     attention_chunk_size=attention_chunk_size)
        if _decode_only(meta):
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          scale, num_splits=self.decode_num_splits,
                                          max_seq_len=meta.max_seq_len, **extra)
        if flash_applies(q, k, scale, k_scale, softcap, sinks, attention_chunk_size, sliding_window, meta):
            return self.prefill_choice.run(q, k, meta, lambda: paged_prefill_attention(q, k_cache, v_cache, meta,
                                                                                       scale, **extra),
                                           lambda: flash_prefill(q, k, v, meta, scale, sliding_window))
        return paged_prefill_attention(q, k_cache, v_cache, meta, scale, **extra)

    def forward_latent(self, q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, value_dim: int, cache_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Latent attention (``backend.py``'s contract): decode steps on the MLA kernel, which
        reads each cache row once; other steps on the prefill kernel with K = V = the cache."""
        write_kv(latent, latent, cache, cache, meta.slot_mapping, cache_scale, cache_scale)
        if _decode_only(meta):
            return paged_mla_decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale, value_dim,
                                              num_splits=self.decode_num_splits, max_seq_len=meta.max_seq_len,
                                              cache_scale=cache_scale)
        out = paged_prefill_attention(q, cache, cache, meta, scale, k_scale=cache_scale, v_scale=cache_scale)
        return out[..., :value_dim]
