"""Request datasets for the pagoda serving benchmark.

Three workloads, all deterministic under a seed:

* ``random``: prompts of random tokens with uniformly drawn input/output
  lengths. With a tokenizer, token ids are drawn from the tokenizer's vocab
  (skipping special tokens) and decoded to text. Without one, the ids are
  drawn from ``[10, 1000)`` and the prompt is sent as a list of token ids,
  which the OpenAI completions API accepts; ids below 10 are avoided because
  that is where most vocabularies keep their special tokens, and 1000 stays
  below every realistic vocab size.
* ``prefix``: K random shared prefixes of length L, each followed by about
  M/K random questions; this is the workload that a prefix cache can exploit,
  so it also reports the ideal prefix-hit fraction.
* ``sharegpt:PATH``: the common ShareGPT conversation JSON.

The chat endpoint cannot take token ids, so without a tokenizer random
prompts for chat are built from a fixed word list, one word per requested
token; the real prompt length then comes from the server's ``usage``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

# Token ids used when no tokenizer is available (see module docstring).
NO_TOKENIZER_ID_RANGE = (10, 1000)

# ShareGPT filter bounds, the same as the widely used reference benchmarks,
# so that results are comparable: drop tiny and oversized conversations.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

_HUMAN_ROLES = ("human", "user")
_GPT_ROLES = ("gpt", "assistant", "chatgpt", "model")

# Common short words, used for text prompts when there is no tokenizer.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be "
    "this have from or one had by word but not what all were we when your can "
    "said there use an each which she do how their if will up other about out "
    "many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been "
    "call who oil its now find long down day did get come made may part"
).split()


class TokenizerLike(Protocol):
    """The slice of a Hugging Face tokenizer that the datasets need."""

    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...


@dataclass
class SampleRequest:
    """One benchmark request: what to send and how long it is expected to be.

    ``prompt`` is a string or a list of token ids. ``prompt_len`` is exact
    for token-id prompts and tokenizer-counted prompts, and an estimate
    otherwise (the server's ``usage`` is authoritative at run time).
    """

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    group: int | None = None  # prefix group, for the prefix dataset
    prompt_len_exact: bool = True


@dataclass
class Dataset:
    """A generated workload plus what is known about it up front."""

    name: str
    requests: list[SampleRequest]
    ideal_prefix_hit_fraction: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


def parse_range(spec: str | int | Sequence[int]) -> tuple[int, int]:
    """Parse ``"MIN:MAX"`` (or a single ``"N"``) into an inclusive range."""
    if isinstance(spec, int):
        lo = hi = spec
    elif isinstance(spec, str):
        parts = spec.split(":")
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError(f"bad range {spec!r}: expected MIN:MAX")
    else:
        lo, hi = int(spec[0]), int(spec[1])
    if lo < 0 or hi < lo:
        raise ValueError(f"bad range {spec!r}: need 0 <= MIN <= MAX")
    return lo, hi


def parse_dataset_spec(spec: str) -> tuple[str, str | None]:
    """Split ``"sharegpt:PATH"`` into (name, path); other names have no path."""
    name, sep, path = spec.partition(":")
    if name not in ("random", "prefix", "sharegpt"):
        raise ValueError(f"unknown dataset {spec!r}: use random, prefix or sharegpt:PATH")
    if name == "sharegpt" and not path:
        raise ValueError("the sharegpt dataset needs a path: sharegpt:PATH")
    if name != "sharegpt" and sep:
        raise ValueError(f"dataset {name} takes no path")
    return name, (path or None)


def _rng(seed: int, tag: int) -> np.random.Generator:
    # Each generator gets its own stream so that e.g. changing the output
    # length range does not reshuffle the prompt tokens.
    return np.random.default_rng([seed, tag])


_ALLOWED_CACHE: dict[int, tuple[Any, np.ndarray]] = {}


def allowed_token_ids(tokenizer: TokenizerLike | None) -> np.ndarray:
    """Token ids that random prompts may use.

    With a tokenizer: non-special ids whose text re-encodes to the same single
    id. Byte-level vocabularies hold partial UTF-8 pieces that decode to
    replacement characters and re-encode longer, which would make text
    prompts miss their requested length; skipping them keeps lengths exact.
    """
    if tokenizer is None:
        return np.arange(*NO_TOKENIZER_ID_RANGE)
    cached = _ALLOWED_CACHE.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    special = set(tokenizer.all_special_ids or [])
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    if not ids:
        raise ValueError("tokenizer has no non-special tokens")
    safe = [i for i, ok in zip(ids, _round_trips(tokenizer, ids)) if ok]
    # A vocab with almost no clean tokens is odd; better inexact than empty.
    out = np.array(safe if len(safe) >= min(100, len(ids)) else ids)
    _ALLOWED_CACHE[id(tokenizer)] = (tokenizer, out)
    return out


def _round_trips(tokenizer: TokenizerLike, ids: list[int]) -> list[bool]:
    """Whether each id's decoded text encodes back to exactly that id."""
    if hasattr(tokenizer, "batch_decode") and callable(tokenizer):
        # Batched calls run in the fast tokenizer's native code: seconds
        # saved on 100k+ vocabularies.
        texts = tokenizer.batch_decode([[i] for i in ids])
        encs = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        encs = [tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) for i in ids]
    return [e == [i] for i, e in zip(ids, encs)]


def _uniform_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    return rng.integers(lo, hi + 1, size=n)


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n))


def _text_of_len(
    tokenizer: TokenizerLike, ids: list[int], target: int, vocab: np.ndarray,
    rng: np.random.Generator,
) -> tuple[str, list[int]]:
    """Decode ``ids`` to text whose re-encoding has exactly ``target`` tokens.

    Decoding then re-encoding random ids can merge or split tokens, so trim or
    pad and retry a few times; return the final text and its encoding.
    """
    text = tokenizer.decode(ids)
    enc = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(10):
        if len(enc) == target:
            break
        if len(enc) > target:
            enc = enc[:target]
        else:
            enc = enc + [int(x) for x in rng.choice(vocab, size=target - len(enc))]
        text = tokenizer.decode(enc)
        enc = tokenizer.encode(text, add_special_tokens=False)
    return text, enc


def gen_random_dataset(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
    as_text: bool = False,
) -> Dataset:
    """Random prompts with uniform lengths in the given inclusive ranges.

    ``as_text`` asks for string prompts (the chat endpoint needs them); with
    a tokenizer prompts are always text.
    """
    rng = _rng(seed, 1)
    in_lens = _uniform_lengths(rng, num_prompts, *input_len)
    out_lens = _uniform_lengths(_rng(seed, 2), num_prompts, *output_len)
    vocab = allowed_token_ids(tokenizer)
    reqs = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        reqs.append(_random_prompt(rng, n_in, n_out, vocab, tokenizer, as_text))
    return Dataset("random", reqs)


def _random_prompt(
    rng: np.random.Generator, n_in: int, n_out: int, vocab: np.ndarray,
    tokenizer: TokenizerLike | None, as_text: bool,
) -> SampleRequest:
    if tokenizer is not None:
        ids = [int(x) for x in rng.choice(vocab, size=n_in)]
        text, enc = _text_of_len(tokenizer, ids, n_in, vocab, rng)
        return SampleRequest(text, len(enc), n_out)
    if as_text:
        return SampleRequest(_words(rng, n_in), n_in, n_out, prompt_len_exact=False)
    ids = [int(x) for x in rng.choice(vocab, size=n_in)]
    return SampleRequest(ids, n_in, n_out)


def gen_prefix_dataset(
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    question_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
    as_text: bool = False,
) -> Dataset:
    """K shared random prefixes, each followed by ~num_prompts/K questions.

    Requests are shuffled (seeded) so groups interleave as they would in a
    real multi-tenant workload instead of arriving in tidy blocks.
    """
    if num_groups < 1:
        raise ValueError("prefix dataset needs at least one group")
    rng = _rng(seed, 3)
    vocab = allowed_token_ids(tokenizer)
    prefixes = [_random_prompt(rng, prefix_len, 0, vocab, tokenizer, as_text).prompt
                for _ in range(num_groups)]
    q_lens = _uniform_lengths(rng, num_prompts, *question_len)
    out_lens = _uniform_lengths(_rng(seed, 4), num_prompts, *output_len)
    reqs = []
    for i, (n_q, n_out) in enumerate(zip(q_lens.tolist(), out_lens.tolist())):
        g = i % num_groups
        q = _random_prompt(rng, n_q, n_out, vocab, tokenizer, as_text)
        reqs.append(_join_prefix(prefixes[g], q, g, prefix_len, tokenizer))
    order = _rng(seed, 5).permutation(num_prompts)
    reqs = [reqs[i] for i in order]
    hit = ideal_prefix_hit_fraction(reqs, prefix_len, tokenizer)
    info = {"num_groups": num_groups, "prefix_len": prefix_len,
            "question_len": list(question_len)}
    return Dataset("prefix", reqs, ideal_prefix_hit_fraction=hit, info=info)


def _join_prefix(
    prefix: str | list[int], q: SampleRequest, group: int, prefix_len: int,
    tokenizer: TokenizerLike | None,
) -> SampleRequest:
    if isinstance(prefix, list):
        assert isinstance(q.prompt, list)
        return SampleRequest(prefix + q.prompt, prefix_len + q.prompt_len,
                             q.expected_output_len, group)
    text = f"{prefix} {q.prompt}"
    if tokenizer is not None:
        n = len(tokenizer.encode(text, add_special_tokens=False))
        return SampleRequest(text, n, q.expected_output_len, group)
    return SampleRequest(text, prefix_len + q.prompt_len, q.expected_output_len,
                         group, prompt_len_exact=False)


def _common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ideal_prefix_hit_fraction(
    reqs: Sequence[SampleRequest], prefix_len: int,
    tokenizer: TokenizerLike | None = None,
) -> float:
    """Prompt tokens a perfect (unbounded) prefix cache could reuse / total.

    In arrival order, the first request of a group must compute its prefix;
    every later one can reuse the shared part. The shared part is measured as
    the common token prefix with the group's first request, capped at the
    prefix length so that chance matches inside questions do not count (and
    so that tokens merged across the prefix/question boundary by a tokenizer
    are correctly not counted either).
    """
    first: dict[int, Sequence[Any]] = {}
    reused = total = 0
    for r in reqs:
        toks = _tokens_of(r, tokenizer)
        total += len(toks) if toks is not None else r.prompt_len
        if r.group is None:
            continue
        if r.group not in first:
            first[r.group] = toks if toks is not None else []
        elif toks is not None:
            reused += min(_common_prefix_len(first[r.group], toks), prefix_len)
        else:
            reused += prefix_len  # word prompts: one word per prefix token
    return reused / total if total else 0.0


def _tokens_of(r: SampleRequest, tokenizer: TokenizerLike | None) -> Sequence[Any] | None:
    if isinstance(r.prompt, list):
        return r.prompt
    if tokenizer is not None:
        return tokenizer.encode(r.prompt, add_special_tokens=False)
    return None


def _conversation_pair(entry: Any) -> tuple[str, str] | None:
    """First human turn and the gpt turn that answers it, if any."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i, t in enumerate(turns[:-1]):
        if t.get("from") in _HUMAN_ROLES:
            nxt = turns[i + 1]
            if nxt.get("from") in _GPT_ROLES:
                return str(t.get("value", "")), str(nxt.get("value", ""))
            return None
    return None


def _approx_len(text: str, tokenizer: TokenizerLike | None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(text) // 4  # ~4 characters per token for English text


def load_sharegpt_dataset(
    path: str,
    num_prompts: int,
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
    fixed_output_len: int | None = None,
) -> Dataset:
    """Sample ``num_prompts`` valid conversations from a ShareGPT JSON file.

    Entries are shuffled with the seed, then taken in order while skipping
    those that are too short (< 4 tokens prompt or output) or too long
    (> 1024 prompt or > 2048 prompt+output tokens).
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [p for p in map(_conversation_pair, data) if p is not None]
    random.Random(seed).shuffle(pairs)
    reqs = []
    for prompt, answer in pairs:
        if len(reqs) >= num_prompts:
            break
        p_len = _approx_len(prompt, tokenizer)
        o_len = fixed_output_len or _approx_len(answer, tokenizer)
        if not _valid_lengths(p_len, o_len, fixed_output_len is not None):
            continue
        reqs.append(SampleRequest(prompt, p_len, o_len,
                                  prompt_len_exact=tokenizer is not None))
    if len(reqs) < num_prompts:
        raise ValueError(f"{path}: only {len(reqs)} usable conversations, "
                         f"{num_prompts} requested")
    return Dataset("sharegpt", reqs, info={"path": path})


def _valid_lengths(p_len: int, o_len: int, fixed_output: bool) -> bool:
    if p_len < SHAREGPT_MIN_LEN or (not fixed_output and o_len < SHAREGPT_MIN_LEN):
        return False
    return p_len <= SHAREGPT_MAX_PROMPT_LEN and p_len + o_len <= SHAREGPT_MAX_TOTAL_LEN
