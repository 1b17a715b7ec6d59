"""The media flags (``--allowed-media-domains``, ``--allowed-local-media-path``,
``--limit-mm-per-prompt``, ``--media-fetch-timeout``) parsed and checked into one
``MediaConfig``, and the fixed limits on one image and on one request's images. Standard
library only: the engine's config imports it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

# Modalities --limit-mm-per-prompt may name (only images are read today) and vLLM's default limit.
MODALITIES = ("image", "video", "audio")
DEFAULT_LIMIT_PER_PROMPT = 999
DEFAULT_FETCH_TIMEOUT_S = 5.0
# Bytes of one encoded image (OpenAI's own limit per image is 20 MB).
MAX_IMAGE_BYTES = 20 << 20
# Pixels of one image: read from the header, refused before anything is decoded. 36 M is a
# 6000 x 6000 photo (108 MB as RGB); vision processors resize far below that anyway.
MAX_IMAGE_PIXELS = 6000 * 6000
# One request's images together: what a request may make the server hold in memory.
MAX_REQUEST_BYTES = 64 << 20
MAX_REQUEST_PIXELS = 4 * MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from and how many a prompt may hold (the media flags, checked)."""

    allowed_domains: frozenset[str] = frozenset()  # hosts the server may fetch from (none: no fetches)
    local_root: str | None = None  # the resolved directory local files may be read from
    limits: tuple[tuple[str, int], ...] = ()  # --limit-mm-per-prompt (modality, count)
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_request_pixels: int = MAX_REQUEST_PIXELS

    @property
    def image_limit(self) -> int:
        return dict(self.limits).get("image", DEFAULT_LIMIT_PER_PROMPT)

    @staticmethod
    def from_flags(allowed_media_domains: Sequence[str] | str | None, allowed_local_media_path: str | None,
                   limit_mm_per_prompt: str | Mapping[str, int] | None,
                   media_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S) -> "MediaConfig":
        """The config of the flags' values; ``ValueError`` naming the flag for a bad one."""
        if not (isinstance(media_fetch_timeout, (int, float)) and 0 < media_fetch_timeout < float("inf")):
            raise ValueError(f"media_fetch_timeout must be a positive number of seconds, got {media_fetch_timeout!r}")
        return MediaConfig(allowed_domains=parse_domains(allowed_media_domains),
                           local_root=_local_root(allowed_local_media_path),
                           limits=parse_limits(limit_mm_per_prompt), fetch_timeout=float(media_fetch_timeout))


def parse_domains(value: Sequence[str] | str | None) -> frozenset[str]:
    """Host names from a list or one comma- or space-separated string, lower-cased."""
    if value is None:
        return frozenset()
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    hosts = set()
    for item in items:
        host = str(item).strip().lower().rstrip(".")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # an IPv6 address, as URLs write it
        elif not host or ":" in host or "/" in host or "@" in host:
            raise ValueError(f"allowed_media_domains: {item!r} is not a host name (give names like example.com, "
                             "without scheme, port or path)")
        hosts.add(host)
    return frozenset(hosts)


def _key_values(text: str) -> dict[str, object]:
    """``image=2,video=1`` as a mapping (values as integers where they are)."""
    out: dict[str, object] = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        out[name.strip()] = int(count) if count.strip().lstrip("-").isdigit() else count.strip()
    return out


def parse_limits(value: str | Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
    """``--limit-mm-per-prompt`` (JSON such as ``{"image": 4}``, or vLLM's ``image=4``) as sorted
    (modality, count)."""
    if value is None or value == "":
        return ()
    if isinstance(value, str) and "=" in value and not value.lstrip().startswith("{"):
        value = _key_values(value)  # vLLM's older form: image=2,video=1
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"limit_mm_per_prompt must be JSON such as '{{\"image\": 4}}': {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"limit_mm_per_prompt must be a JSON object such as {{\"image\": 4}}, got {value!r}")
    out = []
    for name, count in value.items():
        if name not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {name!r}; known: {', '.join(MODALITIES)}")
        if type(count) is not int or count < 0:
            raise ValueError(f"limit_mm_per_prompt[{name!r}] must be a non-negative integer, got {count!r}")
        out.append((name, count))
    return tuple(sorted(out))


def _local_root(path: str | None) -> str | None:
    if not path:
        return None
    root = os.path.realpath(path)
    if not os.path.isdir(root):
        raise ValueError(f"allowed_local_media_path {path!r} is not a directory")
    return root
