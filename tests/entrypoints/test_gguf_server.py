"""``pagoda serve model.gguf``: a GGUF file served with the tokenizer and chat template its
metadata carries (a template of its own here, so it cannot come from anywhere else), answering
a chat completion as the offline engine on the same file does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pagoda import LLM, SamplingParams
from server_helpers import ServerProcess, start_server

pytest.importorskip("gguf")

# Not the checkpoints' ChatML: a prompt rendered with it proves where the template came from.
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def gguf_path(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagoda.bench.gguf_export import write_gguf

    src = tmp_path_factory.mktemp("ckpt") / "llama"
    shutil.copytree(llama_dir, src)
    cfg_path = src / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    (src / "chat_template.jinja").unlink(missing_ok=True)
    return write_gguf(src, tmp_path_factory.mktemp("gguf") / "tiny-Q4_0.gguf", "q4_0")


@pytest.fixture(scope="module")
def server(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(gguf_path, tmp_path_factory.mktemp("server-logs"), "--served-model-name", "tiny-gguf")
    yield srv
    srv.stop()


def test_serve_gguf_answers_a_chat_with_the_files_template(server: ServerProcess, gguf_path: Path) -> None:
    body = {"model": "tiny-gguf", "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()

    llm = LLM(str(gguf_path), kv_cache_memory=16 << 20, max_model_len=512)
    try:
        tok = llm.get_tokenizer()
        rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert rendered == "<<system>> Be brief.\n<<user>> Name a colour.\n<<assistant>> "
        ids = tok(rendered, add_special_tokens=False).input_ids
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=10),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert data["usage"]["prompt_tokens"] == len(ids)
    assert data["choices"][0]["message"]["content"] == out.text
    assert data["usage"]["completion_tokens"] == len(out.token_ids)
    models = httpx.get(server.base_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-gguf"]
