"""Seeded requests' generators live in the executor, keyed by request id and sample: they are
created from the seed, shared by every draw of the sample (drafts included) and dropped when
the request leaves, so a reused request id starts from its seed again."""
from __future__ import annotations

import time

from pagoda import SamplingParams
from pagoda.engine.messages import AbortRequest, EngineCoreRequest

SEEDED = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=6, ignore_eos=True)


def _run(core, rid: str, params: SamplingParams) -> dict[int, list[int]]:
    core.add_request(EngineCoreRequest(rid, [5, 6, 7, 8], params, time.time()))
    tokens: dict[int, list[int]] = {}
    while core.has_unfinished():
        for out in core.step().outputs:
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    return tokens


def test_generators_are_dropped_and_a_reused_id_reproduces(llama_llm):
    core = llama_llm.engine.core
    first = _run(core, "seeded", SEEDED)
    assert len(first) == 2 and first[0] != first[1]  # sample i draws from seed + i
    core.step()  # the step after the request left drops its generators
    assert len(core.executor.generators) == 0
    assert _run(core, "seeded", SEEDED) == first
    # An aborted seeded request gives its generators back too.
    core.add_request(EngineCoreRequest("gone", [5, 6, 7, 8], SEEDED, time.time()))
    core.step()
    core.step()
    assert len(core.executor.generators) == 2
    core.abort(AbortRequest("gone"))
    core.step()
    assert len(core.executor.generators) == 0
