"""The background (batch) class: requests that run only on capacity interactive work leaves idle.

A request marked ``background`` (the Batch API marks every line so, whatever the scheduling
policy) is scheduled in a step only when no interactive (non-background) request is in the
engine, running or waiting. When interactive work arrives, the running background sequences
are *paused*: they keep their KV blocks and state and are simply left out of each step; waiting
ones are not admitted. When the interactive work is gone they resume where they stopped (a
paused sequence's output is the one it would have had alone).

Paused sequences never hold up interactive ones: they are the first preempted (recomputed later)
when an interactive sequence needs a KV block, and before a step admits anything, paused
sequences are preempted, newest first, until the sequence slots (``max_num_seqs``) hold the
running and waiting interactive sequences as well as the paused ones.

Starvation is by design: under continuous interactive load a background request progresses only
in the steps with no interactive request at all; a batch's completion window bounds how long its
lines may wait (the lines not run by then end as ``batch_expired``).
"""
from __future__ import annotations

from typing import Iterable

from pagoda.request import Sequence


def seats(seqs: Iterable[Sequence]) -> int:
    """The sequence slots ``seqs`` take: a prompt not yet forked into ``n`` samples takes ``n``."""
    return sum(s.num_samples for s in seqs)


def split_background(running: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """``running`` as (interactive, background), each in its own order."""
    interactive = [s for s in running if not s.request.background]
    return interactive, [s for s in running if s.request.background]
