"""Host-to-device copies that do not wait for the device.

A plain ``.to("cuda")`` of a host tensor synchronizes the stream: the host waits for every kernel
queued before it. Every step-path copy (the executor's inputs, the sampler's parameters, the
async-scheduling worker, grammar masks) goes through ``to_device`` instead. Imports only torch, so
any package may use it.
"""
from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without waiting for the device: a plain ``.to``
    synchronizes the stream, which would hold the host until the step in flight ends. On CUDA the
    values go through pinned memory (torch's host allocator keeps it until the copy has run),
    so the caller may reuse ``host`` at once. On the CPU ``host`` itself comes back."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
