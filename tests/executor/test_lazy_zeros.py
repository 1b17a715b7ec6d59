"""Large host buffers (the CPU KV cache) come from the OS's zero pages (``transfer.zeros``): all
zeros as ``torch.zeros`` gives, no resident memory until touched, and gone with the tensor."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagoda.transfer import LAZY_ZEROS_BYTES, zeros


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_a_large_buffer_is_zeros_of_the_shape_and_writable(dtype):
    shape = (2, 2, LAZY_ZEROS_BYTES // dtype.itemsize // 64, 4, 4, 4)
    z = zeros(shape, dtype, "cpu")
    assert z.shape == shape and z.dtype == dtype and z.is_contiguous()
    z[1, 0, 7] = torch.ones((4, 4, 4)).to(dtype)
    assert z[1, 0, 7].float().sum() == 64
    assert z[1, 0, 6].float().abs().sum() == 0 and z[0].view(torch.uint8).count_nonzero() == 0


def test_pages_are_resident_only_once_touched_and_freed_with_the_tensor():
    gc.collect()
    before = _resident_kib()
    z = zeros((512 << 20,), torch.uint8, "cpu")
    assert _resident_kib() - before < 16 << 10  # 512 MiB mapped, under 16 MiB resident
    z[: 64 << 20].fill_(1)
    touched = _resident_kib()
    assert touched - before >= 60 << 10
    ref = weakref.ref(z)
    del z
    gc.collect()
    assert ref() is None
    assert touched - _resident_kib() >= 60 << 10  # unmapped, not kept


def test_small_buffers_and_devices_take_torch_zeros():
    z = zeros((3, 5), torch.float32, torch.device("meta"))
    assert z.device.type == "meta" and z.shape == (3, 5)
    small = zeros((3, 5), torch.bfloat16, "cpu")
    assert small.dtype == torch.bfloat16 and small.abs().sum() == 0
