"""``logit_bias``: step 0 of the sampling pipeline, on every path that picks a token. Unit tests
of the sampler, then the engine against a transformers oracle (greedy with the same bias added
to the logits), with multi-step decoding, speculative decoding (n-gram and draft model: outputs
equal to ordinary decoding with the same bias), structured output (the grammar still wins) and
LoRA rows."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.executor.rejection import DraftRow, verify
from pagoda.executor.sampler import SampleRow, Sampler, adjust_logits
from pagoda.structured_output import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).parent.parent / "spec_decode"))
from spec_helpers import copy_prompts, generate  # noqa: E402

VOCAB = 64
LLAMA_VOCAB = 512  # conftest's llama spec


def row(params: SamplingParams, bitmask: torch.Tensor | None = None, generator=None) -> SampleRow:
    return SampleRow(params, generator, [1, 2], [], (), bitmask)


def greedy(bias: dict[int, float] | None = None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 8, "logit_bias": bias, **kw})


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# ---- the sampler ---------------------------------------------------------------------------

def test_bias_is_added_to_its_rows_only() -> None:
    logits = random_logits(3)
    rows = [row(greedy({5: 2.5, 9: -100})), row(greedy()), row(greedy({63: 100}))]
    got = adjust_logits(logits, rows)
    want = logits.clone()
    want[0, 5] += 2.5
    want[0, 9] -= 100
    want[2, 63] += 100
    assert torch.equal(got, want)


def test_positive_bias_forces_the_greedy_token_also_on_the_plain_greedy_path() -> None:
    logits = random_logits(4, seed=1)
    best = logits.argmax(-1).tolist()
    target = [t for t in range(VOCAB) if t not in best][0]
    sampler = Sampler(0)
    rows = [row(greedy()), row(greedy({target: 100})), row(greedy()), row(greedy({target: 100}))]
    # sample_from reads the step's logits in place when every row is plain greedy: a biased row
    # must take the full pipeline (and the unbiased rows keep their argmax).
    out = sampler.sample_from(logits, [0, 1, 2, 3], rows)
    assert out.token_ids == [best[0], target, best[2], target]
    assert sampler.sample_from(logits, [1], [row(greedy({target: 100}))]).token_ids == [target]
    assert sampler.sample_from(logits, [1], [row(greedy())]).token_ids == [best[1]]


def test_minus_100_bans_a_token_greedy_and_sampled() -> None:
    logits = random_logits(1, seed=2)
    logits[0, 17] = 12.0  # nearly all the mass
    sampler = Sampler(0)
    second = logits[0].clone()
    second[17] = -float("inf")
    # (The sampler may write into the logits it is given: each call gets its own copy.)
    assert sampler(logits.clone(), [row(greedy({17: -100}))]).token_ids == [second.argmax().item()]
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, logit_bias={17: -100})
    draws = [sampler(logits.clone(), [row(params, generator=gen)]).token_ids[0] for _ in range(200)]
    assert 17 not in draws and len(set(draws)) > 1
    unbiased = [sampler(logits.clone(), [row(SamplingParams(temperature=1.0), generator=gen)]).token_ids[0]
                for _ in range(50)]
    assert unbiased.count(17) > 40


def test_logprobs_stay_the_models_own() -> None:
    # As vLLM reports them by default: the raw distribution, before any processing.
    logits = random_logits(1, seed=4)
    out = Sampler(0)(logits.clone(), [row(greedy({3: 100}, logprobs=2))])
    assert out.token_ids == [3]
    assert out.token_logprobs[0] == pytest.approx(logits[0].log_softmax(-1)[3].item(), abs=1e-6)


def test_the_grammar_wins_over_a_bias() -> None:
    from pagoda.structured_output.bitmask import unpack_bitmask  # noqa: F401  (the mask's format)

    logits = random_logits(1, seed=5)
    allowed = [4, 8, 15]
    words = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for t in allowed:
        words[0, t // 32] |= 1 << (t % 32)
    params = greedy({20: 100, 8: 50})
    assert Sampler(0)(logits.clone(), [row(params, bitmask=words[0])]).token_ids == [8]  # steered inside it
    params = greedy({20: 100})
    assert Sampler(0)(logits, [row(params, bitmask=words[0])]).token_ids[0] in allowed


def test_draft_verification_applies_the_bias() -> None:
    # Greedy verification accepts exactly the drafts that are the biased argmax at each position.
    logits = random_logits(4, seed=6)
    params = greedy({30: 100})
    verdict = verify(logits, [DraftRow(row(params), [30, 30, 30], None)], None)[0]
    assert verdict.token_ids == [30, 30, 30, 30] and verdict.num_accepted == 3
    plain = verify(logits, [DraftRow(row(greedy()), [30, 30, 30], None)], None)[0]
    assert plain.num_accepted < 3 or logits[:3].argmax(-1).eq(30).all()


def test_a_replaced_map_takes_effect() -> None:
    # The sampler keeps each map's tensors on its params; a new map (validate builds one) is used.
    params = greedy({2: 100})
    logits = random_logits(1, seed=7)
    assert Sampler(0)(logits.clone(), [row(params)]).token_ids == [2]
    params.logit_bias = {9: 100}
    params.validate()
    assert Sampler(0)(logits.clone(), [row(params)]).token_ids == [9]


def test_ids_past_the_logits_are_ignored_not_fatal() -> None:
    # The front end refuses them; a slip must not fail the row (nor the batch).
    params = greedy()
    params.logit_bias = {VOCAB + 5: 100.0, 2: 100.0}
    assert Sampler(0)(random_logits(1), [row(params)]).token_ids == [2]


# ---- the engine ----------------------------------------------------------------------------

def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, LLAMA_VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def _hf_greedy(model_dir: Path, prompt: list[int], bias: dict[int, float] | None, steps: int) -> list[int]:
    """The oracle: transformers' greedy continuation with ``bias`` added to every step's logits."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class AddBias(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            for t, b in (bias or {}).items():
                scores[:, t] += b
            return scores

    hf = _HF.get(model_dir)
    if hf is None:
        hf = _HF[model_dir] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False, logits_processor=LogitsProcessorList([AddBias()]))
    return out[0, len(prompt):].tolist()


_HF: dict[Path, object] = {}


def _biases(seed: int, banned: int) -> dict[int, float]:
    """A ban of ``banned`` and mild biases that reorder the top of the distribution."""
    rng = random.Random(seed)
    bias = {rng.randrange(LLAMA_VOCAB): rng.uniform(-3, 3) for _ in range(40)}
    bias[banned] = -100.0
    return bias


def test_greedy_with_bias_matches_transformers_and_leaves_other_rows_alone(llama_llm, llama_dir) -> None:
    prompts = _prompts(6, seed=1)
    feed = [{"prompt_token_ids": p} for p in prompts]
    plain = generate(llama_llm, feed, greedy(max_tokens=12, ignore_eos=True))
    biases = [_biases(i, plain[i][0]) if i % 2 == 0 else None for i in range(len(prompts))]
    params = [greedy(b, max_tokens=12, ignore_eos=True) for b in biases]
    got = generate(llama_llm, feed, params)  # biased and unbiased rows in one batch
    for i, prompt in enumerate(prompts):
        if biases[i] is None:
            assert got[i] == plain[i]
        else:
            assert got[i] != plain[i] and plain[i][0] not in got[i]
            assert got[i] == _hf_greedy(llama_dir, prompt, biases[i], 12)


def test_multi_step_rounds_apply_the_bias(llama_dir) -> None:
    llm = LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=256, num_scheduler_steps=4)
    prompts = _prompts(3, seed=2)
    plain = generate(llm, [{"prompt_token_ids": p} for p in prompts], greedy(max_tokens=10, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        bias = _biases(10 + i, plain[i][3])  # banned from the fourth token on: inside a round
        got = generate(llm, [{"prompt_token_ids": prompt}], greedy(bias, max_tokens=10, ignore_eos=True))[0]
        assert got == _hf_greedy(llama_dir, prompt, bias, 10)
    llm.shutdown()


@pytest.fixture(scope="module")
def copy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagoda.bench.spec import make_copy_model

    return make_copy_model(tmp_path_factory.mktemp("copy"), hidden_size=192, num_layers=2, num_heads=2,
                           vocab_size=LLAMA_VOCAB, seed=3)


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_ngram_speculation_is_exact_under_a_bias(copy_dir) -> None:
    prompts = copy_prompts(4, seed=5)
    base = LLM(str(copy_dir), kv_cache_memory=8 << 20, max_model_len=256)
    plain = generate(base, prompts, greedy(max_tokens=30, ignore_eos=True))
    # Ban a token the copy continues with, and lift one it never would: outputs change.
    params = [greedy({plain[i][2]: -100, 40 + i: 4.0}, max_tokens=30, ignore_eos=True) for i in range(len(prompts))]
    params.append(SamplingParams(temperature=0.8, seed=7, max_tokens=30, logit_bias={plain[0][1]: -100},
                                 ignore_eos=True))
    prompts = prompts + prompts[:1]
    expected = generate(base, prompts, params)
    assert all(e != p for e, p in zip(expected, plain))
    spec = LLM(str(copy_dir), kv_cache_memory=8 << 20, max_model_len=256, speculative_config=NGRAM)
    assert generate(spec, prompts, params) == expected
    assert spec.engine.core.stats().spec_accepted > 0
    base.shutdown()
    spec.shutdown()


def test_draft_model_speculation_is_exact_under_a_bias(llama_llm, llama_dir) -> None:
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=6)]
    plain = generate(llama_llm, prompts, greedy(max_tokens=16, ignore_eos=True))
    params = [greedy(_biases(20 + i, plain[i][1]), max_tokens=16, ignore_eos=True) for i in range(len(prompts))]
    expected = generate(llama_llm, prompts, params)
    spec = LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=256,
               speculative_config={"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3})
    assert generate(spec, prompts, params) == expected
    # The draft runs the same pipeline (the bias included), so it still agrees with the target.
    assert spec.engine.core.proposer.acceptance_rate > 0.9
    spec.shutdown()


def test_structured_output_grammar_wins_and_bias_steers_inside_it(llama_llm) -> None:
    tok = llama_llm.get_tokenizer()
    choices = ["yes", "no"]
    forbidden = tok.encode("maybe", add_special_tokens=False)[0]
    first_no = tok.encode("no", add_special_tokens=False)[0]
    first_yes = tok.encode("yes", add_special_tokens=False)[0]
    assert first_no != first_yes
    so = StructuredOutputsParams(choice=choices)
    for steer, want in ((first_no, "no"), (first_yes, "yes")):
        params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=so,
                                logit_bias={forbidden: 100, steer: 60})
        out = llama_llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0]
        assert out.text == want and out.finish_reason == "stop"


def test_lora_rows_take_the_bias(llama_dir, lora_adapters) -> None:
    llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=256, enable_lora=True, max_loras=2,
              max_lora_rank=16)
    lora = LoRARequest("attn8", 1, str(lora_adapters["attn8"]))
    prompts = [{"prompt_token_ids": p} for p in _prompts(2, seed=7)]
    params = greedy(max_tokens=10, ignore_eos=True)
    adapted = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=lora, use_tqdm=False)]
    base = generate(llm, prompts, params)
    forced = 77
    biased = [o.outputs[0].token_ids for o in llm.generate(
        prompts, greedy({adapted[0][0]: -100, forced: 100}, max_tokens=10, ignore_eos=True), lora_request=lora,
        use_tqdm=False)]
    assert biased == [[forced] * 10] * 2
    # A biased adapter row beside unbiased base and adapter rows: each as alone.
    mixed = llm.generate(prompts + prompts, [params, params, greedy({forced: 100}, max_tokens=10, ignore_eos=True),
                                             params],
                         lora_request=[None, lora, lora, None], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in mixed]
    assert got == [base[0], adapted[1], [forced] * 10, base[1]]
    llm.shutdown()
