"""Which kernel runs a prefill step on the GPU, chosen per shape by measurement.

Two candidates: the Triton paged prefill kernel (``triton_kernels.py``; any step) and torch's
FlashAttention varlen kernel (``torch.nn.attention.varlen.varlen_attn``) for steps it can take:
every sequence starts from an empty cache (no prefix-cache hit, no earlier chunk), so the step's
own contiguous K/V are all it attends to; CUDA, fp16/bf16 queries, a float cache, no soft-capping,
sinks or chunked attention (a sliding window goes in as ``window_size``).

The first step of each shape class (query and KV heads, head size, dtype, and the power-of-two
classes of the step's token count and longest prompt) runs both, times each once more on CUDA
events, keeps the faster and logs the choice; every later step of that class runs only the
winner. A candidate that raises (a head size the flash build lacks) loses for that class.
``PAGODA_PREFILL_KERNEL=triton|flash`` forces one where it applies (``auto``, the default,
measures). Both compute the same causal attention, so the choice changes speed, not meaning.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable

import torch

from pagoda.env_vars import env_mode
from pagoda.layers.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

ENV = "PAGODA_PREFILL_KERNEL"
MODES = ("auto", "triton", "flash")

Kernel = Callable[[], torch.Tensor]


@functools.lru_cache(maxsize=None)
def _varlen_attn() -> Callable | None:
    """torch's varlen flash kernel, where this torch has one (looked up once: every layer of
    every prefill step asks)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def _varlen_params() -> frozenset[str]:
    varlen = _varlen_attn()
    return frozenset(inspect.signature(varlen).parameters) if varlen is not None else frozenset()


def _on_cuda(q: torch.Tensor) -> bool:
    return q.is_cuda


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
                  sliding_window: int | None) -> torch.Tensor:
    """Causal attention of fresh prompts over their own K/V through torch's varlen flash kernel
    (its keyword names differ between torch releases: ``window_size`` or ``is_causal``)."""
    params = _varlen_params()
    extra: dict = {}
    if q.shape[1] != k.shape[1]:
        extra["enable_gqa"] = True
    if "scale" in params:
        extra["scale"] = scale
    if "window_size" in params:
        # pagoda's window W sees positions p - W + 1 .. p: W - 1 to the left; -1 is unlimited.
        extra["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
    else:
        extra["is_causal"] = True
    return _varlen_attn()(q, k, v, meta.query_start_loc, meta.query_start_loc, meta.max_query_len,
                          meta.max_query_len, **extra)


def flash_applies(q: torch.Tensor, k: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
                  softcap: float | None, sinks: torch.Tensor | None, attention_chunk_size: int | None,
                  sliding_window: int | None, meta: AttentionMetadata) -> bool:
    """Whether the flash candidate can run this step (see the module notes)."""
    if not _on_cuda(q) or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if k_scale is not None or softcap is not None or sinks is not None or attention_chunk_size:
        return False
    params = _varlen_params()
    if not params or (sliding_window and "window_size" not in params):
        return False
    if q.shape[1] != k.shape[1] and "enable_gqa" not in params:
        return False
    if "scale" not in params and abs(scale - q.shape[-1] ** -0.5) > 1e-6 * scale:
        return False
    return any(meta.query_lens_cpu) and not any(meta.context_lens_cpu)


def _bucket(n: int) -> int:
    return max(1, n - 1).bit_length()


def _cuda_ms(fn: Kernel) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class PrefillChoice:
    """The per-shape-class winner between the Triton and flash prefill kernels (module notes).

    ``timer(fn) -> ms`` times one call (CUDA events by default; the tests pass their own)."""

    def __init__(self, timer: Callable[[Kernel], float] = _cuda_ms) -> None:
        self.timer = timer
        self.winners: dict[tuple, str] = {}

    @staticmethod
    def mode() -> str:
        return env_mode(ENV, MODES)

    def run(self, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata, triton: Kernel,
            flash: Kernel) -> torch.Tensor:
        """The step's attention from the kernel chosen for its class (measured on first sight)."""
        mode = self.mode()
        if mode != "auto":
            return flash() if mode == "flash" else triton()
        key = (q.shape[1], k.shape[1], q.shape[2], q.dtype, _bucket(meta.num_tokens), _bucket(meta.max_query_len))
        winner = self.winners.get(key)
        if winner == "flash":
            return flash()
        if winner == "triton":
            return triton()
        return self._measure(key, triton, flash)

    def _measure(self, key: tuple, triton: Kernel, flash: Kernel) -> torch.Tensor:
        out = triton()  # warm-up (and the step's result should flash fail)
        try:
            flash()
            times = {"triton": self.timer(triton), "flash": self.timer(flash)}
        except Exception as exc:  # noqa: BLE001 - a flash build without this shape loses the class
            logger.info("prefill %s: flash attention unavailable (%s); Triton", key, exc)
            self.winners[key] = "triton"
            return out
        winner = min(times, key=times.get)
        self.winners[key] = winner
        logger.info("prefill %s: triton %.3f ms, flash %.3f ms: %s", key, times["triton"], times["flash"], winner)
        return out
