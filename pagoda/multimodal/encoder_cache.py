"""The model runner's side of images: the encoder cache and each step's multimodal inputs.

``EncoderCache``: the vision encoder's output per image, keyed by the image's content hash,
least recently used first out once the cached features pass a byte budget. A repeated image
(in another request, or the same request recomputed after preemption, or its next prefill
chunk) is encoded once while it stays cached.

``MultimodalStep.prepare(sched, inputs)`` completes a step's ``ModelInput`` for a
multimodal model, and does nothing when no scheduled sequence has images (text requests run as
on a text model):

- positions (M-RoPE models only; a model with ``uses_mrope = False``, LLaVA, keeps the token
  indices): each image request's rows get M-RoPE positions. A step in which such a request
  runs part of its prompt gets ``[3, T]`` positions (the prompt's from the model's
  ``mrope_positions``, computed once per request); otherwise the ``[T]`` positions of its
  tokens are shifted by the request's rope delta (decode steps stay one-dimensional).
- ``inputs.mm``: the rows of the step that hold image placeholder tokens and their features:
  a prefill chunk that cuts an image takes only its slice of the image's features.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from pagoda.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from pagoda.executor.input import ModelInput
    from pagoda.step import SchedulerOutput


class EncoderCache:
    """Image features by content hash under ``budget_bytes`` (LRU). The entry just added stays
    even when it alone passes the budget: the step that asked for it uses it."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= _nbytes(old)
        self._entries[key] = value
        self.num_bytes += _nbytes(value)
        while self.num_bytes > self.budget_bytes and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= _nbytes(evicted)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pixel_tensor(image: ImageInput, device: torch.device) -> torch.Tensor:
    """An image's pixel values ``[patches, patch_dim]`` (float32) on ``device``."""
    values = torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(*image.pixel_shape)
    return values.to(device)


class MultimodalStep:
    """What a multimodal model's runner adds to each step (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, budget_bytes: int, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache = EncoderCache(budget_bytes)
        self.num_encoded = 0  # images run through the encoder (cache misses)
        # Per request with images: its prompt's [3, P] positions and its rope delta.
        self._positions: dict[str, tuple[torch.Tensor, int]] = {}

    def drop(self, request_ids: list[str]) -> None:
        """Forget the positions of requests that left the engine."""
        for rid in request_ids:
            self._positions.pop(rid, None)

    def features(self, image: ImageInput) -> torch.Tensor:
        """``image``'s encoder output, from the cache or encoded now (and cached)."""
        cached = self.cache.get(image.hash)
        if cached is not None:
            return cached
        out = self.model.encode_image(pixel_tensor(image, self.device), image.grid_thw)
        self.num_encoded += 1
        self.cache.put(image.hash, out)
        return out

    def prepare(self, sched: "SchedulerOutput", inputs: "ModelInput") -> None:
        """Set ``inputs``' M-RoPE positions and image rows for the step (in place)."""
        items = [(item, row) for item, row in _rows(sched) if item.seq.request.images]
        if not items:
            return
        if not getattr(self.model, "uses_mrope", True):  # 1-D rotary: positions are the indices
            self._image_rows(items, inputs)
            return
        shift = torch.zeros(inputs.positions.shape[-1], dtype=inputs.positions.dtype)
        prompt_parts: list[tuple[int, torch.Tensor]] = []
        rows: list[torch.Tensor] = []
        feats: list[torch.Tensor] = []
        for item, row in items:
            request, start, end = item.seq.request, item.start, item.end
            num_prompt = item.seq.num_prompt_tokens
            pos3, delta = self._prompt_positions(request)
            first_gen = max(start, num_prompt)  # rows from here on sit at index + delta
            shift[row + first_gen - start:row + end - start] = delta
            if start < num_prompt:
                prompt_parts.append((row, pos3[:, start:min(end, num_prompt)]))
            for image in request.images:
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo < hi:
                    rows.append(torch.arange(row + lo - start, row + hi - start))
                    feats.append(self.features(image)[lo - image.offset:hi - image.offset])
        positions = inputs.positions + shift.to(inputs.positions.device)
        if prompt_parts:
            positions = positions.expand(3, -1).clone()
            for row, part in prompt_parts:
                positions[:, row:row + part.shape[1]] = part.to(positions.device)
        inputs.positions = positions
        if rows:
            inputs.mm = (torch.cat(rows).to(self.device), torch.cat(feats))

    def _image_rows(self, items: list, inputs: "ModelInput") -> None:
        """Only the image rows and their features (a model whose positions are token indices)."""
        rows: list[torch.Tensor] = []
        feats: list[torch.Tensor] = []
        for item, row in items:
            start, end = item.start, item.end
            for image in item.seq.request.images:
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo < hi:
                    rows.append(torch.arange(row + lo - start, row + hi - start))
                    feats.append(self.features(image)[lo - image.offset:hi - image.offset])
        if rows:
            inputs.mm = (torch.cat(rows).to(self.device), torch.cat(feats))

    def _prompt_positions(self, request) -> tuple[torch.Tensor, int]:
        cached = self._positions.get(request.request_id)
        if cached is None:
            cached = self._positions[request.request_id] = self.model.mrope_positions(
                len(request.prompt_token_ids), request.images)
        return cached


def _rows(sched: "SchedulerOutput"):
    """Each scheduled item with its first row in the step's flattened tokens."""
    row = 0
    for item in sched.scheduled:
        yield item, row
        row += item.num_new_tokens
