"""Fair shares between tenants and prefix-cache salts, with a fake model (next token = last + 1)."""
from __future__ import annotations

from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import fake_step, make_scheduler, run_all


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int, tenant: str = "default", n: int = 1,
        salt: str | None = None) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True), (0,), tenant=tenant,
                      cache_salt=salt)
    s.add_request(request)
    return request


def steps_until_done(s: Scheduler, rid: str, limit: int = 1000) -> int:
    steps = 0
    while rid in s.requests and steps < limit:
        fake_step(s)
        steps += 1
    return steps


def hog_beside_small(small_tenant: str) -> tuple[Scheduler, int]:
    """One n=128 request running in all 128 slots, then another request of 8 tokens (KV blocks
    for everyone: the slots are what runs out)."""
    s = make_scheduler(num_blocks=8192, budget=512, max_seqs=128, block=16)
    add(s, "hog", list(range(20)), 500, tenant="hog", n=128)
    for _ in range(3):
        fake_step(s)
    assert len(s.running) == 128
    add(s, "small", list(range(100, 108)), 8, tenant=small_tenant)
    return s, steps_until_done(s, "small")


def test_small_request_of_another_tenant_runs_beside_an_n128_request():
    s, steps = hog_beside_small("other")
    assert steps <= 10  # admitted at once (one of the hog's samples preempted), then 8 decode steps
    assert s.num_preemptions == 1
    run_all(s)  # the hog's preempted sample is recomputed and finishes too
    s.kv.check_invariants([])
    assert not s.tenant_requests


def test_same_tenant_keeps_first_come_first_served():
    # Within one tenant nothing changes: the small request waits for free slots, as it always did.
    s, steps = hog_beside_small("hog")
    assert steps > 400 and s.num_preemptions == 0


def test_tenant_over_its_share_does_not_preempt_others():
    s = make_scheduler(num_blocks=4096, budget=512, max_seqs=128, block=16)
    add(s, "small", list(range(100, 108)), 30, tenant="b")
    fake_step(s)
    add(s, "hog", list(range(20)), 50, tenant="a", n=128)  # 128 samples: over its share of 64 slots
    steps = steps_until_done(s, "small")
    assert steps == 30 - 1 and s.num_preemptions == 0
    assert s.requests["hog"][0].num_computed_tokens == 0  # it waited for the slots
    run_all(s)


def test_preemption_victims_come_from_the_tenant_over_its_share():
    # 24 blocks of 4 tokens: tenant a's six sequences fill them; tenant b's arrive later.
    s = make_scheduler(num_blocks=24, budget=64, max_seqs=16, block=4)
    for i in range(6):
        add(s, f"a{i}", list(range(100 * i, 100 * i + 8)), 40, tenant="a")
    for _ in range(4):
        fake_step(s)
    for i in range(2):
        add(s, f"b{i}", list(range(5000 + 100 * i, 5000 + 100 * i + 8)), 10, tenant="b")
    victims = []
    while "b0" in s.requests or "b1" in s.requests:
        victims += [v.request.tenant for v in fake_step(s).preempted]
    assert victims and set(victims) == {"a"}
    run_all(s)
    s.kv.check_invariants([])


def test_prompts_larger_than_a_share_do_not_preempt_each_other_without_end():
    """Three tenants, each with a 70-token prompt (18 blocks of 4) where a share is 10 of the 30
    blocks: a sequence that cannot hold its prompt within its tenant's share takes no blocks
    from another tenant (it would be over its share before its first token, and the next tenant
    would preempt it in turn: they did, and none finished). They run one after another on the
    free blocks (a small request within its share still preempts: the test above)."""
    s = make_scheduler(num_blocks=30, budget=32, max_seqs=6, block=4)
    for i, tenant in enumerate("abc"):
        add(s, f"big-{tenant}", list(range(1000 * (i + 1), 1000 * (i + 1) + 70)), 8, tenant=tenant)
    run_all(s, limit=400)  # (fails if any is unfinished by then)
    s.kv.check_invariants([])


def test_prefill_tokens_are_shared_between_tenants_and_none_go_unused():
    s = make_scheduler(num_blocks=512, budget=64, max_seqs=8, block=4)
    add(s, "long", list(range(1000)), 4, tenant="a")
    fake_step(s)
    add(s, "short", list(range(2000, 2040)), 4, tenant="b")
    out = fake_step(s)
    got = {item.seq.request_id: item.num_new_tokens for item in out.scheduled}
    assert got["short"] >= 32 and got["long"] >= 24  # about half each, not all to the running prompt
    assert out.num_batched_tokens == 64
    # With one tenant, the running prompt is served first and takes the whole budget.
    s1 = make_scheduler(num_blocks=512, budget=64, max_seqs=8, block=4)
    add(s1, "long", list(range(1000)), 4)
    fake_step(s1)
    add(s1, "short", list(range(2000, 2040)), 4)
    out = fake_step(s1)
    assert {item.seq.request_id: item.num_new_tokens for item in out.scheduled} == {"long": 64}


def test_a_lone_decode_leaves_its_tenant_part_to_the_other():
    s = make_scheduler(num_blocks=512, budget=64, max_seqs=8, block=4)
    add(s, "decode", list(range(3000, 3004)), 50, tenant="b")
    fake_step(s)
    add(s, "long", list(range(1000)), 4, tenant="a")
    out = fake_step(s)
    assert {item.seq.request_id: item.num_new_tokens for item in out.scheduled} == {"decode": 1, "long": 63}


def test_outputs_are_the_same_with_one_tenant_or_many_under_memory_pressure():
    def outputs(tenants: list[str]) -> dict[str, list[int]]:
        s = make_scheduler(num_blocks=20, budget=32, max_seqs=6, block=4)
        requests = [add(s, f"r{i}", list(range(50 * i, 50 * i + 6 + i)), 12 + i, tenant=tenants[i % len(tenants)],
                        n=2 if i % 3 == 0 else 1) for i in range(8)]
        run_all(s)
        s.kv.check_invariants([])
        return {r.request_id: [seq.token_ids for seq in s_seqs] for r, s_seqs in
                ((r, sorted(finished[r.request_id], key=lambda q: q.sample_index)) for r in requests)}

    finished: dict = {}
    original = Scheduler._finish

    def keep(self, seq):
        finished.setdefault(seq.request_id, []).append(seq)
        original(self, seq)

    Scheduler._finish = keep
    try:
        one = outputs(["default"])
        finished.clear()
        many = outputs(["a", "b", "c"])
    finally:
        Scheduler._finish = original
    assert one == many and len(one) == 8


def test_cache_salt_separates_prefix_caches():
    s = make_scheduler(num_blocks=256, budget=256, max_seqs=8, block=4)
    prompt = list(range(40))
    first = add(s, "first", prompt, 2, salt="s1")
    run_all(s)
    same = add(s, "same", prompt, 2, salt="s1")
    other = add(s, "other", prompt, 2, salt="s2")
    unsalted = add(s, "unsalted", prompt, 2)
    run_all(s)
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == 36  # the full blocks but the last (its logits are needed)
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    s.kv.check_invariants([])


def test_in_flight_deferral_is_per_cache_namespace():
    def first_step(salts: tuple[str | None, str | None]) -> set[str]:
        s = make_scheduler(num_blocks=256, budget=256, max_seqs=8, block=4)
        add(s, "x", list(range(40)), 2, salt=salts[0])
        add(s, "y", list(range(40)), 2, salt=salts[1])
        return {item.seq.request_id for item in fake_step(s).scheduled}

    assert first_step(("k", "k")) == {"x"}  # y waits a step to reuse x's blocks
    assert first_step(("k", "j")) == {"x", "y"}  # another namespace: nothing to wait for


def test_tenant_counts_follow_requests_out():
    s = make_scheduler()
    add(s, "a", list(range(8)), 3, tenant="t1")
    add(s, "b", list(range(100, 108)), 50, tenant="t2")
    add(s, "c", list(range(200, 208)), 50, tenant="t2")
    fake_step(s)
    assert s.tenant_requests == {"t1": 1, "t2": 2}
    s.abort_request("b")
    s.fail_request(s.requests["c"][0].request, "test")
    run_all(s)
    assert not s.tenant_requests


def test_prompts_still_to_fork_hold_their_samples_slots():
    # Twenty n=8 requests of one tenant: admission counts the samples each prompt will fork
    # into, so the running batch never exceeds max_num_seqs once they fork.
    s = make_scheduler(num_blocks=4096, budget=512, max_seqs=32, block=16)
    for i in range(20):
        add(s, f"r{i}", list(range(10 * i, 10 * i + 8)), 20, n=8)
    most = 0
    while s.has_unfinished():
        fake_step(s)
        most = max(most, len(s.running))
    assert most == 32


def test_fair_step_share_caps_each_tenants_decodes_a_step_and_rotates_them():
    import dataclasses

    s = make_scheduler(num_blocks=8192, budget=512, max_seqs=128, block=16)
    s.config = dataclasses.replace(s.config, fair_step_share=True)
    add(s, "hog", list(range(20)), 60, tenant="hog", n=128)
    for _ in range(3):
        fake_step(s)
    assert len(fake_step(s).scheduled) == 128  # one tenant: every sequence, every step
    add(s, "small", list(range(100, 108)), 8, tenant="other")
    seen: list[dict[str, int]] = []
    while "small" in s.requests:
        per_tenant: dict[str, int] = {}
        for item in fake_step(s).scheduled:
            per_tenant[item.seq.request.tenant] = per_tenant.get(item.seq.request.tenant, 0) + 1
        seen.append(per_tenant)
    assert len(seen) <= 10 and all(step.get("hog", 0) <= 64 for step in seen), seen
    assert all(step.get("other") == 1 for step in seen), seen  # the small request runs every step
    # The hog's samples took turns: none fell more than a step behind another.
    made = [seq.num_output_tokens for seq in s.requests["hog"] if seq.status.name == "RUNNING"]
    assert made and max(made) - min(made) <= 1
    run_all(s)  # and all finish once the other tenant has left
    s.kv.check_invariants([])


def test_without_fair_step_share_a_tenant_decodes_all_its_slots():
    s, _ = hog_beside_small("other")
    assert not s.config.fair_step_share
    assert len(fake_step(s).scheduled) >= 127  # the default of a bare config (the GPU's)
