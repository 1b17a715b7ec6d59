"""A goodness-of-fit check shared by the distribution tests."""
from __future__ import annotations

import math
from collections import Counter
from typing import Hashable


def chi_square(samples: list[Hashable], probs: dict[Hashable, float]) -> tuple[float, int]:
    """Pearson's statistic of ``samples`` against ``probs`` and its degrees of freedom. Cells
    expected fewer than 5 times are pooled, and outcomes outside ``probs`` count against it."""
    n = len(samples)
    counts = Counter(samples)
    stat, dof = 0.0, -1
    pooled_obs, pooled_exp = 0, 0.0
    for outcome, p in probs.items():
        expected = n * p
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(outcome, 0), pooled_exp + expected
            continue
        stat += (counts.get(outcome, 0) - expected) ** 2 / expected
        dof += 1
    pooled_obs += sum(c for o, c in counts.items() if o not in probs)
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    elif pooled_obs:
        stat = math.inf  # an outcome the target gives no probability at all
    return stat, max(dof, 1)


def fits(samples: list[Hashable], probs: dict[Hashable, float]) -> bool:
    """Whether ``samples`` plausibly come from ``probs``: the statistic stays within six
    standard deviations of its mean (a correct sampler fails it far less than once in a
    thousand runs; the tests are seeded, so each run is deterministic)."""
    stat, dof = chi_square(samples, probs)
    return stat < dof + 6 * math.sqrt(2 * dof)
