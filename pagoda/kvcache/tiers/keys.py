"""Content-addressed block keys: what a KV block's values depend on, hashed.

A block's key is ``blake2b(parent key + the block's token ids)``; the first block's parent is
the namespace root key, ``blake2b(model identity + namespace)``. The model identity covers
everything that changes a block's values besides the tokens before it: the weights (a
fingerprint of the checkpoint's files), the compute dtype, the KV-cache dtype, the block size,
the tensor / pipeline parallel layout, weight quantization and this cache layout's version.
The namespace adds the LoRA adapter (its name, path and a fingerprint of its files) and the
request's cache salt. Two engines, or one engine after a restart, agree on a key exactly when
the block's contents would be the same.
"""
from __future__ import annotations

import hashlib
import json
import os
from array import array
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Hashable, Sequence

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

KEY_SIZE = 16
# Bump when the payload layout (executor/kv_offload.py) changes: old blocks must then miss.
LAYOUT_VERSION = 1
# Of each weight file the fingerprint reads this much at the start and at the end (plus its
# size): cheap for a multi-GiB checkpoint, and a retrained or re-quantized file changes its
# header (tensor names, offsets) or its leading and trailing tensors.
_SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".json", ".model")


def _hash(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_SIZE)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def files_fingerprint(directory: str) -> bytes:
    """A digest of a checkpoint or adapter directory: every weight / config file's name, size,
    and its first and last ``_SAMPLE_BYTES`` (read again only when a file's size or mtime
    changed)."""
    root = Path(directory).resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES) if root.is_dir() else []
    listing = []
    for path in files:
        st = path.stat()
        listing.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    return _fingerprint(str(root), tuple(listing))


@lru_cache(maxsize=64)
def _fingerprint(directory: str, listing: tuple[tuple[str, int, int], ...]) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_SIZE)
    for name, size, _ in listing:
        h.update(f"{name}:{size}".encode())
        with open(Path(directory) / name, "rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                f.seek(-_SAMPLE_BYTES, os.SEEK_END)
                h.update(f.read(_SAMPLE_BYTES))
            elif size > _SAMPLE_BYTES:
                h.update(f.read())
    return h.digest()


def model_identity(config: "EngineConfig") -> bytes:
    """The identity digest of an engine's KV blocks (see the module docstring)."""
    m, c, p = config.model, config.cache, config.parallel
    desc = {
        "layout": LAYOUT_VERSION, "architecture": m.architecture, "dtype": str(m.dtype),
        "kv_cache_dtype": str(c.kv_cache_dtype), "block_size": c.block_size,
        "tensor_parallel_size": p.tensor_parallel_size, "pipeline_parallel_size": p.pipeline_parallel_size,
        "quantization": m.quantization, "quantization_config": m.quantization_config,
        "load_format": m.load_format,
        # Dummy weights are drawn from the seed; real ones are read from the files.
        "seed": config.seed if m.load_format == "dummy" else None,
    }
    return _hash(json.dumps(desc, sort_keys=True, default=str).encode(), files_fingerprint(m.path))


def namespace_bytes(namespace: Hashable) -> bytes:
    """A stable encoding of a radix-tree namespace (``Request.cache_namespace``): None (the base
    model), a ``LoRARequest``, or ``(adapter or None, cache salt)``. An adapter is named by its
    name, path and files, not by its engine-local integer id."""
    lora, salt = namespace if isinstance(namespace, tuple) else (namespace, None)
    parts: list[str] = []
    if lora is not None:
        parts += ["lora", str(lora.lora_name), str(lora.lora_path), files_fingerprint(lora.lora_path).hex()]
    if salt is not None:
        parts += ["salt", str(salt)]
    return json.dumps(parts).encode()


class BlockHasher:
    """Computes block keys for one model identity: ``root(namespace)`` for a tree's root, and
    ``chain(parent_key, token_ids)`` for the block after ``parent_key`` holding ``token_ids``."""

    def __init__(self, identity: bytes) -> None:
        self.identity = identity

    def root(self, namespace: Hashable) -> bytes:
        return _hash(b"root", self.identity, namespace_bytes(namespace))

    @staticmethod
    def chain(parent: bytes, token_ids: Sequence[int]) -> bytes:
        return _hash(parent, array("q", token_ids).tobytes())

    def keys(self, parent: bytes, token_ids: Sequence[int], block_size: int, start: int, stop: int) -> list[bytes]:
        """Keys of blocks ``start`` .. ``stop - 1`` of ``token_ids``, ``parent`` being block
        ``start - 1``'s key (or the root's)."""
        out = []
        for i in range(start, stop):
            parent = self.chain(parent, token_ids[i * block_size:(i + 1) * block_size])
            out.append(parent)
        return out
