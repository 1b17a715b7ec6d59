"""The tensor-parallel group this process belongs to, and the collectives layers use.

With one rank (the default) every collective is the identity and torch.distributed is never
initialised, so single-process use needs no rendezvous at all.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_TP = TPGroup()


def get_tp() -> TPGroup:
    return _TP


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str, timeout_s: float = 120) -> None:
    """Join the process group. On one machine the rendezvous and gloo stay on loopback."""
    global _TP
    if size > 1:
        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _TP = TPGroup(rank, size)


def destroy_tensor_parallel() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension, in rank order."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    if _TP.size > 1:
        dist.broadcast(x, src)
    return x
