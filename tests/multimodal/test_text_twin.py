"""Text requests to a vision-language model run as on the text model: against the model's
text-only twin (``pagoda.tools.text_twin``, the same decoder written as a plain text checkpoint)
the same greedy tokens and logprobs, and on the vision model no vision work at all: the encoder
is never called, no step carries image rows or 3-axis M-RoPE positions, and multi-step greedy
rounds run on the runner's lean decode step as a text model's do."""
from __future__ import annotations

import json

import pytest

from pagoda import LLM, SamplingParams
from pagoda.tools.make_vlm import make_vlm
from pagoda.tools.text_twin import text_weight_name, write_text_twin

# One family per text model the twin is written as: Qwen2, Qwen3, Llama.
FAMILIES = {"qwen2_5_vl": "Qwen2ForCausalLM", "qwen3_vl": "Qwen3ForCausalLM", "llava_siglip": "LlamaForCausalLM"}
PROMPTS = ["a text-only question about rivers", "why is the sky", "count: one two three"]


def test_weight_names_keep_the_language_model_only() -> None:
    assert text_weight_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_weight_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_weight_name("lm_head.weight") == "lm_head.weight"
    for vision in ("model.visual.blocks.0.attn.qkv.weight", "visual.merger.mlp.0.weight",
                   "vision_tower.encoder.layers.0.fc1.weight", "multi_modal_projector.linear_1.weight"):
        assert text_weight_name(vision) is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_text_requests_cost_what_they_cost_on_the_text_twin(family, tmp_path) -> None:
    vlm = make_vlm(tmp_path / family, arch=family)
    twin = write_text_twin(vlm, tmp_path / f"{family}-text")
    config = json.loads((twin / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family]] and "vision_config" not in config
    assert not (twin / "preprocessor_config.json").exists()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = {}
    for name, path in (("vlm", vlm), ("twin", twin)):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20, max_model_len=256, num_scheduler_steps=4)
        try:
            runner = llm.engine.core.executor
            assert runner.decode_step is not None  # the lean decode step serves the greedy rounds
            if name == "vlm":
                _watch_for_vision_work(runner)
            outs[name] = llm.generate(PROMPTS, params, use_tqdm=False)
            if name == "vlm":
                assert runner.mm.num_encoded == 0 and len(runner.mm.cache) == 0
                assert runner.seen_steps > 0
        finally:
            llm.shutdown()
    for vlm_out, twin_out in zip(outs["vlm"], outs["twin"]):
        assert vlm_out.prompt_token_ids == twin_out.prompt_token_ids
        assert vlm_out.outputs[0].token_ids == twin_out.outputs[0].token_ids
        lps = [[e[t] for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in (vlm_out, twin_out)]
        assert lps[0] == pytest.approx(lps[1], abs=1e-5)


def _watch_for_vision_work(runner) -> None:
    """Fail on any call of the encoder, and on any step with image rows or [3, T] positions."""
    def no_encoder(*args, **kwargs):
        raise AssertionError("a text request ran the vision encoder")

    runner.model.encode_image = no_encoder
    prepare = runner.prepare
    runner.seen_steps = 0

    def checked(sched):
        inputs, plan = prepare(sched)
        assert inputs.mm is None and inputs.positions.dim() == 1
        runner.seen_steps += 1
        return inputs, plan

    runner.prepare = checked


def test_bench_throughput_compare_text_twin(tmp_path) -> None:
    """``pagoda bench throughput --compare text-twin``: both engines run the same text workload
    (every request's tokens produced) and the ratio is reported; images are refused in this mode."""
    import argparse

    from pagoda.bench.throughput import add_cli

    vlm = make_vlm(tmp_path / "vlm", arch="llava_siglip")
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    out = tmp_path / "out.json"
    common = ["throughput", "--model", str(vlm), "--num-prompts", "3", "--input-len", "8:12", "--output-len", "4:6",
              "--kv-cache-memory", str(16 << 20), "--max-model-len", "128"]
    args = parser.parse_args([*common, "--compare", "text-twin", "--rounds", "1", "--output-json", str(out)])
    assert args.func(args) == 0
    payload = json.loads(out.read_text())
    assert set(payload["results"]) == {"pagoda", "text-twin"}
    ratio = payload["output_tokens_per_s_ratio_vs_text_twin"]
    assert ratio == pytest.approx(payload["results"]["pagoda"]["output_tokens_per_s"]
                                  / payload["results"]["text-twin"]["output_tokens_per_s"])
    args = parser.parse_args([*common, "--compare", "text-twin", "--images", "1"])
    with pytest.raises(SystemExit, match="leave out --images"):
        args.func(args)
