"""What the engine core is doing right now, for the dashboard (``/dashboard``, ``pagoda top``).

``engine_snapshot(core)`` is built only when the front end asks for it (the ``snapshot`` utility
call, which the front end rate-limits), so nothing here runs in the step loop: with nobody
looking, the dashboard costs the engine nothing. The snapshot carries token ids only, never
text: the front end decodes the prefix previews, and only for unsalted prefixes (a cache salt,
or tenant isolation, means the prefix belongs to someone who must stay private: the snapshot then
gives its hash and length alone).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import time
from typing import TYPE_CHECKING, Hashable

import msgspec

if TYPE_CHECKING:
    from pagoda.engine.core import EngineCore
    from pagoda.kvcache.radix_cache import RadixCache, RadixNode
    from pagoda.request import Sequence

# Requests listed one by one (running first, then waiting, oldest first); the totals count all.
MAX_LISTED_REQUESTS = 64
# Hottest prefixes reported, and the token ids of each one's start sent for a text preview.
TOP_PREFIXES = 10
PREVIEW_TOKENS = 48
# Radix nodes visited looking for hot prefixes: bounds the time a snapshot takes on a huge cache.
MAX_SCANNED_NODES = 50_000


class RequestSnapshot(msgspec.Struct):
    """One request in the engine: ``state`` "running" (some sample runs) or "waiting"; token
    counts summed over its samples' outputs (the prompt counted once)."""

    request_id: str
    state: str
    arrival_time: float
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_samples: int = 1
    priority: int = 0
    adapter: str | None = None
    tenant: str = "default"
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None


class PrefixSnapshot(msgspec.Struct):
    """A hot prefix of the radix tree: the longest cached path whose hits all went on to its
    last block (extending it loses hits). ``hash`` names it without its content;
    ``preview_token_ids`` is its start, None for a salted (private) prefix."""

    hash: str
    num_tokens: int
    hits: int
    referenced: bool = False  # a running request holds its last block
    adapter: str | None = None
    salted: bool = False
    preview_token_ids: list[int] | None = None


class TierSnapshot(msgspec.Struct):
    """One KV tier below the device pool: blocks and bytes it holds (None where it cannot tell
    without I/O, e.g. a shared Redis) and its capacity in bytes."""

    name: str
    num_blocks: int | None = None
    used_bytes: int | None = None
    capacity_bytes: int | None = None


class EngineSnapshot(msgspec.Struct, array_like=True, omit_defaults=True):
    """The engine at ``time`` (``time.time()``): its requests, KV blocks (``free`` in the pool,
    ``cached``: in the prefix cache and held by no request, ``used``: held by requests), tiers,
    hot prefixes, live counts per priority and adapter, and where it runs (``kernel``: the CPU
    kernel choice). An array on the wire (the utility result's one array-like type, beside its
    dict); the structs inside are maps, so ``msgspec.to_builtins`` gives named fields."""

    time: float
    num_running: int
    num_waiting: int
    requests: list[RequestSnapshot]
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_prefix_cache_blocks: int = 0  # blocks in the prefix cache, held by requests or not
    prefixes: list[PrefixSnapshot] = []
    tiers: list[TierSnapshot] = []
    # "running"/"waiting" -> priority (as text) or adapter name ("" for the base model) -> requests
    by_priority: dict[str, dict[str, int]] = {}
    by_adapter: dict[str, dict[str, int]] = {}
    device: str = ""
    device_name: str = ""
    kernel: dict[str, str] = {}
    policy: str = "fcfs"
    sleeping: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0


def engine_snapshot(core: EngineCore, max_requests: int = MAX_LISTED_REQUESTS,
                    top_prefixes: int = TOP_PREFIXES) -> EngineSnapshot:
    """The snapshot of ``core`` (called between steps, on request only)."""
    s, kv, cfg = core.scheduler, core.kv, core.config
    requests, by_priority, by_adapter = _requests(s.running, s.waiting, max_requests)
    pool_free = kv.pool.num_free
    cached = kv.cache.num_evictable if kv.cache is not None else 0
    return EngineSnapshot(
        time=time.time(), num_running=len(s.running), num_waiting=len(s.waiting), requests=requests,
        num_blocks=kv.num_blocks, block_size=kv.block_size, num_free_blocks=pool_free,
        num_cached_blocks=cached, num_used_blocks=kv.num_blocks - pool_free - cached,
        num_prefix_cache_blocks=kv.cache.num_cached if kv.cache is not None else 0,
        prefixes=hot_prefixes(kv.cache, top_prefixes) if kv.cache is not None else [],
        tiers=_tiers(core), by_priority=by_priority, by_adapter=by_adapter,
        device=cfg.device, device_name=device_name(cfg.device), kernel=kernel_choice(cfg.device),
        policy=cfg.scheduler.policy, sleeping=core.sleeping, max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens)


def _requests(running, waiting, limit: int) -> tuple[list[RequestSnapshot], dict, dict]:
    """Requests of the running and waiting sequences (a request counts once, as running if any
    of its samples runs), the first ``limit`` listed; counts per priority and adapter."""
    listed: dict[str, RequestSnapshot] = {}
    seen: dict[str, str] = {}  # request id -> state
    by_priority: dict[str, dict[str, int]] = {"running": {}, "waiting": {}}
    by_adapter: dict[str, dict[str, int]] = {"running": {}, "waiting": {}}
    for state, seqs in (("running", running), ("waiting", sorted(waiting, key=_arrival))):
        for seq in seqs:
            req = seq.request
            snap = listed.get(req.request_id)
            if snap is not None:
                snap.num_output_tokens += seq.num_output_tokens
                snap.num_samples += 1
                continue
            if req.request_id in seen:
                continue
            seen[req.request_id] = state
            adapter = req.lora_request.lora_name if req.lora_request is not None else ""
            _count(by_priority[state], str(req.priority))
            _count(by_adapter[state], adapter)
            if len(listed) < limit:
                listed[req.request_id] = _request(seq, state, adapter or None)
    return list(listed.values()), by_priority, by_adapter


def _arrival(seq: Sequence) -> float:
    return seq.request.arrival_time


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _request(seq: Sequence, state: str, adapter: str | None) -> RequestSnapshot:
    req = seq.request
    return RequestSnapshot(
        request_id=req.request_id, state=state, arrival_time=req.arrival_time,
        num_prompt_tokens=seq.num_prompt_tokens, num_computed_tokens=seq.num_computed_tokens,
        num_output_tokens=seq.num_output_tokens, priority=req.priority, adapter=adapter, tenant=req.tenant,
        num_cached_tokens=req.num_cached_tokens, num_preemptions=req.metrics.num_preemptions,
        first_token_time=req.metrics.first_token_time)


# ---- the radix tree's hot prefixes ----------------------------------------------------------

def hot_prefixes(cache: RadixCache, top: int) -> list[PrefixSnapshot]:
    """The ``top`` prefixes with the most hits (ties: the longer first). A prefix ends at a node
    none of whose children had as many hits: every hit on it went on to its last block, so a
    system prompt shared by many requests shows as one prefix of its full length."""
    candidates: list[tuple[int, int, RadixNode]] = []
    for node in itertools.islice(cache.nodes(), MAX_SCANNED_NODES):
        if node.hit_count > 0 and all(c.hit_count < node.hit_count for c in node.children.values()):
            candidates.append((node.hit_count, _depth(node), node))
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    refs = cache.pool.ref_counts
    return [_prefix(node, depth * cache.block_size, hits, refs[node.block] > 0)
            for hits, depth, node in candidates[:top]]


def _depth(node: RadixNode) -> int:
    depth = 0
    while node.parent is not None:
        depth, node = depth + 1, node.parent
    return depth


def _path(node: RadixNode) -> tuple[list[RadixNode], Hashable]:
    """The nodes from the root's child down to ``node``, and the tree's namespace."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path, node.key[0] if node.key else None


def _prefix(node: RadixNode, num_tokens: int, hits: int, referenced: bool) -> PrefixSnapshot:
    path, namespace = _path(node)
    salted = isinstance(namespace, tuple)  # (adapter, salt): see Request.cache_namespace
    lora = namespace[0] if salted else namespace
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8)
    for n in path:
        digest.update(repr(n.key).encode())
    preview = None
    if not salted:
        preview = list(itertools.islice(itertools.chain.from_iterable(n.key for n in path), PREVIEW_TOKENS))
    return PrefixSnapshot(hash=digest.hexdigest(), num_tokens=num_tokens, hits=hits, referenced=referenced,
                          adapter=getattr(lora, "lora_name", None), salted=salted, preview_token_ids=preview)


# ---- tiers, device, kernels -----------------------------------------------------------------

def _tiers(core: EngineCore) -> list[TierSnapshot]:
    store = core.kv_store
    if store is None:
        return []
    out = []
    for tier in store.tiers:
        blocks = len(tier) if hasattr(tier, "__len__") else None
        out.append(TierSnapshot(tier.name, blocks, getattr(tier, "used", None), getattr(tier, "capacity", None)))
    return out


@functools.lru_cache(maxsize=None)
def device_name(device: str) -> str:
    """A readable name of the device: the GPU's, or the CPU model from /proc/cpuinfo."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def kernel_choice(device: str) -> dict[str, str]:
    """Which CPU kernels run (``kernels.select``): the level, its library variant and why; on a
    GPU the CPU kernels do not serve the model, and the answer says so."""
    from pagoda.kernels import select

    if device.startswith("cuda"):
        return {"level": "cuda", "variant": "gpu", "reason": "the model runs on the GPU"}
    if not select.kernels_enabled():
        return {"level": "off", "variant": "torch", "reason": f"{select.KERNELS_VAR}=0"}
    try:
        choice = select.isa()
        gemm = select.gemm_mode()
    except ValueError as exc:
        return {"level": "error", "variant": "torch", "reason": str(exc)}
    return {"level": choice.level, "variant": choice.variant, "reason": choice.reason, "gemm": gemm}
