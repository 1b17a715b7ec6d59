"""Host-to-device copies that do not wait for the device, and large zeroed host buffers.

A plain ``.to("cuda")`` of a host tensor synchronizes the stream: the host waits for every kernel
queued before it. Every step-path copy (the executor's inputs, the sampler's parameters, the
async-scheduling worker, grammar masks) goes through ``to_device`` instead. Imports only torch, so
any package may use it.
"""
from __future__ import annotations

import mmap

import torch

# Host buffers at least this large come from the OS's zero pages (``zeros``).
LAZY_ZEROS_BYTES = 64 << 20


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


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; a large host buffer (at least
    ``LAZY_ZEROS_BYTES``) is an anonymous memory map instead, whose pages the OS zeroes when first
    touched: the CPU KV cache (gibibytes) costs no start-up time to clear and no resident memory
    until its blocks are used. The tensor keeps the map alive; the map is unmapped with it."""
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
