"""Hub names (pagoda/models/hub.py): ``ORG/NAME`` resolved through huggingface_hub.

Nothing here reaches a real hub. A local HTTP server (``fake_hub.py``) stands in for it through
``HF_ENDPOINT``; huggingface_hub itself downloads from it into a temporary ``HF_HUB_CACHE``, so
the cache the offline tests read is laid out exactly as huggingface_hub lays it out. Because
huggingface_hub reads ``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and the cache folder once, at import,
every resolution runs in a fresh subprocess with its own environment.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import httpx
import pytest

from pagoda.models import hub as hub_mod
from pagoda.models.hub import ModelSourceError, choose_gguf, parse_hub_name, resolve_model
from tests.entrypoints.server_helpers import ServerProcess, serve_command
from tests.models.fake_hub import FakeHub, FakeRepo, commit_sha, files_of

LLAMA, SHARDED, GGUF, GATED, BIN_ONLY = ("pagoda-test/tiny-llama", "pagoda-test/tiny-sharded", "pagoda-test/tiny-gguf",
                                         "pagoda-test/gated", "pagoda-test/bin-only")
GRANTED_TOKEN = "hf_granted"
# Files a repository holds beside a checkpoint that pagoda never reads: none may be fetched.
JUNK = {"pytorch_model.bin": os.urandom(300_000), "original/consolidated.00.pth": os.urandom(50_000),
        "original/model.safetensors": os.urandom(1000), "README.md": b"# tiny\n", ".gitattributes": b"*.bin lfs\n",
        "onnx/model.onnx": os.urandom(1000)}
GGUF_FILES = {name: b"GGUF" + os.urandom(2000) for name in (
    "tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf",
    "F16/tiny-F16-00001-of-00002.gguf", "F16/tiny-F16-00002-of-00002.gguf")}


@pytest.fixture(scope="module")
def fake_hub(model_factory) -> FakeHub:
    llama = files_of(model_factory("llama"))
    sharded = files_of(model_factory("llama", max_shard_size="200KB"))
    # A Mistral-style repository: a consolidated copy of the weights beside the indexed shards.
    sharded_repo = {**sharded, "consolidated.safetensors": os.urandom(100_000), **JUNK}
    hub = FakeHub({
        LLAMA: FakeRepo({"main": (commit_sha("main"), {**llama, **JUNK}),
                         "v1": (commit_sha("v1"), {**llama, "README.md": b"# v1\n"})}),
        SHARDED: FakeRepo({"main": (commit_sha("sharded"), sharded_repo)}),
        # A GGUF selection fetches its one file, not even the config and tokenizer beside it.
        GGUF: FakeRepo({"main": (commit_sha("gguf"), {**GGUF_FILES, "README.md": b"# gguf\n",
                                                      "config.json": llama["config.json"],
                                                      "tokenizer.json": llama["tokenizer.json"]})}),
        GATED: FakeRepo({"main": (commit_sha("gated"), llama)}, gated_tokens=frozenset({GRANTED_TOKEN})),
        BIN_ONLY: FakeRepo({"main": (commit_sha("bin"), {"config.json": llama["config.json"],
                                                          "pytorch_model.bin": b"x" * 100})}),
    }).start()
    hub.checkpoints = {LLAMA: llama, SHARDED: sharded}  # type: ignore[attr-defined]
    yield hub
    hub.stop()


def hub_env(hub: FakeHub, cache: Path, offline: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a process that sees ``hub`` as the Hub and ``cache`` as its cache."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_HUB_CACHE",
                        "HF_HOME", "PAGODA_USE_MODELSCOPE")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(cache.parent / "hf-home"), HF_HUB_CACHE=str(cache),
               HF_HUB_DISABLE_TELEMETRY="1", **extra)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


_RESOLVE = """
import json, sys
from pagoda.models.hub import ModelSourceError, resolve_model, resolve_tokenizer
out = []
for job in json.loads(sys.argv[1]):
    fn = resolve_tokenizer if job.pop("tokenizer", False) else resolve_model
    try:
        out.append({"path": fn(**job)})
    except ModelSourceError as exc:
        out.append({"error": str(exc)})
print("RESULT " + json.dumps(out))
"""


def resolve_with_log(env: dict[str, str], *jobs: dict) -> tuple[list[dict], str]:
    """Resolve each job (``resolve_model``'s keyword arguments) in one fresh process; the
    results and what the process wrote to stderr."""
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(list(jobs))], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


def resolve_all(env: dict[str, str], *jobs: dict) -> list[dict]:
    return resolve_with_log(env, *jobs)[0]


@pytest.fixture(scope="module")
def downloaded(fake_hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One online run that fills a fresh cache: the safetensors repositories, revision v1, a
    tokenizer on its own into another download dir, and two GGUF files."""
    cache = tmp_path_factory.mktemp("hub") / "cache"
    other = cache.parent / "download-dir"
    jobs = [{"name": LLAMA}, {"name": SHARDED}, {"name": LLAMA, "revision": "v1"},
            {"name": LLAMA, "download_dir": str(other), "tokenizer": True},
            {"name": GGUF + ":Q8_0"}, {"name": GGUF + ":tiny-Q4_K_S.gguf"}]
    results, log = resolve_with_log(hub_env(fake_hub, cache), *jobs)
    assert all("path" in r for r in results), results
    return {"cache": cache, "other": other, "jobs": jobs, "results": [r["path"] for r in results],
            "requests": fake_hub.count(), "log": log}


def test_hub_names_are_told_from_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_hub_name("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert parse_hub_name("gpt2") == ("gpt2", None)
    assert parse_hub_name("unsloth/Qwen3-8B-GGUF:Q4_K_M") == ("unsloth/Qwen3-8B-GGUF", "Q4_K_M")
    assert parse_hub_name("org/name:model-Q8_0.gguf") == ("org/name", "model-Q8_0.gguf")
    for local in ("/abs/dir", "./rel", "../up", "~/m", "a/b/c", "org/bad--name", "org/x:sub/file.gguf"):
        assert parse_hub_name(local) is None, local
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    monkeypatch.chdir(tmp_path)
    assert parse_hub_name("org/name") is None  # an existing folder wins over the hub
    assert resolve_model("org/name") == "org/name"


def test_gguf_choice() -> None:
    files = [*GGUF_FILES, "README.md"]
    assert choose_gguf("r", files, "Q8_0") == "tiny-Q8_0.gguf"
    assert choose_gguf("r", files, "q4_k_m") == "tiny-Q4_K_M.gguf"  # case-insensitive
    assert choose_gguf("r", files, "tiny-Q4_K_S.gguf") == "tiny-Q4_K_S.gguf"
    assert choose_gguf("r", ["x/a-Q6_K.gguf", "mmproj-a-f16.gguf"], None) == "x/a-Q6_K.gguf"  # the only model file
    with pytest.raises(ModelSourceError, match="no .gguf file of the repository matches.*tiny-Q8_0.gguf"):
        choose_gguf("r", files, "Q4_K")  # a prefix of Q4_K_M / Q4_K_S is not a match
    with pytest.raises(ModelSourceError, match="5 .gguf files match"):
        choose_gguf("r", files, None)
    with pytest.raises(ModelSourceError, match="split into 2 files.*gguf-split --merge"):
        choose_gguf("r", files, "F16")


def test_download_fetches_only_what_pagoda_loads(fake_hub: FakeHub, downloaded: dict) -> None:
    cache, results = downloaded["cache"], downloaded["results"]
    for repo in (LLAMA, SHARDED):
        checkpoint = fake_hub.checkpoints[repo]  # type: ignore[attr-defined]
        # Every file of the checkpoint (config, tokenizer, chat template, weights, index), nothing else.
        assert fake_hub.downloads(repo) == set(checkpoint), repo
    main, sharded, v1, tokenizer, q8, q4ks = map(Path, results)
    assert main.parent == cache / "models--pagoda-test--tiny-llama" / "snapshots"
    assert main.name == commit_sha("main") and v1.name == commit_sha("v1")
    assert (cache / "models--pagoda-test--tiny-llama" / "refs" / "v1").read_text() == commit_sha("v1")
    for name, data in fake_hub.checkpoints[LLAMA].items():  # type: ignore[attr-defined]
        assert (main / name).read_bytes() == data
    assert sorted(p.name for p in sharded.iterdir()) == sorted(fake_hub.checkpoints[SHARDED])  # type: ignore
    # --tokenizer ORG/NAME into --download-dir: the tokenizer and config files only.
    assert tokenizer.is_relative_to(downloaded["other"])
    assert {p.name for p in tokenizer.iterdir()} == {"config.json", "generation_config.json", "tokenizer.json",
                                                     "tokenizer_config.json", "chat_template.jinja"}
    assert q8.name == "tiny-Q8_0.gguf" and q8.read_bytes() == GGUF_FILES["tiny-Q8_0.gguf"]
    assert q4ks.read_bytes() == GGUF_FILES["tiny-Q4_K_S.gguf"]
    assert fake_hub.downloads(GGUF) == {"tiny-Q8_0.gguf", "tiny-Q4_K_S.gguf"}
    # huggingface_hub's progress bars, on stderr.
    assert "Fetching 4 files: 100%" in downloaded["log"] and "Fetching 1 files: 100%" in downloaded["log"]


def test_offline_uses_the_cache_without_a_network_call(fake_hub: FakeHub, downloaded: dict) -> None:
    before = fake_hub.count()
    assert before == downloaded["requests"]
    jobs = [dict(job) for job in downloaded["jobs"]]
    results = resolve_all(hub_env(fake_hub, downloaded["cache"], offline=True), *jobs,
                          {"name": GGUF + ":Q4_K_M"}, {"name": LLAMA, "revision": "v2"})
    assert [r.get("path") for r in results[:len(jobs)]] == downloaded["results"]
    missing_gguf, missing_revision = results[len(jobs):]
    assert "not in the local cache" in missing_gguf["error"] and "HF_HUB_OFFLINE=1" in missing_gguf["error"]
    assert "revision v2" in missing_revision["error"] and "HF_HUB_OFFLINE=1" in missing_revision["error"]
    assert fake_hub.count() == before  # not one request reached the hub


def test_engine_config_resolves_model_tokenizer_and_draft(fake_hub: FakeHub, downloaded: dict) -> None:
    """The hook in ``EngineConfig.from_args``: the engine is built from local paths only."""
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": LLAMA})
    proc = subprocess.run([sys.executable, "-c", f"""
from pagoda.config import EngineArgs, EngineConfig
c = EngineConfig.from_args(EngineArgs(model={LLAMA!r}, tokenizer={LLAMA!r}, speculative_config={spec!r},
                                      device="cpu"))
print("PATHS", c.model.path, c.model.tokenizer, c.speculative.model)
"""], env=hub_env(fake_hub, downloaded["cache"], offline=True), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    main = downloaded["results"][0]
    assert f"PATHS {main} {main} {main}" in proc.stdout
    assert fake_hub.count() == downloaded["requests"]


def test_errors_name_the_model_and_the_remedy(fake_hub: FakeHub, downloaded: dict, tmp_path: Path) -> None:
    online = hub_env(fake_hub, tmp_path / "cache")
    missing, gated, revision, bin_only, gguf_none, granted = resolve_all(
        online, {"name": "pagoda-test/no-such-model"}, {"name": GATED}, {"name": LLAMA, "revision": "v9"},
        {"name": BIN_ONLY}, {"name": GGUF + ":Q5_K_M"}, {"name": GATED, "token": GRANTED_TOKEN})
    assert "'pagoda-test/no-such-model' is neither a local path nor a model on the Hugging Face Hub" \
        in missing["error"] and "HTTP 404" in missing["error"]
    assert f"{GATED} is gated" in gated["error"] and "HTTP 401" in gated["error"] and "--hf-token" in gated["error"]
    assert "has no revision 'v9'" in revision["error"]
    assert "no safetensors weights" in bin_only["error"] and ".bin" in bin_only["error"]
    assert "no .gguf file of the repository matches" in gguf_none["error"]
    assert Path(granted["path"], "model.safetensors").is_file()  # --hf-token
    # HF_TOKEN from the environment; a token without access is a 403.
    (env_token,) = resolve_all({**online, "HF_TOKEN": GRANTED_TOKEN}, {"name": GATED})
    assert env_token["path"] == granted["path"]
    (denied,) = resolve_all(hub_env(fake_hub, tmp_path / "cache2"), {"name": GATED, "token": "hf_other"})
    assert "HTTP 403" in denied["error"] and "gated" in denied["error"]
    # Nothing cached, and no hub: offline, or the network down (a closed port).
    empty = tmp_path / "empty"
    (offline,) = resolve_all(hub_env(fake_hub, empty, offline=True), {"name": LLAMA})
    assert offline["error"].startswith(f"model {LLAMA} is not in the local cache ({empty})")
    assert "HF_HUB_OFFLINE=1" in offline["error"]
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    (down,) = resolve_all({**hub_env(fake_hub, empty), "HF_ENDPOINT": closed}, {"name": LLAMA})
    assert "cannot be reached" in down["error"] and closed in down["error"]
    # With the network down a cached model still resolves.
    (cached,) = resolve_all({**hub_env(fake_hub, downloaded["cache"]), "HF_ENDPOINT": closed}, {"name": LLAMA})
    assert cached["path"] == downloaded["results"][0]
    # Online, a cached model costs one request (the revision's commit) and no download.
    fetched, before = fake_hub.downloads(LLAMA), fake_hub.count()
    (again,) = resolve_all(hub_env(fake_hub, downloaded["cache"]), {"name": LLAMA})
    assert again["path"] == downloaded["results"][0]
    assert fake_hub.downloads(LLAMA) == fetched and fake_hub.count() - before == 1


def test_serve_and_llm_take_a_hub_name_offline(fake_hub: FakeHub, downloaded: dict, tmp_path: Path) -> None:
    """The second start of a downloaded model: offline, served under its hub name."""
    before = fake_hub.count()
    env = hub_env(fake_hub, downloaded["cache"], offline=True)
    server = ServerProcess(LLAMA, tmp_path, set_env=env)  # type: ignore[arg-type]
    llm = subprocess.Popen([sys.executable, "-c", f"""
from pagoda import LLM, SamplingParams
from pagoda.models.hub import ModelSourceError
try:
    LLM("pagoda-test/not-cached")
except ModelSourceError as exc:
    print("ERROR", exc)
llm = LLM({LLAMA!r}, kv_cache_memory=8 << 20, max_model_len=256)
print("MODEL", llm.engine.config.model.path)
print("TOKENS", llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids)
"""], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server.wait_ready()
        models = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [LLAMA]
        body = httpx.post(server.base_url + "/v1/completions", timeout=120,
                          json={"model": LLAMA, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).json()
        assert body["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    out, err = llm.communicate(timeout=300)
    assert llm.returncode == 0, err
    assert "ERROR model pagoda-test/not-cached is not in the local cache" in out
    assert f"MODEL {downloaded['results'][0]}" in out
    assert "TOKENS [" in out
    assert fake_hub.count() == before


def test_serve_refuses_a_bad_hub_name_with_a_message(fake_hub: FakeHub, tmp_path: Path) -> None:
    cases = {"missing": ("pagoda-test/no-such-model", {}, "is neither a local path nor a model"),
             "gated": (GATED, {}, "is gated on the Hugging Face Hub"),
             "offline": (LLAMA, {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1 forbids downloading it")}
    procs = {name: subprocess.Popen(serve_command(model, "--port", "0"), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    env={**hub_env(fake_hub, tmp_path / name), **extra})
             for name, (model, extra, _) in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 1, (name, err)
        assert "pagoda serve: error: " in err and cases[name][2] in err, (name, err)
        assert "Traceback" not in err, (name, err)


class _FakeModelScope:
    """``modelscope.snapshot_download`` over a local folder: copies the files that match."""

    def __init__(self, source: Path, cache: Path) -> None:
        self.source, self.cache, self.calls = source, cache, []

    def snapshot_download(self, model_id: str, cache_dir=None, allow_patterns=None, ignore_patterns=None,
                          local_files_only=False, revision=None) -> str:
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append({"model_id": model_id, "patterns": allow_patterns, "offline": local_files_only,
                           "revision": revision, "cache_dir": cache_dir})
        folder = Path(cache_dir or self.cache) / model_id
        files = [p.relative_to(self.source).as_posix() for p in self.source.rglob("*") if p.is_file()]
        for name in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            if local_files_only and not (folder / name).is_file():
                raise ValueError(f"{name} is not cached")
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes((self.source / name).read_bytes())
        return str(folder)


def test_modelscope(model_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "repo"
    checkpoint = model_factory("llama")
    for name, data in {**files_of(checkpoint), **JUNK, **GGUF_FILES}.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    fake = _FakeModelScope(source, tmp_path / "ms-cache")
    monkeypatch.setitem(sys.modules, "modelscope", types.SimpleNamespace(snapshot_download=fake.snapshot_download))
    monkeypatch.setenv("PAGODA_USE_MODELSCOPE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    folder = Path(resolve_model("org/tiny", revision="v1.0"))
    assert sorted(p.name for p in folder.iterdir()) == sorted(files_of(checkpoint))
    assert all(c["revision"] == "v1.0" and not c["offline"] for c in fake.calls)
    assert resolve_model("org/tiny:Q8_0") == str(folder / "tiny-Q8_0.gguf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny") == str(folder) and fake.calls[-1]["offline"]
    with pytest.raises(ModelSourceError, match="cannot get model org/tiny from ModelScope .HF_HUB_OFFLINE=1"):
        resolve_model("org/tiny:Q4_K_M")  # not cached
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed
    with pytest.raises(ModelSourceError, match="needs the modelscope package: pip install modelscope"):
        resolve_model("org/tiny")
    monkeypatch.delenv("PAGODA_USE_MODELSCOPE")
    assert hub_mod.use_modelscope() is False
