"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch.

- ``request.py``: ``LoRARequest`` (pure Python; what a request carries).
- ``peft.py``: reading and checking a PEFT adapter directory (config in pure Python, tensors
  with torch).
- ``layers.py``: ``LoRALinear``, the wrapper around a target linear layer that adds the
  batched adapter delta, and ``LoRABatch``, a step's rows grouped by adapter slot.
- ``manager.py``: ``LoRAManager``: the fixed GPU/CPU-resident slots (``max_loras``, LRU), the
  host cache of loaded adapters (``max_cpu_loras``, LRU), wrapping a model's layers.

Importing this package loads no torch; ``LoRARequest`` is also ``pagoda.LoRARequest``.
"""
from __future__ import annotations

from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
