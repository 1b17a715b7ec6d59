"""The Mamba-2 mixer (selective state space, SSD form) over a per-sequence recurrent state.

A mixer layer keeps no KV blocks: each running sequence owns one slot of the recurrent-state
pool (``kvcache/state_pool.py`` assigns it, ``AttentionMetadata.state_slots`` names it per
batch row), and the layer holds two tensors indexed by slot:

- ``conv_state [slots, conv_dim, kernel - 1]``: the last inputs of the causal depthwise
  convolution (the model's dtype);
- ``ssm_state [slots, heads, head_dim, d_state]``: the SSM state (float32 whatever the model's
  dtype: it accumulates over the whole sequence).

A sequence whose step starts at position 0 (``context_lens == 0``: a new prompt, or one being
recomputed after preemption) starts from zero state, so a slot never needs clearing. Its
prompt may arrive in several chunks (chunked prefill): each chunk starts from the state the
previous one left. Prefill chunks run the chunked SSD scan (quadratic inside chunks of
``chunk_size`` positions, a recurrence across them); one-token decodes run the one-step
recurrence, batched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.attention.context import get_attention_metadata
from pagoda.layers.linear import ReplicatedLinear
from pagoda.layers.quantization import QuantizationConfig


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x * silu(gate))`` over groups of ``group_size`` features, then scaled."""

    def __init__(self, hidden: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(x.dtype)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's SSM outputs ``y [L, h, p]`` (without the D skip) and final state.

    ``x [L, h, p]``, ``dt [L, h]`` (discretisation steps, already softplus'd and clamped),
    ``a [h]`` (negative decay rates), ``b``/``c [L, h, n]`` (per head), ``state [h, p, n]``
    (float32, the state before the first position). Inside each chunk of ``chunk`` positions the
    outputs are a masked product (the state-space dual of attention); a chunk's end state feeds
    the next chunk."""
    length = x.shape[0]
    pad = (-length) % chunk
    # Padding steps have dt = 0: they neither decay the state nor add to it.
    x, dt, b, c = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, b, c))
    nc = x.shape[0] // chunk
    x, dt = x.view(nc, chunk, *x.shape[1:]), dt.view(nc, chunk, -1)
    b, c = b.view(nc, chunk, *b.shape[1:]), c.view(nc, chunk, *c.shape[1:])
    xdt = x * dt[..., None]  # [c, q, h, p]
    cum = torch.cumsum(dt * a, dim=1)  # [c, q, h]: log-decay from the chunk start to each position
    # Within a chunk: position l reads position s <= l decayed by exp(cum[l] - cum[s]).
    diff = cum.transpose(1, 2)[..., :, None] - cum.transpose(1, 2)[..., None, :]  # [c, h, l, s]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
    scores = torch.einsum("clhn,cshn->chls", c, b) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xdt)
    # Each chunk's contribution to its end state, and the decay over the whole chunk.
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [c, q, h]
    chunk_states = torch.einsum("cshn,csh,cshp->chpn", b, to_end, xdt)
    chunk_decay = torch.exp(cum[:, -1, :])  # [c, h]
    starts = []
    for i in range(nc):  # the recurrence across chunks (few: length / chunk)
        starts.append(state)
        state = state * chunk_decay[i][:, None, None] + chunk_states[i]
    start = torch.stack(starts)  # [c, h, p, n]: the state entering each chunk
    y = y + torch.einsum("clhn,chpn->clhp", c, start) * torch.exp(cum)[..., None]
    return y.reshape(nc * chunk, *y.shape[2:])[:length], state


class Mamba2Mixer(nn.Module):
    """Mamba-2's mixer: ``in_proj`` to (gate, x|B|C, dt), causal depthwise conv + SiLU over
    x|B|C, the SSM scan, a gated group RMSNorm, ``out_proj``. Checkpoint names follow the
    reference layout (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``,
    ``out_proj``)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, d_state: int, groups: int, kernel: int,
                 chunk: int, eps: float, conv_bias: bool, proj_bias: bool, dtype: torch.dtype,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")),
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.heads, self.head_dim, self.d_state, self.groups = heads, head_dim, d_state, groups
        self.kernel, self.chunk = kernel, chunk
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * d_state
        self.dt_min, self.dt_max = time_step_limit
        self.in_proj = ReplicatedLinear(hidden, self.inner + self.conv_dim + heads, proj_bias, dtype, quant,
                                        f"{prefix}.in_proj")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=conv_bias,
                                dtype=dtype)
        self.conv1d.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.inner, self.inner // groups, eps, dtype)
        self.out_proj = ReplicatedLinear(self.inner, hidden, proj_bias, dtype, quant, f"{prefix}.out_proj")
        # Set by the model runner with the state pool (``allocate_state``).
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def state_shapes(self, slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (slots, self.conv_dim, self.kernel - 1), (slots, self.heads, self.head_dim, self.d_state)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        slots = meta.state_slots
        if slots is None:
            raise RuntimeError("a Mamba-2 layer ran without recurrent-state slots in the step's metadata")
        gate, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        a = -torch.exp(self.A_log.float())
        dt = (dt.float() + self.dt_bias.float())
        dt = F.softplus(dt).clamp(self.dt_min, self.dt_max)
        y = torch.empty(x.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=x.device)
        starts, q_lens, ctx = meta.query_start_loc_cpu, meta.query_lens_cpu, meta.context_lens_cpu
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        if decodes:
            self._decode(decodes, starts, ctx, slots, xbc, dt, a, y)
        for i, n in enumerate(q_lens):
            if n > 1:
                self._prefill(starts[i], n, ctx[i] > 0, slots[i], xbc, dt, a, y)
        # Normed in float32 (the scan's precision), then back to the model's dtype.
        out = self.norm(y.view(x.shape[0], self.inner), gate)
        return self.out_proj(out.to(x.dtype))

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[T, h, p]`` and per-head B, C ``[T, h, n]`` (float32) of the convolved x|B|C."""
        t, gn = xbc.shape[0], self.groups * self.d_state
        xs, b, c = xbc.float().split([self.inner, gn, gn], dim=-1)
        rep = self.heads // self.groups
        b = b.view(t, self.groups, self.d_state).repeat_interleave(rep, dim=1)
        c = c.view(t, self.groups, self.d_state).repeat_interleave(rep, dim=1)
        return xs.view(t, self.heads, self.head_dim), b, c

    def _prefill(self, start: int, n: int, resume: bool, slot: int, xbc: torch.Tensor, dt: torch.Tensor,
                 a: torch.Tensor, y: torch.Tensor) -> None:
        """One sequence's chunk of ``n`` positions from row ``start``; ``resume``: it continues
        the state in ``slot`` (else starts from zero)."""
        rows = slice(start, start + n)
        w = self.kernel - 1
        prev = self.conv_state[slot] if resume else xbc.new_zeros(self.conv_dim, w)
        padded = torch.cat([prev.to(xbc.dtype), xbc[rows].t()], dim=1)  # [conv_dim, w + n]
        self.conv_state[slot] = padded[:, -w:]
        conv = F.silu(F.conv1d(padded[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[0].t())
        xs, b, c = self._split(conv)
        state = self.ssm_state[slot] if resume else torch.zeros_like(self.ssm_state[slot])
        out, final = ssd_scan(xs, dt[rows], a, b, c, state.float(), self.chunk)
        self.ssm_state[slot] = final
        y[rows] = out + xs * self.D.float()[:, None]

    def _decode(self, seqs: list[int], starts: list[int], ctx: list[int], slots: list[int], xbc: torch.Tensor,
                dt: torch.Tensor, a: torch.Tensor, y: torch.Tensor) -> None:
        """The one-token sequences ``seqs`` together: one convolution step and one SSM step each
        (a sequence at position 0 starts from zero state)."""
        dev = xbc.device
        rows = torch.tensor([starts[i] for i in seqs], device=dev)
        idx = torch.tensor([slots[i] for i in seqs], device=dev)
        fresh = torch.tensor([ctx[i] == 0 for i in seqs], device=dev)
        conv_prev = self.conv_state[idx].masked_fill(fresh[:, None, None], 0)
        window = torch.cat([conv_prev.to(xbc.dtype), xbc[rows][:, :, None]], dim=2)  # [B, conv_dim, kernel]
        self.conv_state[idx] = window[:, :, 1:]
        conv = (window * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        xs, b, c = self._split(F.silu(conv))
        state = self.ssm_state[idx].masked_fill(fresh[:, None, None, None], 0)
        step = dt[rows]  # [B, h]
        state = state * torch.exp(step * a)[:, :, None, None] + (xs * step[..., None])[..., None] * b[:, :, None, :]
        self.ssm_state[idx] = state
        y[rows] = torch.einsum("bhpn,bhn->bhp", state, c) + xs * self.D.float()[:, None]
