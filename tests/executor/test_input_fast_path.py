"""``prepare_model_input``'s shortcut for decode rows (``executor.input.FAST_PATHS``) builds what
the general path (``LogitsPlan.add``) builds: the same tensors, host lists and logits plan, step
by step over a workload mixing decodes with prompt chunks, one-token chunks that do not sample,
drafts, a prompt forking into samples, prompt logprobs, an embedding request and hybrid slots."""
from __future__ import annotations

import torch

import pagoda.executor.input as step_input
from pagoda.bench.block_tables import same_inputs
from pagoda.config import SchedulerConfig
from pagoda.executor.input import prepare_model_input
from pagoda.kvcache.manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import Draft, ModelOutput, SeqStepResult

CPU = torch.device("cpu")


def _plan(plan) -> tuple:
    return (plan.rows, [(id(e.item), e.sample_row, e.num_samples, e.prompt_rows, e.prompt_next_tokens)
                        for e in plan.entries], [(id(item), row) for item, row in plan.pooled])


def test_decode_rows_shortcut_builds_what_the_general_path_builds(monkeypatch):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=256, enable_chunked_prefill=True,
                          long_prefill_token_threshold=0, policy="fcfs")
    s = Scheduler(cfg, KVCacheManager(64, 4, enable_prefix_caching=False))
    # (One-token prompts: an embedding and a fork into samples whose only row is a decode's shape.)
    kinds = [{}, {"n": 3}, {"prompt_logprobs": 2}, {"pooling": "LAST"}, {}, {"logprobs": 1}, {"pooling": "MEAN"},
             {"n": 2}]
    for i, extra in enumerate(kinds):
        prompt = [100 * (i + 1) + j for j in range((6, 30, 9, 11, 3, 5, 1, 1)[i])]
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=8 + i, ignore_eos=True, **extra), (0,)))
    checked = decodes = 0
    for step in range(40):
        if not s.has_unfinished():
            break
        drafts = {q.seq_id: Draft([5, 6]) for q in s.running[1::3] if q.num_tokens - q.num_computed_tokens == 1}
        out = s.schedule(drafts if step % 2 else {})
        if step == 0:  # a one-token chunk that does not sample, beside the others
            assert out.scheduled[-1].num_new_tokens > 1
            out.scheduled[-1].num_new_tokens = 1
        for k, item in enumerate(out.scheduled):
            item.seq.state_slot = k if step % 3 == 2 else None  # (a hybrid model's slots, some steps)
        monkeypatch.setattr(step_input, "FAST_PATHS", True)
        fast, fast_plan = prepare_model_input(out, CPU, 4)
        monkeypatch.setattr(step_input, "FAST_PATHS", False)
        general, general_plan = prepare_model_input(out, CPU, 4)
        assert same_inputs(fast, general), f"step {step}"
        assert fast.meta.query_lens_cpu == general.meta.query_lens_cpu
        assert fast.meta.state_slots == general.meta.state_slots
        assert _plan(fast_plan) == _plan(general_plan), f"step {step}"
        checked += 1
        decodes += sum(i.num_new_tokens == 1 and i.samples and i.draft is None for i in out.scheduled)
        results = ModelOutput()
        for item in out.scheduled:
            seq = item.seq
            if seq.params.pooling is not None and item.samples:
                results.results[seq.seq_id] = SeqStepResult([], embedding=[0.0])
            elif item.draft is not None:
                results.results[seq.seq_id] = SeqStepResult([5, 9], num_draft_accepted=1)
            elif item.samples:
                results.results[seq.seq_id] = SeqStepResult([seq.token_ids[-1] + 1 + j for j in range(seq.num_samples)])
        for item in out.scheduled:
            item.seq.state_slot = None
        s.update(out, results)
    assert checked > 10 and decodes > 20 and not s.has_unfinished()
