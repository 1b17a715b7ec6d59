"""Command lines and engine arguments written for vLLM: its spellings, aliases and no-op flags
work, its other flags fail naming themselves, and its value forms parse (``vllm_flags.py``,
``config.integer``, the config's vLLM names)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pagoda.config import EngineArgs, EngineConfig, integer
from pagoda.entrypoints.cli import main
from pagoda.entrypoints.vllm_flags import ignore_vllm_kwargs, translate
from pagoda.multimodal.options import parse_limits


def test_vllm_spellings_become_pagodas(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        out = translate(["M", "--max_model_len", "64", "-tp", "2", "--trust-remote-code", "--swap-space", "4",
                         "--uvicorn-log-level=debug", "--kv-cache-memory-bytes=1GiB", "--tokenizer-mode", "auto",
                         "--enable_prefix_caching", "--port", "9"])
    assert out == ["M", "--max-model-len", "64", "--tensor-parallel-size", "2", "--kv-cache-memory=1GiB",
                   "--enable-prefix-caching", "--port", "9"]
    assert "--trust-remote-code" in caplog.text and "--swap-space" in caplog.text  # said, not silently dropped
    with pytest.raises(ValueError, match="--tokenizer-mode slow: pagoda implements only --tokenizer-mode auto"):
        translate(["--tokenizer-mode", "slow"])


def test_an_unknown_vllm_flag_names_itself(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "/nonexistent", "--middleware", "x.y"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --middleware x.y" in err and "vllm serve" in err


def test_vllms_value_forms() -> None:
    assert [integer(t) for t in ("32k", "32K", "1M", "2GiB", "1.5k", "77")] == [32000, 32768, 1 << 20, 2 << 30,
                                                                              1500, 77]
    assert parse_limits("image=2,video=0") == parse_limits('{"image": 2, "video": 0}')


@pytest.mark.parametrize("changes, check", [
    (dict(max_model_len=-1), lambda c: c.model.max_model_len == c.model.max_position_embeddings),
    (dict(load_format="safetensors"), lambda c: c.model.load_format == "auto"),
    (dict(task="embedding"), lambda c: c.pooler is not None),
    (dict(speculative_config='{"model": "MODEL", "num_speculative_tokens": 2}'),
     lambda c: c.speculative.method == "draft_model"),
    (dict(max_logprobs=-1), lambda c: c.max_logprobs == c.model.vocab_size),
])
def test_vllms_names_of_engine_options(llama_dir: Path, changes: dict, check) -> None:
    changes = {k: v.replace("MODEL", str(llama_dir)) if isinstance(v, str) else v for k, v in changes.items()}
    assert check(EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu", **changes)))


def test_vllms_no_op_engine_arguments_are_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        kept = ignore_vllm_kwargs({"trust_remote_code": True, "swap_space": 4, "max_model_len": 64,
                                   "tokenizer_mode": "auto"})
    assert kept == {"max_model_len": 64} and "trust_remote_code" in caplog.text
    with pytest.raises(ValueError, match="tokenizer_mode"):
        ignore_vllm_kwargs({"tokenizer_mode": "mistral"})


def test_a_chat_template_path_that_is_nothing_fails_before_the_model_loads(llama_dir: Path, tmp_path: Path) -> None:
    """(``--chat-template`` with a file: ``test_generation_config.py``'s server.)"""
    from tests.entrypoints.server_helpers import ServerProcess

    bad = ServerProcess(llama_dir, tmp_path, "--chat-template", str(tmp_path / "missing.jinja"))
    assert bad.proc.wait(60) == 1 and "no such file, and not a template" in bad.log()
