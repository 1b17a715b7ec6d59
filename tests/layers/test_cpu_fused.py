"""The compiled CPU versions of the decoder's elementwise ops (float32 and bfloat16) against the
torch references in ``fused_ops`` (the same float32 arithmetic; the norm's sum of squares in
another order and exp as a polynomial, so agreement is to a few float32 ulps, and in bfloat16
to the same values but for rare elements one rounding step apart)."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import fused as cpu_fused
from pagoda.kernels import select
from pagoda.layers import fused_ops

pytestmark = pytest.mark.skipif(not select.kernels_enabled(), reason="PAGODA_CPU_KERNELS=0")
TOL = dict(rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [0, 1, 3, 200])
@pytest.mark.parametrize("hidden", [7, 64, 768])
def test_norms_match_torch(rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    base = torch.randn(rows, hidden + 5, generator=g) * 3
    x = base[:, 2:hidden + 2]  # rows with a stride other than the width
    res = torch.randn(rows, hidden, generator=g)
    w = torch.rand(hidden, generator=g) + 0.5
    assert cpu_fused.applies(x, res, w)
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-6), fused_ops.torch_rms_norm(x, w, 1e-6), **TOL)
    y, r = fused_ops.fused_add_rms_norm(x, res, w, 1e-5)
    y_ref, r_ref = fused_ops.torch_fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(r, r_ref)
    torch.testing.assert_close(y, y_ref, **TOL)


def test_rms_norm_of_heads_keeps_the_shape() -> None:
    x = torch.randn(5, 4, 32)
    w = torch.rand(32) + 0.5
    out = fused_ops.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape
    torch.testing.assert_close(out, fused_ops.torch_rms_norm(x, w, 1e-6), **TOL)


@pytest.mark.parametrize("rows", [0, 1, 50])
def test_silu_and_mul_matches_torch(rows: int) -> None:
    x = torch.randn(rows, 2 * 96) * 4
    torch.testing.assert_close(fused_ops.silu_and_mul(x), fused_ops.torch_silu_and_mul(x), **TOL)


@pytest.mark.parametrize("rot", [64, 32])  # full and partial rotary width
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_rotary_matches_torch(rot: int, tokens: int) -> None:
    """q and k as the attention layer makes them: views into one fused qkv output."""
    g = torch.Generator().manual_seed(tokens + rot)
    head_dim, heads, kv_heads, max_pos = 64, 6, 2, 300
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    cache = torch.randn(max_pos, rot, generator=g)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    got = fused_ops.apply_rotary(q, k, pos, cache)
    want = fused_ops.torch_apply_rotary(q, k, pos, cache)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_rotary_refuses_a_position_outside_the_table() -> None:
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        fused_ops.apply_rotary(q, k, torch.tensor([16]), torch.randn(16, 8))


def test_other_dtypes_keep_the_torch_path() -> None:
    x = torch.randn(2, 16, dtype=torch.float16)
    assert not cpu_fused.applies(x)
    assert not cpu_fused.applies(x.bfloat16(), torch.ones(16))  # mixed dtypes: the torch path
    assert fused_ops.silu_and_mul(x).dtype == torch.float16


# bfloat16: the same float32 arithmetic between one widening and one rounding, so the results
# are the torch references' except where a float32 difference of a few ulps (the norm's sum of
# squares in another order, exp) crosses a bfloat16 rounding boundary: one bfloat16 step, 2**-8
# relative, on a small share of the elements.
BF16_STEP = dict(rtol=2 ** -7, atol=1e-6)


def _mostly_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **BF16_STEP)
    if want.numel():
        assert (got != want).float().mean().item() <= 0.02


@pytest.mark.parametrize("rows", [0, 1, 200])
def test_bfloat16_ops_match_torch(rows: int) -> None:
    g = torch.Generator().manual_seed(rows + 7)
    hidden = 768
    x = (torch.randn(rows, hidden + 4, generator=g) * 3).bfloat16()[:, 1:hidden + 1]
    res = torch.randn(rows, hidden, generator=g).bfloat16()
    w = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    assert cpu_fused.applies(x, res, w)
    _mostly_equal(fused_ops.rms_norm(x, w, 1e-6), fused_ops.torch_rms_norm(x, w, 1e-6))
    y, r = fused_ops.fused_add_rms_norm(x, res, w, 1e-5)
    y_ref, r_ref = fused_ops.torch_fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(r, r_ref)  # the new residual is the bfloat16 sum, exactly
    _mostly_equal(y, y_ref)
    gu = (torch.randn(rows, 2 * 352, generator=g) * 4).bfloat16()
    _mostly_equal(fused_ops.silu_and_mul(gu), fused_ops.torch_silu_and_mul(gu))


@pytest.mark.parametrize("rot", [64, 32])
def test_bfloat16_rotary_matches_torch(rot: int) -> None:
    g = torch.Generator().manual_seed(rot)
    tokens, head_dim, heads, kv_heads, max_pos = 9, 64, 6, 2, 300
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16()
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    cache = torch.randn(max_pos, rot, generator=g).bfloat16()
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    assert cpu_fused.applies(q, k, cache)
    for a, b in zip(fused_ops.apply_rotary(q, k, pos, cache), fused_ops.torch_apply_rotary(q, k, pos, cache)):
        _mostly_equal(a, b)
        assert torch.equal(a[..., rot:], b[..., rot:])  # dims past the rotary width pass through


@pytest.mark.parametrize("vocab", [1, 15, 16, 64, 100, 1003, 32000])
def test_greedy_tokens_match_the_samplers_argmax(vocab: int) -> None:
    from pagoda.executor.sampler import finite_logits

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g)
    last = vocab - 1
    x[1, last // 2] = float("nan")
    x[1, last] = float("inf")            # +inf: the largest finite value, first one wins
    x[2] = float("nan")                  # nothing usable: index 0, as argmax gives
    x[3] = float("-inf")
    x[3, last] = float("nan")
    x[4, last] = torch.finfo(torch.float32).max
    x[4, last // 3] = float("inf")       # ties with the largest finite value: the first
    x[5, last] = 50.0
    x[5, last // 2] = 50.0               # an exact tie: the first index
    x[6, :] = -1.0
    x[6, last] = float("nan")            # NaN after the maximum is skipped
    rows = [0, 1, 2, 3, 4, 5, 6, 1, 0]   # repeated and out of order
    want = finite_logits(x[rows]).argmax(-1).tolist()
    assert cpu_fused.greedy_tokens(x, rows) == want
    b = x.bfloat16()  # a bfloat16 model's logits: widened exactly, then the same rule
    assert cpu_fused.greedy_tokens(b, rows) == finite_logits(b[rows].float()).argmax(-1).tolist()
    assert cpu_fused.greedy_tokens(x[:, :vocab], []) == []
    with pytest.raises(RuntimeError, match="outside the logits"):
        cpu_fused.greedy_tokens(x, [7])


@pytest.mark.parametrize("host_meta", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_steps_feed_each_argmax_back(host_meta: bool, dtype: torch.dtype) -> None:
    """The multi-step greedy loop: every step's token is its row's argmax (the sampler's rule,
    NaN and inf included), becomes the sequence's next input (id, position, lengths, slot from
    its block table, embedding row), and the round stops at ``steps``, when every sequence has
    sampled one of its ending tokens, or when ``stop()`` says so."""
    from pagoda.executor.input import build_model_input
    from pagoda.executor.sampler import finite_logits

    vocab, hidden, block = 5000, 24, 4
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(vocab, hidden, generator=g).to(dtype)
    tables = [[7, 2, 9, 4], [1, 3, 5, 8]]
    script = [torch.randn(2, vocab, generator=g).to(dtype) for _ in range(6)]
    script[1][0, 10], script[1][0, 4000] = float("nan"), float("inf")  # +inf: the largest finite value
    script[2][1] = float("-inf")
    script[2][1, 4999] = float("nan")  # nothing usable: token 0
    script[3][0, 17] = script[3][0, 4321] = 99.0  # a tie: the first index
    want = [finite_logits(s.float()).argmax(-1).tolist() for s in script]

    def run(steps: int, ends: list[frozenset[int]], stop=None):
        inputs = build_model_input([11, 12], [1, 1], [6, 9], tables, [0, 1], torch.device("cpu"), block)
        seen: list[tuple] = []

        def forward(inp, x=None):
            k = len(seen) + 1
            meta = inp.meta
            seen.append((inp.input_ids.tolist(), inp.positions.tolist(), meta.slot_mapping.tolist(),
                         meta.seq_lens.tolist(), meta.context_lens.tolist(), list(meta.seq_lens_cpu),
                         meta.max_seq_len, None if x is None else x.clone()))
            return script[k]

        rnd = cpu_fused.greedy_round(inputs, block, steps, ends, embed)
        assert torch.equal(rnd.embed_inputs(), embed[[11, 12]])  # the first step's rows
        out = cpu_fused.greedy_steps(rnd, script[0], inputs, steps, forward, stop, host_meta)
        return out, seen, inputs

    out, seen, inputs = run(4, [frozenset(), frozenset()])
    assert out == [[w[0] for w in want[:5]], [w[1] for w in want[:5]]]
    for k, (ids, pos, slots, lens, ctx, lens_cpu, max_len, x) in enumerate(seen):
        assert ids == want[k]
        assert pos == [5 + k + 1, 8 + k + 1] and lens == [7 + k, 10 + k] and ctx == [6 + k, 9 + k]
        assert slots == [tables[i][p // block] * block + p % block for i, p in enumerate(pos)]
        assert torch.equal(x, embed[want[k]])
        assert (lens_cpu, max_len) == (([7 + k, 10 + k], 10 + k) if host_meta else ([6, 9], 9))
    assert inputs.meta.seq_lens_cpu == [6 + 4, 9 + 4] and inputs.meta.max_seq_len == 9 + 4  # moved on at the end
    # Every sequence at one of its ending tokens ends the round (sequence 1 reached its own at step 2).
    ends = [frozenset({want[2][0], 123456}), frozenset({want[2][1]})]
    out, seen, _ = run(4, ends)
    assert out == [[w[0] for w in want[:3]], [w[1] for w in want[:3]]] and len(seen) == 2
    # stop() is asked before every further step.
    asked = []
    out, seen, _ = run(4, [frozenset(), frozenset()], stop=lambda: asked.append(1) or len(asked) == 2)
    assert [len(t) for t in out] == [2, 2] and len(seen) == 1
