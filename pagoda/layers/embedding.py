"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp
from pagoda.layers import cpu_gemm
from pagoda.layers.linear import check_extent, copy_checked


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp()
        self.vocab_size = vocab_size
        self.tp_size = tp.size
        self.per_rank = -(-vocab_size // tp.size)  # padded so every rank has the same rows
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        check_extent(source, 0, self.vocab_size)  # a vocab_size that disagrees with the weights
        end = min(self.start + self.per_rank, self.vocab_size)
        copy_checked(param.data[: end - self.start], source[self.start:end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; each rank scores its vocab slice, then they are gathered."""

    packed: torch.Tensor | None = None
    tied = False  # set when the weight is the input embedding's
    # Weight quantization of the LM head (``--quantization-config '{"lm_head": true}'``): the
    # method set before loading; after it, the instance attribute ``qlinear`` holds the quantized
    # matmul (only then: ``hasattr(module, "qlinear")`` marks the quantized layers of a model).
    quant_method: Any = None

    def quantize_with(self, method: Any) -> None:
        """Quantize this head with ``method`` (an online ``--quantization`` method) once loaded."""
        method.check_shape(self, self.weight.shape[1])
        self.quant_method = method

    def process_weights_after_loading(self) -> None:
        if self.quant_method is None or hasattr(self, "qlinear"):
            return
        self.qlinear = self.quant_method.quantize(self, self.weight.data)
        if not self.tied:  # a tied weight stays: the token lookup reads it
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def pack_weight(self) -> bool:
        """oneDNN layout for the logits matmul (CPU). A tied weight keeps its dense copy, which
        the token lookup reads. A quantized head has its own kernel: nothing to pack."""
        if hasattr(self, "qlinear"):
            return True
        if self.packed is None:
            self.packed = cpu_gemm.pack_parameter(self.weight, keep_dense=self.tied)
        return self.packed is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        qlinear = getattr(self, "qlinear", None)
        if qlinear is not None:
            logits = qlinear(hidden, None)
        else:
            logits = cpu_gemm.linear(hidden, self.weight, self.packed, None)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
