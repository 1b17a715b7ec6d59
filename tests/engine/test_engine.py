"""The offline engine end to end on a tiny model: batching, preemption, sampling, errors."""
from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_alone_equals_among_32_others(llama_llm):
    target = prompts(1, seed=1)[0]
    alone = token_ids(llama_llm.generate([target], GREEDY, use_tqdm=False))[0]
    engine = llama_llm.engine
    # Others arrive and finish around it: different lengths, added over several steps.
    others = prompts(32, seed=2)
    rng = random.Random(3)
    for i, p in enumerate(others[:16]):
        engine.add_request(f"o{i}", p, SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("target", target, GREEDY)
    for i, p in enumerate(others[16:]):
        engine.add_request(f"o{16 + i}", p, SamplingParams(temperature=0, max_tokens=rng.randint(1, 40),
                                                            ignore_eos=True))
        engine.step()
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "target" and out.finished:
                result = out
    assert result is not None and result.outputs[0].token_ids == alone


def test_tiny_kv_budget_preempts_and_keeps_outputs(llama_dir, llama_llm):
    ps = prompts(12, seed=4, lo=20, hi=60)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = token_ids(llama_llm.generate(ps, params, use_tqdm=False))
    # 2 layers x (K, V) x 2 kv heads x 16 dims x 4 bytes = 512 bytes per token: 16 blocks = 256 tokens.
    tight = LLM(str(llama_dir), kv_cache_memory=16 * 16 * 512, max_model_len=256, enable_prefix_caching=False)
    outs = tight.generate(ps, params, use_tqdm=False)
    assert token_ids(outs) == expected
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert tight.engine.core.kv.num_used_blocks == 0


def test_seeded_sampling_reproduces_whatever_the_batch(llama_llm):
    p = prompts(1, seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=20, ignore_eos=True)
    a = token_ids(llama_llm.generate([p], params, use_tqdm=False))[0]
    batch = prompts(6, seed=6) + [p]
    b = token_ids(llama_llm.generate(batch, [SamplingParams(temperature=1.0, max_tokens=20)] * 6 + [params],
                                     use_tqdm=False))[-1]
    assert a == b
    c = token_ids(llama_llm.generate([p], params.clone(seed=124), use_tqdm=False))[0]
    assert c != a


def test_top_k_1_equals_greedy_and_n_returns_n(llama_llm):
    ps = prompts(3, seed=7)
    greedy = token_ids(llama_llm.generate(ps, GREEDY, use_tqdm=False))
    topk1 = token_ids(llama_llm.generate(ps, GREEDY.clone(temperature=1.0, top_k=1), use_tqdm=False))
    assert topk1 == greedy
    outs = llama_llm.generate(ps[:1], SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)
    samples = outs[0].outputs
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert all(len(s.token_ids) == 12 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert llama_llm.engine.core.kv.num_used_blocks == 0


def test_n_greedy_samples_equal_single(llama_llm):
    p = prompts(1, seed=8)
    single = token_ids(llama_llm.generate(p, GREEDY, use_tqdm=False))[0]
    many = llama_llm.generate(p, GREEDY.clone(n=3), use_tqdm=False)[0].outputs
    assert [s.token_ids for s in many] == [single] * 3


def test_stop_strings_stop_ids_and_min_tokens(llama_llm):
    p = prompts(1, seed=9)[0]
    free = llama_llm.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    # A stop string taken from the middle of the free-running text.
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = llama_llm.generate([p], SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.find(stop)] and stop not in cut.text
    # Its tokens end at the one that completed the stop string, however many tokens a step (or a
    # multi-step round) produced: the ones after it are not the client's.
    decode = llama_llm.get_tokenizer().decode
    assert cut.token_ids == ids[:len(cut.token_ids)]
    assert stop in decode(cut.token_ids) and stop not in decode(cut.token_ids[:-1])
    # A stop token id: generation ends at its first occurrence, the token included.
    stop_id = ids[5]
    by_id = llama_llm.generate([p], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id],
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == ids[: ids.index(stop_id) + 1] and by_id.stop_reason == stop_id
    # min_tokens suppresses the stop id until enough tokens exist.
    first = ids.index(stop_id)
    late = llama_llm.generate([p], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id],
                                                  min_tokens=first + 2, ignore_eos=True), use_tqdm=False)[0]
    assert len(late.outputs[0].token_ids) >= first + 2
    assert late.outputs[0].token_ids[first] != stop_id


def test_allowed_token_ids_limit_every_row_kind(llama_llm):
    """vLLM's ``allowed_token_ids``: greedy, sampled and several-sample rows only ever produce
    listed ids (a row with them never takes a multi-step round's raw argmax); a bad list is
    refused naming the field."""
    p = prompts(2, seed=11)
    allowed = [7, 40, 311]
    # A greedy row alone first: a batch of plain greedy rows may take multi-step rounds.
    alone = llama_llm.generate(p[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                     allowed_token_ids=allowed), use_tqdm=False)
    assert set(alone[0].outputs[0].token_ids) <= set(allowed)
    outs = llama_llm.generate(p * 2, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                     allowed_token_ids=allowed),
                                      SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
                                                     allowed_token_ids=allowed),
                                      SamplingParams(temperature=1.0, n=2, max_tokens=24, ignore_eos=True,
                                                     allowed_token_ids=allowed[:1]),
                                      SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)], use_tqdm=False)
    for out in outs[:3]:
        assert all(len(c.token_ids) == 24 and set(c.token_ids) <= set(allowed) for c in out.outputs)
    assert [c.token_ids for c in outs[2].outputs] == [[7] * 24] * 2
    assert not set(outs[3].outputs[0].token_ids) <= set(allowed)  # the unlimited row beside them is free
    # Greedy among the allowed: the likeliest allowed id at each step, as a bias of -100 elsewhere gives.
    banned = {t: -100.0 for t in range(llama_llm.config.model.vocab_size) if t not in allowed}
    biased = llama_llm.generate(p[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=banned),
                                use_tqdm=False)
    assert biased[0].outputs[0].token_ids == outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    for bad, message in (([], "non-empty"), ([llama_llm.config.model.vocab_size], "outside the vocabulary"),
                         ([-1], "allowed_token_ids")):
        with pytest.raises(ValueError, match=message):
            llama_llm.generate(p[:1], SamplingParams(allowed_token_ids=bad), use_tqdm=False)


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_never_appear_in_the_output(llama_llm):
    """vLLM's ``bad_words``: each word's spellings (at the start and after a space) never occur
    in the output, greedy or sampled, one-token words and longer ones."""
    p = prompts(1, seed=12)
    free = llama_llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    ids = free[0].outputs[0].token_ids
    decode = llama_llm.get_tokenizer().decode
    words = [decode(ids[4:5]).strip() or decode(ids[6:7]).strip(), decode(ids[10:13]).strip()]
    spelled = llama_llm.engine.input_processor.spell_bad_words(words)
    assert any(len(w) > 1 for w in spelled) and any(_contains(ids, w) for w in spelled)  # the bans bite
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, bad_words=words),
                   SamplingParams(temperature=1.0, seed=2, max_tokens=40, ignore_eos=True, bad_words=words)):
        out = llama_llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(out) == 40 and not any(_contains(out, w) for w in spelled), (words, spelled, out)
    # A three-token spelling given as ids: the greedy output runs as before up to its third
    # token, which is banned there (its first two tokens just came out).
    word = ids[10:13]
    banned = llama_llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                  bad_words_token_ids=[word]), use_tqdm=False)[0].outputs[0].token_ids
    first = next(i for i in range(len(ids)) if ids[i:i + 3] == word)
    assert banned[:first + 2] == ids[:first + 2] and banned[first + 2] != ids[first + 2]
    assert not _contains(banned, word)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llama_llm):
    """vLLM's ``truncate_prompt_tokens``: a prompt longer than the context runs as its last k
    tokens, exactly as those tokens alone; 0 and values below -1 are refused."""
    long_ids = [(13 * i) % 500 + 3 for i in range(1100)]
    cut = llama_llm.generate([{"prompt_token_ids": long_ids}], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=50), use_tqdm=False)[0]
    alone = llama_llm.generate([{"prompt_token_ids": long_ids[-50:]}], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert cut.prompt_token_ids == long_ids[-50:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    short = llama_llm.generate([{"prompt_token_ids": long_ids[:20]}], SamplingParams(
        temperature=0, max_tokens=2, truncate_prompt_tokens=50), use_tqdm=False)[0]
    assert short.prompt_token_ids == long_ids[:20]  # shorter than k: as it is
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_logprobs_and_penalties(llama_llm):
    p = prompts(1, seed=10)
    out = llama_llm.generate(p, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) <= 4
        assert max(entry.values()) == entry[token]  # greedy: the chosen token is the most likely
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)), abs=1e-4)
    plain = llama_llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    penal = llama_llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                 repetition_penalty=5.0, frequency_penalty=2.0), use_tqdm=False)
    toks = penal[0].outputs[0].token_ids
    assert toks != plain[0].outputs[0].token_ids
    assert len(set(toks)) >= len(set(plain[0].outputs[0].token_ids))


@pytest.mark.parametrize("kwargs, name", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"), (dict(top_k=-3), "top_k"), (dict(min_p=2), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-1), "logprobs"),
    (dict(ignore_eos="false"), "ignore_eos"), (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(detokenize=0), "detokenize"), (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    (dict(stop=["x"], detokenize=False), "stop strings need detokenize"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_inputs_are_refused_and_engine_keeps_working(llama_llm, monkeypatch):
    too_long = {"prompt_token_ids": [5] * 1100}
    with pytest.raises(ValueError, match=r"1100.*1024"):
        llama_llm.generate([prompts(1)[0], too_long], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llama_llm.generate([{"prompt_token_ids": [10**6]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llama_llm.generate([{"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llama_llm.generate(prompts(2), [GREEDY], use_tqdm=False)
    for odd in (5, None):
        with pytest.raises(ValueError, match="prompts must be a string"):
            llama_llm.generate(odd, GREEDY, use_tqdm=False)
    # n beyond max_num_seqs (4 here, for a moment) on the second prompt: refused before the
    # first one starts, as the engine core would refuse it.
    with monkeypatch.context() as patch:
        import dataclasses

        processor = llama_llm.engine.input_processor
        patch.setattr(processor, "config", dataclasses.replace(
            processor.config, scheduler=dataclasses.replace(processor.config.scheduler, max_num_seqs=4)))
        with pytest.raises(ValueError, match=r"n must be at most max_num_seqs \(4\)"):
            llama_llm.generate(prompts(2), [GREEDY, GREEDY.clone(n=5)], use_tqdm=False)
    assert not llama_llm.engine.has_unfinished_requests()
    assert llama_llm.engine.core.kv.num_used_blocks == 0
    assert len(llama_llm.generate(prompts(2), GREEDY, use_tqdm=False)) == 2


def test_a_prompt_the_engine_refuses_after_validation_takes_the_calls_others_with_it(llama_llm, monkeypatch):
    """Should the engine core still refuse a prompt the front end passed, the prompts of the
    same call added before it are aborted: none runs later, inside another call."""
    real, added = llama_llm.engine.core.add_request, []

    def refuse_the_second(request):
        if added:
            raise ValueError("refused by the engine core")
        added.append(request.request_id)
        real(request)

    monkeypatch.setattr(llama_llm.engine.core, "add_request", refuse_the_second)
    with pytest.raises(ValueError, match="refused by the engine core"):
        llama_llm.generate(prompts(3), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert len(added) == 1 and not llama_llm.engine.has_unfinished_requests()
    assert not llama_llm.engine.output_processor.requests
    assert len(llama_llm.generate(prompts(2), GREEDY, use_tqdm=False)) == 2


def test_unknown_architecture_and_missing_weights(tmp_path, llama_dir):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(bad))
    missing = tmp_path / "missing"
    shutil.copytree(llama_dir, missing)
    for f in missing.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(missing), kv_cache_memory=1 << 24)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(llama_dir, corrupt)
    for f in corrupt.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="model.safetensors"):
        LLM(str(corrupt), kv_cache_memory=1 << 24)
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "nope"))


@pytest.mark.parametrize("field", ["intermediate_size", "num_key_value_heads", "vocab_size", "head_dim"])
def test_a_config_that_disagrees_with_its_weights_is_refused(tmp_path, llama_dir, field):
    """Weights larger than the config says are not cut to size (garbage out): the load fails
    naming the tensor, as transformers' size-mismatch check does. (Smaller ones never fitted.)"""
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg[field] = {"intermediate_size": cfg["intermediate_size"] // 2, "num_key_value_heads": cfg["num_key_value_heads"] // 2,
                  "vocab_size": cfg["vocab_size"] - 64, "head_dim": head_dim // 2}[field]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match=r"weight '.+' in .+ does not fit parameter .+ the checkpoint tensor has shape"):
        LLM(str(bad), kv_cache_memory=1 << 24, max_model_len=64)


def test_experts_wider_than_the_config_says_are_refused(tmp_path, model_factory):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model_factory("qwen3_moe"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moe_intermediate_size"] //= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match=r"experts.+ the checkpoint tensor has shape"):
        LLM(str(bad), kv_cache_memory=1 << 24, max_model_len=64)


def test_finished_only_steps_build_outputs_for_finished_requests_alone(llama_llm, monkeypatch):
    """``LLM.generate`` keeps finished outputs only, so its steps build no cumulative output of
    a running request (a copy of its tokens so far, every step); the outputs equal the
    step-by-step engine's."""
    from pagoda.engine.output_processor import OutputProcessor

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17)]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)]
    built: list[bool] = []
    real = OutputProcessor.make_output

    def counting(self, state, delta=False):
        built.append(state.finished)
        return real(self, state, delta)

    monkeypatch.setattr(OutputProcessor, "make_output", counting)
    outs = llama_llm.generate(prompts, params, use_tqdm=False)
    assert built == [True, True, True]
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 17]
    engine = llama_llm.engine  # the cumulative steps: an output for every running request each step
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"steps-{i}", prompt, p)
    built.clear()
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    assert len(built) > 3 and not all(built)
    assert [last[f"steps-{i}"].outputs[0].token_ids for i in range(3)] == [o.outputs[0].token_ids for o in outs]
