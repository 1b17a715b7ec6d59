"""The background (batch) class through a real engine and model: background requests make no
progress in any step while an interactive request is unfinished, then resume and end with the
greedy tokens they have alone."""
from __future__ import annotations

from pagoda import SamplingParams


def test_background_rows_wait_for_interactive_work_and_keep_their_greedy_output(llama_llm):
    engine = llama_llm.engine
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [7 + i] * (5 + i)} for i in range(3)]
    alone = {o.prompt_token_ids[0]: o.outputs[0].token_ids
             for o in llama_llm.generate(prompts, greedy, use_tqdm=False)}

    for i, prompt in enumerate(prompts):
        engine.add_request(f"bg-{i}", prompt, greedy, background=True)
    progress: dict[str, int] = {}
    final: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            progress[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)

    for _ in range(3):
        step()  # alone, the batch runs
    before = {k: v for k, v in progress.items() if k.startswith("bg-")}
    assert before and all(v > 0 for v in before.values())
    engine.add_request("chat", {"prompt_token_ids": [3, 4, 5, 6]}, SamplingParams(max_tokens=6, temperature=0.0,
                                                                                  ignore_eos=True))
    while "chat" not in final:
        step()
        assert {k: v for k, v in progress.items() if k.startswith("bg-")} == before  # paused
    while engine.has_unfinished_requests():
        step()
    assert len(final["chat"]) == 6
    for i, prompt in enumerate(prompts):
        assert final[f"bg-{i}"] == alone[prompt["prompt_token_ids"][0]]
