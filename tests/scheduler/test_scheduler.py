"""The scheduler with a fake model (next token = last + 1): budgets, chunking, preemption."""
from __future__ import annotations

from pagoda.config import SchedulerConfig
from pagoda.kvcache.manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import ModelOutput, SeqStepResult


def make_scheduler(num_blocks=64, budget=16, max_seqs=8, chunked=True, threshold=0, prefix=True, block=4):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                          enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold, policy="fcfs")
    return Scheduler(cfg, KVCacheManager(num_blocks, block, enable_prefix_caching=prefix))


def fake_results(out) -> ModelOutput:
    """A fake model's results of the scheduled step ``out``: each sampling sequence's next token
    is its last + 1 (its ``n`` samples' last + 1 .. + n)."""
    results = ModelOutput()
    for item in out.scheduled:
        if item.samples:
            n = item.seq.num_samples
            results.results[item.seq.seq_id] = SeqStepResult([item.seq.token_ids[-1] + 1 + i for i in range(n)])
    return results


def fake_step(s: Scheduler):
    out = s.schedule()
    s.update(out, fake_results(out))
    return out


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int, n: int = 1, start: int = 0):
    s.add_request(Request(rid, list(range(start, start + prompt_len)), SamplingParams(max_tokens=max_tokens, n=n,
                                                                                       ignore_eos=True), (0,)))


def run_all(s: Scheduler, limit: int = 10_000):
    steps = []
    while s.has_unfinished() and len(steps) < limit:
        steps.append(fake_step(s))
    assert not s.has_unfinished()
    return steps


def test_long_prompt_is_chunked_while_decodes_advance_every_step():
    s = make_scheduler(budget=16)
    for i in range(3):
        add(s, f"d{i}", 4, 40, start=100 * i)
    for _ in range(2):
        fake_step(s)  # the three short prompts are now decoding
    add(s, "long", 160, 2, start=500)  # ten times the step budget
    steps_with_long = 0
    while any(x.request_id == "long" for x in s.running + list(s.waiting)):
        out = fake_step(s)
        ids = {item.seq.request_id: item for item in out.scheduled}
        assert out.num_batched_tokens <= 16
        if "long" in ids and ids["long"].num_new_tokens > 1:
            steps_with_long += 1
            for i in range(3):  # every running decode got its token this step
                assert ids[f"d{i}"].num_new_tokens == 1
    assert steps_with_long >= 160 // 13
    run_all(s)
    s.kv.check_invariants([])


def test_long_prefill_threshold_caps_chunks():
    s = make_scheduler(budget=64, threshold=8)
    add(s, "a", 40, 1)
    add(s, "b", 40, 1, start=1000)
    out = s.schedule()
    assert [i.num_new_tokens for i in out.scheduled] == [8, 8]


def test_whole_prompts_only_when_chunking_disabled():
    s = make_scheduler(budget=16, chunked=False)
    add(s, "a", 10, 1)
    add(s, "b", 10, 1, start=100)
    out = s.schedule()
    assert [i.num_new_tokens for i in out.scheduled] == [10]


def test_preemption_when_blocks_run_out_and_everything_finishes():
    s = make_scheduler(num_blocks=12, budget=64, block=4)
    for i in range(4):
        add(s, f"r{i}", 8, 16, start=1000 * i)
    steps = run_all(s)
    assert s.num_preemptions > 0
    assert any(step.preempted for step in steps)
    assert s.kv.num_used_blocks == 0  # what is left is cached and evictable, nothing owned
    s.kv.reset_prefix_cache()
    s.kv.check_invariants([])
    assert s.kv.pool.num_free == 12


def test_outputs_identical_with_and_without_memory_pressure():
    def outputs(num_blocks):
        s = make_scheduler(num_blocks=num_blocks, budget=32)
        for i in range(5):
            add(s, f"r{i}", 6 + i, 12, start=100 * i)
        seqs = {rid: v[0] for rid, v in s.requests.items()}
        run_all(s)
        return {rid: seq.output_token_ids for rid, seq in seqs.items()}, s.num_preemptions

    roomy, none = outputs(200)
    tight, some = outputs(10)
    assert none == 0 and some > 0
    assert roomy == tight


def test_n_samples_fork_and_share_prompt_blocks():
    s = make_scheduler(budget=64)
    add(s, "p", 10, 3, n=3)
    fake_step(s)  # prefill, then fork into three samples
    seqs = s.requests["p"]
    assert len(seqs) == 3 and [q.sample_index for q in seqs] == [0, 1, 2]
    assert seqs[0].block_table[:2] == seqs[1].block_table[:2] == seqs[2].block_table[:2]
    assert [q.output_token_ids for q in seqs] == [[10], [11], [12]]
    out = s.schedule()
    assert len(out.block_copies) == 2  # the shared partial block is copied for two of three writers
    run_all(s)
    s.kv.reset_prefix_cache()
    s.kv.check_invariants([])


def test_abort_frees_blocks():
    s = make_scheduler()
    add(s, "a", 20, 50)
    fake_step(s)
    assert s.kv.num_used_blocks > 0
    s.abort_request("a")
    s.kv.reset_prefix_cache()
    assert s.kv.num_used_blocks == 0 and not s.has_unfinished()
