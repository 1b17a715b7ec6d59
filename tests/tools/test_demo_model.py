"""The trained built-in demo model (pagoda/demo_model, made by `pagoda train-demo`).

`LLM()` with no model must load it, and it must still be the model that was trained:
held-out perplexity under the threshold recorded at training time (through pagoda's own
loader and `prompt_logprobs`), greedy text made of English words, chat turns that end with
the end token, transformers reading the same weights to the same numbers, and the shipped
draft model speculating for it without changing its greedy output.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.tools.make_model import IM_END, IM_START, builtin_model_path

MAIN = builtin_model_path("main")
DRAFT = builtin_model_path("draft")
pytestmark = pytest.mark.skipif(MAIN is None, reason="the built-in demo model is not installed")

GREEDY = SamplingParams(temperature=0, max_tokens=48)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # No model: the built-in one. float32, as its recorded figures were (on a CPU with bfloat16
    # dot products --dtype auto picks bfloat16 for this bfloat16 checkpoint).
    engine = LLM(dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def evaluation() -> dict:
    return json.loads((MAIN / "demo_eval.json").read_text())


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [float(entry[tid]) for tid, entry in zip(ids[1:], out.prompt_logprobs[1:])]


def test_no_model_means_the_builtin_model(llm: LLM) -> None:
    assert Path(llm.config.model.path).resolve() == MAIN.resolve()
    assert llm.config.model.max_model_len >= 512
    assert 10e6 <= llm.config.model.num_params <= 30e6


def test_heldout_perplexity_below_recorded_threshold(llm: LLM, evaluation: dict) -> None:
    ids = llm.get_tokenizer().encode(evaluation["sample_text"], add_special_tokens=False)
    assert len(ids) == evaluation["sample_tokens"]  # the tokenizer is the one trained with the model
    logprobs = _prompt_logprobs(llm, ids)
    ppl = math.exp(-sum(logprobs) / len(logprobs))
    assert ppl < evaluation["sample_ppl_threshold"]
    assert ppl == pytest.approx(evaluation["sample_ppl"], rel=0.02)


def test_greedy_continuation_is_english(llm: LLM) -> None:
    known = set((MAIN / "words.txt").read_text().split())
    prompts = ["And the king said unto his servants,", "The morning came, and"]
    vocabulary: set[str] = set()
    for out in llm.generate(prompts, GREEDY, use_tqdm=False):
        text = out.outputs[0].text
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 8, text
        assert sum(w.lower() in known for w in words) >= 0.9 * len(words), text
        # A small model's greedy text may fall into a loop of a short phrase ("the third day,
        # and the third day, and ..."); a broken loader or weights repeat one token.
        assert len({w.lower() for w in words}) >= 3, text
        vocabulary |= {w.lower() for w in words}
    assert len(vocabulary) >= 12, vocabulary


def test_chat_reply_ends_with_the_end_token(llm: LLM) -> None:
    end_id = llm.get_tokenizer().convert_tokens_to_ids(IM_END)
    conversations = [
        [{"role": "user", "content": "What comes after this? The LORD is my shepherd; I shall not want."}],
        [{"role": "user", "content": "Define Ambition."}],
        [{"role": "user", "content": "Who are you?"}],
    ]
    params = SamplingParams(temperature=0, max_tokens=120)
    for out in llm.chat(conversations, params, use_tqdm=False):
        reply = out.outputs[0]
        assert reply.finish_reason == "stop" and reply.token_ids[-1] == end_id, reply
        assert len(reply.token_ids) < params.max_tokens
        assert IM_START not in reply.text and IM_END not in reply.text
        assert len(re.findall(r"[A-Za-z]+", reply.text)) >= 2, reply.text


def test_transformers_reads_the_same_model(llm: LLM, evaluation: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MAIN)
    ids = tok(evaluation["sample_text"], add_special_tokens=False)["input_ids"][:96]
    assert ids == llm.get_tokenizer().encode(evaluation["sample_text"], add_special_tokens=False)[:96]
    hf = AutoModelForCausalLM.from_pretrained(MAIN, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert _prompt_logprobs(llm, ids) == pytest.approx(expected, abs=2e-3)


@pytest.mark.skipif(DRAFT is None, reason="the built-in draft model is not installed")
def test_draft_model_speculates_for_it(llm: LLM) -> None:
    draft = json.loads((DRAFT / "config.json").read_text())
    assert draft["vocab_size"] == json.loads((MAIN / "config.json").read_text())["vocab_size"]
    spec = LLM(dtype="float32",
               speculative_config={"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 3})
    try:
        prompts = ["And the king said unto his servants,", "Now the LORD had said unto"]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        fast = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert fast == plain
        assert spec.engine.core.proposer.acceptance_rate > 0.2
    finally:
        spec.shutdown()
