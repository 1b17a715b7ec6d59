"""Routing policies for pagoda replicas, in pure Python (no Ray import): which replica of a
deployment should run a request.

``round_robin``: the replicas in a fixed order, one after the other.
``least_loaded``: the replica with the fewest requests in flight.
``prefix_affinity``: the replica that most recently ran the longest prefix of this request's
prompt (its radix cache most likely still holds those KV blocks), unless that replica has more
than ``margin`` requests in flight beyond the least loaded one; then the least loaded.

Prompts are compared by chained hashes of fixed-size blocks of their text
(``prefix_hashes``): the i-th hash covers the first ``i + 1`` blocks, so two prompts share
their first ``k`` hashes exactly when they share their first ``k`` blocks. Only full blocks
count, as in the engine's own prefix cache. ``PrefixIndex`` remembers, for each hash, the
replica that last ran a prompt with that prefix (bounded, least recently used out first).
The Ray Serve request router (``router.py``) is a thin adapter over ``Policy``.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from typing import Any, Hashable, Iterable, Sequence

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_affinity")
# Characters per hashed block: about one 16-token KV block of English text.
PREFIX_BLOCK_CHARS = 64
# Only the leading blocks are hashed: enough to tell shared system prompts apart, and it
# bounds the work per request however long the prompt.
MAX_PREFIX_BLOCKS = 256
# Hashes the index keeps (16 bytes of key + a replica id each; a few tens of MB at most).
DEFAULT_INDEX_CAPACITY = 200_000
# prefix_affinity: the preferred replica keeps a request while it has at most this many more
# requests in flight than the least loaded replica.
DEFAULT_PREFIX_AFFINITY_MARGIN = 8


def prefix_hashes(text: str, block_chars: int = PREFIX_BLOCK_CHARS,
                  max_blocks: int = MAX_PREFIX_BLOCKS) -> list[str]:
    """Chained hashes of the full ``block_chars`` blocks of ``text`` (at most ``max_blocks``)."""
    hashes: list[str] = []
    digest = b""
    data = text.encode("utf-8", "surrogatepass")
    step = block_chars  # bytes of UTF-8: stable for equal text, which is all that matters here
    for start in range(0, min(len(data) // step, max_blocks) * step, step):
        digest = hashlib.blake2b(digest + data[start:start + step], digest_size=12).digest()
        hashes.append(digest.hex())
    return hashes


def token_prefix_hashes(token_ids: Sequence[int], block_tokens: int = 16,
                        max_blocks: int = MAX_PREFIX_BLOCKS) -> list[str]:
    """``prefix_hashes`` for a prompt given as token ids (blocks of ``block_tokens`` ids)."""
    hashes: list[str] = []
    digest = b""
    end = min(len(token_ids) // block_tokens, max_blocks) * block_tokens
    for start in range(0, end, block_tokens):
        chunk = ",".join(str(t) for t in token_ids[start:start + block_tokens]).encode()
        digest = hashlib.blake2b(digest + b"t" + chunk, digest_size=12).digest()
        hashes.append(digest.hex())
    return hashes


def request_prefix_hashes(path: str, body: Any) -> list[str]:
    """The prefix hashes of an OpenAI request body (already parsed JSON); ``[]`` when the
    body has no prompt this router understands (the replica will answer what is wrong)."""
    if not isinstance(body, dict):
        return []
    if path.endswith("/chat/completions"):
        return prefix_hashes(_conversation_text(body.get("messages")))
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_token_ids(prompt):
            prompt = prompt[0]  # several prompts: route by the first
        if isinstance(prompt, str):
            return prefix_hashes(prompt)
        if isinstance(prompt, list) and _is_token_ids(prompt):
            return token_prefix_hashes(prompt)
    return []


def _is_token_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _conversation_text(messages: Any) -> str:
    """A conversation as one string whose prefixes follow the messages' order (what the chat
    template renders, up to its markup)."""
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            break
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                              and isinstance(p.get("text"), str))
        parts.append(f"{message.get('role')}\x1f{content if isinstance(content, str) else ''}\x1e")
    return "".join(parts)


class PrefixIndex:
    """Which replica last ran each prompt prefix (by ``prefix_hashes``), LRU-bounded."""

    def __init__(self, capacity: int = DEFAULT_INDEX_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[str, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, hashes: Sequence[str], replicas: Iterable[Hashable]) -> tuple[Hashable | None, int]:
        """The replica among ``replicas`` holding the longest prefix of ``hashes``, and how
        many blocks of it; ``(None, 0)`` when none holds even the first block."""
        live = set(replicas)
        best: Hashable | None = None
        length = 0
        for i, h in enumerate(hashes):
            owner = self._owner.get(h)
            if owner is None:
                break  # chained: nothing longer can match either
            if owner in live:
                best, length = owner, i + 1
        return best, length

    def record(self, hashes: Sequence[str], replica: Hashable) -> None:
        """``replica`` now runs a prompt with these prefixes: it owns all of them."""
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """Drop a replica that went away (its cache went with it)."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]


class Policy:
    """One routing policy over a changing set of replicas.

    ``rank(replicas, load, hashes)`` orders the candidates: the router tries the first group,
    then the next (Ray Serve's ``choose_replicas`` contract: a list of groups, best first;
    within a group the least loaded that has room wins). ``routed`` records where a request
    went; ``load`` maps a replica to its requests in flight."""

    def __init__(self, name: str, margin: int = DEFAULT_PREFIX_AFFINITY_MARGIN,
                 index_capacity: int = DEFAULT_INDEX_CAPACITY) -> None:
        if name not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(ROUTING_POLICIES)}")
        if margin < 0:
            raise ValueError(f"the prefix-affinity margin must be non-negative, got {margin}")
        self.name = name
        self.margin = margin
        self.index = PrefixIndex(index_capacity)
        self._turn = itertools.count()
        # Counters (for logs and tests): requests routed to the replica holding their prefix,
        # and those sent elsewhere because it was too busy.
        self.affinity_hits = 0
        self.affinity_overflows = 0

    def rank(self, replicas: Sequence[Hashable], load: dict[Hashable, int],
             hashes: Sequence[str] = ()) -> list[list[Hashable]]:
        if not replicas:
            return []
        ordered = sorted(replicas, key=str)
        # Each call starts the order at the next replica, so ties (equal loads) rotate
        # instead of always going to the same replica.
        start = next(self._turn) % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        if self.name == "round_robin":
            return [[rotated[0]], rotated[1:]] if len(rotated) > 1 else [rotated]
        by_load = sorted(rotated, key=lambda r: load.get(r, 0))  # stable: ties keep the rotation
        if self.name == "least_loaded" or not hashes:
            return [by_load]
        preferred, _ = self.index.match(hashes, ordered)
        if preferred is None:
            return [by_load]
        rest = [r for r in by_load if r != preferred]
        lightest = load.get(by_load[0], 0)
        if load.get(preferred, 0) - lightest <= self.margin or not rest:
            self.affinity_hits += 1
            return [[preferred], rest] if rest else [[preferred]]
        self.affinity_overflows += 1
        return [rest, [preferred]]

    def routed(self, hashes: Sequence[str], replica: Hashable) -> None:
        if self.name == "prefix_affinity" and hashes:
            self.index.record(hashes, replica)

    def removed(self, replica: Hashable) -> None:
        self.index.forget(replica)
