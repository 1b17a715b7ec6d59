"""Request sampling defaults from a model's ``generation_config.json``, as vLLM's
``--generation-config`` reads them: its temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (as max_tokens) stand for the fields a request leaves unset
(``ModelConfig.generation_defaults``; the server's ``Serving.model_defaults``, offline
``LLM.get_default_sampling_params``)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json keys that become request sampling defaults, as vLLM reads them.
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: str, source: str = "auto", override: str | dict | None = None) -> dict[str, Any]:
    """Request sampling defaults (``SamplingParams`` names) from the generation config ``source``
    names (``auto``: the model's; ``vllm``: none; else a directory), with ``override`` (JSON, the
    file's key names) merged over; checked by building a ``SamplingParams`` from them."""
    from pagoda.sampling_params import SamplingParams

    if source == "vllm":
        found: dict[str, Any] = {}
    else:
        folder = Path(model_path) if source == "auto" else Path(source)
        if source != "auto" and not folder.is_dir():
            raise ValueError(f"generation_config must be auto, vllm or a directory, got {source!r}")
        gen = folder / "generation_config.json" if folder.is_dir() else None
        try:
            found = json.loads(gen.read_text()) if gen is not None and gen.is_file() else {}
        except ValueError as exc:
            raise ValueError(f"{gen} is not valid JSON: {exc}") from exc
    if override:
        extra = json.loads(override) if isinstance(override, str) else override
        if not isinstance(extra, dict):
            raise ValueError("override_generation_config must be a JSON object")
        found = {**found, **extra}
    defaults = {name: found[key] for key, name in GENERATION_DEFAULT_KEYS.items() if found.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"the generation config's sampling defaults are not valid: {exc}") from exc
    return defaults


def log_generation_defaults(defaults: dict[str, Any]) -> None:
    """One line where requests' sampling defaults are the model's, not pagoda's (as vLLM says it)."""
    if defaults:
        logger.info("request sampling defaults from the model's generation config: %s (fields a request sets win; "
                    "--generation-config vllm keeps pagoda's own)", defaults)
