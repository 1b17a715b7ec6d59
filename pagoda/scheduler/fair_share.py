"""Fair shares between tenants (who sent a request: an API key, a ``user``, a header).

When requests of more than one tenant are in the engine, each tenant's fair share of the
sequence slots is ``max_num_seqs / tenants`` and of the KV blocks ``num_blocks / tenants``. The
scheduler admits waiting sequences tenant by tenant, the least loaded first; a tenant within its
share whose sequence finds no free slot or block preempts (recompute) the newest sequence of the
tenant furthest over its share; for blocks, only for a sequence whose whole prompt fits in the
tenant's share (``within_block_share``: otherwise such sequences preempt each other before any
makes progress). Optionally (``SchedulerConfig.fair_step_share``, on by default on
CPU) each tenant also decodes at most its share of slots a step, so one tenant's big batch does
not set the time per token of the others. Pure Python.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Literal

from pagoda.request import Sequence

Resource = Literal["seqs", "blocks"]


class TenantLoads:
    """Sequence slots held per tenant during one ``schedule`` call (a sequence still to fork
    into ``n`` samples holds ``n``), and the fair shares of slots and blocks."""

    def __init__(self, running: Iterable[Sequence], tenants: Iterable[str], max_num_seqs: int,
                 num_blocks: int) -> None:
        self.tenants = list(tenants)
        self.seq_share = max_num_seqs / max(len(self.tenants), 1)
        self.block_share = num_blocks / max(len(self.tenants), 1)
        self.seqs: Counter[str] = Counter()
        for seq in running:
            self.seqs[seq.request.tenant] += seq.num_samples

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.request.tenant] += seq.num_samples

    def remove(self, seq: Sequence) -> None:
        self.seqs[seq.request.tenant] -= seq.num_samples

    @property
    def num_slots(self) -> int:
        """Slots held by all running sequences."""
        return sum(self.seqs.values())

    def step_share(self, decodes: list[Sequence]) -> list[Sequence]:
        """The decoding sequences that run this step when each tenant decodes at most its share
        of slots (rounded up): a tenant's least advanced sequences first, so that over steps its
        sequences take turns; the result keeps ``decodes``' order."""
        cap = math.ceil(self.seq_share)
        by_tenant: dict[str, list[Sequence]] = {}
        for seq in decodes:
            by_tenant.setdefault(seq.request.tenant, []).append(seq)
        chosen: set[int] = set()
        for seqs in by_tenant.values():
            ranked = sorted(range(len(seqs)), key=lambda i: (seqs[i].num_output_tokens, i))
            chosen.update(id(seqs[i]) for i in ranked[:cap])
        return [seq for seq in decodes if id(seq) in chosen]

    def within_share(self, tenant: str, more_seqs: int) -> bool:
        """``tenant`` would still hold no more than its share of slots with ``more_seqs`` more."""
        return self.seqs[tenant] + more_seqs <= self.seq_share

    def within_block_share(self, running: Iterable[Sequence], seq: Sequence, block_size: int) -> bool:
        """``seq``'s tenant would hold no more than its share of blocks with ``seq``'s whole
        prompt (its tokens so far) and first new token in the cache, beside its running
        sequences. Only then may it take blocks from another tenant: a sequence that could not
        would be over its share before its first token, so the next tenant could preempt it in
        turn, and prompts larger than a share preempted each other without end."""
        tenant = seq.request.tenant
        held = sum(len(s.block_table) for s in running if s.request.tenant == tenant)
        return held + -(-(seq.num_tokens + 1) // block_size) <= self.block_share

    def over_share(self, running: Iterable[Sequence], resource: Resource, exclude: str) -> str | None:
        """The tenant other than ``exclude`` furthest over its share of ``resource`` (blocks are
        counted from the running sequences' block tables now), or None if none is over."""
        if resource == "seqs":
            load, share = self.seqs, self.seq_share
        else:
            load, share = Counter(), self.block_share
            for seq in running:
                load[seq.request.tenant] += len(seq.block_table)
        over = [(n, t) for t, n in load.items() if t != exclude and n > share]
        return max(over)[1] if over else None


def heaviest_tenant(running: Iterable[Sequence]) -> str:
    """The tenant whose running sequences hold the most KV blocks (then the most sequences):
    the one to preempt from when a running sequence needs a block."""
    blocks: Counter[str] = Counter()
    seqs: Counter[str] = Counter()
    for seq in running:
        blocks[seq.request.tenant] += len(seq.block_table)
        seqs[seq.request.tenant] += seq.num_samples
    return max(blocks, key=lambda t: (blocks[t], seqs[t]))
