"""Constrained decoding through the offline ``LLM``: a random-weight model writes garbage, so
every output being valid is the grammar's doing."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
from schemas import make_schemas

from pagoda import LLM, SamplingParams
from pagoda.structured_output import StructuredOutputsParams as SO

PROMPT = "Answer in JSON:"
SCHEMAS = make_schemas(100)
# Small schemas for the engine-feature comparisons (each feature needs its own engine).
SUBSET = make_schemas(8, seed=7, max_depth=1)


def _params(i: int, schema: dict, max_tokens: int = 600, **kw) -> SamplingParams:
    """Even rows greedy, odd rows sampled (seeded, so a rerun draws the same)."""
    return SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=max_tokens,
                          structured_outputs=SO(json=schema), **kw)


def _assert_valid(schema: dict, text: str, finish_reason: str, strict: bool = True) -> None:
    assert finish_reason == "stop", (finish_reason, text)
    jsonschema.validate(json.loads(text, strict=strict), schema)


def test_hundred_generated_schemas_greedy_and_sampled(llama_llm):
    params = [_params(i, s, n=2 if i % 10 == 1 else 1) for i, s in enumerate(SCHEMAS)]
    outs = llama_llm.generate([PROMPT] * len(SCHEMAS), params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        for sample in out.outputs:
            _assert_valid(schema, sample.text, sample.finish_reason)
    # n > 1: each sample followed the grammar on its own (sampled rows differ).
    forked = [out.outputs for i, out in enumerate(outs) if i % 10 == 1]
    assert all(len(o) == 2 for o in forked)
    assert any(o[0].text != o[1].text for o in forked)


def test_regex_choice_grammar_and_json_object(llama_llm):
    regex = r"[a-z]{2,5}-\d{1,3}"
    choices = ["yes", "no", "maybe so", "don't \"know\""]
    grammar = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[0-9]{1,2}/ | "x"'
    params = []
    for seed in range(4):
        params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=50, structured_outputs=SO(regex=regex)),
                   SamplingParams(temperature=1.0, seed=seed, max_tokens=50, structured_outputs=SO(choice=choices)),
                   SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured_outputs=SO(grammar=grammar)),
                   SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                                  structured_outputs=SO(json_object=True))]
    outs = llama_llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0] for o in outs]
    for k in range(4):
        rx, ch, gr, obj = texts[4 * k:4 * k + 4]
        assert re.fullmatch(regex, rx.text) and rx.finish_reason == "stop", rx.text
        assert ch.text in choices and ch.finish_reason == "stop"
        assert re.fullmatch(r"\((\d{1,2}|x)(,(\d{1,2}|x)){0,2}\)", gr.text) and gr.finish_reason == "stop", gr.text
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.text), dict)


def test_gbnf_grammars_as_vllm_takes_them(llama_llm):
    """The default backend reads Lark, and takes GBNF (``root ::= ...``: llama.cpp's, the form
    vLLM's default backend takes) through llguidance's converter; the same language either way."""
    gbnf = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [0-9] [0-9]? | "x"'
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured_outputs=SO(grammar=gbnf))
              for seed in range(3)]
    for out in llama_llm.generate([PROMPT] * 3, params, use_tqdm=False):
        text = out.outputs[0].text
        assert re.fullmatch(r"\((\d{1,2}|x)(,(\d{1,2}|x)){0,2}\)", text) and out.outputs[0].finish_reason == "stop", text
    with pytest.raises(ValueError, match="unsupported or invalid grammar"):
        llama_llm.generate(PROMPT, SamplingParams(structured_outputs=SO(grammar="root ::= (")), use_tqdm=False)


def test_max_tokens_cut_reports_length(llama_llm):
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 20, "maxLength": 30}},
              "required": ["a"], "additionalProperties": False}
    out = llama_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, structured_outputs=SO(json=schema)),
                             use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(out.text)
    # A stop string still ends a constrained output (here: before the first comma of a record).
    record = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a", "b"], "additionalProperties": False}
    out = llama_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=50, stop=[","],
                                                    structured_outputs=SO(json=record)), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "," and re.fullmatch(r'\{"a":\d', out.text), out.text


@pytest.mark.parametrize("spec", [
    {"json": {"type": "foo"}},
    {"json": {"type": "array", "minItems": 3, "maxItems": 1}},
    {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
    {"regex": "(unclosed"},
    {"grammar": "start: undefined_rule"},
])
def test_invalid_constraint_is_a_value_error_and_engine_unharmed(llama_llm, spec):
    with pytest.raises(ValueError, match="unsupported or invalid") as info:
        llama_llm.generate(PROMPT, SamplingParams(structured_outputs=SO(**spec)), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert not llama_llm.engine.has_unfinished_requests()


def test_a_grammar_that_crashes_the_compiler_is_a_value_error_offline_too(llama_llm):
    """Offline, constraints are checked in the same sandbox: 5,000 chained rules crash a worker,
    not the caller's process, and the engine serves on."""
    chain = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(4999)) + 'r4999: "a"\n'
    with pytest.raises(ValueError, match="crashed") as info:
        llama_llm.generate(PROMPT, SamplingParams(structured_outputs=SO(grammar=chain)), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    out = llama_llm.generate(PROMPT, SamplingParams(max_tokens=5, structured_outputs=SO(choice=["yes", "no"])),
                             use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={})
    with pytest.raises(ValueError, match="not valid JSON"):
        SO(json="{not json")
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])


def _without_multiple_of(node):
    if isinstance(node, dict):
        return {k: _without_multiple_of(v) for k, v in node.items() if k != "multipleOf"}
    return [_without_multiple_of(v) for v in node] if isinstance(node, list) else node


def _subset_outputs(llm: LLM, strict: bool = True) -> list:
    outs = llm.generate([PROMPT] * len(SUBSET), [_params(i, s, 200) for i, s in enumerate(SUBSET)], use_tqdm=False)
    for schema, out in zip(SUBSET, outs):
        _assert_valid(schema if strict else _without_multiple_of(schema), out.outputs[0].text,
                      out.outputs[0].finish_reason, strict)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(llama_llm) -> list:
    return _subset_outputs(llama_llm)


@pytest.mark.parametrize("feature", ["ngram", "draft_model", "preemption", "chunked", "tp2", "xgrammar"])
def test_engine_features_leave_constrained_outputs_unchanged(llama_dir, baseline, feature):
    kw: dict = dict(kv_cache_memory=32 << 20, max_model_len=1024)
    if feature == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    elif feature == "draft_model":
        kw["speculative_config"] = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}
    elif feature == "preemption":
        # 16 blocks (256 tokens) for 8 sequences of up to ~200 tokens: preemptions are certain.
        kw.update(kv_cache_memory=_blocks_bytes(llama_dir, 16), max_model_len=256)
    elif feature == "tp2":
        kw["tensor_parallel_size"] = 2  # rank 0 samples: the masks must reach it
    elif feature == "chunked":
        kw.update(long_prefill_token_threshold=2, enable_prefix_caching=False)  # prompts in 2-token chunks
    else:
        kw["structured_outputs_backend"] = "xgrammar"
    llm = LLM(str(llama_dir), **kw)
    try:
        # xgrammar 0.2.8 lets raw control characters into length-bounded strings (JSON wants them
        # escaped) and ignores multipleOf on numbers: reasons ``auto`` is llguidance. Its
        # documents are otherwise valid.
        got = _subset_outputs(llm, strict=feature != "xgrammar")
        stats = llm.engine.last_stats
        if feature == "preemption":
            assert stats.num_preemptions > 0
        elif feature in ("ngram", "draft_model"):
            assert stats.spec_proposed > 0 and stats.spec_accepted > 0
    finally:
        llm.shutdown()
    greedy = range(0, len(SUBSET), 2)
    if feature == "xgrammar":
        return  # another grammar library allows other (equally valid) tokens: only validity compares
    if feature in ("preemption", "chunked", "tp2"):
        assert got == baseline  # seeded sampled rows too: recomputation and chunking change no draw
    else:
        assert [got[i] for i in greedy] == [baseline[i] for i in greedy]


def _blocks_bytes(model_dir, blocks: int) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * head_dim * 4
    return blocks * per_block


def test_slow_compile_does_not_hold_up_other_requests(llama_llm):
    """A grammar that is still compiling delays only its own request: the engine keeps stepping
    an unconstrained request meanwhile (the compile is held until that request has streamed
    tokens, which would deadlock if compiling blocked the step loop)."""
    engine = llama_llm.engine
    manager = engine.core.structured
    real_compile = manager._compile
    release = threading.Event()
    started = threading.Event()

    def slow_compile(params):
        started.set()
        assert release.wait(60), "the compile was never released"
        return real_compile(params)

    manager._compile = slow_compile
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": 9}
                                               for i in range(8)},
              "required": [f"k{i}" for i in range(8)], "additionalProperties": False}
    try:
        engine.add_request("free", {"prompt": PROMPT}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        engine.add_request("slow", {"prompt": PROMPT},
                           SamplingParams(temperature=0, max_tokens=400, structured_outputs=SO(json=schema)))
        assert started.wait(30)
        free_tokens_while_compiling = 0
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "free":
                    free_tokens_while_compiling = max(free_tokens_while_compiling, len(out.outputs[0].token_ids)) \
                        if not release.is_set() else free_tokens_while_compiling
                    if len(out.outputs[0].token_ids) >= 10:
                        release.set()
                if out.finished:
                    done[out.request_id] = out
    finally:
        release.set()
        manager._compile = real_compile
    assert free_tokens_while_compiling >= 10
    assert len(done["free"].outputs[0].token_ids) == 40
    _assert_valid(schema, done["slow"].outputs[0].text, done["slow"].outputs[0].finish_reason)


def test_deferred_masks_change_no_token(llama_llm, baseline, monkeypatch):
    """Deferred masks (sample first, compute the mask only for a refused token) give exactly the
    tokens of masks computed ahead, greedy and seeded-sampled rows alike: with the default
    back-off (``baseline``), with no back-off (every eligible step defers; the random model's
    token is then sometimes accepted without a mask and sometimes refused: both branches run),
    and with deferral off."""
    from pagoda.structured_output.manager import DeferPolicy

    manager = llama_llm.engine.core.structured
    assert manager.defer_masks  # the default, with which ``baseline`` was generated
    monkeypatch.setattr(DeferPolicy, "MAX_BACKOFF", 0)
    before = dict(manager.stats)
    always = _subset_outputs(llama_llm)
    stats = {k: manager.stats[k] - before[k] for k in before}
    assert stats["deferred"] > stats["refused"] > 0
    manager.defer_masks = False
    try:
        ahead = _subset_outputs(llama_llm)
    finally:
        manager.defer_masks = True
    assert always == baseline and ahead == baseline


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_tokenizer_larger_than_the_model_vocabulary(llama_dir, tmp_path, backend):
    """A fine-tune that added tokens to the tokenizer without resizing the embeddings: the grammar
    library knows every tokenizer id, the ids without a logit are never allowed, and the greedy
    constrained outputs are the same tokens as on the unchanged checkpoint."""
    import shutil

    from transformers import AutoTokenizer

    grown = tmp_path / "grown"
    shutil.copytree(llama_dir, grown)
    tokenizer = AutoTokenizer.from_pretrained(grown)
    vocab = json.loads((grown / "config.json").read_text())["vocab_size"]
    tokenizer.add_tokens([f"<added_{i}>" for i in range(vocab - len(tokenizer) + 40)])
    tokenizer.save_pretrained(grown)
    assert len(AutoTokenizer.from_pretrained(grown)) > vocab
    greedy = [(i, s) for i, s in enumerate(SUBSET) if i % 2 == 0]
    outputs = {}
    for name, path in (("plain", llama_dir), ("grown", grown)):
        llm = LLM(str(path), kv_cache_memory=32 << 20, max_model_len=1024, structured_outputs_backend=backend)
        try:
            outs = llm.generate([PROMPT] * len(greedy), [_params(i, s, max_tokens=200) for i, s in greedy],
                                use_tqdm=False)
        finally:
            llm.shutdown()
        for (_, schema), out in zip(greedy, outs):
            _assert_valid(schema, out.outputs[0].text, out.outputs[0].finish_reason, strict=backend != "xgrammar")
            assert max(out.outputs[0].token_ids) < vocab
        outputs[name] = [o.outputs[0].token_ids for o in outs]
    assert outputs["grown"] == outputs["plain"]
