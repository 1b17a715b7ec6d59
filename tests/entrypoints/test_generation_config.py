"""A model's generation_config.json sampling defaults stand for the fields a request leaves
unset, as vLLM's ``--generation-config auto`` makes them: offline (``LLM.generate`` without
params, ``get_default_sampling_params``) and on the server; ``vllm`` and an override JSON change
them; bad values are refused at start."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs, EngineConfig
from tests.entrypoints.server_helpers import ServerProcess

# Greedy (top_k 1) and 7 new tokens: both visible in any output.
GENERATION = {"temperature": 0.9, "top_k": 1, "max_new_tokens": 7, "repetition_penalty": 1.05, "do_sample": True}


@pytest.fixture(scope="module")
def tuned_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(llama_dir, out)
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, **GENERATION}))
    return out


def test_the_defaults_are_read_overridden_and_checked(tuned_dir: Path, tmp_path: Path) -> None:
    def defaults(**kw) -> dict:
        return EngineConfig.from_args(EngineArgs(model=str(tuned_dir), device="cpu", **kw)).model.generation_defaults

    assert defaults() == {"temperature": 0.9, "top_k": 1, "repetition_penalty": 1.05, "max_tokens": 7}
    assert defaults(generation_config="vllm") == {}
    assert defaults(override_generation_config='{"temperature": 0.2, "top_p": 0.5}')["top_p"] == 0.5
    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"min_p": 0.1}))
    assert defaults(generation_config=str(elsewhere)) == {"min_p": 0.1}
    with pytest.raises(ValueError, match="generation config's sampling defaults are not valid.*top_p"):
        defaults(override_generation_config='{"top_p": 2}')
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a directory"):
        defaults(generation_config=str(tmp_path / "nope"))


def test_offline_generate_without_params_takes_them(tuned_dir: Path) -> None:
    llm = LLM(str(tuned_dir), kv_cache_memory=8 << 20, max_model_len=256)
    try:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.9, top_k=1, repetition_penalty=1.05,
                                                                   max_tokens=7)
        first, again = (llm.generate(["Hello there"], use_tqdm=False)[0].outputs[0] for _ in range(2))
        assert len(first.token_ids) <= 7 and first.token_ids == again.token_ids  # top_k 1: the same tokens
    finally:
        llm.shutdown()


def test_the_server_fills_unset_fields_with_them(tuned_dir: Path, tmp_path: Path) -> None:
    """(The same server checks vLLM's ``--chat-template FILE``: every chat prompt renders with it.)"""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}")
    server = ServerProcess(tuned_dir, tmp_path, "--chat-template", str(template))
    try:
        server.wait_ready()
        assert "request sampling defaults from the model's generation config" in server.log()
        ids = httpx.post(server.base_url + "/tokenize", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}).json()["tokens"]
        assert httpx.post(server.base_url + "/detokenize", timeout=30,
                          json={"tokens": ids}).json()["prompt"] == "<<user:hi>>"
        body = {"model": str(tuned_dir), "prompt": [5, 6, 7], "ignore_eos": True}
        outs = [httpx.post(server.base_url + "/v1/completions", json={**body, "seed": s}, timeout=60).json()
                for s in (1, 2)]
        assert [o["usage"]["completion_tokens"] for o in outs] == [7, 7]  # max_new_tokens
        assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]  # top_k 1 whatever the seed
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": str(tuned_dir), "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 7
        free = httpx.post(server.base_url + "/v1/completions", timeout=60,
                          json={**body, "max_tokens": 12, "top_k": -1, "temperature": 1.0}).json()
        assert free["usage"]["completion_tokens"] == 12  # fields a request sets win
    finally:
        assert server.stop() == 0, server.log()
