"""Verification of speculative proposals: which drafts the target accepts, and its next token.

A sequence proposes ``k`` draft tokens ``x_1..x_k`` drawn from a draft distribution ``q`` (a
point mass for n-gram proposals). The target scored ``k + 1`` positions in one forward pass;
``p_j`` is its processed distribution at position ``j``: the sampling pipeline of
``executor.sampler`` (``adjust_logits``, then ``sampling_probs``), the very steps the ordinary
sampler and the draft model run, with the drafts before ``j`` counted as output. Then, per
position:

* greedy requests accept while the draft equals the target's argmax and emit the argmax at the
  first mismatch (or at position ``k + 1`` when everything was accepted);
* sampling requests accept ``x_j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``; the first
  rejection emits a sample of ``normalize(max(0, p_j - q_j))``; if all are accepted a bonus token
  is drawn from ``p_{k+1}``. Every emitted token is then distributed exactly as the target's.

All random draws of a seeded request come from its own generator, a fixed number per step
(``k`` uniforms and one exponential race), so a seeded run reproduces.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.executor.sampler import SampleRow, adjust_logits, exponential_race, sampling_probs


@dataclass
class DraftRow:
    """One speculating sequence: how the target samples it, and what was proposed (a
    ``Draft``'s token ids and distributions)."""

    row: SampleRow
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None  # [k, vocab]; None is a point mass on each draft token
    # Structured output: the grammar's bitmask at each of the k + 1 positions (the drafts
    # before a position accepted), or None.
    bitmasks: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return len(self.draft_token_ids)


@dataclass
class Verdict:
    """The tokens a sequence emits this step: its accepted drafts, then one target token."""

    token_ids: list[int]
    num_accepted: int


def accept_rule(p_draft: torch.Tensor, q_draft: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Accept ``x`` with probability ``min(1, p(x) / q(x))``; written as ``u * q < p`` so that a
    token the target cannot produce (``p = 0``) is never accepted."""
    return uniforms * q_draft < p_draft


def position_rows(d: DraftRow) -> list[SampleRow]:
    """The sampler row of each of the ``k + 1`` scored positions: position ``j`` has the first
    ``j`` drafts as output already (penalties and min_tokens depend on them)."""
    r = d.row
    return [SampleRow(r.params, r.generator, r.prompt_token_ids, r.output_token_ids + d.draft_token_ids[:j],
                      r.stop_ids, d.bitmasks[j] if d.bitmasks is not None else None) for j in range(d.k + 1)]


def target_logits(logits: torch.Tensor, drafts: list[DraftRow]) -> torch.Tensor:
    """``adjust_logits`` per scored position (``logits`` has ``k + 1`` rows per sequence, in
    order)."""
    return adjust_logits(logits, [row for d in drafts for row in position_rows(d)])


def verify(logits: torch.Tensor, drafts: list[DraftRow], default: torch.Generator | None) -> list[Verdict]:
    """Accept a prefix of each sequence's drafts and pick its next token.

    ``logits``: the target's raw logits, ``k + 1`` consecutive rows per sequence (the last real
    token's position, then one per draft). ``default`` draws for unseeded requests."""
    logits = target_logits(logits, drafts)
    starts = _row_starts(drafts)
    verdicts: list[Verdict | None] = [None] * len(drafts)
    greedy = [i for i, d in enumerate(drafts) if d.row.params.greedy]
    sampled = [i for i, d in enumerate(drafts) if not d.row.params.greedy]
    if greedy:
        best = logits.argmax(-1).tolist()  # one transfer for the whole batch
        for i in greedy:
            verdicts[i] = _verify_greedy(best[starts[i]:starts[i] + drafts[i].k + 1], drafts[i].draft_token_ids)
    if sampled:
        sub = [drafts[i] for i in sampled]
        rows = torch.cat([torch.arange(starts[i], starts[i] + drafts[i].k + 1) for i in sampled])
        raw = logits[rows.to(logits.device)]
        # Steps 4-5 read only the sampling params, the same at every position of a sequence.
        probs = sampling_probs(raw, [d.row for d in sub for _ in range(d.k + 1)])
        for i, v in zip(sampled, rejection_sample(probs, sub, default)):
            verdicts[i] = v
    return verdicts  # type: ignore[return-value]


def _row_starts(drafts: list[DraftRow]) -> list[int]:
    starts, at = [], 0
    for d in drafts:
        starts.append(at)
        at += d.k + 1
    return starts


def _verify_greedy(best: list[int], draft: list[int]) -> Verdict:
    """``best``: the target's argmax at each of the ``k + 1`` positions."""
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return Verdict(draft[:n] + [best[n]], n)


def rejection_sample(probs: torch.Tensor, drafts: list[DraftRow], default: torch.Generator | None) -> list[Verdict]:
    """The rejection scheme for sampling requests. ``probs``: the target's processed
    distributions, ``k + 1`` rows per sequence."""
    starts = _row_starts(drafts)
    accepted = _num_accepted(probs, drafts, starts, default)
    final_rows = []
    for d, start, n in zip(drafts, starts, accepted):
        p = probs[start + n]
        final_rows.append(p if n == d.k else _residual(p, d, n))
    gens = [d.row.generator for d in drafts]
    tokens = exponential_race(torch.stack(final_rows), gens, default).tolist()
    return [Verdict(d.draft_token_ids[:n] + [t], n) for d, n, t in zip(drafts, accepted, tokens)]


def _num_accepted(probs: torch.Tensor, drafts: list[DraftRow], starts: list[int],
                  default: torch.Generator | None) -> list[int]:
    """How many leading drafts each sequence keeps (all ``k`` uniforms are drawn regardless)."""
    rows, ids, q_draft, uniforms = [], [], [], []
    for d, start in zip(drafts, starts):
        rows.extend(range(start, start + d.k))
        ids.extend(d.draft_token_ids)
        q_draft.append(_draft_prob_of_drafts(d))
        uniforms.append(torch.rand(d.k, generator=d.row.generator if d.row.generator is not None else default))
    p_draft = probs[torch.tensor(rows, device=probs.device), torch.tensor(ids, device=probs.device)].cpu()
    ok = accept_rule(p_draft, torch.cat(q_draft), torch.cat(uniforms)).tolist()
    accepted, at = [], 0
    for d in drafts:
        n = 0
        while n < d.k and ok[at + n]:
            n += 1
        accepted.append(n)
        at += d.k
    return accepted


def _draft_prob_of_drafts(d: DraftRow) -> torch.Tensor:
    """``q_j(x_j)`` for each draft (1 for a point mass)."""
    if d.draft_probs is None:
        return torch.ones(d.k)
    ids = torch.tensor(d.draft_token_ids, device=d.draft_probs.device)[:, None]
    return d.draft_probs.float().gather(1, ids)[:, 0].cpu()


def _residual(p: torch.Tensor, d: DraftRow, n: int) -> torch.Tensor:
    """``normalize(max(0, p - q))`` at the first rejected position ``n``."""
    if d.draft_probs is None:
        residual = p.clone()
        residual[d.draft_token_ids[n]] = 0.0
    else:
        residual = (p - d.draft_probs[n].to(p.device, p.dtype)).clamp_min(0.0)
    total = residual.sum()
    # A rejection implies p != q, so the residual has mass; rounding aside, fall back to p.
    return residual / total if total > 0 else p
