"""Deferred grammar masks: sample first, compute the mask only for a token the grammar refuses.

A constrained row whose mask is deferred (``SampleRow.grammar``, chosen by
``manager.DeferPolicy``) goes through the sampling pipeline without a mask. Then each sampled
token is checked against the grammar (one matcher call, ``allows``); a token it accepts is kept,
and only for the rows it refuses is the mask computed (all at once) and the token drawn again
from the masked distribution, **with the same random draw** ``q``.

Why the result is exactly the masked path's (the proof the tests check statistically):

* Greedy rows. Let ``t = argmax(l)`` over the vocabulary ``V`` (first index on ties). If ``t``
  is allowed (``t`` in ``A``), then ``l[t] >= l[a]`` for every ``a`` in ``A``, and no ``a < t``
  reaches ``l[t]`` (``t`` is the first maximum of all of ``V``), so ``t`` is also the first
  maximum over ``A``: the masked argmax. If ``t`` is refused, the masked argmax is computed.

* Random rows without truncation. The pipeline samples by the exponential race
  ``t = argmax_v p[v] / q[v]`` with ``q[v] ~ Exp(1)`` independent, which draws ``t ~ p``. The
  masked path races the same way over ``p_A`` (``p`` restricted to ``A`` and renormalised:
  temperature and penalties commute with the mask, and without top-k / top-p / min-p nothing
  else depends on it), i.e. over ``p[a] / p(A)`` for ``a`` in ``A``. For any fixed ``q``, if
  the unmasked winner ``t`` is in ``A`` then ``p[t] / q[t] >= p[a] / q[a]`` for all ``a`` in
  ``A``, and dividing every score by the same ``p(A)`` keeps the order: ``t`` also wins the
  masked race. If ``t`` is not in ``A``, the masked race is run with the same ``q`` (over the
  scores ``p[a] / q[a]`` already computed: the common factor ``1 / p(A)`` changes no argmax). So for
  every draw ``q`` the token equals the masked path's token, and its law is the masked one:
  ``P(t = a) = p[a] / p(A)`` for ``a`` in ``A``. (Equivalently, as a rejection scheme: accept
  ``t ~ p`` with probability ``p(A)``, else draw from ``p_A``; ``P(a) = p[a] + (1 - p(A)) p[a] /
  p(A) = p[a] / p(A)``; reusing ``q`` is what makes the second draw the conditional one.)
  Seeded requests therefore draw the same number of random numbers as before and get the same
  tokens (up to float rounding of the softmax normalisation).

* Rows with top-k, top-p or min-p truncate the masked distribution, which is not the truncated
  distribution masked; rows still under ``min_tokens`` suppress stop tokens depending on what the
  grammar allows: neither defers (they keep vLLM's semantics: mask, then truncate).

Logprobs are unaffected: pagoda reports the logprobs of the raw logits, before any processing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagoda.executor.sampler import SampleRow


def resample_refused(logits: torch.Tensor, rows: list["SampleRow"], tokens: torch.Tensor, random: list[int],
                     probs: torch.Tensor | None, draws: torch.Tensor | None) -> list[int]:
    """For the deferred rows of ``rows`` whose token in ``tokens`` the grammar refuses: compute
    their masks and replace the token (in place) by the masked path's, reusing ``draws`` (the
    race's ``q`` of the ``random`` rows, whose distributions are ``probs``). ``logits`` are the
    adjusted logits the tokens came from, without the deferred rows' masks. Returns the refused
    rows' indices. (``probs`` stays the unmasked distributions: only the token is the masked
    path's.)"""
    from pagoda.executor.sampler import finite_logits, sampling_probs
    from pagoda.structured_output.bitmask import apply_bitmask_
    from pagoda.structured_output.manager import DeferredMask

    deferred = [i for i, r in enumerate(rows) if r.grammar is not None]
    sampled = tokens[deferred].tolist()
    refused = [i for i, t in zip(deferred, sampled) if not rows[i].grammar.allows(t)]
    if not refused:
        return refused
    unique: dict[int, Any] = {id(rows[i].grammar): rows[i].grammar for i in refused}
    DeferredMask.fill_many(list(unique.values()))
    masks = torch.cat([rows[i].grammar.rows() for i in refused])
    position = {row: j for j, row in enumerate(random)}
    again = [k for k, i in enumerate(refused) if i in position]
    greedy = [k for k, i in enumerate(refused) if i not in position]
    if greedy:  # the masked argmax
        sub = logits[[refused[k] for k in greedy]]
        apply_bitmask_(sub, masks[greedy])
        tokens[[refused[k] for k in greedy]] = finite_logits(sub).argmax(-1)
    if again:
        # The masked race over the unmasked race's scores p / q: the masked distribution is p
        # restricted and renormalised, and a common factor does not change an argmax. A row
        # whose allowed tokens all underflowed in p (or whose p was degenerate) is recomputed
        # the long way: mask the logits, then the whole pipeline (never for a sane row).
        assert probs is not None and draws is not None
        at = [position[refused[k]] for k in again]
        scores = probs[at] / draws[at]
        apply_bitmask_(scores, masks[again])
        best, winner = scores.max(-1)
        tokens[[refused[k] for k in again]] = winner
        slow = [j for j, ok in enumerate((best > MIN_SCORE).tolist()) if not ok]
        if slow:
            ks = [again[j] for j in slow]
            sub = logits[[refused[k] for k in ks]]
            apply_bitmask_(sub, masks[ks])
            sub = finite_logits(sub)
            masked = sampling_probs(sub, [rows[refused[k]] for k in ks])
            slow_at = [at[j] for j in slow]
            tokens[[refused[k] for k in ks]] = (masked / draws[slow_at]).argmax(-1)
    return refused


# Below this best masked race score (p / q), the allowed tokens' probabilities may have lost
# precision to underflow in the unmasked softmax: such a row is recomputed from masked logits.
MIN_SCORE = 1e-30
