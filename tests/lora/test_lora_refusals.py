"""What LoRA cannot serve is refused with a clear error, and the engine keeps serving."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from lora_helpers import PROMPTS, no_adapter_paths

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.lora.peft import NO_ADAPTER

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FEED = [{"prompt_token_ids": PROMPTS[0]}]


def edited(src, dst, **changes):
    """A copy of adapter ``src`` with its config changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    (dict(r=32), "rank 32 exceeds --max-lora-rank 16"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "target modules ['embed_tokens'] are not supported"),
    (dict(target_modules=["lm_head"]), "target modules ['lm_head'] are not supported"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "bias 'all' is not supported"),
    (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
    # Patterns with catastrophic backtracking (for Python's re): refused quickly, the second one
    # (catastrophic for the regex engine too) by the match's time limit.
    (dict(target_modules="(([a-z_.0-9]+)+)+Z"), "matches none of"),
    (dict(target_modules="(([a-z_.0-9]|[a-z])+)+[0-9]"), "took longer than"),
    (dict(target_modules="(q_proj"), "not a valid regular expression"),
])
def test_unsupported_adapter_configs_are_refused(lora_llm, lora_adapters, tmp_path, changes, message):
    bad = edited(lora_adapters["attn8"], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        lora_llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 90, str(bad)))
    assert lora_llm.generate(FEED, GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_target_modules_regex_is_matched(lora_adapters, tmp_path):
    from pagoda.lora.peft import read_adapter_config

    cfg = read_adapter_config(str(edited(lora_adapters["attn8"], tmp_path / "re", target_modules=r".*\.(q|v)_proj")), 16)
    assert cfg.target_modules == {"q_proj", "v_proj"}


def test_unsupported_weights_are_refused(lora_llm, lora_adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    src = lora_adapters["attn8"]
    tensors = load_file(str(src / "adapter_model.safetensors"))
    cases = {
        "lm_head": {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)},
        "shape": {k: torch.zeros(v.shape[0], 2 * v.shape[1]) if ".lora_A." in k else v for k, v in tensors.items()},
        "half": {k: v for k, v in tensors.items() if ".lora_B." not in k},
    }
    messages = {"lm_head": "is not a LoRA A/B matrix of a supported target", "shape": "do not fit the model",
                "half": "not both A and B"}
    for i, (case, weights) in enumerate(cases.items()):
        bad = tmp_path / case
        bad.mkdir()
        shutil.copy(src / "adapter_config.json", bad)
        save_file(weights, str(bad / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=messages[case]):
            lora_llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=LoRARequest(case, 80 + i, str(bad)))


def test_missing_adapters_all_get_one_message(lora_llm, tmp_path):
    """Which of these paths exist (and what they are) must not show in the refusal."""
    for i, path in enumerate(no_adapter_paths(tmp_path)):
        with pytest.raises(ValueError) as err:
            lora_llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 60 + i, str(path)))
        assert str(err.value) == f"LoRA adapter {str(path)!r}: {NO_ADAPTER}", path


def test_missing_files_and_bad_requests(lora_llm, lora_adapters, tmp_path, llama_llm):
    good = LoRARequest("dup", 72, str(lora_adapters["attn8"]))
    lora_llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=good)
    with pytest.raises(ValueError, match="lora_int_id 72 is already adapter 'dup'"):
        lora_llm.generate(FEED, GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("other", 72, str(lora_adapters["mlp16rs"])))
    with pytest.raises(ValueError, match="got 2 lora_requests for 1 prompts"):
        lora_llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=[good, good])
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("zero", 0, str(lora_adapters["attn8"]))
    with pytest.raises(ValueError, match="enable_lora=True"):
        llama_llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=good)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras .2. must be at least max_loras .4."),
    (dict(max_loras=0), "max_loras must be at least 1"),
    (dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": "x"}),
     "LoRA does not support the draft_model speculative method"),
])
def test_bad_engine_options_are_refused(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), enable_lora=True, **kwargs)


@pytest.mark.parametrize("flags, message", [
    (dict(lora_modules=["a=/x"], enable_lora=False), "need --enable-lora"),
    (dict(allow_runtime_lora_updating=True, enable_lora=False), "need --enable-lora"),
    (dict(lora_modules=["no-path"]), "must be name=path"),
    (dict(lora_modules=["a=/x", "a=/y"]), "names must be unique"),
    (dict(lora_modules=['{"name": "a"}']), "needs string 'name' and 'path'"),
    (dict(lora_modules=['{"name": "a", "path": "/x", "rank": 4}']), "nothing else"),
    (dict(lora_modules=["a=/definitely/not/here"]), "no readable PEFT adapter"),
])
def test_serve_lora_flags_are_checked_before_start(flags, message):
    import argparse

    from pagoda.entrypoints.openai.serving_lora import check_lora_args

    args = argparse.Namespace(**{"lora_modules": None, "allow_runtime_lora_updating": False, "enable_lora": True,
                                 "max_lora_rank": 16, **flags})
    with pytest.raises(ValueError, match=message):
        check_lora_args(args)


def test_serve_lora_modules_forms(lora_adapters):
    from pagoda.entrypoints.openai.serving_lora import parse_lora_modules

    path = str(lora_adapters["attn8"])
    assert parse_lora_modules([f"a={path}", json.dumps({"name": "b", "path": path, "base_model_name": "m"})]) == \
        [("a", path, None), ("b", path, "m")]
