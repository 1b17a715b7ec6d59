"""The decode step's shortcuts (``scheduler.FAST_PATHS``, ``kvcache.manager.FAST_PATHS``) schedule
every step as the general path does: the same workload run with them on and off gives the same
schedules, preemptions, block tables and tokens step by step. The workloads mix decodes with
chunked prompts, preemption, priorities, tenants, drafts, ``n > 1``, images under an encoder
budget, lookahead steps and a deadline, with a fake model (next token = last + 1)."""
from __future__ import annotations

import pytest

import pagoda.kvcache.manager as kv_manager
import pagoda.scheduler.scheduler as scheduler_module
from pagoda.config import SchedulerConfig
from pagoda.kvcache.manager import KVCacheManager
from pagoda.multimodal.inputs import ImageInput
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import Draft, ModelOutput, SeqStepResult

IMAGE_TOKEN = 7


def _image(digest: str, offset: int, length: int) -> ImageInput:
    patches = 4 * length
    return ImageInput(digest, offset, length, (1, 2, 2 * length), (patches, 1), bytes(4 * patches))


def _request(i: int, prompt_len: int, max_tokens: int, n: int = 1, priority: int = 0, tenant: str = "t0",
             image: bool = False, deadline: float | None = None) -> Request:
    ids = [1000 * (i + 1) + j for j in range(prompt_len)]
    images = []
    if image:  # two images of 6 placeholder tokens, at 4 (one of two pictures) and 40 (its own)
        for offset, digest in ((4, f"{i % 2 + 10:x}" * 8), (40, f"{i + 20:x}" * 8)):
            ids[offset:offset + 6] = [IMAGE_TOKEN] * 6
            images.append(_image(digest, offset, 6))
    return Request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True), (0,),
                   priority=priority, tenant=tenant, images=images, deadline=deadline)


# (step, request) arrivals per workload: prompts longer than the budget (chunked), n > 1,
# priorities or tenants, images, a request whose deadline has passed once it runs.
def _arrivals(kind: str) -> list[tuple[int, Request]]:
    out = []
    for i in range(14):
        prompt = (5, 40, 9, 70, 3)[i % 5]
        kwargs: dict = {"n": 2 if i % 6 == 2 else 1}
        if kind == "priority":
            kwargs["priority"] = (2, 0, 1)[i % 3]
        if kind == "tenants":
            kwargs["tenant"] = ("a", "b", "c")[i % 3]
        if kind == "images" and i % 3 != 1:
            prompt, kwargs["image"] = max(prompt, 50), True
        if i == 5:
            kwargs["deadline"] = 1.0  # long past: it ends (or fails) at the next schedule
        out.append((2 * i if i % 4 else i // 2, _request(i, prompt, 6 + (i * 7) % 13, **kwargs)))
    return out


CONFIGS = {
    "fcfs": dict(policy="fcfs"),
    "priority": dict(policy="priority"),
    "tenants": dict(policy="fcfs"),
    "tenants-step-share": dict(policy="fcfs", fair_step_share=True),
    "images": dict(policy="fcfs", max_num_encoder_tokens_per_step=30),
    "whole-prompts": dict(policy="fcfs", enable_chunked_prefill=False, max_num_batched_tokens=80),
    "threshold": dict(policy="fcfs", long_prefill_token_threshold=8),
    "lookahead": dict(policy="fcfs"),
    "lpm": dict(policy="lpm"),
}


def _run(kind: str, cached: set[str]) -> list:
    """The workload's trace: per step, what was scheduled, preempted and finished, the block
    tables and tokens of every unfinished sequence."""
    options = dict(max_num_seqs=6, max_num_batched_tokens=32, max_model_len=256, enable_chunked_prefill=True,
                   long_prefill_token_threshold=0)
    options.update(CONFIGS[kind])
    num_blocks = options.pop("num_blocks", 30)
    s = Scheduler(SchedulerConfig(**options), KVCacheManager(num_blocks, 4, enable_prefix_caching=True),
                  cached.__contains__)
    arrivals = _arrivals(kind.split("-")[0])
    trace = []
    step = 0
    while (arrivals or s.has_unfinished()) and step < 400:
        while arrivals and arrivals[0][0] <= step:
            s.add_request(arrivals.pop(0)[1])
        drafts = {}
        if step % 3 == 1:  # a two-token draft for every other decoding sequence
            drafts = {q.seq_id: Draft([q.token_ids[-1] + 1, q.token_ids[-1] + 5])
                      for q in s.running[::2] if q.num_tokens - q.num_computed_tokens == 1}
        out = s.schedule(drafts, 3 if kind == "lookahead" else 1)
        results = ModelOutput()
        for item in out.scheduled:
            seq = item.seq
            for image in seq.request.images:
                if image.offset < item.end and item.start < image.end:
                    cached.add(image.hash)
            if item.draft is not None:  # the first draft token accepted, then the target's
                results.results[seq.seq_id] = SeqStepResult([item.draft.token_ids[0], seq.token_ids[-1] + 2],
                                                            num_draft_accepted=1)
            elif item.samples:
                tokens = [seq.token_ids[-1] + 1 + i for i in range(seq.num_samples)]
                tokens += [tokens[-1] + 1 + j for j in range(item.num_lookahead)]
                results.results[seq.seq_id] = SeqStepResult(tokens)
        assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.scheduled)
        trace.append(("schedule", [(i.seq.seq_id, i.start, i.num_new_tokens, i.num_draft_tokens, i.num_lookahead)
                                   for i in out.scheduled], out.num_batched_tokens,
                      [q.seq_id for q in out.preempted], out.finished_request_ids, out.block_copies,
                      [(q.seq_id, list(q.block_table)) for q in s.running]))
        updates = s.update(out, results)
        trace.append(("update", [(u.seq.seq_id, u.new_token_ids, u.seq.finish_reason) for u in updates],
                      [(q.seq_id, q.num_computed_tokens, q.status.value) for q in s.running + list(s.waiting)]))
        step += 1
    assert not arrivals and not s.has_unfinished()
    s.kv.check_invariants([])
    return trace


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_fast_paths_schedule_as_the_general_path(kind, monkeypatch):
    fast = _run(kind, set())
    monkeypatch.setattr(scheduler_module, "FAST_PATHS", False)
    monkeypatch.setattr(kv_manager, "FAST_PATHS", False)
    general = _run(kind, set())
    assert len(fast) == len(general)
    for i, (a, b) in enumerate(zip(fast, general)):
        assert a == b, f"step {i // 2} ({a[0]}) differs"
    # The workload has what the shortcuts must not change: decodes, prompt chunks, preemptions.
    scheduled = [x for entry in fast if entry[0] == "schedule" for x in entry[1]]
    assert any(n == 1 for _, _, n, d, _ in scheduled) and any(n - d > 1 for _, _, n, d, _ in scheduled)
    if kind in ("fcfs", "priority", "tenants"):
        assert any(entry[3] for entry in fast if entry[0] == "schedule"), "no preemption in the workload"
    if kind == "fcfs":
        assert any(d for _, _, _, d, _ in scheduled), "no draft ran"
    if kind == "lookahead":
        assert any(la for *_, la in scheduled), "no lookahead step"


def test_allocate_shortcut_decides_as_the_general_path(monkeypatch):
    """``KVCacheManager.allocate`` for a running sequence: a block with room, a full last block,
    a shared (copy-on-write) block, and too little memory, with the shortcut on and off."""
    def scenario() -> list:
        kv = KVCacheManager(6, 4, enable_prefix_caching=False)
        a = Request("a", list(range(6)), SamplingParams(max_tokens=8), (0,))
        from pagoda.request import Sequence
        seq = Sequence("a#0", a, list(range(6)))
        log = [kv.allocate(seq, 6)]
        seq.num_computed_tokens = 6
        for n in (1, 2, 3, 9, 30):
            log.append((kv.allocate(seq, n), list(seq.block_table), kv.num_free_blocks, kv.take_copies()))
        child = Sequence("a#1", a, list(seq.token_ids), sample_index=1)
        kv.fork(seq, child)
        child.num_computed_tokens = 6
        log.append((kv.allocate(child, 1), list(child.block_table), kv.num_free_blocks, kv.take_copies()))
        log.append((kv.allocate(seq, 1), list(seq.block_table), kv.num_free_blocks, kv.take_copies()))
        return log

    fast = scenario()
    monkeypatch.setattr(kv_manager, "FAST_PATHS", False)
    assert scenario() == fast
