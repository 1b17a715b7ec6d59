"""C++ versions of the elementwise ops of a decoder layer for float32 and bfloat16 on CPU
(RMSNorm, residual add + RMSNorm, rotary embedding, SiLU-and-mul) and of the greedy sampler's
argmax (csrc/fused.h, fused.cpp), from Python.

Why: at batch 1 a decode step's matrices are a few milliseconds of streaming, and the torch
versions of these ops cost 5-15 small tensor ops each (upcasts, a reduction, chunk, cat...),
every one a dispatch of a few microseconds: tens of microseconds per layer, a share of the
step that grows as the matmuls get faster (quantized weights). In a bfloat16 prefill the torch
versions' upcasts and downcasts were a third of the time (a 512-token prompt on the 2-core AMD
EPYC: 147-170 ms before, 109-117 ms after). Each op here is one call that reads its inputs once.
Same arithmetic as the torch references in ``fused_ops``: float32 throughout, a bfloat16 row
widened on the way in and rounded once on the way out (the residual sum rounded before the norm
reads it, as the reference's bfloat16 add does); the norm's sum of squares is taken in another
order and ``exp`` is a vectorised polynomial, so results agree to float32 rounding (bfloat16:
but for the rare element that a few float32 ulps move across a rounding boundary).

Used for float32 or bfloat16 CPU tensors when the module builds (``fused_ops`` dispatches);
elsewhere, or with ``PAGODA_CPU_KERNELS=0``, the torch versions run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pagoda.kernels.build import Kernel
from pagoda.step import StepAbandoned

if TYPE_CHECKING:
    from pagoda.executor.input import ModelInput

_KERNEL = Kernel("fused", "CPU fused elementwise ops", "using the torch versions")


def module() -> object | None:
    """The kernel library's op namespace, or None when the ops cannot run here."""
    return _KERNEL.load()


_DTYPES = (torch.float32, torch.bfloat16)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the C++ ops serve these tensors: all float32 or all bfloat16, on CPU, and the
    module built (bfloat16 rows are widened, computed in float32 and rounded once, as the torch
    references do)."""
    dtype = tensors[0].dtype
    return (dtype in _DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and module() is not None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return module().rms_norm(_rows(x), weight.contiguous(), eps).view(x.shape)  # type: ignore[union-attr]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, new_residual = module().add_rms_norm(_rows(x), _rows(residual), weight.contiguous(), eps)  # type: ignore[union-attr]
    return y.view(x.shape), new_residual.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return module().silu_and_mul(_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)  # type: ignore[union-attr]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = module()
    pos = positions.to(torch.int64).contiguous()
    cache = cos_sin_cache.contiguous()
    return m.rotate(_unit_inner(q), pos, cache), m.rotate(_unit_inner(k), pos, cache)  # type: ignore[union-attr]


def serves_greedy(logits: torch.Tensor) -> bool:
    """Whether ``greedy_tokens`` takes these logits: float32 or bfloat16 on CPU, the module built
    (checked in the order of their cost: this runs once a step, with every cache cold)."""
    dtype = logits.dtype
    return ((dtype is torch.float32 or dtype is torch.bfloat16) and logits.is_cpu
            and (_KERNEL.module is not None or module() is not None))


def greedy_tokens(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """The greedy token of each of ``logits``' listed ``rows`` (float32 or bfloat16), as
    ``finite_logits(logits[rows].float()).argmax(-1).tolist()`` gives it, in one pass over each
    row without copying it."""
    flat = logits if logits.dim() == 2 and logits.stride(1) == 1 else _rows(logits)  # no reshape op per step
    return module().greedy_tokens(flat, rows)  # type: ignore[union-attr]


def serves_steps(inputs: "ModelInput") -> bool:
    """Whether ``greedy_steps`` can run a multi-step round of these inputs: one-token decodes on
    the host whose every hidden row gets logits, no LoRA, the module built (the logits' dtype is
    checked with ``serves_greedy`` once the first step has them)."""
    return (inputs.lora_slots is None and inputs.logits_all_rows and inputs.meta.max_query_len == 1
            and inputs.input_ids.is_cpu and (_KERNEL.module is not None or module() is not None))


def greedy_round(inputs: "ModelInput", block_size: int, steps: int, ends: list[frozenset[int]],
                 embed: torch.Tensor | None = None) -> object:
    """The host-side state of a multi-step greedy round over ``inputs`` (``serves_steps``) of at
    most ``steps + 1`` tokens per sequence: ``GreedyRound`` above. Given the ``embed`` table, its
    ``embed_inputs()`` is the embedding rows of the inputs' tokens (for the round's first step).
    A torch custom class object (csrc/bindings.cpp), freed with its last reference."""
    meta = inputs.meta
    return module().greedy_round(  # type: ignore[union-attr]
        inputs.input_ids, inputs.positions, meta.context_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables,
        block_size, embed, [list(e) for e in ends], steps + 1)


def greedy_steps(rnd: object, logits: torch.Tensor, inputs: "ModelInput", steps: int,
                 forward: Callable[..., torch.Tensor], stop: Callable[[], bool] | None = None,
                 host_meta: bool = True) -> list[list[int]]:
    """Multi-step greedy decoding on CPU: from the first step's ``logits`` (``serves_greedy``;
    one row per sequence), each sequence's greedy token, fed back for up to ``steps`` more steps
    of ``forward`` (the logits of ``inputs``), which move on in place between steps, tensors and
    all, in one C++ call per step (``rnd``, the round's ``greedy_round``, which also records the
    tokens and checks them against the ending tokens); with an embedding table in ``rnd``, that
    call also writes the tokens' embedding rows, and ``forward(inputs, x)`` takes them. Stops
    early once every sequence's latest token is one of its ending tokens, when ``stop()``
    (asked before each further step) is true, or when a further step's forward is given up
    (``StepAbandoned``: its tokens' K/V are not counted computed). ``host_meta``: whether ``forward`` reads the
    host-side lengths (``seq_lens_cpu``, ``context_lens_cpu``, ``max_seq_len``), which are then
    moved on before every step; otherwise (the fused decode stack reads only the tensors) once,
    at the end, by as much as those steps would have. Returns each sequence's tokens, 1 to
    ``steps + 1`` of them.

    Why a C++ round: after a step has streamed the weights, the host's own work runs with every
    cache cold, and the per-step Python (lists, set lookups, a dozen argument conversions) took
    as long as the argmax itself (~35 us of a 1.2 ms int4 step; now ~20 us in all)."""
    meta = inputs.meta
    advance = rnd.step  # type: ignore[attr-defined]
    x = rnd.x if rnd.x.numel() else None  # type: ignore[attr-defined]
    k = 0
    while True:
        more = k < steps
        if advance(logits, more) or not more or (stop is not None and stop()):
            break
        k += 1
        if host_meta:
            _move_host_meta(meta, 1)
        try:
            logits = forward(inputs) if x is None else forward(inputs, x)
        except StepAbandoned:  # a background-only round: interactive work came, keep the steps done
            break
    if not host_meta and k:
        _move_host_meta(meta, k)
    return rnd.tokens()  # type: ignore[attr-defined]


def _move_host_meta(meta, by: int) -> None:
    meta.seq_lens_cpu = [v + by for v in meta.seq_lens_cpu]
    meta.context_lens_cpu = [v + by for v in meta.context_lens_cpu]
    meta.max_seq_len += by


def _unit_inner(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
