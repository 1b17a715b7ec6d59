"""Token sampling: penalties, min_tokens, temperature, top-k, top-p, min-p, per-request seeds
and logprobs, vectorised over the rows of a step.

The sampling pipeline. Every distribution pagoda samples from goes through the same ordered
steps, in one place, for all three users: ordinary sampling (``Sampler``), draft-model
proposals (``spec_decode.draft_model``) and draft verification (``executor.rejection``).
Speculative decoding is exact only while the three agree, so none of them has steps of its own.

  ``adjust_logits(logits, rows)`` (every row, greedy ones included):
    0. ``allowed_token_ids``: every other token's logit -inf; ``bad_words``: a word's last token
       -inf where the output ends with the tokens before it; ``logit_bias``: each listed token's
       bias added to its logit (OpenAI's "before sampling")
    1. penalties: repetition (prompt + output), presence and frequency (output)
    2. the grammar's token bitmask (structured output): disallowed tokens -> -inf;
       ``min_tokens``: stop and EOS ids suppressed until the row has produced enough (unless the
       grammar allows nothing else: then the grammar wins)
    3. ``finite_logits``: NaN -> -inf, +inf -> largest finite
  then greedy rows take the argmax; random rows continue with
  ``sampling_probs(logits, rows)``:
    4. temperature, top-k, top-p, min-p (``process_logits``)
    5. ``safe_probs``: softmax, or a point mass on the argmax for a degenerate row
  and draw by the exponential race (``exponential_race``).

``sample_tokens`` runs the steps and the draw for a batch of rows; ``sample_row`` builds the
per-row state (``SampleRow``) they read, from a sequence.

Random rows draw by the exponential race ``argmax(p / q)`` with ``q ~ Exp(1)``, which samples
exactly from ``p``. A seeded request draws its ``q`` from its own generator, so its tokens do not
depend on what else is in the batch.

Hostile but representable values (a ``top_k`` past the vocabulary, a ``top_p`` that underflows
float32, a repetition penalty near zero) must not turn a row into NaN/inf: penalties are
clamped, the most likely token always survives top-p/min-p, and a row whose distribution is
still degenerate samples its argmax (``safe_probs``). Rows that are well-formed are untouched,
so the sampled distribution (and speculative decoding's exactness) is unchanged for them.
"""
from __future__ import annotations

import collections.abc
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from pagoda.kernels import fused as cpu_fused
from pagoda.outputs import Logprobs
from pagoda.sampling_params import SamplingParams
from pagoda.step import SeqStepResult
from pagoda.transfer import to_device

if TYPE_CHECKING:
    from pagoda.request import Sequence as Seq

# Penalties are clamped so that ``logit / repetition_penalty`` and ``count * frequency_penalty``
# stay finite in float32 for any sane logit (|x| < 1e8), keeping the order of penalised logits.
MIN_PENALTY_SCALE = 1e-30
MAX_PENALTY_SCALE = 1e30
# Any Python int is a valid seed: seeds wrap modulo 2**64 (``generator_seed``).
SEED_MODULUS = 2**64


def generator_seed(seed: int) -> int:
    """What a sample's generator is seeded with for the sample seed ``seed`` (modulo 2**64):
    torch's CPU generator keeps only the low 32 bits of its seed, so seeds that differ only above
    them drew alike (1 and 2**32 + 1); a seed below 2**32 is kept as it is, a larger one is
    hashed down to 32 bits (splitmix64's finalizer), so such seeds draw apart."""
    seed %= SEED_MODULUS
    if seed < 2**32:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) % SEED_MODULUS
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % SEED_MODULUS
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % SEED_MODULUS
    return (z ^ (z >> 31)) & 0xFFFFFFFF


@dataclass
class SampleRow:
    """What the sampler needs to know about one logits row."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]  # a list, or ``OutputTokens`` (no copy)
    stop_ids: tuple[int, ...]  # ids suppressed until min_tokens is reached
    # A grammar's allowed tokens (int32 words, bit t % 32 of word t // 32), or None: unconstrained.
    bitmask: torch.Tensor | None = None
    # A grammar whose mask is deferred (structured_output.manager.DeferredMask): the row samples
    # unmasked, and samples again under the mask only if the grammar refuses the token
    # (``resample_refused``; the object's ``allows(token)``, ``rows()`` and ``fill_many``).
    grammar: Any = None


class OutputTokens(collections.abc.Sequence):
    """``ids[start:end] + extra`` without copying ``ids``: a sequence's output tokens as they are
    when its row is made (``end``: later appends are not seen), then ``extra`` (drafts counted
    as output already). Copying the output each step made every step cost its length, so a
    generation's host work grew with the square of its length; most rows only ask ``len``."""

    __slots__ = ("ids", "start", "end", "extra")

    def __init__(self, ids: list[int], start: int, end: int | None = None, extra: Sequence[int] = ()) -> None:
        self.ids, self.start, self.extra = ids, start, extra
        self.end = len(ids) if end is None else end

    def __len__(self) -> int:
        return self.end - self.start + len(self.extra)

    def __getitem__(self, index):  # (rare: the list does the indexing)
        return self.tolist()[index]

    def __iter__(self):
        yield from itertools.islice(self.ids, self.start, self.end)
        yield from self.extra

    def tolist(self) -> list[int]:
        return self.ids[self.start:self.end] + list(self.extra)

    def __add__(self, other: Iterable[int]) -> list[int]:
        return self.tolist() + list(other)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"OutputTokens({self.tolist()!r})"


class SeedGenerators:
    """The random generators of seeded requests, one per sample, keyed by (request id, sample
    index): created from the seed on first use (sample ``i`` of seed ``s`` draws from
    ``generator_seed(s + i)``) and dropped when the request finishes. A seeded sample's draws thus
    depend on nothing else in the batch; the draft model proposer shares these generators with
    the target's sampler, so a seeded request draws from one stream either way."""

    def __init__(self) -> None:
        self._generators: dict[tuple[str, int], torch.Generator] = {}

    def get(self, request_id: str, index: int, seed: int | None) -> torch.Generator | None:
        """The sample's generator; None for an unseeded request (it draws from the default)."""
        if seed is None:
            return None
        key = (request_id, index)
        gen = self._generators.get(key)
        if gen is None:
            gen = self._generators[key] = torch.Generator()
            gen.manual_seed(generator_seed(int(seed) + index))
        return gen

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' generators (a request id may then be reused)."""
        ids = set(request_ids)
        if ids and self._generators:
            for key in [k for k in self._generators if k[0] in ids]:
                del self._generators[key]

    def __len__(self) -> int:
        return len(self._generators)


def sample_row(seq: "Seq", generators: SeedGenerators, index: int | None = None,
               drafts: Sequence[int] = ()) -> SampleRow:
    """The sampler row of ``seq``'s next token: sample ``index`` (default: the sequence's own;
    a prompt forking into ``n`` samples has one row per sample), with ``drafts`` counted as
    output already (a position after accepted drafts)."""
    index = seq.sample_index if index is None else index
    output = OutputTokens(seq.token_ids, seq.num_prompt_tokens, extra=tuple(drafts))
    return SampleRow(seq.params, generators.get(seq.request_id, index, seq.params.seed),
                     seq.request.prompt_token_ids, output,
                     seq.request.eos_token_ids + tuple(seq.params.stop_token_ids or ()))


@dataclass
class SamplerOutput:
    token_ids: list[int]
    token_logprobs: list[float] | None  # per row, the sampled token's logprob (when asked)
    logprobs: list[Logprobs | None]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Repetition (prompt + output, HF style), presence and frequency (output) penalties in place."""
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return
    vocab = logits.shape[1]
    sub = logits[idx]
    counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, sub.device)
    seen = counts > 0
    prompt_seen = _token_counts([rows[i].prompt_token_ids for i in idx], vocab, sub.device) > 0
    p = [rows[i].params for i in idx]
    rep = to_device(torch.tensor([_clamp(x.repetition_penalty, MIN_PENALTY_SCALE, MAX_PENALTY_SCALE, 1.0)
                                  for x in p]), sub.device)[:, None]
    pres = to_device(torch.tensor([_clamp(x.presence_penalty, -MAX_PENALTY_SCALE, MAX_PENALTY_SCALE, 0.0)
                                   for x in p]), sub.device)[:, None]
    freq = to_device(torch.tensor([_clamp(x.frequency_penalty, -MAX_PENALTY_SCALE, MAX_PENALTY_SCALE, 0.0)
                                   for x in p]), sub.device)[:, None]
    repeated = seen | prompt_seen
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(repeated, penalised, sub)
    sub = sub - freq * counts - pres * seen.float()
    logits[idx] = finite_logits(sub)


def _clamp(value: float, lo: float, hi: float, nan: float) -> float:
    """A penalty the float32 arithmetic can carry: within ``[lo, hi]``, ``nan`` for NaN (an
    infinite penalty times a zero count would otherwise make NaN)."""
    value = float(value)
    if value != value:
        return nan
    return min(max(value, lo), hi)


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN becomes -inf (never chosen) and +inf the largest finite value, so ``argmax`` and
    ``softmax`` of a row stay meaningful."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max,
                            neginf=float("-inf"))


def _token_counts(token_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        # Padding goes to an extra column that is dropped afterwards.
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for i, tokens in enumerate(token_lists):
            if tokens:
                padded[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
        counts.scatter_add_(1, to_device(padded, device), torch.ones_like(padded, dtype=counts.dtype, device=device))
    return counts[:, :vocab]


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """``SamplingParams.logit_bias`` added in place: one scatter-add for all rows. A bias of -100
    bans a token in practice, yet a grammar's -inf (applied after) still wins over +100."""
    biased = [(i, _bias_tensors(r.params)) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return
    device = logits.device
    rows_t = to_device(torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, (ids, _) in biased]), device)
    ids_t = to_device(torch.cat([ids for _, (ids, _) in biased]), device)
    values = to_device(torch.cat([vals for _, (_, vals) in biased]).to(logits.dtype), device)
    inside = ids_t < logits.shape[1]  # the front end refuses others: a backstop for direct callers
    logits.index_put_((rows_t[inside], ids_t[inside]), values[inside], accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """``SamplingParams.allowed_token_ids`` in place: every other token of the row -inf (one
    masked fill for all rows that have a list)."""
    limited = [(i, _allowed_tensor(r.params)) for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not limited:
        return
    keep = torch.zeros(len(limited), logits.shape[1], dtype=torch.bool)
    for k, (_, ids) in enumerate(limited):
        keep[k, ids[ids < logits.shape[1]]] = True  # the front end refuses others
    index = to_device(torch.tensor([i for i, _ in limited]), logits.device)
    logits[index] = logits[index].masked_fill(~to_device(keep, logits.device), float("-inf"))


def apply_bad_words(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """``SamplingParams.bad_words`` in place (their token ids, ``bad_words_token_ids``): for each
    spelling, its last token -inf in a row whose output ends with the spelling's other tokens (a
    one-token word always), as vLLM bans them."""
    banned: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        for word in row.params.bad_words_token_ids or ():
            head = len(word) - 1
            if head == 0 or (head <= len(row.output_token_ids) and _tail(row.output_token_ids, head) == word[:-1]):
                banned.append((i, word[-1]))
    if banned:
        where = to_device(torch.tensor(banned), logits.device)
        inside = where[:, 1] < logits.shape[1]
        logits[where[inside, 0], where[inside, 1]] = float("-inf")


def _tail(tokens: Sequence[int], k: int) -> list[int]:
    """The last ``k`` (>= 1) tokens of a list or ``OutputTokens``, without copying the rest."""
    if isinstance(tokens, OutputTokens):
        extra = list(tokens.extra)
        if k <= len(extra):
            return extra[-k:]
        return tokens.ids[max(tokens.start, tokens.end - (k - len(extra))):tokens.end] + extra
    return list(tokens[-k:])


def _allowed_tensor(params: SamplingParams) -> torch.Tensor:
    """A request's allowed ids as a CPU tensor, kept on its params as ``_bias_tensors`` keeps the
    bias (rebuilt when the list is replaced)."""
    allowed = params.allowed_token_ids
    cached = params.__dict__.get("_allowed_tensor")
    if cached is None or cached[0] is not allowed:
        cached = params.__dict__["_allowed_tensor"] = (allowed, torch.tensor(allowed, dtype=torch.long))
    return cached[1]


def _bias_tensors(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's bias map as (ids, values) CPU tensors, made once and kept on its params (a map
    of up to 1024 entries would otherwise be converted at every step). Rebuilt when the map is
    replaced (``validate`` builds a new one); msgspec and ``clone`` copy fields only."""
    bias = params.logit_bias or {}
    cached = params.__dict__.get("_logit_bias_tensors")
    if cached is None or cached[0] is not bias:
        cached = (bias, torch.tensor(list(bias.keys()), dtype=torch.long),
                  torch.tensor(list(bias.values()), dtype=torch.float32))
        params.__dict__["_logit_bias_tensors"] = cached
    return cached[1], cached[2]


def apply_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            ids = [t for t in row.stop_ids if 0 <= t < logits.shape[1]]
            if ids and row.bitmask is not None:
                kept = logits[i].clone()
                kept[ids] = float("-inf")
                if bool(torch.isfinite(kept).any()):  # else the grammar allows only stop tokens
                    logits[i] = kept
            elif ids:
                logits[i, ids] = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, words]`` int32 bitmask -> ``[rows, vocab]`` bool (True: allowed)."""
    from pagoda.structured_output.bitmask import unpack_bitmask as unpack

    return unpack(bitmask, vocab)


def apply_bitmasks(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Structured output: tokens a row's grammar does not allow become -inf, in place (one
    fused pass over the rows: structured_output.bitmask)."""
    from pagoda.structured_output.bitmask import apply_bitmask_

    idx = [i for i, r in enumerate(rows) if r.bitmask is not None]
    if not idx:
        return
    if len(idx) == len(rows):
        apply_bitmask_(logits, torch.stack([rows[i].bitmask for i in idx]))  # type: ignore[misc]
        return
    # Some rows unconstrained: all-ones rows for them, so the pass stays in place (no copies).
    first = rows[idx[0]].bitmask
    masks = torch.full((len(rows), first.shape[-1]), -1, dtype=torch.int32)  # type: ignore[union-attr]
    masks[idx] = torch.stack([rows[i].bitmask for i in idx])  # type: ignore[misc]
    apply_bitmask_(logits, masks)


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p: the distribution a request samples from, as logits
    (masked entries are -inf). Rows are all non-greedy."""
    device = logits.device
    temps = to_device(torch.tensor([p.temperature for p in params], dtype=logits.dtype), device)
    logits = logits / temps[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    min_p = [min(float(p.min_p), 1.0) if p.min_p > 0 else 0.0 for p in params]
    if any(m > 0 for m in min_p):
        probs = logits.softmax(-1)
        # min_p <= 1 keeps the most likely token(s): the floor never exceeds the maximum.
        floor = to_device(torch.tensor(min_p, dtype=probs.dtype), device)[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    # A top_k past the vocabulary (even past int64) means no top-k.
    ks = to_device(torch.tensor([k if 0 < k < vocab else vocab for k in top_k]), logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    # top_p = 1 keeps everything (rounding in the cumulative sum must not drop the tail).
    ps = to_device(torch.tensor([p if p < 1.0 else float("inf") for p in top_p], dtype=logits.dtype),
                   logits.device)[:, None]
    probs = sorted_logits.softmax(-1)
    # Drop a token when the tokens ranked above it already reach top_p. The first always stays,
    # also when a tiny top_p underflows to 0 in float32.
    before = probs.cumsum(-1) - probs
    sorted_logits = sorted_logits.masked_fill((before >= ps) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def safe_probs(logits: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)``, except that a row with no usable distribution (NaN, all masked)
    becomes a point mass on ``fallback``'s argmax (the row's greedy token). No host sync."""
    probs = finite_logits(logits).softmax(-1)
    bad = ~(torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0))
    best = finite_logits(fallback).argmax(-1, keepdim=True)
    point = torch.zeros_like(probs).scatter_(1, best, 1.0)
    return torch.where(bad[:, None], point, probs)


def adjust_logits(logits: torch.Tensor, rows: list[SampleRow], owned: bool = False) -> torch.Tensor:
    """Steps 0-3 of the pipeline (logit bias, penalties, grammar bitmask and min_tokens, finite
    values): what greedy rows take the argmax of and random rows go on from. Works on a float32
    copy of ``logits`` unless the caller hands the tensor over (``owned``: it is not read again),
    saving a copy per step."""
    logits = logits.float() if owned else logits.float().clone()
    if any(r.params.edits_logits for r in rows):
        apply_allowed_token_ids(logits, rows)
        apply_bad_words(logits, rows)
        apply_logit_bias(logits, rows)
    if any(r.params.needs_penalties for r in rows):
        apply_penalties(logits, rows)
    apply_bitmasks(logits, rows)
    apply_min_tokens(logits, rows)
    return finite_logits(logits)


def sampling_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Steps 4-5 of the pipeline for random rows of ``adjust_logits``' result: the
    distribution each row samples from (never NaN)."""
    return safe_probs(process_logits(logits, [r.params for r in rows]), logits)


def sample_tokens(logits: torch.Tensor, rows: list[SampleRow],
                  default: torch.Generator | None) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """One token per row of adjusted ``logits``: the argmax for greedy rows, a draw from
    ``sampling_probs`` for the others (seeded rows from their own generator, the rest from
    ``default``). Returns the tokens, the random rows' indices and their distributions."""
    tokens = logits.argmax(-1)
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = draws = None
    if random:
        index = _index(random, logits.device)
        probs = sampling_probs(logits.index_select(0, index), [rows[i] for i in random])
        draws = exponential_draws(probs, [rows[i].generator for i in random], default)
        tokens.index_copy_(0, index, (probs / draws).argmax(-1))
    if any(r.grammar is not None for r in rows):  # deferred grammar masks: fix refused tokens
        resample_refused(logits, rows, tokens, random, probs, draws)
    return tokens, random, probs


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """``rows`` as an index tensor on ``device``, sent without waiting for the device (indexing a
    CUDA tensor with a Python list copies the list there and waits for the stream)."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]`` (a copy) without a stream sync."""
    return t.index_select(0, _index(rows, t.device))


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None],
                     default: torch.Generator | None) -> torch.Tensor:
    """One exact sample per row of ``probs``; seeded rows use their own generator."""
    return (probs / exponential_draws(probs, generators, default)).argmax(-1)


def exponential_draws(probs: torch.Tensor, generators: list[torch.Generator | None],
                      default: torch.Generator | None) -> torch.Tensor:
    """The race's ``q ~ Exp(1)``, shaped like ``probs``; seeded rows from their own generator."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        drawn = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=default)
        if len(unseeded) == len(generators):
            q = drawn
        else:
            q.index_copy_(0, _index(unseeded, probs.device), drawn)
    for i, g in enumerate(generators):
        if g is not None:
            q[i] = to_device(torch.empty(probs.shape[1]).exponential_(generator=g), probs.device)
    return q


# ---- deferred grammar masks ---------------------------------------------------------------
# Sample first, compute the mask only for a token the grammar refuses.
#
# A constrained row whose mask is deferred (``SampleRow.grammar``, chosen by
# ``manager.DeferPolicy``) goes through the sampling pipeline without a mask. Then each sampled
# token is checked against the grammar (one matcher call, ``allows``); a token it accepts is kept,
# and only for the rows it refuses is the mask computed (all at once) and the token drawn again
# from the masked distribution, **with the same random draw** ``q``.
#
# Why the result is exactly the masked path's (the proof the tests check statistically):
#
# * Greedy rows. Let ``t = argmax(l)`` over the vocabulary ``V`` (first index on ties). If ``t``
#   is allowed (``t`` in ``A``), then ``l[t] >= l[a]`` for every ``a`` in ``A``, and no ``a < t``
#   reaches ``l[t]`` (``t`` is the first maximum of all of ``V``), so ``t`` is also the first
#   maximum over ``A``: the masked argmax. If ``t`` is refused, the masked argmax is computed.
#
# * Random rows without truncation. The pipeline samples by the exponential race
#   ``t = argmax_v p[v] / q[v]`` with ``q[v] ~ Exp(1)`` independent, which draws ``t ~ p``. The
#   masked path races the same way over ``p_A`` (``p`` restricted to ``A`` and renormalised:
#   temperature and penalties commute with the mask, and without top-k / top-p / min-p nothing
#   else depends on it), i.e. over ``p[a] / p(A)`` for ``a`` in ``A``. For any fixed ``q``, if
#   the unmasked winner ``t`` is in ``A`` then ``p[t] / q[t] >= p[a] / q[a]`` for all ``a`` in
#   ``A``, and dividing every score by the same ``p(A)`` keeps the order: ``t`` also wins the
#   masked race. If ``t`` is not in ``A``, the masked race is run with the same ``q`` (over the
#   scores ``p[a] / q[a]`` already computed: the common factor ``1 / p(A)`` changes no argmax). So for
#   every draw ``q`` the token equals the masked path's token, and its law is the masked one:
#   ``P(t = a) = p[a] / p(A)`` for ``a`` in ``A``. (Equivalently, as a rejection scheme: accept
#   ``t ~ p`` with probability ``p(A)``, else draw from ``p_A``; ``P(a) = p[a] + (1 - p(A)) p[a] /
#   p(A) = p[a] / p(A)``; reusing ``q`` is what makes the second draw the conditional one.)
#   Seeded requests therefore draw the same number of random numbers as before and get the same
#   tokens (up to float rounding of the softmax normalisation).
#
# * Rows with top-k, top-p or min-p truncate the masked distribution, which is not the truncated
#   distribution masked; rows still under ``min_tokens`` suppress stop tokens depending on what the
#   grammar allows: neither defers (they keep vLLM's semantics: mask, then truncate).
#
# Logprobs are unaffected: pagoda reports the logprobs of the raw logits, before any processing.


def resample_refused(logits: torch.Tensor, rows: list[SampleRow], tokens: torch.Tensor, random: list[int],
                     probs: torch.Tensor | None, draws: torch.Tensor | None) -> list[int]:
    """For the deferred rows of ``rows`` whose token in ``tokens`` the grammar refuses: compute
    their masks and replace the token (in place) by the masked path's, reusing ``draws`` (the
    race's ``q`` of the ``random`` rows, whose distributions are ``probs``). ``logits`` are the
    adjusted logits the tokens came from, without the deferred rows' masks. Returns the refused
    rows' indices. (``probs`` stays the unmasked distributions: only the token is the masked
    path's.)"""
    from pagoda.structured_output.bitmask import apply_bitmask_

    deferred = [i for i, r in enumerate(rows) if r.grammar is not None]
    sampled = tokens[deferred].tolist()
    refused = [i for i, t in zip(deferred, sampled) if not rows[i].grammar.allows(t)]
    if not refused:
        return refused
    unique: dict[int, Any] = {id(rows[i].grammar): rows[i].grammar for i in refused}
    type(rows[refused[0]].grammar).fill_many(list(unique.values()))  # one backend call for all
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


def plain_greedy(row: SampleRow) -> bool:
    """The row's token is the argmax of its finite logits: greedy, and nothing of the pipeline
    (logprobs, penalties, logit bias, a grammar, a pending ``min_tokens``) changes them."""
    return row.bitmask is None and row.grammar is None and plain_greedy_params(row.params, len(row.output_token_ids))


def plain_greedy_params(p: SamplingParams, num_output_tokens: int) -> bool:
    """``plain_greedy`` of an unconstrained row (no bitmask, no grammar) with these params and
    ``num_output_tokens`` output tokens so far, asked before (or instead of) building the row."""
    return (p.greedy and p.logprobs is None and not p.needs_penalties and not p.edits_logits
            and num_output_tokens >= p.min_tokens)


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = logits.float().log_softmax(-1) if any(want_logprobs) else None
        token_list = self.tokens(logits, rows).tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_list, None, [None] * len(rows))
        return self.gather_logprobs(raw_logprobs, token_list, rows)

    def tokens(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Each row's token as a tensor where ``logits`` are (read by nobody yet: no sync). As
        always, the sampler may write into the logits it is given (the runner passes rows indexed
        out of the step's logits, a copy), sparing one more copy."""
        logits = adjust_logits(logits, rows, owned=True)
        return sample_tokens(logits, rows, self.default_generator(logits.device))[0]

    def sample_from(self, logits: torch.Tensor, row_index: list[int], rows: list[SampleRow]) -> SamplerOutput:
        """``self(logits[row_index], rows)``, where ``logits`` (the step's, not modified here) is
        read in place when every row is plain greedy: no logprobs, penalties, logit bias, grammar
        or pending ``min_tokens``, so its token is the argmax of its finite logits (on CPU one pass of a C++
        kernel per row instead of a copy, ``nan_to_num`` and ``argmax`` of the whole batch)."""
        if all(plain_greedy(r) for r in rows):
            return SamplerOutput(self.greedy(logits, row_index), None, [None] * len(rows))
        return self(select_rows(logits, row_index), rows)

    @staticmethod
    def greedy(logits: torch.Tensor, row_index: list[int]) -> list[int]:
        """The argmax of each listed row's finite logits (plain greedy rows)."""
        if cpu_fused.serves_greedy(logits):
            return cpu_fused.greedy_tokens(logits, row_index)
        return Sampler.greedy_on_device(logits, row_index).tolist()

    @staticmethod
    def greedy_on_device(logits: torch.Tensor, row_index: list[int]) -> torch.Tensor:
        """``greedy``'s ids as a tensor where the logits are, read by nobody yet (no sync). In the
        logits' own dtype: widening changes no order, and a float copy is a launch and an
        allocation more on the step's host path."""
        if row_index != list(range(logits.shape[0])):
            logits = logits.index_select(0, _index(row_index, logits.device))
        return finite_logits(logits).argmax(-1)

    def default_generator(self, device: torch.device) -> torch.Generator | None:
        """What unseeded rows draw from: this sampler's own generator on CPU, torch's default
        on other devices (a CPU generator cannot fill a CUDA tensor)."""
        return self.generator if device.type == "cpu" else None

    def gather_logprobs(self, raw: torch.Tensor, tokens: list[int], rows: list[SampleRow]) -> SamplerOutput:
        """``tokens`` with their logprobs (and each row's top-k) from log-softmaxed ``raw``."""
        chosen = raw.gather(1, to_device(torch.tensor(tokens), raw.device)[:, None]).squeeze(1).tolist()
        k = max(r.params.logprobs or 0 for r in rows)
        top_vals, top_ids = raw.topk(k, dim=-1) if k else (None, None)
        out: list[Logprobs | None] = []
        for i, row in enumerate(rows):
            if row.params.logprobs is None:
                out.append(None)
                continue
            entry: Logprobs = {tokens[i]: chosen[i]}
            n = row.params.logprobs
            if n:
                entry.update(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
            out.append(entry)
        return SamplerOutput(tokens, chosen, out)


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> tuple[list[Logprobs], list[int]]:
    """For prompt positions: the logprob of the actual next prompt token and the top ``k``, and
    that token's rank (1 + the number of other tokens at least as likely, as vLLM counts it)."""
    raw = logits.float().log_softmax(-1)
    chosen_t = raw.gather(1, to_device(torch.tensor(next_tokens), raw.device)[:, None])
    ranks = (raw >= chosen_t).sum(-1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    top_vals, top_ids = raw.topk(k, dim=-1) if k else (None, None)
    out = []
    for i, token in enumerate(next_tokens):
        entry: Logprobs = {token: chosen[i]}
        if k:
            entry.update(zip(top_ids[i].tolist(), top_vals[i].tolist()))
        out.append(entry)
    return out, ranks


class DeviceTokens:
    """One token per sequence, sampled on the device and not yet read by the host (async
    scheduling): the copy to host memory is queued right after the sampling, so waiting for it
    (``results``) waits for this step's work only, never for the steps queued after it; the next
    step fills its placeholder rows from ``tokens`` on the device (``row_of``)."""

    def __init__(self, tokens: torch.Tensor, seq_ids: list[str]) -> None:
        self.tokens = tokens
        self.seq_ids = seq_ids
        self.row_of = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        self.resolved = False
        self._done: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = tokens

    def results(self) -> dict[str, SeqStepResult]:
        """Sequence id -> its ``SeqStepResult`` (waits for the copy to the host)."""
        if self._done is not None:
            self._done.synchronize()
        self.resolved = True
        return {seq_id: SeqStepResult([t]) for seq_id, t in zip(self.seq_ids, self._host.tolist())}

