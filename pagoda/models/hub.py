"""Model sources: a hub name resolved to local files before anything loads them.

``resolve_model(name, ...)`` returns ``name`` as it is when it is a local path. Otherwise a name
``ORG/NAME`` (or ``NAME``) is a model repository on the Hugging Face Hub: the files pagoda
reads (config, generation config, tokenizer files and chat template, the safetensors weights
with their index, embedding-model pooling files) are found in the local cache or downloaded
into it, and the local snapshot folder is returned. ``ORG/NAME:QUANT`` (``Q4_K_M``, ...) or
``ORG/NAME:FILE.gguf`` chooses exactly one ``.gguf`` file of the repository instead, and its
local path is returned. Nothing else of the repository is fetched.

Everything goes through ``huggingface_hub``: its cache layout (``--download-dir``, else
``HF_HUB_CACHE`` / ``HF_HOME``), ``HF_ENDPOINT``, ``HF_TOKEN`` (or ``--hf-token``), its progress
bars, and ``HF_HUB_OFFLINE=1`` (the cache only, no network call). With
``PAGODA_USE_MODELSCOPE=1`` the ``modelscope`` package does the same from ModelScope.

Every failure is a ``ModelSourceError`` whose message names the model and what to do; callers
print it (``pagoda serve``) or raise it (``LLM``) without a traceback of the hub's internals.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

logger = logging.getLogger(__name__)

# The files pagoda reads besides the weights (config.py, the tokenizer, chat templates,
# pooling.py for embedding models, legacy GPTQ options). Patterns as huggingface_hub matches
# them (fnmatch over the path in the repository).
METADATA_PATTERNS = (
    "config.json", "generation_config.json", "quantize_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
    "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja",
    "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", "*_Pooling/config.json",
    "model.safetensors.index.json",
)
WEIGHT_INDEX = "model.safetensors.index.json"
# Shards of a split GGUF (llama.cpp's gguf-split): model-00001-of-00003.gguf.
_GGUF_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


class ModelSourceError(OSError):
    """A model name that could not be resolved to local files; the message says why."""


def use_modelscope() -> bool:
    return os.environ.get("PAGODA_USE_MODELSCOPE", "").strip().lower() in ("1", "true", "yes", "on")


def parse_hub_name(name: str) -> tuple[str, str | None] | None:
    """``(repo_id, selector)`` for a hub name ``ORG/NAME[:QUANT|:FILE.gguf]``; None when ``name``
    is a local path or could not be a repository id (an absolute or ``./`` path, three parts)."""
    if os.path.exists(name) or name.startswith(("/", ".", "~")) or "\\" in name:
        return None
    repo, _, selector = name.partition(":")
    if "/" in selector or ":" in selector:
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, selector or None


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None,
                  token: str | None = None) -> str:
    """The local path to load for ``name``: itself when it is a local path (or no hub name),
    else the hub snapshot folder, or the chosen ``.gguf`` file (see the module docstring)."""
    parsed = parse_hub_name(name)
    if parsed is None:
        return name
    repo, selector = parsed
    if use_modelscope():
        path = _ModelScope(repo, revision, download_dir).model(selector)
    else:
        path = _HuggingFace(repo, revision, download_dir, token).model(selector)
    logger.info("model %s%s: %s", name, f" (revision {revision})" if revision else "", path)
    return path


def resolve_tokenizer(name: str, revision: str | None = None, download_dir: str | None = None,
                      token: str | None = None) -> str:
    """As ``resolve_model`` for a ``--tokenizer`` name: only the tokenizer and config files."""
    parsed = parse_hub_name(name)
    if parsed is None:
        return name
    repo, selector = parsed
    if selector is not None:
        raise ModelSourceError(f"tokenizer {name!r}: a tokenizer is a repository (ORG/NAME), not a file of one")
    if use_modelscope():
        return _ModelScope(repo, revision, download_dir).snapshot(METADATA_PATTERNS)
    return _HuggingFace(repo, revision, download_dir, token).snapshot(METADATA_PATTERNS)


def choose_gguf(repo: str, files: Sequence[str], selector: str | None) -> str:
    """The one ``.gguf`` file of ``files`` that ``selector`` names: a file path (or base name)
    ending in ``.gguf``, or a quantization name matched case-insensitively between separators
    (``Q4_K`` does not match ``Q4_K_M``); with no selector, the repository's only one."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower())
    if selector is not None and selector.lower().endswith(".gguf"):
        found = [f for f in ggufs if f == selector or f.rsplit("/", 1)[-1] == selector]
    elif selector is not None:
        word = re.compile(rf"(?:^|[-./]){re.escape(selector)}(?:$|[-.])", re.IGNORECASE)
        found = [f for f in ggufs if word.search(f[: -len(".gguf")])]
    else:
        found = ggufs
    if len(found) == 1 and not _GGUF_SHARD.search(found[0]):
        return found[0]
    listing = ", ".join(ggufs) or "none"
    wanted = f"{repo}:{selector}" if selector else repo
    if found and all(_GGUF_SHARD.search(f) for f in found):
        raise ModelSourceError(f"{wanted} is a GGUF split into {len(found)} files ({', '.join(found)}); pagoda loads "
                               "one .gguf file: merge them with llama.cpp's gguf-split --merge and serve the file")
    if not found:
        raise ModelSourceError(f"{wanted}: no .gguf file of the repository matches; its .gguf files: {listing}")
    raise ModelSourceError(f"{wanted}: {len(found)} .gguf files match ({', '.join(found)}); name one with "
                           f"{repo}:QUANT or {repo}:FILE.gguf")


def safetensors_files(folder: str | Path, files: Sequence[str]) -> list[str]:
    """The weight files to fetch: those the index names when the repository has one (a repo may
    also hold a consolidated copy the loader would not read), else its top-level safetensors."""
    index = Path(folder) / WEIGHT_INDEX
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelSourceError(f"corrupt weight index {index}: {exc}") from exc
    return sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))


def _no_weights_error(repo: str, files: Sequence[str]) -> ModelSourceError:
    other = sorted({Path(f).suffix for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".h5", ".onnx"))})
    also = f" (it holds {', '.join(other)} files, which pagoda does not load)" if other else ""
    return ModelSourceError(f"{repo} has no safetensors weights and no .gguf file{also}")


class _HuggingFace:
    """One repository at one revision on the Hugging Face Hub (or ``HF_ENDPOINT``)."""

    def __init__(self, repo: str, revision: str | None, cache_dir: str | None, token: str | None) -> None:
        self.repo, self.revision, self.cache_dir, self.token = repo, revision, cache_dir, token

    def model(self, selector: str | None) -> str:
        # The first call fetches the small files that say which weights to fetch (none for a
        # GGUF selection) and caches the repository's listing; the second fetches the weights.
        with _quiet_no_match():  # a GGUF repository has none of them
            folder = self.snapshot(() if selector is not None else METADATA_PATTERNS)
        commit = Path(folder).name
        files = self._listing(commit, folder)
        has_config = (Path(folder) / "config.json").is_file()
        weights = safetensors_files(folder, files) if selector is None and has_config else []
        if weights:
            return self.snapshot([glob.escape(w) for w in weights], commit)
        if selector is not None or any(f.lower().endswith(".gguf") for f in files):
            chosen = choose_gguf(self.repo, files, selector)
            return str(Path(self.snapshot([glob.escape(chosen)], commit)) / chosen)
        if not has_config:
            raise ModelSourceError(f"{self.repo} has no config.json: it is not a Hugging Face model repository "
                                   "pagoda can load (nor does it hold a .gguf file)")
        raise _no_weights_error(self.repo, files)

    def snapshot(self, patterns: Sequence[str], commit: str | None = None) -> str:
        """The local snapshot folder holding ``patterns``'s files (downloaded if missing). Given
        the ``commit`` a first call resolved, the revision is not asked for again."""
        from huggingface_hub import snapshot_download

        quiet = {} if patterns else {"tqdm_class": _no_bar_class()}  # a listing only: no "Fetching 0 files"
        with self._errors():
            return snapshot_download(self.repo, revision=commit or self.revision, cache_dir=self.cache_dir,
                                     token=self.token, allow_patterns=list(patterns), **quiet)

    def _listing(self, commit: str, folder: str) -> list[str]:
        """Every file of the repository at ``commit``: the listing huggingface_hub cached with the
        snapshot (no network call), else the files present in the local snapshot folder."""
        try:
            from huggingface_hub import get_cached_repo_tree
            from huggingface_hub.errors import CachedRepoTreeNotFoundError
        except ImportError:  # an older huggingface_hub caches no listing
            return _files_under(folder)
        try:
            return [f.path for f in get_cached_repo_tree(self.repo, revision=commit, cache_dir=self.cache_dir)]
        except CachedRepoTreeNotFoundError:
            return _files_under(folder)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        from huggingface_hub import constants
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)

        repo = self.repo
        try:
            yield
        except GatedRepoError as exc:
            raise ModelSourceError(
                f"model {repo} is gated on the Hugging Face Hub ({_status(exc)}): accept its terms on "
                f"{constants.ENDPOINT}/{repo} and give a token of an account with access (--hf-token or "
                "HF_TOKEN)") from None
        except RepositoryNotFoundError as exc:
            raise ModelSourceError(
                f"model {repo!r} is neither a local path nor a model on the Hugging Face Hub ({_status(exc)}); "
                "check the name, or, for a private model, give a token with access (--hf-token or HF_TOKEN)"
            ) from None
        except RevisionNotFoundError:
            raise ModelSourceError(f"model {repo} has no revision {self.revision!r} on the Hugging Face Hub "
                                   "(--revision takes a branch, tag or commit)") from None
        except LocalEntryNotFoundError as exc:
            raise self._not_cached(exc) from None
        except HfHubHTTPError as exc:
            raise ModelSourceError(f"the Hugging Face Hub refused {repo} ({_status(exc)}): "
                                   f"{str(exc).strip().splitlines()[-1]}") from None

    def _not_cached(self, exc: Exception) -> ModelSourceError:
        from huggingface_hub import constants, errors

        where = self.cache_dir or constants.HF_HUB_CACHE
        what = f"model {self.repo}" + (f" (revision {self.revision})" if self.revision else "")
        incomplete = getattr(errors, "IncompleteSnapshotError", None)  # newer huggingface_hub only
        if incomplete is not None and isinstance(exc, incomplete):
            state = f"only partly in the local cache ({where})"
        else:
            state = f"not in the local cache ({where})"
        if getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)():
            return ModelSourceError(f"{what} is {state} and HF_HUB_OFFLINE=1 forbids downloading it: "
                                    "download it once with the network on (unset HF_HUB_OFFLINE)")
        return ModelSourceError(f"{what} is {state} and the Hugging Face Hub ({constants.ENDPOINT}) cannot be "
                                "reached: check the network connection (or HF_ENDPOINT, proxy settings)")


def _no_bar_class() -> type:
    from tqdm.auto import tqdm

    class NoBar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return NoBar


class _NoMatchFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No files matched")


@contextmanager
def _quiet_no_match() -> Iterator[None]:
    """Without huggingface_hub's warning that no file matched the patterns (expected here)."""
    hub_logger, quiet = logging.getLogger("huggingface_hub._snapshot_download"), _NoMatchFilter()
    hub_logger.addFilter(quiet)
    try:
        yield
    finally:
        hub_logger.removeFilter(quiet)


def _status(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(exc).__name__


def _files_under(folder: str) -> list[str]:
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


class _ModelScope:
    """The same resolution through ``modelscope.snapshot_download`` (``PAGODA_USE_MODELSCOPE=1``).
    Without a cached listing to choose from, a GGUF selection asks for the files whose names
    hold the selector and then requires exactly one of them."""

    def __init__(self, repo: str, revision: str | None, cache_dir: str | None) -> None:
        self.repo, self.revision, self.cache_dir = repo, revision, cache_dir

    def model(self, selector: str | None) -> str:
        folder = self.snapshot(METADATA_PATTERNS)
        if selector is not None:
            patterns = [selector] if selector.lower().endswith(".gguf") else \
                sorted({f"*{s}*.gguf" for s in (selector, selector.lower(), selector.upper())})
            folder = self.snapshot(patterns)
            return str(Path(folder) / choose_gguf(self.repo, _files_under(folder), selector))
        if not (Path(folder) / "config.json").is_file():
            raise ModelSourceError(f"{self.repo} has no config.json on ModelScope; for a GGUF repository name "
                                   f"the file: {self.repo}:QUANT or {self.repo}:FILE.gguf")
        if (Path(folder) / WEIGHT_INDEX).is_file():
            folder = self.snapshot([glob.escape(p) for p in safetensors_files(folder, [])])
        else:
            folder = self.snapshot(["*.safetensors"], ignore=["*/*"])  # the top-level ones only
        if not safetensors_files(folder, _files_under(folder)):
            raise _no_weights_error(self.repo, _files_under(folder))
        return folder

    def snapshot(self, patterns: Sequence[str], ignore: Sequence[str] | None = None) -> str:
        try:
            from modelscope import snapshot_download
        except ImportError:
            raise ModelSourceError("PAGODA_USE_MODELSCOPE=1 needs the modelscope package: pip install modelscope"
                                   ) from None
        kwargs: dict = {"revision": self.revision} if self.revision else {}
        if ignore:
            kwargs["ignore_patterns"] = list(ignore)
        try:
            return str(snapshot_download(self.repo, cache_dir=self.cache_dir, allow_patterns=list(patterns),
                                         local_files_only=_offline(), **kwargs))
        except Exception as exc:  # modelscope raises many types (HTTP, not found, offline, ...)
            offline = " (HF_HUB_OFFLINE=1: the local cache only)" if _offline() else ""
            raise ModelSourceError(f"cannot get model {self.repo} from ModelScope{offline}: "
                                   f"{type(exc).__name__}: {exc}") from None
