"""Embedding models: ``LLM.embed`` and ``/v1/embeddings`` (through the official ``openai`` client)
equal ``sentence-transformers`` on the same checkpoint (a random Qwen3 with sentence-transformers
files: last-token pooling with Normalize, and mean pooling without), within 1e-4 cosine in
float32, for text and token-id inputs, batched, with prompts prefilled in small chunks."""
from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import torch

from server_helpers import ServerProcess, side_by_side

MODEL = "m"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog and runs far away into the woods"]
# Over two 16-token KV blocks: a prefix-cache hit would skip positions that mean pooling reads.
LONG_IDS = [(7 * i + 3) % 500 + 5 for i in range(40)]
CHUNK = 8  # --max-num-batched-tokens: the longer prompts are prefilled in several chunks
TOLERANCE = 1e-4


def _as_bare_decoder(path: Path) -> None:
    """Rewrite a checkpoint as Qwen3-Embedding ships it: the decoder's weights without their
    "model." prefix, no LM head, and ``tie_word_embeddings`` false all the same."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head.")},
              path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))


def _with_sentence_transformers(src: Path, dst: Path, mode: str, normalize: bool) -> Path:
    """A copy of ``src`` with sentence-transformers files: Transformer, Pooling (``mode``),
    and a Normalize module when ``normalize``."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (dst / "2_Normalize").mkdir()
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    keys = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    pooling = {f"pooling_mode_{k}": k == mode for k in keys}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    return dst


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-models")
    base = model_factory("qwen3")
    last = _with_sentence_transformers(base, root / "last", "lasttoken", True)
    _as_bare_decoder(last)
    return {"last": last, "mean": _with_sentence_transformers(base, root / "mean", "mean_tokens", False)}


@pytest.fixture(scope="module")
def server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = {"last": ServerProcess(models["last"], tmp_path_factory.mktemp("embedding-logs"), "--served-model-name",
                                     MODEL, "--max-num-batched-tokens", str(CHUNK), "--dtype", "float32")}
    with side_by_side(started) as ready:
        yield ready["last"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _reference(model_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


def _reference_ids(st, ids: list[int]) -> torch.Tensor:
    """sentence-transformers' embedding of a prompt given as token ids (its modules in order)."""
    with torch.no_grad():
        features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        return st.forward(features)["sentence_embedding"][0].float()


def _assert_close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got, dtype=torch.float32)
    assert got_t.shape == want.shape
    cosine = torch.nn.functional.cosine_similarity(got_t, want, dim=0).item()
    assert cosine > 1 - TOLERANCE, cosine
    assert torch.allclose(got_t, want, atol=1e-4, rtol=1e-3)  # the norm too, not only the direction


def test_pooler_from_checkpoint_files_and_flags(models: dict[str, Path], model_factory) -> None:
    from pagoda.pooling import PoolerConfig, resolve_pooler

    assert resolve_pooler(str(models["last"]), "auto", "auto", None, None) == PoolerConfig("LAST", True)
    assert resolve_pooler(str(models["mean"]), "auto", "auto", None, None) == PoolerConfig("MEAN", False)
    assert resolve_pooler(str(models["mean"]), "auto", "auto", "cls", True) == PoolerConfig("CLS", True)
    assert resolve_pooler(str(models["last"]), "generate", "auto", None, None) is None
    plain = str(model_factory("qwen3"))
    assert resolve_pooler(plain, "auto", "auto", None, None) is None
    assert resolve_pooler(plain, "embed", "auto", None, None) == PoolerConfig("LAST", True)
    assert resolve_pooler(plain, "auto", "pooling", "MEAN", False) == PoolerConfig("MEAN", False)
    with pytest.raises(ValueError, match="pooling_type"):
        resolve_pooler(plain, "embed", "auto", "max", None)


def test_pooler_flags_parse() -> None:
    import argparse

    from pagoda.config import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args([]).normalize is None
    ns = parser.parse_args(["--task", "embed", "--pooling-type", "MEAN", "--no-normalize"])
    args = EngineArgs.from_namespace(ns)
    assert (args.task, args.pooling_type, args.normalize) == ("embed", "MEAN", False)
    assert parser.parse_args(["--runner", "pooling", "--normalize"]).normalize is True


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_offline_embed_equals_sentence_transformers(models: dict[str, Path], kind: str) -> None:
    """Texts and token ids, batched with prompts chunked over several steps; the long prompt twice
    (its blocks are cached after the first: the second must not reuse them and pool the rest)."""
    from pagoda import LLM, SamplingParams

    st = _reference(models[kind])
    llm = LLM(str(models[kind]), kv_cache_memory=16 << 20, max_model_len=256, max_num_batched_tokens=CHUNK,
              dtype="float32")
    try:
        outs = llm.embed([*TEXTS, LONG_IDS, LONG_IDS], use_tqdm=False)
        want = st.encode(TEXTS, convert_to_tensor=True).float()
        for out, w in zip(outs, want):
            _assert_close(out.outputs.embedding, w)
        for out in outs[2:]:
            _assert_close(out.outputs.embedding, _reference_ids(st, LONG_IDS))
        # After the first ones cached its blocks: LAST pooling reuses them (it reads only the
        # last position, always computed), MEAN matches nothing.
        again = llm.generate([LONG_IDS], SamplingParams(pooling=kind.upper(), max_tokens=None), use_tqdm=False)[0]
        assert (again.num_cached_tokens >= 32) == (kind == "last") and again.outputs[0].token_ids == []
        vector = torch.tensor(again.embedding)
        _assert_close((vector / vector.norm() if kind == "last" else vector).tolist(), _reference_ids(st, LONG_IDS))
        if kind == "last":
            short = llm.embed(TEXTS[0], use_tqdm=False, dimensions=16)[0].outputs.embedding
            cut = want[0][:16]
            _assert_close(short, cut / cut.norm())
    finally:
        llm.shutdown()


def test_generation_and_embeddings_share_a_step(llama_llm, llama_dir: Path) -> None:
    """Pooling requests in the same steps as a generating one (any decoder pools when asked):
    the generation is unchanged, the embeddings equal transformers' final hidden states pooled."""
    from transformers import AutoModel

    from pagoda import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = llama_llm.generate([LONG_IDS[:20]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    pooled = [SamplingParams(pooling=kind, max_tokens=None) for kind in ("MEAN", "LAST", "CLS")]
    outs = llama_llm.generate([LONG_IDS[:20], LONG_IDS, LONG_IDS, LONG_IDS], [greedy, *pooled], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone and outs[0].embedding is None
    with torch.no_grad():
        hf = AutoModel.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
        hidden = hf(torch.tensor([LONG_IDS])).last_hidden_state[0]
    for out, want in zip(outs[1:], (hidden.mean(0), hidden[-1], hidden[0])):
        _assert_close(out.embedding, want)
    with pytest.raises(ValueError, match="task='embed'"):
        llama_llm.embed(["hello"], use_tqdm=False)


def test_task_embed_serves_any_decoder(llama_dir: Path) -> None:
    """``task="embed"`` on a checkpoint without sentence-transformers files: LAST pooling, here
    without normalising (``normalize=False``), cut to ``dimensions``; CLS and MEAN requests
    prefilled in chunks of 8 tokens beside it."""
    from transformers import AutoModel

    from pagoda import LLM, SamplingParams

    llm = LLM(str(llama_dir), task="embed", normalize=False, kv_cache_memory=16 << 20, max_model_len=256,
              max_num_batched_tokens=CHUNK)
    try:
        out = llm.embed([LONG_IDS], use_tqdm=False, dimensions=32)[0].outputs.embedding
        cls, mean = llm.generate([LONG_IDS, LONG_IDS], [SamplingParams(pooling=k, max_tokens=None)
                                                         for k in ("CLS", "MEAN")], use_tqdm=False)
        # A prompt that fills the context: nothing follows an embedding's prompt, so the front
        # end's check and the engine core's agree that it fits.
        whole = [(7 * i) % 500 + 3 for i in range(256)]
        filled = llm.embed([whole], use_tqdm=False)[0].outputs.embedding
    finally:
        llm.shutdown()
    with torch.no_grad():
        hf = AutoModel.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
        hidden = hf(torch.tensor([LONG_IDS])).last_hidden_state[0]
        hidden_whole = hf(torch.tensor([whole])).last_hidden_state[0]
    _assert_close(out, hidden[-1, :32])
    _assert_close(cls.embedding, hidden[0])
    _assert_close(mean.embedding, hidden.mean(0))
    _assert_close(filled, hidden_whole[-1])


def _prompt_tokens_metric(server: ServerProcess) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagoda:prompt_tokens_total{"))


def test_server_float_batch_and_token_ids(client: openai.OpenAI, server: ServerProcess,
                                          models: dict[str, Path]) -> None:
    st = _reference(models["last"])
    before = _prompt_tokens_metric(server)
    resp = client.embeddings.create(model=MODEL, input=TEXTS)
    assert resp.object == "list" and resp.model == MODEL and [d.index for d in resp.data] == [0, 1]
    want = st.encode(TEXTS, convert_to_tensor=True).float()
    for d, w in zip(resp.data, want):
        assert d.object == "embedding"
        _assert_close(d.embedding, w)
    num_tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == num_tokens
    assert _prompt_tokens_metric(server) - before == num_tokens
    ids = client.embeddings.create(model=MODEL, input=[LONG_IDS, LONG_IDS[:5]])
    _assert_close(ids.data[0].embedding, _reference_ids(st, LONG_IDS))
    _assert_close(ids.data[1].embedding, _reference_ids(st, LONG_IDS[:5]))
    one = client.embeddings.create(model=MODEL, input=LONG_IDS[:5])  # one prompt of token ids
    assert len(one.data) == 1
    _assert_close(one.data[0].embedding, _reference_ids(st, LONG_IDS[:5]))
    # vLLM's truncate_prompt_tokens: each input embedded as its last k tokens.
    cut = client.embeddings.create(model=MODEL, input=[LONG_IDS], extra_body={"truncate_prompt_tokens": 7})
    _assert_close(cut.data[0].embedding, _reference_ids(st, LONG_IDS[-7:]))
    assert cut.usage.prompt_tokens == 7


def test_server_base64_and_dimensions(client: openai.OpenAI, server: ServerProcess,
                                      models: dict[str, Path]) -> None:
    want = _reference(models["last"]).encode(TEXTS[1], convert_to_tensor=True).float()
    raw = httpx.post(server.base_url + "/v1/embeddings",
                     json={"model": MODEL, "input": TEXTS[1], "encoding_format": "base64"}, timeout=60).json()
    blob = base64.b64decode(raw["data"][0]["embedding"])
    _assert_close(list(struct.unpack(f"<{len(blob) // 4}f", blob)), want)
    # The openai client asks for base64 by default and decodes it itself.
    _assert_close(client.embeddings.create(model=MODEL, input=TEXTS[1]).data[0].embedding, want)
    short = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=16, encoding_format="float")
    cut = want[:16]
    _assert_close(short.data[0].embedding, cut / cut.norm())


@pytest.mark.parametrize("body,param", [
    ({"input": [5, 512]}, "input"),  # a token id outside the 512-token vocabulary
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [7] * 513}, "input"),  # longer than --max-model-len 512
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, None),
])
def test_server_bad_input_is_400(server: ServerProcess, body: dict, param: str | None) -> None:
    resp = httpx.post(server.base_url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert httpx.post(server.base_url + "/v1/embeddings", json={"model": MODEL, "input": "ok"},
                      timeout=60).status_code == 200


def test_embedding_model_does_not_generate(client: openai.OpenAI) -> None:
    """The checkpoint has no LM head (as Qwen3-Embedding ships): generation is refused, clearly."""
    with pytest.raises(openai.BadRequestError, match="served for embeddings"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)


def test_server_large_invalid_body_is_400(server: ServerProcess) -> None:
    """A body over 1 MiB is checked in the worker process first, with the route's 400."""
    body = {"model": MODEL, "input": [[1, 2, -3]] + [[5] * 100] * 4000}  # 1.2 MB: too many inputs, a negative id
    resp = httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"].startswith("input"), resp.text
