"""A C++ grouped-expert kernel for the mixture-of-experts layer on CPU (csrc/moe.cpp).

One call does the whole expert computation of a step: group the ``T * k`` (token, slot) pairs by
expert (a counting sort), then inside one OpenMP parallel region gather each pair's activation
row, per active expert ``act = silu(x W_gate^T) * (x W_up^T)`` and ``y = act W_down^T`` on that
expert's rows, and finally each token's weighted sum over its slots (in slot order). Each thread
takes the same contiguous share of every active expert's output panels, so the threads' work is
equal and each one's weight reads are a forward stream per matrix; an expert with no rows costs
nothing.

The inner product is register-blocked: up to 28 activation rows (all of an expert's rows at
decode sizes, so its weights are read once; more rows are split into even tiles) by one vector
of 16 output features, or a tile of up to 14 rows by two panels at once (gate with up, two
adjacent down panels), so that with few rows each broadcast activation still feeds two multiply-
adds. The weights are packed at start-up into panels of 16 output features stored k-major
(``pack_experts``), float32 or bfloat16 widened in registers, float32 sums; an expert's
activation rows are gathered k-major per tile, so one pointer serves every row of a tile. The
weight stream is prefetched a fixed distance ahead into the second-level cache, which keeps it
flowing at the memory's speed while the multiply-adds of many rows run (at batch 32 every expert
is active and the layer is bound by reading them). A token's result does not depend on which
other tokens share the batch (the same blocking for every row).

Where the kernel library is unavailable or ``PAGODA_CPU_KERNELS=0`` the module reports itself unavailable
and ``FusedMoE`` keeps its per-expert oneDNN path.
"""
from __future__ import annotations

import torch

from pagoda.kernels.build import Kernel


_KERNEL = Kernel("moe", "CPU grouped-expert kernel", "MoE layers use per-expert oneDNN matmuls")


def load() -> object | None:
    """The kernel library's op namespace, or None when the kernel cannot run here."""
    return _KERNEL.load()


PANEL = 16  # output features per packed panel (NP in the kernel)


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and load() is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` -> ``[..., ceil(N / PANEL), K, PANEL]``: the output features in panels of
    ``PANEL``, each stored k-major (zero-padded to a whole panel)."""
    n, k = weight.shape[-2:]
    panels = -(-n // PANEL)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, panels * PANEL - n))
    return padded.reshape(*weight.shape[:-2], panels, PANEL, k).transpose(-1, -2).contiguous()


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``FusedMoE``'s stacked ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in the kernel's layout:
    ``[E, 2, I / PANEL, H, PANEL]`` (gate panels, then up panels) and ``[E, H / PANEL, I, PANEL]``."""
    e, two_i, h = w13.shape
    return pack_panels(w13.reshape(e, 2, two_i // 2, h)), pack_panels(w2)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, first_expert: int, intermediate: int) -> torch.Tensor:
    """Each token's routing-weighted sum of its experts' SiLU-gated MLP outputs (``[T, H]`` in
    ``x``'s dtype) with ``w13``/``w2`` from ``pack_experts``; pairs whose expert is not in
    ``first_expert .. first_expert + E - 1`` add 0."""
    ops = load()
    assert ops is not None
    out = ops.moe_experts(x.float().contiguous(), weights.float().contiguous(),  # type: ignore[attr-defined]
                             ids.long().contiguous(), w13, w2, first_expert, intermediate)
    return out.to(x.dtype)
