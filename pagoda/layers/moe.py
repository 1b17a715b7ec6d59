"""Mixture-of-experts building blocks: top-k routers and the expert layer.

Experts live as stacked weights, ``w13_weight [E, 2 * I, H]`` (gate rows then up rows of each
expert) and ``w2_weight [E, H, I]``, filled expert by expert from per-expert checkpoint tensors
by their ``weight_loader``s; with tensor parallelism every rank holds every expert's slice
``I / tp`` of the intermediate dimension, so the layer's output is a partial sum that the
caller all-reduces. With expert parallelism (``--enable-expert-parallel``) rank ``r`` instead
holds experts ``r * E / tp .. (r + 1) * E / tp - 1`` whole: every rank has every token (the
activations are replicated under tensor parallelism), computes the (token, expert) pairs routed
to its own experts, and the same all-reduce combines the ranks' partial sums.

The computation groups tokens by expert: the ``T * k`` (token, expert) pairs are sorted by
expert, each active expert runs one matmul over its contiguous rows (no Python loop over
tokens; the loop is over experts that received tokens), and the weighted rows are scattered
back to (token, slot) order and summed per token. On a CPU, once the weights are packed
(``pack_weight``, at start-up), one call of a C++ kernel (``cpu_moe.py``) does all of it: the
grouping, every active expert's two products in panels of output features handed out to the
threads, and the weighted combine; where it cannot be built, each expert's weights are packed
for oneDNN like the dense linear layers and the grouping runs in torch. On a GPU a Triton grouped
GEMM (``moe_triton.py``) does the same without reading the expert counts on the host.

Checkpoints store experts either one tensor per expert and projection (Mixtral, Qwen, DeepSeek)
or all experts in one tensor per projection (``STACKED``: gpt-oss and Llama 4, as transformers
lays them out: ``gate_up_proj [E, H, 2I]`` input-major, gate and up halves side by side or
interleaved, and ``down_proj [E, I, H]``); ``stacked_layout`` says which, and each rank reads
only its own experts' slices.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import get_ep, get_tp
from pagoda.kernels import moe as cpu_moe
from pagoda.layers import cpu_gemm, fused_ops
from pagoda.layers.linear import check_extent, copy_checked, divide, load_cols, load_rows


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral/Qwen routing: softmax over all experts (fp32), keep the ``top_k`` largest,
    optionally rescale the kept ones to sum to 1. Returns fp32 weights and int64 ids ``[T, k]``."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                 correction_bias: torch.Tensor | None, renormalize: bool,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores; experts are chosen by score + correction bias,
    first keeping the ``topk_groups`` groups whose two best biased scores sum highest, then the
    ``top_k`` best experts inside them; the weights are the unbiased scores (renormalised when
    asked) times ``scaling``."""
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    t, e = choice.shape
    if num_groups > 1:
        group_scores = choice.view(t, num_groups, e // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
        choice = choice.masked_fill(keep == 0, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class FusedMoE(nn.Module):
    """``num_experts`` SiLU-gated MLPs as stacked weights; ``forward(x, weights, ids)`` returns
    this rank's partial sum of each token's weighted expert outputs (all-reduce it under TP)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 stacked_layout: str | None = None) -> None:
        super().__init__()
        # None: per-expert checkpoint tensors; "halves" / "interleaved": STACKED tensors whose
        # gate_up_proj holds gate then up, or gate and up alternating, along its last dim.
        self.stacked_layout = stacked_layout
        tp, ep = get_tp(), get_ep()
        # This rank's experts (global ids first_expert ..) and its slice of each one's intermediate.
        self.num_experts = divide(num_experts, ep.size)
        self.first_expert = ep.rank * self.num_experts
        self.expert_parallel = ep.size > 1
        slices = tp.size // ep.size
        self.slice_rank = tp.rank % slices
        self.intermediate = divide(intermediate, slices)
        self.full_intermediate = intermediate
        e, i = self.num_experts, self.intermediate
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden, i, dtype=dtype), requires_grad=False)
        self.w13_weight.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2_weight.weight_loader = self._load_w2  # type: ignore[attr-defined]
        # What the loader must see: each own expert's gate (0) and up (1) projection, and its down.
        own = range(self.first_expert, self.first_expert + e)
        if stacked_layout is None:
            self.w13_weight.expected_shards = {(x, j) for x in own for j in (0, 1)}  # type: ignore[attr-defined]
            self.w2_weight.expected_shards = set(own)  # type: ignore[attr-defined]
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per expert, oneDNN
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None  # all experts, cpu_moe's layout

    def _local(self, expert: int) -> int | None:
        local = expert - self.first_expert
        return local if 0 <= local < self.num_experts else None  # another rank's expert: not read

    def _gate_up_rows(self, source: Any, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's gate and up rows ``[I / tp, H]`` of a STACKED ``gate_up_proj``'s ``expert``."""
        w = source[expert:expert + 1][0].t()  # [2I, H]
        gate, up = (w[0::2], w[1::2]) if self.stacked_layout == "interleaved" else w.chunk(2)
        i = self.intermediate
        return gate[self.slice_rank * i:(self.slice_rank + 1) * i], up[self.slice_rank * i:(self.slice_rank + 1) * i]

    def _load_stacked(self, param: nn.Parameter, source: Any) -> None:
        """All of this rank's experts from one STACKED tensor (expert by expert, so a lazily
        dequantized source never materialises whole)."""
        i = self.intermediate
        for local in range(self.num_experts):
            expert = self.first_expert + local
            if param is self.w13_weight:
                gate, up = self._gate_up_rows(source, expert)
                param.data[local, :i].copy_(gate)
                param.data[local, i:].copy_(up)
            else:  # down_proj [I, H] -> [H, I], this rank's columns
                w = source[expert:expert + 1][0].t()
                param.data[local].copy_(w[:, self.slice_rank * i:(self.slice_rank + 1) * i])

    def _load_w13(self, param: nn.Parameter, source: Any, shard: tuple[int, int] | None) -> None:
        if self.stacked_layout is not None:
            self._load_stacked(param, source)
            return
        expert, which = self._local(shard[0]), shard[1]
        i = self.intermediate
        check_extent(source, 0, self.full_intermediate)  # a config that disagrees with its weights
        if expert is not None:
            copy_checked(param.data[expert, which * i:(which + 1) * i], load_rows(source, self.slice_rank * i, i))

    def _load_w2(self, param: nn.Parameter, source: Any, expert: int | None) -> None:
        if self.stacked_layout is not None:
            self._load_stacked(param, source)
            return
        local, i = self._local(expert), self.intermediate
        check_extent(source, 1, self.full_intermediate)
        if local is not None:
            copy_checked(param.data[local], load_cols(source, self.slice_rank * i, i))

    def pack_weight(self, grouped_kernel: bool = True) -> bool:
        """CPU: the experts in the grouped kernel's panel layout (unless ``grouped_kernel`` is
        False or it cannot be built), else each expert's two matrices in oneDNN's layout; the
        stacked copies are dropped."""
        if self.packed is not None or self.panels is not None:
            return True
        if self.w13_weight.device.type != "cpu":
            return False
        if grouped_kernel and cpu_moe.supports(self.w13_weight):
            self.panels = cpu_moe.pack_experts(self.w13_weight.data, self.w2_weight.data)
            self.w13_weight.data = torch.empty(0, dtype=self.w13_weight.dtype)
            self.w2_weight.data = torch.empty(0, dtype=self.w2_weight.dtype)
            return True
        packed = []
        for e in range(self.num_experts):
            a, b = cpu_gemm.pack(self.w13_weight.data[e]), cpu_gemm.pack(self.w2_weight.data[e])
            if a is None or b is None:
                return False
            packed.append((a, b))
        self.packed = packed
        self.w13_weight.data = torch.empty(0, dtype=self.w13_weight.dtype)
        self.w2_weight.data = torch.empty(0, dtype=self.w2_weight.dtype)
        return True

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            w13, w2 = self.packed[e]
            h = cpu_gemm.linear(rows, self.w13_weight, w13, None)
            return cpu_gemm.linear(fused_ops.silu_and_mul(h), self.w2_weight, w2, None)
        h = F.linear(rows, self.w13_weight[e])
        return F.linear(fused_ops.silu_and_mul(h), self.w2_weight[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return cpu_moe.moe_experts(x, weights, ids, *self.panels, self.first_expert, self.intermediate)
        if self.packed is None and fused_ops.use_triton(x):
            return self._forward_triton(x, weights, ids)
        return self._forward_grouped(x, weights, ids)

    def _forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The torch path: (token, expert) pairs sorted by expert, one ``_expert`` call each."""
        t, k = ids.shape
        if t == 1 and not self.expert_parallel:
            # One token (batch-1 decode): its k experts directly, no sort, gather or scatter.
            rows = [self._expert(e, x) for e in ids[0].tolist()]
            out = torch.cat(rows) * weights.reshape(-1, 1).to(x.dtype)
            return out.view(1, k, -1).sum(dim=1)
        flat = ids.reshape(-1) - self.first_expert
        if self.expert_parallel:
            # Pairs routed to other ranks' experts go to a last, skipped bucket (output 0).
            flat = torch.where((flat >= 0) & (flat < self.num_experts), flat, self.num_experts)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[token_of]
        out = torch.zeros_like(rows) if len(counts) > self.num_experts else torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts[:self.num_experts]):
            if n:
                out[start:start + n] = self._expert(e, rows[start:start + n])
                start += n
        out *= weights.reshape(-1)[order].to(out.dtype)[:, None]
        # Back to (token, slot) order, then each token's k rows summed.
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted.view(t, k, -1).sum(dim=1)

    def _forward_triton(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """GPU: the Triton grouped GEMM (no host synchronisation). Pairs routed to another
        rank's experts get weight 0 on a local expert."""
        from pagoda.layers import moe_triton

        if self.expert_parallel:
            local = ids - self.first_expert
            mine = (local >= 0) & (local < self.num_experts)
            ids, weights = torch.where(mine, local, 0), torch.where(mine, weights, 0.0)
        return moe_triton.fused_experts(x, self.w13_weight, self.w2_weight, weights, ids, **self.triton_options())

    def triton_options(self) -> dict:
        """Extra arguments of ``moe_triton.fused_experts`` (experts with biases or another gate
        activation override it)."""
        return {}
