"""The vision encoder's share of a step: how many image patches one step may encode.

A prompt chunk that covers an image's placeholder rows needs that image's features, so the
runner encodes the image in that step unless its encoder cache holds them. ``EncoderBudget``
limits the patches (encoder input tokens, before the spatial merge) encoded in one step: a chunk
is cut at the start of the first image whose encoding would pass what is left, so a prompt with
many images is spread over several steps while the decodes of the others keep running. An image
already in the encoder cache, or charged earlier in the same step (the same image in another
sequence), costs nothing; an image larger than the whole budget runs when it is the step's first
encoder work, alone, so it never starves. Requests without images are never looked at.
Pure Python: the cache is asked through ``cached(hash)``.
"""
from __future__ import annotations

from typing import Callable

from pagoda.request import Request


class EncoderBudget:
    """One step's encoder budget (``limit`` patches; None: no limit). ``reset`` starts a step;
    ``cap`` says how far a chunk may go; ``charge`` books a scheduled chunk's images, ``refund``
    gives back those of a sequence taken out of the step again (preempted)."""

    def __init__(self, limit: int | None, cached: Callable[[str], bool] | None = None) -> None:
        self.limit = limit
        self.cached = cached or (lambda _hash: False)
        self.used = 0  # patches charged this step
        self._step: set[str] = set()  # image hashes charged this step
        self._charges: dict[str, list[tuple[str, int]]] = {}  # seq id -> (hash, patches) charged

    def reset(self) -> None:
        self.used = 0
        self._step.clear()
        self._charges.clear()

    def _cost(self, image, seen: set[str]) -> int:
        if image.hash in self._step or image.hash in seen or self.cached(image.hash):
            return 0
        return image.pixel_shape[0]

    def cap(self, request: Request, start: int, end: int) -> int:
        """How far (``start`` .. ``end``) a chunk of ``request``'s tokens may run this step: ``end``,
        or the start of the first image it covers whose encoding does not fit (``start`` if the
        chunk begins inside it)."""
        if self.limit is None or not request.images:
            return end
        spent, seen = self.used, set()
        for image in request.images:
            if image.end <= start:
                continue
            if image.offset >= end:
                break
            cost = self._cost(image, seen)
            if cost and spent + cost > self.limit and spent:
                return max(start, image.offset)
            spent += cost
            seen.add(image.hash)
        return end

    def blocks(self, request: Request, start: int) -> bool:
        """Whether a chunk of ``request`` starting at ``start`` cannot run at all this step
        because the image at ``start`` does not fit what is left."""
        return self.cap(request, start, start + 1) == start

    def charge(self, seq_id: str, request: Request, start: int, end: int) -> None:
        """Book the images a scheduled chunk ``[start, end)`` of ``request`` encodes."""
        if self.limit is None or not request.images:
            return
        for image in request.images:
            if image.end <= start:
                continue
            if image.offset >= end:
                break
            cost = self._cost(image, set())
            if cost:
                self._step.add(image.hash)
                self.used += cost
                self._charges.setdefault(seq_id, []).append((image.hash, cost))

    def refund(self, seq_id: str) -> None:
        """A sequence scheduled earlier in the step was taken out: its images are not encoded."""
        for image_hash, cost in self._charges.pop(seq_id, []):
            self._step.discard(image_hash)
            self.used -= cost
