"""The tensor-parallel group this process belongs to, and the collectives layers use.

With one rank (the default) every collective is the identity and torch.distributed is never
initialised, so single-process use needs no rendezvous at all.

Two groups span the same ranks: the default one (gloo on CPU, NCCL on CUDA) carries the
model's activations; a gloo "host" group carries the executor's control messages and step
inputs, which live in host memory (on CPU both are the same group).

Pipeline parallelism (``pipeline_size`` P > 1) makes the ranks a P x T grid: ranks
``(P - 1 - s) * T .. (P - s) * T - 1`` are stage ``s``'s tensor-parallel group, so rank 0 (the
engine core, which samples) is on the last stage. Tensor-parallel collectives then run in the
stage's own group, and stage-to-stage activations in a separate point-to-point group.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagoda.distributed.rendezvous import init_method_host, is_loopback, open_store, pin_to_loopback


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class PPGroup:
    """This rank's pipeline stage (``rank``) of ``size`` stages and its place in the rank grid."""

    rank: int = 0
    size: int = 1
    world_rank: int = 0
    world_size: int = 1
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def peer(self, stage: int) -> int:
        """The world rank of stage ``stage``'s member with this rank's tensor-parallel index."""
        return (self.size - 1 - stage) * self.tp_size + self.world_rank % self.tp_size


def stage_of(world_rank: int, pipeline_size: int, tp_size: int) -> int:
    """Rank ``world_rank``'s pipeline stage: ranks are numbered from the last stage back."""
    return pipeline_size - 1 - world_rank // tp_size


def get_pp_indices(num_layers: int, stage: int, pipeline_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of ``stage``: contiguous ranges of ``num_layers // P`` layers, the
    remainder going one each to the stages before the last (which also holds the LM head)."""
    sizes = [num_layers // pipeline_size] * pipeline_size
    for i in range(2, num_layers % pipeline_size + 2):
        sizes[-i] += 1
    start = sum(sizes[:stage])
    return start, start + sizes[stage]


_TP = TPGroup()
_PP = PPGroup()
_HOST_GROUP: dist.ProcessGroup | None = None
_TP_GROUP: dist.ProcessGroup | None = None  # None: the default group (no pipeline stages)
_PP_GROUP: dist.ProcessGroup | None = None  # stage-to-stage sends, apart from every collective
_STORE: dist.Store | None = None  # where the ranks met; also carries the nodes' heartbeats


def get_tp() -> TPGroup:
    return _TP


def get_pp() -> PPGroup:
    return _PP


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


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str, timeout_s: float = 120,
                         pipeline_size: int = 1, connect_timeout_s: float | None = None) -> None:
    """Join the process group of ``size`` ranks (``pipeline_size`` stages of ``size //
    pipeline_size`` tensor-parallel ranks). ``timeout_s`` bounds every collective, so a rank that
    stops answering surfaces as an error instead of a hang; ``connect_timeout_s`` (default the
    same) how long a rank waits for the others to reach rank 0's store (another node may start
    later). On one machine every socket stays on loopback."""
    global _TP, _PP, _HOST_GROUP, _TP_GROUP, _PP_GROUP, _STORE
    tp_size = size // pipeline_size
    if size > 1:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a tensor-parallel group: shut the other "
                               "tensor-parallel engine down first")
        if is_loopback(init_method_host(init_method)):
            pin_to_loopback()
        timeout = datetime.timedelta(seconds=timeout_s)
        connect = datetime.timedelta(seconds=connect_timeout_s or timeout_s)
        try:
            _STORE = open_store(init_method, rank == 0, connect)
            _wait_for_ranks(_STORE, size, connect_timeout_s or timeout_s)
            _STORE.set_timeout(timeout)
            dist.init_process_group(backend, store=dist.PrefixStore("pagoda/pg/", _STORE), rank=rank,
                                    world_size=size, timeout=timeout)
            _HOST_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
            if pipeline_size > 1:
                _TP_GROUP, _PP_GROUP = _new_pipeline_groups(rank, pipeline_size, tp_size, backend, timeout)
        except BaseException:
            destroy_tensor_parallel()  # a group left half made would refuse every later engine here
            raise
    _TP = TPGroup(rank % tp_size, tp_size)
    _PP = PPGroup(stage_of(rank, pipeline_size, tp_size), pipeline_size, rank, size, tp_size)


def _new_pipeline_groups(rank: int, pipeline_size: int, tp_size: int, backend: str,
                         timeout: datetime.timedelta) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup]:
    """Each stage's tensor-parallel group (every rank creates every group, in the same order)
    and the point-to-point group."""
    mine = None
    for first in range(0, pipeline_size * tp_size, tp_size):
        group = dist.new_group(list(range(first, first + tp_size)), timeout=timeout, backend=backend)
        if first <= rank < first + tp_size:
            mine = group
    return (mine if tp_size > 1 else None), dist.new_group(backend=backend, timeout=timeout)


def _wait_for_ranks(store: dist.Store, size: int, timeout_s: float) -> None:
    """Return once all ``size`` ranks have reached the store (another node's may come later than
    the collectives' timeout allows), so that the group forms at once."""
    store.add("pagoda/joined", 1)
    deadline = time.monotonic() + timeout_s
    while (joined := store.add("pagoda/joined", 0)) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {joined} of {size} ranks reached the rendezvous within {timeout_s:.0f} s")
        time.sleep(0.05)


def get_store() -> dist.Store | None:
    """The rendezvous store of this process's group (None with one rank)."""
    return _STORE


def destroy_tensor_parallel() -> None:
    """Leave the group and forget every part of it (expert parallelism too), also after a
    failed or partial start, so that a later engine in this process starts from nothing."""
    global _TP, _PP, _HOST_GROUP, _TP_GROUP, _PP_GROUP, _STORE, _EXPERT_PARALLEL
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _TP, _PP, _HOST_GROUP, _TP_GROUP, _PP_GROUP, _STORE = TPGroup(), PPGroup(), None, None, None, None
        _EXPERT_PARALLEL = False


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over the ranks (in place)."""
    if _TP.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_TP_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension, in rank order."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Broadcast from tensor-parallel rank ``src`` of this stage."""
    if _TP.size > 1:
        dist.broadcast(x, _PP.world_rank - _TP.rank + src, group=_TP_GROUP)
    return x


# ---- stage to stage (pipeline parallelism) -----------------------------------------------------

def pp_isend(x: torch.Tensor, stage: int, tag: int) -> dist.Work:
    """Start sending ``x`` to stage ``stage`` (the rank with this rank's tensor-parallel index)."""
    return dist.isend(x.contiguous(), _PP.peer(stage), group=_PP_GROUP, tag=tag)


def pp_irecv(x: torch.Tensor, stage: int, tag: int) -> dist.Work:
    """Start receiving into ``x`` from stage ``stage``."""
    return dist.irecv(x, _PP.peer(stage), group=_PP_GROUP, tag=tag)


# ---- host-side collectives (executor control and step inputs) --------------------------------

def _host_group() -> dist.ProcessGroup:
    return _HOST_GROUP if _HOST_GROUP is not None else dist.group.WORLD


def host_broadcast(x: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> torch.Tensor:
    """Broadcast a CPU tensor over the host group. ``timeout_s`` overrides the group's timeout
    for this one call: a worker waiting for the next step may wait as long as the engine idles."""
    if _PP.world_size == 1:
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
    if _PP.world_size == 1:
        return value
    x = torch.tensor([value], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    if timeout_s is not None:
        opts.timeout = datetime.timedelta(seconds=timeout_s)
    _host_group().allreduce([x], opts).wait()
    return int(x.item())


def host_all_gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), in world-rank order."""
    x = torch.tensor(values, dtype=torch.float64)
    if _PP.world_size == 1:
        return [x.tolist()]
    parts = [torch.empty_like(x) for _ in range(_PP.world_size)]
    dist.all_gather(parts, x, group=_host_group())
    return [p.tolist() for p in parts]


def host_gather(x: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's CPU tensor ``x`` (the same shape and dtype on each) on rank 0, in world-rank
    order; None on the other ranks."""
    if _PP.world_size == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(_PP.world_size)] if _PP.world_rank == 0 else None
    dist.gather(x, parts, dst=0, group=_host_group())
    return parts
