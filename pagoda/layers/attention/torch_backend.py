"""Paged attention in plain torch (CPU, and a reference everywhere).

Decodes (one query token each) are one group: the C++ kernel reads their K/V in place, or the
group gathers its K/V through the block tables once and runs one masked
``scaled_dot_product_attention``. Prefill chunks run one attention each, over exactly their own
tokens (no padding to the step's longest chunk): a chunk with nothing cached before it attends
over its new K/V directly with a causal kernel, a later chunk over its cached prefix plus itself.
No Python loop runs per token.

A quantized cache (int8/fp8 with per-token-head scales) is read the same way: each group
gathers only the blocks its sequences use and dequantizes those; decode rows go to the C++
kernel, which dequantizes inside its loop.

Logit soft-capping (``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the
mask and softmax, Gemma 2) runs the prefill attention as explicit matmuls (``_attention``), as
torch's fused kernel has no such step; decode rows go to the C++ kernel, which caps its scores.
Attention sinks (``sinks``, gpt-oss: one logit per head added to the softmax denominator) keep
torch's fused kernel: the keys get one more, all zeros with a zero value, and an additive float
mask (``-inf`` where hidden) gives that key's score the head's sink (``_attention_with_sinks``;
with soft-capping too they take the explicit path). Their decode rows, and chunked local
attention's (``attention_chunk_size``, Llama 4: a key is visible only from its own chunk), skip
the C++ kernel, whose one window per call expresses neither.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels import attention as cpu_kernel
from pagoda.layers.attention import kv_quant
from pagoda.layers.attention.backend import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter k, v ``[T, Hkv, D]`` into the caches at ``slot_mapping``; slot -1 marks a padding
    token (CUDA-graph batches), which is not written. With scales, quantize into the cache."""
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # a host sync on CUDA, where the Triton backend is the fast path
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    if k_scale is not None and v_scale is not None:
        kv_quant.store(k, k_cache, k_scale, slot_mapping)
        kv_quant.store(v, v_cache, v_scale, slot_mapping)
        return
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B, Hkv, max_len, D]`` view of each sequence's first ``max_len`` cached tokens."""
    nb, bs, h, d = cache.shape
    nblocks = -(-max_len // bs)
    blocks = cache[block_tables[:, :nblocks].long()]  # [B, nblocks, bs, H, D]
    return blocks.view(blocks.shape[0], nblocks * bs, h, d)[:, :max_len].transpose(1, 2)


def gather_dequantized(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                       max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``gather_kv`` in ``dtype``; a quantized cache's gathered blocks are dequantized."""
    values = gather_kv(cache, block_tables, max_len)
    if scales is None:
        return values.to(dtype)
    return (values.float() * gather_kv(scales.unsqueeze(-1), block_tables, max_len).float()).to(dtype)


class TorchAttentionBackend:
    supports_softcap = True  # attention logit soft-capping (see the module docstring)
    supports_sinks = True
    supports_chunked_attention = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, attention_chunk_size: int | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        chunk = attention_chunk_size
        plan = _plan(meta)
        if plan.fresh_prefill:
            # One prompt with nothing cached before it: attend over the new K/V directly (as
            # the cache holds them: quantized and back, so chunking cannot change the result).
            if k_scale is not None:
                k = kv_quant.dequantize(*kv_quant.quantize(k, k_cache.dtype), dtype=q.dtype)
                v = kv_quant.dequantize(*kv_quant.quantize(v, v_cache.dtype), dtype=q.dtype)
            return _causal(q, k, v, scale, sliding_window, softcap, sinks, chunk)
        out = torch.empty_like(q)
        plain = sinks is None and chunk is None  # what the C++ decode kernel does (soft-capping included)
        for group in plan.groups:
            if group.q_len == 1 and plain and cpu_kernel.usable(q, k_cache, k_scale):
                out[group.rows] = cpu_kernel.paged_decode(q[group.rows], k_cache, v_cache,
                                                          meta.block_tables[group.seq_idx],
                                                          meta.seq_lens[group.seq_idx], scale, sliding_window,
                                                          k_scale, v_scale, softcap)
            else:
                out[group.rows] = _attend_group(q, k_cache, v_cache, meta, group, scale, sliding_window,
                                                k_scale, v_scale, softcap, sinks, chunk)
        for i in plan.prefills:
            _attend_prefill(q, k, v, k_cache, v_cache, meta, i, scale, out, sliding_window, k_scale, v_scale,
                            softcap, sinks, chunk)
        return out


class _Group:
    """Sequences ``seq_idx`` whose query rows are laid out as ``[len(seq_idx), q_len]`` with
    ``rows`` (flat token indices) and ``valid`` (which padded slots are real)."""

    def __init__(self, meta: AttentionMetadata, seq_idx: list[int], q_len: int) -> None:
        starts = meta.query_start_loc_cpu
        device = meta.slot_mapping.device
        self.seq_idx = torch.tensor(seq_idx, device=device)
        self.q_len = q_len
        self.max_seq_len = max(meta.seq_lens_cpu[i] for i in seq_idx)
        offsets = torch.arange(q_len, device=device)
        base = torch.tensor([starts[i] for i in seq_idx], device=device)
        lens = torch.tensor([meta.query_lens_cpu[i] for i in seq_idx], device=device)
        self.valid = offsets[None, :] < lens[:, None]  # [G, q_len]
        self.padded_rows = (base[:, None] + offsets[None, :]).masked_fill(~self.valid, 0)
        self.rows = self.padded_rows[self.valid]
        # [G, 1, max_seq_len, 1]: gathered key positions past each sequence's length (None when
        # every sequence is max_seq_len long).
        self.tails = None
        if any(meta.seq_lens_cpu[i] < self.max_seq_len for i in seq_idx):
            seq_lens = torch.tensor([meta.seq_lens_cpu[i] for i in seq_idx], device=device)
            tails = torch.arange(self.max_seq_len, device=device)[None, :] >= seq_lens[:, None]
            self.tails = tails[:, None, :, None]


class _Plan:
    def __init__(self, meta: AttentionMetadata) -> None:
        decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        prefills = [i for i, n in enumerate(meta.query_lens_cpu) if n > 1]
        self.fresh_prefill = len(prefills) == 1 and not decodes and meta.context_lens_cpu[prefills[0]] == 0
        self.groups = [_Group(meta, decodes, 1)] if decodes else []
        self.prefills = prefills
        self.seq_lens_cpu = meta.seq_lens_cpu  # the lengths it was made for (see ``_plan``)


def _plan(meta: AttentionMetadata) -> _Plan:
    # All layers of a step share the metadata, so the plan is built once per step. A multi-step
    # decoding round moves the same metadata on in place between its steps and gives it new
    # host-side length lists (``cpu_fused.greedy_steps``): a plan made for other lists is stale
    # (its groups' key lengths and masks), so it is rebuilt.
    plan = getattr(meta, "_torch_plan", None)
    if plan is None or plan.seq_lens_cpu is not meta.seq_lens_cpu:
        plan = _Plan(meta)
        meta._torch_plan = plan  # type: ignore[attr-defined]
    return plan


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """Which keys each query sees (broadcast ``q_pos[..., None]`` against ``k_pos``): causal,
    within the last ``window`` positions, and within the query's own ``chunk``."""
    q, k = q_pos[..., None], k_pos
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    if chunk is not None:
        mask &= k >= q - q % chunk
    return mask


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
               softcap: float | None, is_causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` over ``[B, H, Lq, D]`` queries and ``[B, Hkv, Lk, D]``
    keys/values (``mask`` True where a key is visible), with the scores soft-capped when
    ``softcap`` is given and each head's sink logit joining the softmax when ``sinks`` is
    (explicit float32 matmuls then)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    if softcap is None:
        return _attention_with_sinks(q, k, v, mask, scale, is_causal, sinks)
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n_q, n_k = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1), values).to(q.dtype)
    # The sink is one more logit per head, with no value: it only enlarges the denominator.
    column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs, values).to(q.dtype)


def _attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float, is_causal: bool, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax denominators also hold ``exp(sinks[h])``, through torch's fused
    kernel: a last key of zeros (score 0) with a zero value, whose score the float mask moves to
    the head's sink; the other keys' mask entries are 0 or ``-inf``."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    if is_causal:
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    zeros = k.new_zeros(k.shape[0], k.shape[1], 1, d)
    bias = torch.empty(b, h, n_q, n_k + 1, dtype=q.dtype, device=q.device)
    bias[..., :n_k] = 0.0 if mask is None else torch.where(mask, 0.0, float("-inf"))
    bias[..., n_k] = sinks.to(q.dtype).view(1, h, 1)
    return F.scaled_dot_product_attention(q, torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2),
                                          attn_mask=bias, scale=scale, enable_gqa=True)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
            chunk: int | None = None) -> torch.Tensor:
    mask = None
    if window is not None or chunk is not None:  # positions 0..n-1: nothing cached before
        pos = torch.arange(q.shape[0], device=q.device)
        mask = _visible(pos, pos, window, chunk)
    # Batched 4-D operands: torch's CPU flash kernel takes those, where 3-D ones fall back to the
    # math path (matmuls, a full softmax, mask checks: ~3x the time of a 512-token prompt).
    out = _attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                     v.transpose(0, 1).unsqueeze(0), mask, scale, softcap, is_causal=mask is None, sinks=sinks)
    return out[0].transpose(0, 1)


def _attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, i: int, scale: float, out: torch.Tensor,
                    window: int | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    chunk: int | None = None) -> None:
    """Sequence ``i``'s prefill chunk into ``out``: its queries over its own keys only."""
    start, n = meta.query_start_loc_cpu[i], meta.query_lens_cpu[i]
    ctx = meta.context_lens_cpu[i]
    rows = slice(start, start + n)
    if ctx == 0:  # nothing cached before the chunk: its new K/V (as the cache holds them)
        k_new, v_new = k[rows], v[rows]
        if k_scale is not None:
            k_new = kv_quant.dequantize(*kv_quant.quantize(k_new, k_cache.dtype), dtype=q.dtype)
            v_new = kv_quant.dequantize(*kv_quant.quantize(v_new, v_cache.dtype), dtype=q.dtype)
        out[rows] = _causal(q[rows], k_new, v_new, scale, window, softcap, sinks, chunk)
        return
    table = meta.block_tables[i:i + 1]
    keys = gather_dequantized(k_cache, k_scale, table, ctx + n, q.dtype)  # [1, Hkv, ctx + n, D]
    values = gather_dequantized(v_cache, v_scale, table, ctx + n, q.dtype)
    # Query j sits at position ctx + j and sees keys 0..ctx + j (the last ``window`` of them,
    # those of its own chunk).
    q_pos = ctx + torch.arange(n, device=q.device)
    mask = _visible(q_pos, torch.arange(ctx + n, device=q.device), window, chunk)
    o = _attention(q[rows].transpose(0, 1).unsqueeze(0), keys, values, mask, scale, softcap, sinks=sinks)
    out[rows] = o[0].transpose(0, 1)


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  g: _Group, scale: float, window: int | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    tables = meta.block_tables[g.seq_idx]
    keys = gather_dequantized(k_cache, k_scale, tables, g.max_seq_len, q.dtype)
    values = gather_dequantized(v_cache, v_scale, tables, g.max_seq_len, q.dtype)
    if g.tails is not None:
        # A shorter sequence's gathered rows run past its length into whatever those slots hold
        # (its block table is padded with block 0, some other sequence's block or a free one),
        # possibly NaN or inf. The mask hides them from the scores, but softmax weight 0 times a
        # NaN value is still NaN, so the rows are zeroed: one request's bad values never reach
        # another's output.
        keys = keys.masked_fill(g.tails, 0)
        values = values.masked_fill(g.tails, 0)
    masks = g.__dict__.setdefault("masks", {})  # per window and chunk size: layers may differ
    mask = masks.get((window, chunk))
    if mask is None:
        # Query i of a sequence sits at position context_len + i and sees keys 0..that position
        # (with a sliding window only the last ``window`` of them, only its own chunk's).
        ctx = meta.context_lens[g.seq_idx].long()
        q_pos = ctx[:, None] + torch.arange(g.q_len, device=ctx.device)[None, :]
        mask = _visible(q_pos, torch.arange(g.max_seq_len, device=ctx.device), window, chunk)
        mask = mask.unsqueeze(1)  # [G, 1, q_len, L]
        masks[(window, chunk)] = mask
    queries = q[g.padded_rows].transpose(1, 2)  # [G, H, q_len, D]
    out = _attention(queries, keys, values, mask, scale, softcap, sinks=sinks)
    return out.transpose(1, 2)[g.valid]
