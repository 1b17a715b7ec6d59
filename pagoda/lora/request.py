"""``LoRARequest``: which adapter a request runs with. Pure Python (a msgspec struct), so it
rides on the engine's wire messages and the torch-free scheduler and KV cache can key on it."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """An adapter for a request: ``lora_name`` (what the server lists), ``lora_int_id`` (a
    positive id, unique per adapter within one engine) and ``lora_path`` (a PEFT adapter
    directory). Equal requests are the same adapter; the prefix cache keys KV on it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must name the adapter's directory")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
