"""The tensor-parallel group this process belongs to, and the collectives layers use.

With one rank (the default) every collective is the identity and torch.distributed is never
initialised, so single-process use needs no rendezvous at all.

Two groups span the same ranks: the default one (gloo on CPU, NCCL on CUDA) carries the
model's activations; a gloo "host" group carries the executor's control messages and step
inputs, which live in host memory (on CPU both are the same group).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagoda.distributed.rendezvous import init_method_host, is_loopback, pin_to_loopback


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_TP = TPGroup()
_HOST_GROUP: dist.ProcessGroup | None = None


def get_tp() -> TPGroup:
    return _TP


_EXPERT_PARALLEL = False


def set_expert_parallel(enabled: bool) -> None:
    """Whether mixture-of-experts layers built from now on split whole experts over the
    tensor-parallel ranks (``--enable-expert-parallel``)."""
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = enabled


def get_ep() -> TPGroup:
    """The expert-parallel group: the tensor-parallel ranks when expert parallelism is on,
    else a group of one (every rank holds a slice of every expert)."""
    return _TP if _EXPERT_PARALLEL else TPGroup()


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str, timeout_s: float = 120) -> None:
    """Join the process group. ``timeout_s`` bounds every collective, so a rank that stops
    answering surfaces as an error instead of a hang. On one machine every socket stays on
    loopback."""
    global _TP, _HOST_GROUP
    if size > 1:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a tensor-parallel group: shut the other "
                               "tensor-parallel engine down first")
        if is_loopback(init_method_host(init_method)):
            pin_to_loopback()
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        _HOST_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    _TP = TPGroup(rank, size)


def destroy_tensor_parallel() -> None:
    global _TP, _HOST_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP, _HOST_GROUP = TPGroup(), None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over the ranks (in place)."""
    if _TP.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
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


# ---- host-side collectives (executor control and step inputs) --------------------------------

def _host_group() -> dist.ProcessGroup:
    return _HOST_GROUP if _HOST_GROUP is not None else dist.group.WORLD


def host_broadcast(x: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> torch.Tensor:
    """Broadcast a CPU tensor over the host group. ``timeout_s`` overrides the group's timeout
    for this one call: a worker waiting for the next step may wait as long as the engine idles."""
    if _TP.size == 1:
        return x
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    if timeout_s is not None:
        opts.timeout = datetime.timedelta(seconds=timeout_s)
    _host_group().broadcast([x], opts).wait()
    return x


def host_all_reduce_min(value: int, timeout_s: float | None = None) -> int:
    """The smallest ``value`` over all ranks (e.g. the KV-cache blocks every rank can hold).
    With a long ``timeout_s`` it doubles as a barrier for slow phases such as model loading."""
    if _TP.size == 1:
        return value
    x = torch.tensor([value], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    if timeout_s is not None:
        opts.timeout = datetime.timedelta(seconds=timeout_s)
    _host_group().allreduce([x], opts).wait()
    return int(x.item())
