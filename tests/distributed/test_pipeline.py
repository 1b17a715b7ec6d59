"""Pipeline parallelism leaves results unchanged: P stages (and P x T ranks, gloo, CPU) give the
greedy tokens and logprobs of one process, with micro-batches, chunked prefill, prefix caching
and preemption all at work; bad sizes and unsupported combinations are refused at start-up."""
from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs, EngineConfig, ModelConfig
from pagoda.distributed.parallel_state import PPGroup, get_pp_indices, stage_of
from pagoda.executor.input import build_model_input
from pagoda.executor.pipeline import micro_batch_bounds, split_micro_batches
from pagoda.structured_output.params import StructuredOutputsParams as SO

from test_tp_engine import BLOCK, ROUNDS, assert_same_results, prompts
from tp_helpers import child_pids


# ---- layout ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layers,stages,want", [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [2, 3, 2]), (8, 3, [3, 3, 2]), (3, 3, [1, 1, 1]), (2, 1, [2]),
])
def test_stage_layers_are_contiguous_with_the_remainder_before_the_last(layers, stages, want):
    ranges = [get_pp_indices(layers, s, stages) for s in range(stages)]
    assert [end - start for start, end in ranges] == want
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_rank_grid_puts_rank_zero_on_the_last_stage():
    # 3 stages x 2 tensor-parallel ranks: ranks 0-1 last stage, 4-5 first.
    assert [stage_of(r, 3, 2) for r in range(6)] == [2, 2, 1, 1, 0, 0]
    group = PPGroup(rank=1, size=3, world_rank=3, world_size=6, tp_size=2)  # stage 1, tp rank 1
    assert (group.peer(0), group.peer(2)) == (5, 1)


def test_micro_batches_cover_the_step_in_order():
    for tokens in (1, 2, 7, 40):
        for m in range(1, 6):
            bounds = micro_batch_bounds(tokens, m)
            assert len(bounds) == min(m, tokens)
            assert bounds[0][0] == 0 and bounds[-1][1] == tokens
            assert all(a < b for a, b in bounds) and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1  # equal work per micro-batch


@pytest.mark.parametrize("num_micro_batches", [2, 3, 4])
def test_split_inputs_equal_inputs_built_per_micro_batch(num_micro_batches):
    """Each micro-batch is exactly the step the input builder makes of its tokens alone; a
    prompt chunk cut in two continues in the next micro-batch with the first part as context."""
    q_lens, seq_lens = [5, 1, 1, 7, 1], [5, 20, 9, 30, 17]
    tables = [[3], [4, 5], [6], [7, 8], [9, 10]]
    ids = list(range(100, 100 + sum(q_lens)))
    logits_rows = [2, 3, 4, 5, 6, 10, 12, 13, 14]  # prompt-logprob rows, sampling rows
    step = build_model_input(ids, q_lens, seq_lens, tables, logits_rows, torch.device("cpu"), 16)
    starts = [0, 5, 6, 7, 14, 15]
    parts = split_micro_batches(step, num_micro_batches)
    assert len(parts) == num_micro_batches
    cut_inside = False
    for (t0, t1), part in zip(micro_batch_bounds(len(ids), num_micro_batches), parts):
        own_q, own_len, own_tables = [], [], []
        for i in range(len(q_lens)):
            lo, hi = max(starts[i], t0), min(starts[i + 1], t1)
            if lo < hi:
                cut_inside |= (lo, hi) != (starts[i], starts[i + 1])
                own_q.append(hi - lo)
                own_len.append(seq_lens[i] - q_lens[i] + hi - starts[i])
                own_tables.append(tables[i])
        rows = [r - t0 for r in logits_rows if t0 <= r < t1]
        want = build_model_input(ids[t0:t1], own_q, own_len, own_tables, rows, torch.device("cpu"), 16)
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(part, name), getattr(want, name)), name
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens"):
            assert torch.equal(getattr(part.meta, name), getattr(want.meta, name)), name
        assert torch.equal(part.meta.block_tables[:, :want.meta.block_tables.shape[1]], want.meta.block_tables)
        for name in ("max_query_len", "max_seq_len", "query_lens_cpu", "seq_lens_cpu", "query_start_loc_cpu",
                     "context_lens_cpu"):
            assert getattr(part.meta, name) == getattr(want.meta, name), name
    assert cut_inside == (num_micro_batches > 2)  # 3 and 4 cut inside a prompt chunk


# ---- refused sizes and combinations -----------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an integer of at least 1, got 0"),
    (dict(pipeline_parallel_size=-2), "at least 1, got -2"),
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size 3 is more stages than the model's 2 decoder layers"),
    (dict(pipeline_parallel_size=2, enable_lora=True), "LoRA (enable_lora) does not support pipeline_parallel_size 2"),
    (dict(pipeline_parallel_size=2, speculative_config='{"method": "draft_model", "model": "x", '
                                                       '"num_speculative_tokens": 2}'),
     "draft_model does not support pipeline_parallel_size 2"),
])
def test_bad_pipeline_sizes_are_refused(llama_dir, kwargs, message):
    with pytest.raises(ValueError) as err:
        EngineConfig.from_args(EngineArgs(model=str(llama_dir), **kwargs))
    assert message in str(err.value)
    before = child_pids()
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(str(llama_dir), **kwargs)
    assert child_pids() == before  # refused before any worker started


# ---- the engine -------------------------------------------------------------------------------

def kv_bytes_for(path, pp: int, tp: int, num_blocks: int) -> int:
    """The per-rank budget that gives the stage with the most layers ``num_blocks`` blocks (and
    the others more), so every layout runs with exactly ``num_blocks`` and schedules the same."""
    m = ModelConfig.from_pretrained(str(path), None, "float32", None, "cpu")
    layers = max(end - start for start, end in (get_pp_indices(m.num_layers, s, pp) for s in range(pp)))
    return num_blocks * 2 * layers * BLOCK * max(m.num_kv_heads // tp, 1) * m.head_dim * 4


def generate(path, pp: int, tp: int, num_blocks: int) -> dict:
    before = child_pids()  # children an earlier test in this process left running are not this engine's
    llm = LLM(str(path), pipeline_parallel_size=pp, tensor_parallel_size=tp,
              kv_cache_memory=kv_bytes_for(path, pp, tp, num_blocks), max_model_len=96,
              max_num_batched_tokens=16, max_num_seqs=4)
    try:
        feed = [{"prompt_token_ids": p} for p in prompts()]
        rounds = [llm.generate(feed, params, use_tqdm=False) for params in ROUNDS]
        # A batch of short prompts of different lengths: whole prompts and decodes share steps.
        rng = random.Random(1)
        short = [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(n)]} for n in (3, 9, 1, 6)]
        rounds.append(llm.generate(short, ROUNDS[1], use_tqdm=False))
        core = llm.engine.core
        executor = core.executor
        return {"rounds": rounds, "preemptions": core.scheduler.num_preemptions,
                "cached": sum(o.num_cached_tokens for o in rounds[1]), "blocks": core.kv.num_blocks,
                "workers": len(child_pids() - before),
                "stages": executor.stage_stats() if pp > 1 else None}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def three_layers(model_factory):
    return model_factory("llama", num_layers=3)  # two stages of 2 and 1 layers


@pytest.fixture(scope="module")
def one_process(three_layers):
    return generate(three_layers, 1, 1, num_blocks=10)


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)], ids=["P2", "P2xT2"])
def test_pipeline_matches_one_process(three_layers, one_process, pp, tp):
    want = one_process
    got = generate(three_layers, pp, tp, num_blocks=10)
    assert got["workers"] == pp * tp - 1
    assert got["blocks"] == want["blocks"] == 10  # the minimum over stages
    assert want["preemptions"] > 0 and want["cached"] > 0  # the features are really exercised
    assert (got["preemptions"], got["cached"]) == (want["preemptions"], want["cached"])
    assert_same_results(want, got)
    stages = got["stages"]
    assert [s.stage for s in stages] == [0, 1]
    assert all(s.steps > 0 for s in stages)
    assert stages[0].micro_batches > stages[0].steps  # several sequences: steps were split
    assert stages[0].wait_ms == 0  # the first stage's input is the step itself
    assert 0 < stages[1].bubble < 1  # the last stage waits for the first micro-batch


def test_pipeline_on_a_mixture_of_experts_model(model_factory):
    """Qwen3-MoE with an expert layer on both stages (the third layer dense): the same results
    as one process, with chunked prefill, micro-batches, prefix caching and preemption."""
    path = model_factory("qwen3_moe", num_layers=3, extra_config=dict(
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[2]))
    want = generate(path, 1, 1, num_blocks=10)
    got = generate(path, 2, 1, num_blocks=10)
    assert want["preemptions"] > 0 and want["cached"] > 0
    assert (got["preemptions"], got["cached"]) == (want["preemptions"], want["cached"])
    assert_same_results(want, got)


def test_pipeline_with_ngram_speculation_and_a_grammar(three_layers, one_process):
    """Rank 0 on the last stage verifies drafts and applies grammars exactly as one process
    does: greedy outputs unchanged with n-gram speculation, a constrained request obeys."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    llm = LLM(str(three_layers), pipeline_parallel_size=2, speculative_config=spec,
              kv_cache_memory=kv_bytes_for(three_layers, 2, 1, 10), max_model_len=96, max_num_batched_tokens=16,
              max_num_seqs=4)
    try:
        feed = [{"prompt_token_ids": p} for p in prompts()]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(feed, params, use_tqdm=False)]
        assert llm.engine.core.proposer.num_proposed > 0  # drafts were verified on the last stage
        choices = ["yes", "no", "maybe so"]
        constrained = llm.generate(["Answer:"] * 2, SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                                                   structured_outputs=SO(choice=choices)),
                                   use_tqdm=False)
    finally:
        llm.shutdown()
    assert got == [o.outputs[0].token_ids for o in one_process["rounds"][1]]
    assert all(o.outputs[0].text in choices for o in constrained)
